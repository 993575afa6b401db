"""Pages: the allocator with reference counts, the prefix cache over full pages, chained page keys.

A page is in exactly one of three states:

    free      ref == 0, no key        in `_free`
    cached    ref == 0, has a key     in `_lru` or `_kept` (evictable, oldest first) and `_by_key`
    in use    ref >= 1                held by the block tables of ref requests (key optional)

A full page's key chains over the previous page's key, so equal keys mean equal whole prefixes:

    key(page i) = H(key(page i-1) || tokens of page i)

With the node's pool, a prompt's pages are spread over several engines, and an engine's LRU alone
would evict a page in the middle of a chain whose later pages other engines hold: every reader's
match then ends there, and those later pages occupy room no match reaches. The pool marks pages
that a cached page elsewhere follows as inner (`set_inner`): a cached inner page waits in `_kept`
and goes only when no other cached page is left, so eviction takes chains from their ends,
node-wide (what one engine's LRU does for its own chains, as a request frees its pages end first).
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from typing import Callable, Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def leading_run(keys: Sequence[bytes], table: dict[bytes, int]) -> list[int]:
    """table[key] for each of the longest prefix of `keys` that `table` holds."""
    found: list[int] = []
    for key in keys:
        value = table.get(key)
        if value is None:
            break
        found.append(value)
    return found


def chain_page_keys(
    token_ids: Sequence[int], page_size: int, keys: list[bytes], num_tokens: int | None = None, seed: bytes = b""
) -> list[bytes]:
    """Extend `keys` in place with the keys of every full page of `token_ids[:num_tokens]` not yet keyed.
    `seed`: the key of the page before token_ids[0] (a request whose leading pages live on a peer
    engine of the pool keys its own pages as the whole prompt's), b"" at a sequence's start."""
    n = len(token_ids) if num_tokens is None else num_tokens
    for i in range(len(keys), n // page_size):
        prev = keys[i - 1] if i else seed
        chunk = array("q", token_ids[i * page_size : (i + 1) * page_size]).tobytes()
        keys.append(hashlib.blake2b(prev + chunk, digest_size=16).digest())
    return keys


class OutOfPages(RuntimeError):
    pass


class PagePool:
    def __init__(self, num_pages: int, enable_prefix_caching: bool = True, *, reuse_first: bool = False,
                 on_evict: Callable[[int, bytes], None] | None = None) -> None:
        """`reuse_first`: hand out the most recently freed page first (a host tier in untouched
        memory then touches only what it uses at peak). `on_evict(page, key)`: called before a
        cached page is taken for reuse, while it still holds its data (the host tier spills it)."""
        if num_pages < 1:
            raise ValueError("the KV pool needs at least one page")
        self.num_pages = num_pages
        self.enable_prefix_caching = enable_prefix_caching
        self.reuse_first = reuse_first
        self.on_evict = on_evict
        self._ref = [0] * num_pages
        self._key: list[bytes | None] = [None] * num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._kept: OrderedDict[int, None] = OrderedDict()  # cached inner pages, oldest first
        self._inner: set[bytes] = set()  # keys here that a page cached elsewhere follows (the pool's)
        self._first: set[int] = set()  # cached pages that go before all others until read (`evict_first`)
        self._by_key: dict[bytes, int] = {}
        # cached pages taken for reuse, or unpublished: a prefix match taken before is stale if one of
        # its pages is among them (`dropped_since`)
        self.num_evictions = 0
        self._dropped = [0] * num_pages  # page -> num_evictions as its key was last dropped (0: never)
        # pages in or out of the LRU (evictable or not any more): a match's evictable count may have moved
        self.num_lru_changes = 0
        # Published and evicted keys since the last drain_key_events(), for the router's index;
        # recorded only once someone drains them (an engine process does, the in-process API not).
        self.track_key_events = False
        self._keys_added: dict[bytes, None] = {}  # (ordered; a key removed after it is dropped from it)
        self._keys_removed: list[bytes] = []

    # -- counts -------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages an allocation can take now: free plus evictable cached ones."""
        return len(self._free) + len(self._lru) + len(self._kept)

    @property
    def num_cached(self) -> int:
        return len(self._lru) + len(self._kept)

    @property
    def num_unused(self) -> int:
        """Pages holding nothing: what an allocation can take without evicting a cached page."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    def ref_count(self, page: int) -> int:
        return self._ref[page]

    def num_held_alone(self, pages: list[int]) -> int:
        """Of `pages`, how many have one reference (what freeing their holder frees). Counted in C:
        the scheduler asks it of every running request each step memory is tight."""
        return list(map(self._ref.__getitem__, pages)).count(1)

    def num_unreferenced(self, pages: list[int]) -> int:
        """Of `pages`, how many no request holds: of published pages (a prefix match's), the
        evictable ones. Counted in C, as num_held_alone."""
        return list(map(self._ref.__getitem__, pages)).count(0)

    def dropped_since(self, pages: list[int], evictions: int) -> bool:
        """Whether any of `pages` lost its key (evicted, or unpublished) after the pool's
        num_evictions was `evictions`: a prefix match over them, taken then, is stale. Only its own
        pages' evictions make it so; another's leave it as it was."""
        return bool(pages) and max(map(self._dropped.__getitem__, pages)) > evictions

    def is_evictable(self, page: int) -> bool:
        return page in self._lru or page in self._kept

    # -- allocation ---------------------------------------------------------------------------
    def allocate(self) -> int:
        """A fresh page with ref 1; evicts the least recently used cached page if none is free
        (an inner one only when no other is left)."""
        if self._free:
            page = self._free.popleft()
        elif self._lru or self._kept:
            page, _ = (self._lru or self._kept).popitem(last=False)
            self._first.discard(page)
            self.num_evictions += 1
            self._dropped[page] = self.num_evictions
            self.num_lru_changes += 1
            key = self._key[page]
            if self.on_evict is not None:
                self.on_evict(page, key)  # type: ignore[arg-type]
            del self._by_key[key]  # type: ignore[arg-type]
            if self.track_key_events:
                self._key_removed(key)  # type: ignore[arg-type]
            self._inner.discard(key)  # type: ignore[arg-type]
            self._key[page] = None
        else:
            raise OutOfPages("no free or evictable KV page")
        self._ref[page] = 1
        return page

    def incref(self, page: int) -> None:
        if self._ref[page] == 0:
            self._first.discard(page)
            if self._lru.pop(page, 0) is not None:  # only a cached page can be revived from ref 0
                del self._kept[page]
            self.num_lru_changes += 1
        self._ref[page] += 1

    def decref(self, page: int) -> None:
        assert self._ref[page] > 0, f"page {page} freed twice"
        self._ref[page] -= 1
        if self._ref[page] == 0:
            key = self._key[page]
            if key is not None:
                (self._kept if key in self._inner else self._lru)[page] = None  # most recently used end
                self.num_lru_changes += 1
            elif self.reuse_first:
                self._free.appendleft(page)
            else:
                self._free.append(page)

    def evict_first(self, pages: Sequence[int]) -> None:
        """Unreferenced cached `pages` go before any other cached page (a copy of what another engine
        holds: PoolMember.copy_in), the last of them first, inner or not (a second copy cuts no
        chain); a page read from then on takes its place by use again."""
        for page in pages:
            if self._ref[page] == 0 and (self._lru.pop(page, 0) is None or self._kept.pop(page, 0) is None):
                self._lru[page] = None
                self._lru.move_to_end(page, last=False)
                self._first.add(page)
                self.num_lru_changes += 1

    # -- prefix cache -------------------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """Pages holding the longest cached prefix of `keys` (no references taken)."""
        return leading_run(keys, self._by_key) if self.enable_prefix_caching else []

    def key_of(self, page: int) -> bytes | None:
        """The key `page` is published under (None: private, or free)."""
        return self._key[page]

    def holds(self, key: bytes) -> bool:
        """Whether a page is published under `key`."""
        return self.enable_prefix_caching and key in self._by_key

    def register(self, page: int, key: bytes) -> None:
        """Publish a full, computed page under its chained key. A key already published by another
        page keeps that page; this one stays private and returns to the free list when released."""
        if not self.enable_prefix_caching or self._key[page] is not None or key in self._by_key:
            return
        self._key[page] = key
        self._by_key[key] = page
        if self.track_key_events:
            self._keys_added[key] = None

    def unpublish(self, keys: Sequence[bytes]) -> int:
        """Stop caching the pages of `keys` here (the pool keeps them on another engine): a page in
        use stays with its requests, private, and is freed with them; an unreferenced one is freed
        now. -> pages unpublished."""
        n = 0
        for key in keys:
            page = self._by_key.pop(key, None)
            if page is None:
                continue
            n += 1
            self._key[page] = None
            self.num_evictions += 1  # a prefix match taken before may name it: stale
            self._dropped[page] = self.num_evictions
            if self.track_key_events:
                self._key_removed(key)
            self._inner.discard(key)
            if self._ref[page] == 0:
                self._first.discard(page)
                if self._lru.pop(page, 0) is not None:
                    del self._kept[page]
                self.num_lru_changes += 1
                self._free.append(page)
        return n

    def set_inner(self, keys: Sequence[bytes], inner: bool) -> int:
        """The pool's word on where chains end (see the module docstring). `inner`: a page cached on
        some engine follows each of `keys`, so a cached page of theirs here waits until no other
        cached page is left. Else each is a chain's end again, or follows a page gone from the node
        (no match can reach it): a cached page of theirs is evicted next. Keys not published here
        are skipped. -> pages whose place in eviction moved."""
        n = 0
        for key in keys:
            page = self._by_key.get(key)
            if page is None:
                continue
            if inner:
                if key not in self._inner:
                    self._inner.add(key)
                    if page not in self._first and self._lru.pop(page, 0) is None:  # cached: it waits now
                        self._kept[page] = None
                        n += 1
            else:
                self._inner.discard(key)
                if self._kept.pop(page, 0) is None or self._lru.pop(page, 0) is None:  # cached: next out
                    self._lru[page] = None
                    self._lru.move_to_end(page, last=False)
                    n += 1
        if n:
            self.num_lru_changes += 1
        return n

    def cached_keys(self) -> list[bytes]:
        """Every published key, for the router's prefix index."""
        return list(self._by_key)

    def _key_removed(self, key: bytes) -> None:
        """A key gone: the index applies a drain's removals before its additions, so a key published
        and then removed since the last drain leaves the additions."""
        self._keys_added.pop(key, None)
        self._keys_removed.append(key)

    def drain_key_events(self) -> tuple[list[bytes], list[bytes]]:
        """(keys published, keys evicted) since the last call, in order; a key can be in both."""
        self.track_key_events = True
        added, removed = list(self._keys_added), self._keys_removed
        self._keys_added, self._keys_removed = {}, []
        return added, removed
