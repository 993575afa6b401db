"""A KVTransport whose writes are memmoves within the process, for in-process federation tests."""
from __future__ import annotations

import ctypes
from typing import Sequence

import torch

from tokenflowd.federation.transport import DONE, FAILED, Block, KVTransport, Region, Transfer


class LocalTransport(KVTransport):
    """Writes are memmoves within this process; `fail` makes every later write fail."""

    def __init__(self) -> None:
        super().__init__()
        self.fail = False
        self.batches: list[int] = []  # blocks per batch, in submission order

    @property
    def endpoint(self) -> str:
        return "local"

    def register(self, tensor: torch.Tensor) -> Region:
        return Region(tensor.data_ptr(), tensor.numel() * tensor.element_size())

    def unregister(self, region: Region) -> None:
        pass

    def submit_write(self, peer: str, blocks: Sequence[Block]) -> Transfer:
        t = Transfer(peer, sum(b.nbytes for b in blocks), 0.0)
        self.batches.append(len(blocks))
        if self.fail:
            t.state = FAILED
            return t
        for b in blocks:
            ctypes.memmove(b.dst, b.src, b.nbytes)
        t.state = DONE
        return t

    def close(self) -> None:
        pass
