"""Read mode's path on a GPU: an engine's KV cache, opened by its peers over CUDA IPC.

The owner allocates its cache as usual and exports it once (`export`): torch's CUDA IPC reduction
of the tensor (a cudaIpcMemHandle of its allocation, with its size, stride and offset), written with
the owner's GPU to a file in the daemon's runtime directory (mode 0700), one per incarnation as the
shared memory block of the CPU twin (shared_kv.py). A peer opens it once (`DeviceKV.open`) and
attends to the owner's pages in place, on its own stream, as it does on a CPU; the write into the
home copies device to device. Nothing crosses the host but the pins.

A peer opens only a cache on its own GPU: torch ties a tensor to one device, so a cache on another
GPU would need every kernel that reads it to run there. Engines on different GPUs are served
through host staging (query mode's path) instead, and so is a peer whose export cannot be opened
(IPC refused: a container without it, MPS limits); /health names the peers served so (PoolMember
`sharing`).

Query mode on a GPU shares its buffers the same way: a requester's q rows and the (o, lse) that
come back live in one device allocation it exports (query.py QueryBuffers.on_device); a holder on
the same GPU opens it once and attends from it and into it, so a query's rows never cross the host.
A holder that cannot open it says why, and that requester stages through the host from then on.
"""
from __future__ import annotations

import os
import pickle
from dataclasses import dataclass

import torch


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


def open_export(path: str) -> torch.Tensor:
    """A tensor another process exported (`export`), opened here. ValueError where it is on another GPU."""
    with open(path, "rb") as f:
        exported = pickle.load(f)
    if exported["gpu"] != device_uuid():
        raise ValueError(f"it is on GPU {exported['gpu']}, this engine on {device_uuid()}")
    return exported["rebuild"](*exported["args"])


@dataclass
class DeviceKV:
    layers: list[torch.Tensor]  # each [*layer_shape], a view of the owner's cache

    @classmethod
    def open(cls, path: str, num_layers: int, layer_shape: tuple[int, ...], dtype: torch.dtype) -> "DeviceKV":
        """A peer's cache, opened here. ValueError where it is on another GPU or not the shape asked."""
        kv = open_export(path)
        if kv.dtype != dtype or tuple(kv.shape) != (num_layers, *layer_shape):
            raise ValueError(f"its cache is {tuple(kv.shape)} {kv.dtype}, not {(num_layers, *layer_shape)} {dtype}")
        return cls(list(kv.unbind(0)))

    def close(self) -> None:
        self.layers.clear()
