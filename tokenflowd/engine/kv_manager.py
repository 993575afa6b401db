"""Per-request page bookkeeping on top of the PagePool: prefix hits, growth, publication, release;
and, with a host tier (offload/), preemption that keeps the KV and admission that loads it back."""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from tokenflowd.buffer.policy import cdiv
from tokenflowd.engine.page_pool import PagePool, chain_page_keys
from tokenflowd.engine.request import Request

if TYPE_CHECKING:
    from tokenflowd.offload.manager import OffloadManager


class PrefixHit(NamedTuple):
    pages: list[int]
    num_evictable: int  # of `pages`, how many sit unreferenced in the LRU (admission takes them off it)

    @property
    def num_pages(self) -> int:
        return len(self.pages)


class KVCacheManager:
    def __init__(self, pool: PagePool, page_size: int, offload: "OffloadManager | None" = None) -> None:
        self.pool = pool
        self.page_size = page_size
        self.offload = offload  # None: no host tier, a preempted request's KV is recomputed

    def prefix_hit(self, req: Request) -> PrefixHit:
        """The longest cached run of full pages covering at most num_tokens - 1 tokens: the last
        token is always computed so that the step that admits the request can sample from it."""
        chain_page_keys(req.token_ids, self.page_size, req.page_hashes)
        max_pages = (req.num_tokens - 1) // self.page_size
        pages = self.pool.lookup(req.page_hashes[:max_pages])
        return PrefixHit(pages, sum(self.pool.is_evictable(p) for p in pages))

    def pages_needed(self, req: Request, num_new_tokens: int) -> int:
        return max(0, cdiv(req.num_computed_tokens + num_new_tokens, self.page_size) - len(req.block_table))

    def admit(self, req: Request, hit: PrefixHit, num_new_tokens: int) -> bool:
        """Take the prefix hit's pages and allocate room for `num_new_tokens` past it, or change nothing."""
        assert not req.block_table and req.num_computed_tokens == 0
        fresh = cdiv(len(hit.pages) * self.page_size + num_new_tokens, self.page_size) - len(hit.pages)
        if fresh > self.pool.num_free - hit.num_evictable:
            return False
        for page in hit.pages:
            self.pool.incref(page)
        req.block_table = list(hit.pages)
        req.num_computed_tokens = len(hit.pages) * self.page_size
        if req.num_preemptions == 0:  # a resumed request's hit on its own pages is no saving
            req.num_cached_tokens = req.num_computed_tokens
        req.num_published_pages = len(hit.pages)
        return self.grow(req, num_new_tokens)

    def grow(self, req: Request, num_new_tokens: int) -> bool:
        """Make the block table cover num_computed_tokens + num_new_tokens, or change nothing."""
        need = self.pages_needed(req, num_new_tokens)
        if need > self.pool.num_free:
            return False
        req.block_table.extend(self.pool.allocate() for _ in range(need))
        return True

    def commit(self, req: Request) -> None:
        """Publish every page whose tokens are all computed (prompt or output) to the prefix cache."""
        if not self.pool.enable_prefix_caching:
            return
        num_full = req.num_computed_tokens // self.page_size
        chain_page_keys(req.token_ids, self.page_size, req.page_hashes, req.num_computed_tokens)
        for i in range(req.num_published_pages, num_full):
            self.pool.register(req.block_table[i], req.page_hashes[i])
        req.num_published_pages = max(req.num_published_pages, num_full)

    def start_load(self, req: Request, hit: PrefixHit, num_tokens: int) -> bool:
        """Admit `req` to come back from the host tier with its first `num_tokens` tokens computed:
        device-cached pages are taken as they are, the others loaded (offload/manager.py)."""
        assert self.offload is not None and not req.block_table and req.num_computed_tokens == 0
        self.offload.attach_host_prefix(req)
        return self.offload.start_load(req, hit.pages, num_tokens)

    def preempt(self, req: Request) -> None:
        """Give up the request's device pages. With a host tier what the host lacks is written
        first (those pages are freed when the copy ends); without, the KV is recomputed later."""
        if self.offload is not None:
            self.offload.preempt(req)
        self._release_device(req)

    def free(self, req: Request) -> None:
        """The request ends: release its pages in every tier."""
        self._release_device(req)
        if self.offload is not None:
            self.offload.release(req)

    def _release_device(self, req: Request) -> None:
        """Release the request's device pages, tail first, so that LRU eviction takes the tails of
        prefixes before their heads; a page a copy still reads stays pinned until it ends."""
        for page in reversed(req.block_table):
            self.pool.decref(page)
        req.block_table = []
        req.num_computed_tokens = req.num_published_pages = 0
