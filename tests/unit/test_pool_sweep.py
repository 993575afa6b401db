"""A daemon in read mode, at start, unlinks the shared KV caches that daemons killed outright left
(pool/names.py sweep_stale), and only those: not a live daemon's, whatever its runtime directory."""
from __future__ import annotations

import mmap
import os

from tokenflowd.pool.names import mapped, sweep_stale


def block(shm_dir, name: str) -> str:
    path = os.path.join(shm_dir, name)
    with open(path, "wb") as f:
        f.truncate(mmap.PAGESIZE)
    return path


def test_only_blocks_no_process_maps_and_no_runtime_directory_owns_are_swept(tmp_path):
    base, shm_dir = tmp_path / "run", tmp_path / "shm"
    base.mkdir()
    shm_dir.mkdir()
    (base / "tokenflowd-here").mkdir()  # a daemon of this base, between its engines' starts
    same_base = block(shm_dir, "tokenflowd-here-kv-0-1")
    dead = block(shm_dir, "tokenflowd-gone-kv-1-2")  # its daemon and its runtime directory are gone
    other = block(shm_dir, "tokenflowd-elsewhere-kv-0-1")  # a live daemon with another --runtime-dir
    unrelated = block(shm_dir, "not-ours-kv-0-1")
    with open(other, "r+b") as f, mmap.mmap(f.fileno(), mmap.PAGESIZE) as live:
        assert "tokenflowd-elsewhere-kv-0-1" in mapped(str(shm_dir))
        assert sweep_stale(str(base), str(shm_dir)) == ["tokenflowd-gone-kv-1-2"]
        live[0] = 1  # still mapped, still there
    assert not os.path.exists(dead)
    assert all(os.path.exists(p) for p in (same_base, other, unrelated))
    # once its daemon has let go of it, the other's block is stale too
    assert sweep_stale(str(base), str(shm_dir)) == ["tokenflowd-elsewhere-kv-0-1"]


def test_a_dead_engines_cache_removed_by_its_resource_tracker_mid_unlink_is_no_error(monkeypatch):
    """The supervisor unlinks a killed engine's cache (pool/names.py unlink) while the engine's
    resource tracker, which outlives it, may remove the block too: between the supervisor's open and
    its unlink, the unlink found nothing, and the error left Supervisor._engine_gone and the
    launcher's restart loop with it (the engine stayed dead, named ready)."""
    from tokenflowd.pool import names

    name = f"tokenflowd-test-{os.getpid()}-kv-0-1"
    block("/dev/shm", name)
    attach = names.attach_untracked

    def raced(block_name: str):
        shm = attach(block_name)
        os.unlink(f"/dev/shm/{block_name}")  # the tracker, meanwhile
        return shm

    monkeypatch.setattr(names, "attach_untracked", raced)
    try:
        names.unlink(name)
        assert not os.path.exists(f"/dev/shm/{name}")
        names.unlink(name)  # gone before the open: nothing to do either
    finally:
        monkeypatch.undo()
        names.unlink(name)
