"""The places KV pages live, behind one ABC: the device pages (here), host memory (pinned on a GPU
box) and, optionally, a file on disk (offload/tiers.py); NullHostTier stands where no host tier
is configured.

    DeviceTier ──write / load──> HostTier ──spill / promote──> DiskTier
    (the pages attention reads)   (or NullHostTier: holds nothing, so a preempted request recomputes)

Each tier answers `lookup(keys)`: for the longest prefix of the chained page keys it can give, a
handle per key. A prefix match (manager.py) walks the tiers once and names each run of pages by
the tier it comes from; a peer engine's pool or a remote node becomes one more tier.

A host page is in one of PagePool's three states: free; cached (ref 0, keyed: a prefix page
nobody holds, evictable in LRU order); in use (held by requests' host tables, and pinned by the
copier while a copy reads or writes it). When the host tier needs room it reuses the least
recently used cached page, and spills it to the disk tier first, where one is configured. The disk
tier holds only keyed pages (the hierarchical prefix cache); a hit is promoted back to the host.
"""
from __future__ import annotations

import abc
from typing import Sequence

from tokenflowd.kv.pages import PagePool

DEVICE, HOST, DISK = "device", "host", "disk"  # the tiers' names: where a prefix match's pages come from
REMOTE = "remote"  # another node writes them (federation/): a decode node's request from a prefill node


class KVTier(abc.ABC):
    """A place that holds KV pages under their chained keys."""

    name: str
    num_pages: int

    @abc.abstractmethod
    def lookup(self, keys: Sequence[bytes]) -> list:
        """For the longest prefix of `keys` this tier can give, one handle per key (no reference taken)."""

    def close(self) -> None:
        """Let go of what the tier holds (files, memory)."""


class DeviceTier(KVTier):
    """The pages attention reads: the engine's KV cache tensor, allocated through `pool`."""

    name = DEVICE

    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self.num_pages = pool.num_pages

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        return self.pool.lookup(keys)


class NullHostTier(KVTier):
    """No host tier: it holds no page and finds none, so nothing is written through and a
    preempted request's KV is recomputed. Callers treat it as any host tier (offload/tiers.py)."""

    name = HOST

    def __init__(self, page_bytes: int = 0) -> None:
        self.num_pages = 0
        self.page_bytes = page_bytes
        self.pages = None
        self.disk = None
        self.pool = PagePool(1, enable_prefix_caching=False)

    def allocate(self) -> int | None:
        return None

    def lookup(self, keys: Sequence[bytes]) -> list[int | None]:
        return []

    def promote(self, key: bytes) -> int | None:
        return None
