"""KV caches that the engines of one host can map: the pool's direct-read mode (`--pool-mode read`).

An engine's KV cache (all layers, the backend's layout) lives in one POSIX shared memory block
named after the daemon and the engine. A peer maps it read-only in spirit (nothing enforces it:
only the owner writes, and only pages nobody has pinned) and attends to the owner's segments in
place with its own backend (`attend_pages` on the mapped layer), so neither the query rows nor
the prefix KV cross between processes; only the pins do (query.py's Pin/Unpin, once a request).

On a GPU the same role is played by CUDA IPC handles of the cache with peer access; that twin is
not built yet, and query mode is the one that fits separate GPUs (each attends over its own HBM).
"""
from __future__ import annotations

from dataclasses import dataclass
from multiprocessing import shared_memory

import torch

from tokenflowd.pool.names import attach_untracked


@dataclass
class SharedKV:
    shm: shared_memory.SharedMemory
    layers: list[torch.Tensor]  # each [*layer_shape], a view of the block
    owner: bool

    @staticmethod
    def nbytes(num_layers: int, layer_shape: tuple[int, ...], dtype: torch.dtype) -> int:
        n = 1
        for d in layer_shape:
            n *= d
        return num_layers * n * torch.empty((), dtype=dtype).element_size()

    @classmethod
    def create(cls, name: str, num_layers: int, layer_shape: tuple[int, ...], dtype: torch.dtype) -> "SharedKV":
        """The owner's cache, zeroed (as the runner's: masked reads must not meet NaNs). A block of
        this name left by a killed owner is unlinked first (its old mappings stay valid)."""
        size = cls.nbytes(num_layers, layer_shape, dtype)
        try:
            shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        except FileExistsError:
            stale = attach_untracked(name)
            stale.close()
            stale.unlink()
            shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        kv = cls(shm, cls._views(shm, num_layers, layer_shape, dtype), owner=True)
        for layer in kv.layers:
            layer.zero_()
        return kv

    @classmethod
    def attach(cls, name: str, num_layers: int, layer_shape: tuple[int, ...], dtype: torch.dtype) -> "SharedKV":
        """A peer's cache, mapped here."""
        shm = attach_untracked(name)
        if shm.size < cls.nbytes(num_layers, layer_shape, dtype):
            shm.close()
            raise ValueError(f"shared KV {name} holds {shm.size} bytes, fewer than its shape needs")
        return cls(shm, cls._views(shm, num_layers, layer_shape, dtype), owner=False)

    @staticmethod
    def _views(shm, num_layers: int, layer_shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
        size = SharedKV.nbytes(1, layer_shape, dtype)
        raw = torch.frombuffer(shm.buf, dtype=torch.uint8, count=num_layers * size)
        return [raw[i * size : (i + 1) * size].view(dtype).view(layer_shape) for i in range(num_layers)]

    def whole(self) -> torch.Tensor:
        """Every layer as one tensor [layers, *layer_shape] (the runner's KV cache), a view of the block."""
        first = self.layers[0]
        raw = torch.frombuffer(self.shm.buf, dtype=first.dtype, count=len(self.layers) * first.numel())
        return raw.view(len(self.layers), *first.shape)

    def close(self) -> None:
        """Unmap (and, for the owner, unlink). Every view of the block is dead from here on."""
        self.layers.clear()
        self.shm.close()
        if self.owner:
            self.shm.unlink()
