"""Read mode's path on a GPU: an engine's KV cache, opened by its peers over CUDA IPC.

The owner allocates its cache as usual and exports it once (`export`): torch's CUDA IPC reduction
of the tensor (a cudaIpcMemHandle of its allocation, with its size, stride and offset), written with
the owner's GPU to a file in the daemon's runtime directory (mode 0700), one per incarnation as the
shared memory block of the CPU twin (shared_kv.py). A peer opens it once (`DeviceKV.open`) and
attends to the owner's pages in place, on its own stream, as it does on a CPU; the write into the
home copies device to device. Nothing crosses the host but the pins.

A peer on another GPU opens it too where its GPU has peer access to the owner's (NVLink or PCIe
P2P; `peer_access`, checked once at start): the allocation is mapped into the opener's own device
(CUDA's lazy peer access), so its kernels read and write the owner's pages over the link and
nothing runs on the owner's GPU (the driver may keep a context of the opener's there: a few
hundred MiB, within what --gpu-memory-utilization leaves beside each KV budget). For that the
launcher lets each pooled engine see the node's other GPUs after its own (launcher.py
engine_configs). A peer on a GPU without peer access, or one this engine does not see, or whose
export cannot be opened (IPC refused: a container without it, MPS limits) is served through host
staging (query mode's path) instead; /health names the peers served so (PoolMember `sharing`) and
the start-up check's result (`peer_access`).

Query mode on a GPU shares its buffers the same way: a requester's q rows and the (o, lse) that
come back live in one device allocation it exports (query.py QueryBuffers.on_device); a holder on
the same GPU, or on one with peer access to it, opens it once and attends from it and into it, so
a query's rows never cross the host. A holder that cannot open it says why, and that requester
stages through the host from then on.
"""
from __future__ import annotations

import os
import pickle
from dataclasses import dataclass

import torch

STORAGE_DEVICE = 6  # where torch's rebuild_cuda_tensor takes the device index in its arguments


def device_uuid(device: torch.device | int | None = None) -> str:
    """The GPU's UUID: the same card in every process, whatever CUDA_VISIBLE_DEVICES numbers it."""
    return str(torch.cuda.get_device_properties(torch.device("cuda") if device is None else device).uuid)


def export(kv: torch.Tensor, path: str) -> None:
    """Publish the owner's whole cache (every layer, one allocation) for peers to open; so, too, a
    requester's query buffers (query.py QueryBuffers.on_device)."""
    from torch.multiprocessing.reductions import reduce_tensor

    rebuild, args = reduce_tensor(kv)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump({"gpu": device_uuid(kv.device), "rebuild": rebuild, "args": args}, f)
    os.replace(tmp, path)


def peer_access() -> dict[str, bool]:
    """The start-up check: for every other GPU this process sees, by UUID, whether this one's kernels
    can read and write its memory (NVLink or PCIe P2P)."""
    own = torch.cuda.current_device()
    return {device_uuid(k): torch.cuda.can_device_access_peer(own, k)
            for k in range(torch.cuda.device_count()) if k != own}


def open_export(path: str, access: dict[str, bool] | None = None) -> torch.Tensor:
    """A tensor another process exported (`export`), opened here, in this process's own device: on
    the exporter's GPU, or on another that this one has peer access to (`access`, from
    `peer_access`; checked now if not given). ValueError where it is on a GPU without peer access
    from this one or not seen here."""
    with open(path, "rb") as f:
        exported = pickle.load(f)
    gpu, own = exported["gpu"], device_uuid()
    if gpu != own:
        access = peer_access() if access is None else access
        if gpu not in access:
            raise ValueError(f"it is on GPU {gpu}, which this engine (on {own}) does not see")
        if not access[gpu]:
            raise ValueError(f"it is on GPU {gpu}, and this engine's GPU {own} has no peer access to it")
    args = list(exported["args"])
    args[STORAGE_DEVICE] = torch.cuda.current_device()  # mapped here, with lazy peer access where on another GPU
    return exported["rebuild"](*args)


@dataclass
class DeviceKV:
    layers: list[torch.Tensor]  # each [*layer_shape], a view of the owner's cache

    @classmethod
    def open(cls, path: str, num_layers: int, layer_shape: tuple[int, ...], dtype: torch.dtype,
             access: dict[str, bool] | None = None) -> "DeviceKV":
        """A peer's cache, opened here (`open_export`). ValueError where it is on a GPU out of reach
        or not the shape asked."""
        kv = open_export(path, access)
        if kv.dtype != dtype or tuple(kv.shape) != (num_layers, *layer_shape):
            raise ValueError(f"its cache is {tuple(kv.shape)} {kv.dtype}, not {(num_layers, *layer_shape)} {dtype}")
        return cls(list(kv.unbind(0)))

    def close(self) -> None:
        self.layers.clear()
