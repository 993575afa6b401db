"""Where an engine's pool endpoints live, by engine and incarnation: its query service's socket and
its shared KV cache (or its CUDA IPC export). Torch-free: the supervisor cleans up after a killed engine with it."""
from __future__ import annotations

import contextlib
import glob
import os
from multiprocessing import shared_memory


def service_address(runtime_dir: str, engine: int, incarnation: int) -> str:
    return f"ipc://{runtime_dir}/pool-{engine}-{incarnation}"


def cache_name(runtime_dir: str, engine: int, incarnation: int) -> str:
    """The shared memory block of an engine's KV cache (read mode): one per incarnation, so a
    peer never reads a successor's pages through a dead engine's mapping."""
    return f"{os.path.basename(runtime_dir.rstrip('/'))}-kv-{engine}-{incarnation}"


def export_path(runtime_dir: str, engine: int, incarnation: int) -> str:
    """The file of an engine's KV cache exported over CUDA IPC (read mode on a GPU, cuda_ipc.py)."""
    return os.path.join(runtime_dir, f"kv-{engine}-{incarnation}.cudaipc")


def query_buffers_path(runtime_dir: str, engine: int, incarnation: int, holder: int) -> str:
    """The file of a requester's query buffers on its GPU, exported over CUDA IPC for one holder
    (query mode on a GPU, query.py QueryBuffers.on_device)."""
    return os.path.join(runtime_dir, f"q-{engine}-{incarnation}-{holder}.cudaipc")


def query_buffers_of(runtime_dir: str, engine: int, incarnation: int) -> list[str]:
    """The files of an engine's query buffers for every holder (a killed engine leaves them)."""
    return glob.glob(os.path.join(glob.escape(runtime_dir), f"q-{engine}-{incarnation}-*.cudaipc"))


def attach_untracked(name: str) -> shared_memory.SharedMemory:
    """Map a block another process made and will unlink. Before Python 3.13 every attach is
    tracked, and the tracker would unlink the block when this process exits."""
    try:
        return shared_memory.SharedMemory(name=name, track=False)
    except TypeError:
        from multiprocessing import resource_tracker

        shm = shared_memory.SharedMemory(name=name)
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        return shm


def unlink(name: str) -> None:
    """Remove a block whose owner was killed (a dead engine's cache), if it is there. The owner's
    resource tracker outlives it and removes the block too, maybe between the open and the unlink."""
    try:
        shm = attach_untracked(name)
    except FileNotFoundError:
        return
    shm.close()
    with contextlib.suppress(FileNotFoundError):
        shm.unlink()


def sweep_stale(runtime_base: str, shm_dir: str = "/dev/shm") -> list[str]:
    """Unlink the KV caches of daemons that are gone (a whole process group killed at once leaves
    them): a block whose runtime directory is not in `runtime_base` and that no process maps. A
    daemon with another runtime directory (a second instance, another --runtime-dir) maps its own,
    so it keeps them. -> the names removed."""
    try:
        names = [n for n in os.listdir(shm_dir) if n.startswith("tokenflowd-") and "-kv-" in n]
    except OSError:
        return []
    names = [n for n in names if not os.path.isdir(os.path.join(runtime_base, n.partition("-kv-")[0]))]
    if not names:
        return []
    live = mapped(shm_dir)
    gone = []
    for name in names:
        if name in live:
            continue
        try:
            os.unlink(os.path.join(shm_dir, name))
            gone.append(name)
        except OSError:
            pass
    return gone


def mapped(shm_dir: str = "/dev/shm") -> set[str]:
    """The names of the blocks in `shm_dir` that a process this one may inspect maps (/proc/*/maps;
    another user's blocks cannot be unlinked here anyway: /dev/shm is sticky)."""
    head = shm_dir.rstrip("/") + "/"
    out: set[str] = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                for line in f:
                    at = line.find(head)
                    if at >= 0:
                        out.add(line[at + len(head):].rstrip("\n").removesuffix(" (deleted)"))
        except OSError:  # gone meanwhile, or not ours
            continue
    return out
