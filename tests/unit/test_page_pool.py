"""PagePool and KVCacheManager: reference counts, chained keys, LRU eviction, prefix hits."""
from __future__ import annotations

import pytest

from tokenflowd.kv.manager import KVCacheManager
from tokenflowd.kv.pages import OutOfPages, PagePool, chain_page_keys
from tokenflowd.engine.request import Request, SamplingParams


def test_chained_keys_cover_the_whole_prefix():
    a = chain_page_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, [])
    b = chain_page_keys([0, 2, 3, 4, 5, 6, 7, 8], 4, [])
    assert len(a) == 2 and len(b) == 2
    assert a[0] != b[0] and a[1] != b[1]  # same second page, different first page -> different key
    assert chain_page_keys([1, 2, 3, 4, 5, 6, 7, 8], 4, []) == a


def test_refcounts_lru_and_eviction_order():
    pool = PagePool(3)
    p = [pool.allocate() for _ in range(3)]
    with pytest.raises(OutOfPages):
        pool.allocate()
    pool.register(p[0], b"k0")
    pool.register(p[1], b"k1")
    pool.incref(p[0])
    pool.decref(p[0])
    assert pool.num_free == 0
    pool.decref(p[1])  # cached first -> evicted first
    pool.decref(p[0])
    pool.decref(p[2])  # no key -> plain free
    assert pool.num_free == 3 and pool.num_cached == 2
    assert pool.allocate() == p[2]  # free pages go before evicting cached ones
    assert pool.allocate() == p[1]  # the LRU cached page
    assert pool.lookup([b"k0", b"k1"]) == [p[0]]


def test_duplicate_key_keeps_the_first_page():
    pool = PagePool(2)
    a, b = pool.allocate(), pool.allocate()
    pool.register(a, b"k")
    pool.register(b, b"k")
    pool.decref(b)
    assert pool.num_cached == 0 and pool.num_free == 1  # b went back to the free list
    assert pool.lookup([b"k"]) == [a]


def _req(rid, tokens):
    return Request(rid, tokens, SamplingParams(max_tokens=4), max_model_len=1000)


def test_prefix_hit_is_shared_and_leaves_the_last_token():
    kv = KVCacheManager(PagePool(16), page_size=4)
    a = _req("a", list(range(12)))
    assert kv.admit(a, kv.match(a), 12)
    a.num_computed_tokens = 12
    kv.commit(a)
    b = _req("b", list(range(12)))
    hit = kv.match(b)
    assert hit.num_device_pages == 2  # page 3 holds the last token, which must be recomputed
    assert hit.sources == (("device", 8, 0.0),) and hit.io_time is None  # no host tier: nothing to load
    assert kv.admit(b, hit, 4)
    ta, tb = kv.block_table(a), kv.block_table(b)
    assert tb[:2] == ta[:2] and tb[2] != ta[2]
    assert kv.pool.ref_count(ta[0]) == 2
    kv.free(a)
    kv.free(b)
    assert kv.pool.num_used == 0 and kv.pool.num_cached == 3


def test_a_waiting_requests_match_is_kept_until_one_of_its_own_pages_is_evicted():
    """view_matches keeps a waiting request's match (the same object) while another prefix's pages
    are evicted, walks again once one of its own is, and refresh() does the same."""
    kv = KVCacheManager(PagePool(8), page_size=4)
    for rid, first in (("b", 100), ("a", 0)):  # two prefixes of 3 pages each, cached, unreferenced, "b"'s older
        r = _req(rid, list(range(first, first + 12)))
        assert kv.admit(r, kv.match(r), 12)
        r.num_computed_tokens = 12
        kv.commit(r)
        kv.free(r)
    waiting = _req("w", list(range(12)) + [7])  # reads "a"'s 3 pages
    kv.track(waiting)
    kept = kv.view_matches([waiting])[0]
    assert kept.num_device_pages == 3 and kept.num_evictable == 3
    taken = [kv.pool.allocate() for _ in range(4)]  # the 2 free pages, then 2 of "b"'s (LRU), evicted
    assert kv.pool.num_evictions == 2 and kv.pool.lookup([kv.state(waiting).page_hashes[0]])
    assert kv.view_matches([waiting])[0] is kept
    assert kv.refresh(waiting, kept).device_pages == kept.device_pages
    taken.append(kv.pool.allocate())  # "b"'s last page; then one of "a"'s: the request's own
    assert kv.view_matches([waiting])[0] is kept
    taken.append(kv.pool.allocate())
    walked = kv.view_matches([waiting])[0]
    assert walked is not kept and walked.num_device_pages == 2
    assert kv.refresh(waiting, kept).num_device_pages == 2


def test_admit_fails_without_side_effects():
    kv = KVCacheManager(PagePool(2), page_size=4)
    r = _req("r", list(range(20)))
    assert not kv.admit(r, kv.match(r), 20)
    assert kv.block_table(r) == [] and kv.pool.num_free == 2


def test_key_events_report_publication_and_eviction_once_drained():
    pool = PagePool(2)
    pool.register(pool.allocate(), b"before")  # not recorded: nobody drains yet
    assert pool.drain_key_events() == ([], [])
    b = pool.allocate()
    pool.register(b, b"k1")
    pool.decref(0)
    pool.decref(b)  # both cached now
    pool.allocate()  # evicts the oldest cached page: page 0, key b"before"
    assert pool.drain_key_events() == ([b"k1"], [b"before"])
    assert pool.drain_key_events() == ([], [])


def test_a_key_published_and_removed_between_drains_reads_as_removed():
    from tokenflowd.daemon.prefix_index import PrefixIndex

    pool, index = PagePool(3), PrefixIndex()
    pool.drain_key_events()
    a = pool.allocate()
    pool.register(a, b"k")
    pool.unpublish([b"k"])  # published, then given away, in one step window
    index.update(0, *pool.drain_key_events())
    assert index.holders(b"k") == []
    pool.register(a, b"k")  # and back: removed, then published again
    pool.unpublish([b"k"])
    pool.register(a, b"k")
    index.update(0, *pool.drain_key_events())
    assert index.holders(b"k") == [0]


def test_inner_pages_are_evicted_last_and_ends_first():
    """The pool's marks (set_inner): a page that a page cached elsewhere follows waits while any
    other cached page is left; a page marked a chain's end again (or orphaned) goes next."""
    pool = PagePool(4)
    pages = [pool.allocate() for _ in range(4)]
    for i, page in enumerate(pages):
        pool.register(page, b"k%d" % i)
    assert pool.set_inner([b"k0", b"k1"], True) == 0  # in use: only the mark moves
    assert pool.set_inner([b"gone"], True) == 0
    for page in pages:
        pool.decref(page)
    assert pool.num_cached == 4 and pool.num_free == 4
    assert pool.allocate() == pages[2]  # k0 and k1 are older, but inner
    pool.set_inner([b"k1"], False)  # what followed k1 left the node: k1 goes before k3
    assert pool.allocate() == pages[1]
    assert pool.allocate() == pages[3]
    assert pool.allocate() == pages[0]  # an inner page goes only when nothing else is cached
    with pytest.raises(OutOfPages):
        pool.allocate()


def test_inner_marks_survive_use_and_leave_with_the_key():
    pool = PagePool(3)
    a, b, c = (pool.allocate() for _ in range(3))
    pool.register(a, b"a")
    pool.register(b, b"b")
    for page in (a, b, c):
        pool.decref(page)
    assert pool.set_inner([b"a"], True) == 1  # cached: it moves
    pool.incref(a)
    pool.decref(a)  # back among the inner pages, not the LRU
    assert pool.allocate() == c and pool.allocate() == b and pool.allocate() == a
    pool.register(a, b"a2")  # a reused page under another key is not inner
    pool.decref(a)
    assert pool.unpublish([b"a2"]) == 1 and pool.num_free == 1 and pool.num_cached == 0
