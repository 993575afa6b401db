"""KV of whole pages into another node's prefix cache (MemServe §4), the primitive under two
federation moves:

- a decode node, when a request ends, gives the prefill node the pages of the reply, so the next
  turn of the conversation hits there (the prompt's pages it already holds): wired, through the
  fronts (daemon/api/federation.py `give_back`, /federation/keep and /federation/kept);
- a prefill node pulls a longer prefix that another prefill node holds (Algorithm 1's transfer
  branch), and keeps it, so hot prefixes replicate by use: wired through the fronts too (the
  prefill node's own engine keeps, the other node's /federation/give gives).

    keeper (takes the pages)                        giver (holds them in its prefix cache)
    reserve(keys) -> (held, pages): the leading
      keys it holds already, and fresh pages for
      the ones after them
                                                    give(keys[held:], target) -> pins the pages it
                                                      holds for those keys and writes every layer
                                                      of them as one aggregated batch
                                                    settled -> unpins; answers with the crc32
    done(ok, crc) -> checks the crc32, publishes
      the keys (unreferenced: its LRU decides), or
      frees the pages

The keeper is told `done` only once the giver's writes have settled; a store never reported
expires at its horizon (timing.py), when no write of the giver's can land any more.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from tokenflowd.federation.streaming import checksum
from tokenflowd.federation.transport import DONE, KVLayout, KVTransport, Transfer, kv_blocks
from tokenflowd.kv.pages import OutOfPages, PagePool


@dataclass
class _Kept:
    keys: list[bytes]
    pages: list[int]
    until: float  # monotonic: by then the giver can write no more (timing.py horizon)
    report: tuple[bool, int, int] | None = None  # the giver's (ok, crc32, pages written), once settled
    verify_until: float = 0.0  # its bytes may still be on the wire until then: the crc is tried again


VERIFY_SECONDS = 5.0  # as the decode node's Receiver: over TCP a write said done may still be landing
MAX_SHARE = 0.25  # of the cache, the most one store may reserve


class Keeper:
    def __init__(self, pool: PagePool, layers: Sequence[torch.Tensor], page_axis: int) -> None:
        self.pool = pool
        self.layers = list(layers)
        self.page_axis = page_axis
        self.kept: dict[str, _Kept] = {}
        self.max_pages = max(1, int(pool.num_pages * MAX_SHARE))

    def reserve(self, store_id: str, keys: Sequence[bytes], until: float = math.inf) -> tuple[int, list[int]]:
        """(leading keys held already, fresh pages for as many of the next keys as it can get). The
        held pages are referenced while it allocates, so that none of them is the one evicted."""
        if store_id in self.kept:
            raise ValueError(f"store {store_id!r} is already under way")
        held = self.pool.lookup(keys)
        for page in held:
            self.pool.incref(page)
        pages: list[int] = []
        try:
            for _ in keys[len(held):len(held) + self.max_pages]:
                pages.append(self.pool.allocate())
        except OutOfPages:
            pass
        finally:
            for page in reversed(held):
                self.pool.decref(page)
        if pages:
            self.kept[store_id] = _Kept(list(keys[len(held):len(held) + len(pages)]), pages, until)
        return len(held), pages

    def done(self, store_id: str, ok: bool, crc: int = 0, num_pages: int | None = None, now: float = 0.0,
             unwritten: bool = False) -> int:
        """The giver's writes are settled (its report): publish the first `num_pages` (all by default;
        a giver whose cache held fewer wrote fewer) once their crc32 matches, trying again for
        VERIFY_SECONDS while bytes may still land (`poll`). A failed store keeps its pages until its
        horizon: a write said done may still be on the wire; one the giver refused before any
        write (`unwritten`) frees them at once. -> pages published now."""
        kept = self.kept.get(store_id)
        if kept is None or kept.report is not None:
            return 0
        if unwritten and not ok:
            self._release(store_id, kept, 0)
            return 0
        n = len(kept.pages) if num_pages is None else max(0, min(num_pages, len(kept.pages)))
        kept.report, kept.verify_until = (ok and n > 0, crc, n), now + VERIFY_SECONDS
        return self._verify(store_id, kept, now)

    def poll(self, now: float) -> int:
        """Reports whose bytes are still landing, and stores past their horizon (never reported, or
        failed): their pages are free once no write of theirs can land. -> pages published."""
        published = 0
        for sid, kept in list(self.kept.items()):
            if kept.until <= now:
                self._release(sid, kept, 0)
            elif kept.report is not None and kept.report[0] and now < kept.verify_until + 1:
                published += self._verify(sid, kept, now)
        return published

    def _verify(self, sid: str, kept: _Kept, now: float) -> int:
        ok, crc, n = kept.report
        if ok and checksum(self.layers, kept.pages[:n], self.page_axis) == crc:
            self._release(sid, kept, n)
            return n
        if not ok or now >= kept.verify_until:
            kept.report = (False, crc, n)  # given up: the pages wait out the horizon
        return 0

    def _release(self, sid: str, kept: _Kept, publish: int) -> None:
        del self.kept[sid]
        for page, key in zip(kept.pages[:publish], kept.keys[:publish]):
            self.pool.register(page, key)
        for page in reversed(kept.pages):
            self.pool.decref(page)  # registered: cached, unreferenced; otherwise free


@dataclass
class _Given:
    pages: list[int]
    transfer: Transfer
    crc: int = 0


class Giver:
    def __init__(self, transport: KVTransport, pool: PagePool, layers: Sequence[torch.Tensor], page_axis: int) -> None:
        self.transport = transport
        self.pool = pool
        self.layers = list(layers)
        self.layout = KVLayout.of(self.layers, page_axis)
        self.given: dict[str, _Given] = {}

    def give(self, store_id: str, keys: Sequence[bytes], peer: str, dst: KVLayout, dst_pages: Sequence[int]) -> int:
        """Write the pages this node's prefix cache holds for `keys` (a leading run, at most as many
        as `dst_pages`) into the peer's pages, every layer in one batch. -> pages sent. ValueError
        (nothing taken) for a target of another shape or bad pages."""
        if store_id in self.given:
            raise ValueError(f"store {store_id!r} is already under way")
        pages = self.pool.lookup(keys)[: len(dst_pages)]
        if not pages:
            return 0
        blocks = kv_blocks(self.layout, dst, pages, list(dst_pages[: len(pages)]))  # checks the target first
        if any(not 0 <= page < dst.num_pages for page in dst_pages[: len(pages)]):
            raise ValueError("a target page outside the peer's cache")
        for page in pages:
            self.pool.incref(page)
        crc = checksum(self.layers, pages, self.layout.page_axis)
        self.given[store_id] = _Given(pages, self.transport.submit_write(peer, blocks), crc)
        return len(pages)

    def poll(self) -> list[tuple[str, bool, int, int]]:
        """(store, ok, crc32 of the pages, pages) for each store whose write has settled; its pages
        unpinned."""
        out = []
        for sid, g in list(self.given.items()):
            if not self.transport.settled(g.transfer):
                continue
            ok = self.transport.status(g.transfer) == DONE
            for page in reversed(g.pages):
                self.pool.decref(page)
            del self.given[sid]
            out.append((sid, ok, g.crc, len(g.pages)))
        return out
