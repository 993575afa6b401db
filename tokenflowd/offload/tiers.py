"""The host and disk tiers: host memory in the device pages' layout (pinned on a GPU box), and
keyed pages spilled to a file (the hierarchical prefix cache). The tiers' seam and the device
tier: kv/tiers.py.
"""
from __future__ import annotations

import os
import tempfile
from collections import OrderedDict
from typing import Sequence

import torch

from tokenflowd.kv.pages import OutOfPages, PagePool, leading_run
from tokenflowd.kv.tiers import DISK, HOST, KVTier


class DiskTier(KVTier):
    """Keyed pages in one unlinked file under `directory`: nothing outlives the process.

    Invariants: a key maps to one slot; a slot's bytes are the page written under its key; when the
    file is full, the least recently used key is dropped (its slot reused)."""

    name = DISK

    def __init__(self, directory: str, num_pages: int, page_bytes: int) -> None:
        if num_pages < 1:
            raise ValueError("the disk KV tier needs room for at least one page")
        os.makedirs(directory, exist_ok=True)
        self._file = tempfile.TemporaryFile(dir=directory, prefix="kv-")
        self._fd = self._file.fileno()
        os.ftruncate(self._fd, num_pages * page_bytes)
        self.num_pages = num_pages
        self.page_bytes = page_bytes
        self._slot: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, least recently used first
        self._free = list(range(num_pages - 1, -1, -1))
        self.num_reads = 0  # pages promoted back (tests and benchmarks read it)
        self.num_evictions = 0  # keys dropped for room (a prefix match taken before may name one)

    def __contains__(self, key: bytes) -> bool:
        return key in self._slot

    def __len__(self) -> int:
        return len(self._slot)

    def put(self, key: bytes, page: torch.Tensor) -> None:
        """Store `page` (a contiguous CPU tensor of page_bytes) under `key`."""
        if key in self._slot:
            self._slot.move_to_end(key)
            return
        if self._free:
            slot = self._free.pop()
        else:
            slot = self._slot.popitem(last=False)[1]
            self.num_evictions += 1
        os.pwrite(self._fd, _bytes_of(page), slot * self.page_bytes)
        self._slot[key] = slot

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The slots of the longest prefix of `keys` stored here."""
        return leading_run(keys, self._slot)

    def touch(self, key: bytes) -> None:
        """Mark `key` most recently used (so that a spill made to read it back does not drop it)."""
        if key in self._slot:
            self._slot.move_to_end(key)

    def get(self, key: bytes, out: torch.Tensor) -> bool:
        """Read the page stored under `key` into `out`; False (out unchanged) if it is not here."""
        slot = self._slot.get(key)
        if slot is None:
            return False
        view = _bytes_of(out)
        n = os.preadv(self._fd, [view], slot * self.page_bytes)
        if n != self.page_bytes:
            raise OSError(f"short read from the disk KV tier: {n} of {self.page_bytes} bytes")
        self._slot.move_to_end(key)
        self.num_reads += 1
        return True

    def close(self) -> None:
        self._file.close()


def _bytes_of(t: torch.Tensor) -> memoryview:
    assert t.is_contiguous() and t.device.type == "cpu"
    return memoryview(t.view(torch.uint8).reshape(-1).numpy())


class HostTier(KVTier):
    """Host memory for KV pages, in the device pages' layout, with its own allocator and LRU.

    pages: [num_pages, layers, *rest] dtype cpu (pinned when the device is a GPU). Committed at
    start (zeroed): the tier's memory shows in the engine's RSS from the first moment, not as a
    slow climb while the host prefix cache fills, and an operator's memory limit fails at start.
    None in the simulator, which keeps the bookkeeping and moves no bytes."""

    name = HOST

    def __init__(self, num_pages: int, page_bytes: int, pages: torch.Tensor | None, enable_prefix_caching: bool,
                 disk: DiskTier | None = None) -> None:
        self.pages = pages
        self.num_pages = num_pages
        self.page_bytes = page_bytes
        self.disk = disk
        self.pool = PagePool(num_pages, enable_prefix_caching, reuse_first=True,  # warm pages first
                             on_evict=self._spill if disk is not None else None)

    @classmethod
    def create(cls, num_pages: int, page_shape: tuple[int, ...], dtype: torch.dtype, pin: bool,
               enable_prefix_caching: bool, disk: DiskTier | None = None, numa_node: int | None = None) -> "HostTier":
        """`pin`: page-locked for CUDA copies (exactly its bytes, on `numa_node`: pinned.py)."""
        if pin:
            from tokenflowd.offload.pinned import pinned_zeros

            pages = pinned_zeros((num_pages, *page_shape), dtype, numa_node)
        else:
            pages = torch.zeros((num_pages, *page_shape), dtype=dtype)
        return cls(num_pages, pages[0].numel() * pages.element_size(), pages, enable_prefix_caching, disk)

    def allocate(self) -> int | None:
        """A fresh host page (ref 1), or None when every page is in use."""
        try:
            return self.pool.allocate()
        except OutOfPages:
            return None

    def _spill(self, page: int, key: bytes) -> None:
        self.disk.put(key, self.pages[page])  # type: ignore[union-attr]

    def lookup(self, keys: list[bytes]) -> list[int | None]:
        """The longest prefix of `keys` held here or on the disk tier: for each, its host page (no
        reference taken), or None where only the disk holds it."""
        found: list[int | None] = []
        for key in keys:
            page = self.pool.lookup([key])
            if page:
                found.append(page[0])
            elif self.disk is not None and key in self.disk:
                found.append(None)
            else:
                break
        return found

    def promote(self, key: bytes) -> int | None:
        """A host page (ref 1, keyed) holding the disk tier's copy of `key`, or None if there is no
        room or the disk no longer holds it."""
        if self.disk is None or key not in self.disk or self.pool.num_free == 0:
            return None
        self.disk.touch(key)
        page = self.pool.allocate()
        if not self.disk.get(key, self.pages[page]):
            self.pool.decref(page)
            return None
        self.pool.register(page, key)
        return page

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

