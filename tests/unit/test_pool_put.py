"""Placement's put path: an engine gives a segment it computed to the segment's home (query.py Put,
one frame of KV for all layers); the home stores what it lacks in its prefix cache, unreferenced,
with the same bytes; the giver stops caching what the home took (PagePool.unpublish)."""
from __future__ import annotations

import os
import threading

import pytest
import torch

from tokenflowd import protocol as p
from tokenflowd.engine.attention.torch_backend import TorchAttentionBackend
from tokenflowd.kv.pages import PagePool, chain_page_keys
from tokenflowd.pool.member import PoolMember
from tokenflowd.pool.names import cache_name
from tokenflowd.pool.shared_kv import SharedKV

HEADS, KV_HEADS, HEAD_DIM, PAGE, LAYERS = 4, 2, 8, 4, 3


class PageSecondLayout(TorchAttentionBackend):
    """flashinfer's cache layout, [2, pages, kv_heads, page_size, d] (the page axis is 1, not 2)."""

    def kv_cache_shape(self, num_pages: int) -> tuple[int, ...]:
        return (2, num_pages, self.num_kv_heads, self.page_size, self.head_dim)


def member(engine: int, pages: int, runtime_dir: str, backend_class=TorchAttentionBackend) -> PoolMember:
    backend = backend_class(HEADS, KV_HEADS, HEAD_DIM, PAGE, torch.float32, torch.device("cpu"), paged_kernel=False)
    gen = torch.Generator().manual_seed(engine)
    layers = [torch.randn(backend.kv_cache_shape(pages), generator=gen) for _ in range(LAYERS)]
    return PoolMember(engine, 1, "query", runtime_dir, backend, layers, PagePool(pages), threading.Lock(), 8)


@pytest.fixture
def pair(tmp_path):
    a, b = member(0, 16, str(tmp_path)), member(1, 6, str(tmp_path))
    a.set_peers([p.PoolPeer(1, 1, os.getpid(), 6)])
    yield a, b
    a.close()
    b.close()


def test_a_put_segment_lands_in_the_homes_prefix_cache_with_the_same_bytes(pair):
    a, b = pair
    keys = chain_page_keys(list(range(4 * PAGE + 1)), PAGE, [])
    pages = [a.pool.allocate() for _ in keys]
    for page, key in zip(pages, keys):
        a.pool.register(page, key)
    b.pool.register(b.pool.allocate(), keys[1])  # the home holds one of them already
    assert a.put(1, keys, a.stage(pages)) == 4
    stored = b.pool.lookup(keys[2:])
    assert len(stored) == 2 and b.stats["stored_pages"] == 3 and a.stats["put_pages"] == 4
    for layer_a, layer_b in zip(a.kv_layers, b.kv_layers):
        for i in (0, 2, 3):
            (page,) = b.pool.lookup([keys[i]])
            assert torch.equal(layer_b[:, :, page], layer_a[:, :, pages[i]])
            assert b.pool.ref_count(page) == 0 and b.pool.is_evictable(page), "kept as cache, not pinned"
    # The giver stops caching them: pages its request still uses stay with it, the rest are freed.
    a.pool.decref(pages[3])
    a.pool.drain_key_events()  # (an engine records them from its start)
    assert a.pool.unpublish(keys) == 4
    assert a.pool.lookup(keys) == [] and a.pool.ref_count(pages[0]) == 1 and not a.pool.is_evictable(pages[3])
    assert a.pool.num_free == 16 - 3
    assert a.pool.drain_key_events() == ([], keys), "the router learns they left"


def test_a_put_segment_is_evicted_from_its_end_so_no_later_page_stays_behind_a_missing_one(pair):
    a, b = pair
    keys = chain_page_keys(list(range(4 * PAGE + 1)), PAGE, [])
    pages = [a.pool.allocate() for _ in keys]
    cached = b.pool.allocate()
    b.pool.register(cached, keys[1])  # cached there already: it takes its place in the put's order
    b.pool.decref(cached)
    assert a.put(1, keys, a.stage(pages)) == 4
    b.pool.allocate(), b.pool.allocate()  # the free pages
    for held in (3, 2, 1, 0):  # then each allocation there evicts the segment's last page
        b.pool.allocate()
        assert len(b.pool.lookup(keys)) == held and b.pool.num_cached == held


def test_a_full_home_takes_the_leading_keys_it_can_and_a_gone_one_none(pair):
    a, b = pair
    keys = chain_page_keys(list(range(9 * PAGE + 1)), PAGE, [])
    pages = [a.pool.allocate() for _ in keys]
    held = [b.pool.allocate() for _ in range(2)]  # in use there: 4 of its 6 pages are left
    assert a.put(1, keys, a.stage(pages)) == 4
    assert len(b.pool.lookup(keys)) == 4 and b.pool.num_free == 4
    del held
    a.set_peers([])  # the home is gone: nothing is given, the giver keeps its pages
    assert a.put(1, keys, a.stage(pages)) == 0


def test_a_put_whose_bytes_do_not_match_its_pages_is_an_error_and_changes_nothing(pair):
    a, b = pair
    keys = chain_page_keys(list(range(2 * PAGE + 1)), PAGE, [])
    kv = a.stage([a.pool.allocate()])  # one page's KV for two keys
    assert a.put(1, keys, kv) == 0
    assert b.pool.lookup(keys) == [] and b.pool.num_free == 6
    assert a.put(1, keys[:1], kv) == 1, "the home keeps serving"


def test_the_share_of_an_engine_its_peers_take_is_the_query_services_busy_time_over_wall_time(pair):
    a, _ = pair
    t0 = a._share_at[0]
    assert a.measure_share(t0 + 0.1) == 0.0, "measured once a period"
    a.service.busy_seconds += 0.4
    assert a.measure_share(t0 + 1.0) == pytest.approx(0.5 * 0.4)  # smoothed: half the last period's
    a.service.busy_seconds += 5.0  # more than the wall time (a clock's jitter): capped
    assert a.measure_share(t0 + 2.0) == pytest.approx(0.5 * 0.2 + 0.5 * 0.9)


def test_a_put_between_engines_of_different_cache_layouts_keeps_every_value_in_its_place(tmp_path):
    a, b = member(0, 16, str(tmp_path)), member(1, 6, str(tmp_path), PageSecondLayout)
    try:
        a.set_peers([p.PoolPeer(1, 1, os.getpid(), 6)])
        keys = chain_page_keys(list(range(3 * PAGE + 1)), PAGE, [])
        pages = [a.pool.allocate() for _ in keys]
        assert a.put(1, keys, a.stage(pages)) == 3
        for layer_a, layer_b in zip(a.kv_layers, b.kv_layers):
            for key, page in zip(keys, pages):
                (there,) = b.pool.lookup([key])
                assert torch.equal(layer_b[:, there], layer_a[:, :, page])
    finally:
        a.close()
        b.close()


def test_a_store_never_evicts_a_page_it_counts_as_held(pair):
    _, b = pair
    keys = chain_page_keys(list(range(7 * PAGE + 1)), PAGE, [])
    # The home holds keys[0] cached (unreferenced, the oldest in its LRU) and has 5 other pages.
    page = b.pool.allocate()
    b.pool.register(page, keys[0])
    b.pool.decref(page)
    kv = torch.zeros(LAYERS, 7, 2, KV_HEADS, PAGE, HEAD_DIM)
    held = b._store(keys, kv)
    assert held == 6, "keys[0] held, then the 5 free pages; the 7th page would evict keys[0]"
    assert len(b.pool.lookup(keys)) == held and b.pool.num_used == 0


def test_a_store_whose_copy_fails_frees_the_pages_it_took(pair, monkeypatch):
    _, b = pair
    keys = chain_page_keys(list(range(3 * PAGE + 1)), PAGE, [])
    page = b.pool.allocate()
    b.pool.register(page, keys[0])
    b.pool.decref(page)

    def broken(kv, new):
        raise RuntimeError("out of device memory")

    monkeypatch.setattr(b, "_write", broken)
    assert b._store(keys, torch.zeros(LAYERS, 3, 2, KV_HEADS, PAGE, HEAD_DIM)) == 1, "only what it held before"
    assert b.pool.lookup(keys) == [page] and b.pool.num_used == 0 and b.pool.num_free == 6


def test_read_mode_serves_a_peer_it_cannot_map_through_host_staging_and_says_so(tmp_path):
    """Read mode maps each peer's cache (shared memory here, CUDA IPC on a GPU). A peer whose cache
    cannot be mapped (no block of its name: on a GPU, another GPU or IPC refused) is served as in
    query mode: its pins hold, a write into it is a put, and sharing() names it for /health."""
    backend = TorchAttentionBackend(HEADS, KV_HEADS, HEAD_DIM, PAGE, torch.float32, torch.device("cpu"),
                                    paged_kernel=False)
    layers = [torch.randn(backend.kv_cache_shape(16)) for _ in range(LAYERS)]
    a = PoolMember(0, 1, "read", str(tmp_path), backend, layers, PagePool(16), threading.Lock(), 8)
    b = member(1, 6, str(tmp_path))
    try:
        a.set_peers([p.PoolPeer(1, 1, os.getpid(), 6)])
        assert a.sharing() == ("shared memory", {})
        keys = chain_page_keys(list(range(2 * PAGE + 1)), PAGE, [])
        local = [a.pool.allocate() for _ in keys]
        theirs = a._write_home(1, "r", keys, local)
        assert len(theirs) == 2 and a.stats["put_pages"] == 2 and b.service.pinned_pages == 2
        for layer_a, layer_b in zip(a.kv_layers, b.kv_layers):
            for mine, home in zip(local, theirs):
                assert torch.equal(layer_b[:, :, home], layer_a[:, :, mine])
        path, staged = a.sharing()
        assert path == "shared memory" and list(staged) == [1] and "exports no cache" in staged[1]
        assert a.pin("s", [p.PrefixRun(1, keys)]) == 2, "its pins hold: the request reads them by query"
    finally:
        a.close()
        b.close()


def held_segment(m: PoolMember, n: int) -> tuple[list[bytes], list[int]]:
    """`n` pages cached on `m` under a prompt's chained keys (unreferenced, as a prefix cache holds them)."""
    keys = chain_page_keys(list(range(n * PAGE + 1)), PAGE, [])
    pages = [m.pool.allocate() for _ in keys]
    for page, key in zip(pages, keys):
        m.pool.register(page, key)
        m.pool.decref(page)
    return keys, pages


def assert_copied(a: PoolMember, b: PoolMember, keys: list[bytes], theirs: list[int]):
    for key, page in zip(keys, theirs):
        (mine,) = a.pool.lookup([key])
        assert a.pool.ref_count(mine) == 0 and a.pool.is_evictable(mine), "kept as cache, not pinned"
        for layer_a, layer_b in zip(a.kv_layers, b.kv_layers):
            assert torch.equal(layer_a[:, :, mine], layer_b[:, :, page])


def test_a_hot_segment_is_copied_in_from_its_holder_and_later_pins_read_the_copy_here(pair):
    """A heavy hitter read on a peer (AddRequest.copy): query mode fetches the pages this engine
    lacks, keeps them as cache with the holder's bytes, and a run the front still names on the peer
    is read here from then on; the holder keeps its own and pins nothing for the copy."""
    a, b = pair
    keys, theirs = held_segment(b, 3)
    a.pool.register(a.pool.allocate(), keys[0])  # it has the first page already: only the others come
    a.pool.decref(a.pool.lookup([keys[0]])[0])
    assert a.copy_in([p.PrefixRun(1, keys)]) == 2 and a.stats["copied_pages"] == 2
    assert_copied(a, b, keys[1:], theirs[1:])
    assert b.service.pinned_pages == 0 and b.pool.num_used == 0 and len(b.pool.lookup(keys)) == 3
    assert a.pin("r", [p.PrefixRun(1, keys)]) == 3
    assert list(a.foreign["r"].pages) == [0] and a.count("r") == (0, 3), "read here, not on the peer"
    assert b.service.pinned_pages == 0
    a.release("r")
    assert a.pool.num_used == 0


def test_a_copy_takes_what_the_holder_still_has_and_a_gone_holder_none(pair):
    a, b = pair
    keys, _ = held_segment(b, 3)
    assert a.copy_in([p.PrefixRun(1, keys + [b"gone"])]) == 3, "the holder's leading pages"
    assert a.copy_in([p.PrefixRun(1, keys)]) == 0, "held here already: nothing crosses"
    a.set_peers([])
    assert a.copy_in([p.PrefixRun(1, [b"x"])]) == 0


def test_read_mode_copies_a_hot_segment_through_the_holders_mapped_cache(tmp_path):
    backend = TorchAttentionBackend(HEADS, KV_HEADS, HEAD_DIM, PAGE, torch.float32, torch.device("cpu"),
                                    paged_kernel=False)
    shape = backend.kv_cache_shape(7)  # the holder's pages and its scratch page (runner.py)
    shared = SharedKV.create(cache_name(str(tmp_path), 1, 1), LAYERS, shape, torch.float32)
    for layer in shared.layers:
        layer.copy_(torch.randn(shape))
    mine = [torch.zeros(backend.kv_cache_shape(16)) for _ in range(LAYERS)]
    a = PoolMember(0, 1, "read", str(tmp_path), backend, mine, PagePool(16), threading.Lock(), 8)
    b = PoolMember(1, 1, "read", str(tmp_path), backend, shared.layers, PagePool(6), threading.Lock(), 8)
    fetches = []
    b.service.stage = lambda pages: fetches.append(pages)  # read mode must not stage through the host
    try:
        a.set_peers([p.PoolPeer(1, 1, os.getpid(), 6)])
        keys, theirs = held_segment(b, 4)
        assert a.copy_in([p.PrefixRun(1, keys)]) == 4 and fetches == []
        assert a.sharing() == ("shared memory", {})
        assert_copied(a, b, keys, theirs)
        assert b.service.pinned_pages == 0, "the copy's pins go with it"
    finally:
        a.close()
        b.close()
        shared.close()


def test_a_copy_between_engines_of_different_cache_layouts_keeps_every_value_in_its_place(tmp_path):
    a, b = member(0, 16, str(tmp_path), PageSecondLayout), member(1, 6, str(tmp_path))
    try:
        a.set_peers([p.PoolPeer(1, 1, os.getpid(), 6)])
        keys, theirs = held_segment(b, 3)
        assert a.copy_in([p.PrefixRun(1, keys)]) == 3
        for key, page in zip(keys, theirs):
            (mine,) = a.pool.lookup([key])
            for layer_a, layer_b in zip(a.kv_layers, b.kv_layers):
                assert torch.equal(layer_a[:, mine], layer_b[:, :, page])
    finally:
        a.close()
        b.close()


def test_a_hot_segment_named_to_copy_in_stays_here_though_a_request_here_wrote_it_into_its_home(pair):
    """A request here computed a hot segment and wrote it into its home; the front names it to copy
    in here. It is held here already, so nothing crosses, and it is a replica: a hand-off lets go of
    what its homes took but the replicas (PoolHooks._hand_off, tests/unit/test_pool_hand_off.py), and
    it stays cached here until it is evicted here."""
    from types import SimpleNamespace

    from tokenflowd.pool.engine_hooks import PoolHooks

    a, b = pair
    keys, _ = held_segment(a, 3)  # computed here; its home (engine 1) took it
    held_segment(b, 3)
    h = PoolHooks.__new__(PoolHooks)
    h.member, h.core = a, SimpleNamespace(pool=a.pool)
    assert a.copy_in([p.PrefixRun(1, keys)]) == 0, "held here already: nothing crosses"
    assert a.replicas == set(keys)
    a.pool.unpublish(keys[2:])  # evicted here
    h.evicted(keys[1:])  # the report names keys[1] too: evicted and copied back in since, held here again
    assert a.replicas == set(keys[:2]), "evicted here: no longer a replica; one cached here again still is"


def test_a_replica_takes_free_pages_only_and_goes_before_other_cached_pages_until_read(pair):
    """PoolMember.copy_in: a copy of a hot segment is a second copy of what the node holds, so it
    never costs this engine a prefix held nowhere else: it is not made where the pages it lacks
    outnumber the free ones, and its pages are evicted before this engine's own cached pages (the
    segment's end first) unless a request reads them."""
    a, b = pair  # a: 16 pages
    keys, _ = held_segment(b, 3)
    own = chain_page_keys(list(range(500, 500 + 10 * PAGE + 1)), PAGE, [])
    pages = [a.pool.allocate() for _ in own]  # a's own prefix, cached before the copy
    for page, key in zip(pages, own):
        a.pool.register(page, key)
    for page in reversed(pages):  # let go of end first, as a request does
        a.pool.decref(page)
    used = [a.pool.allocate() for _ in range(4)]  # a running request's pages: 2 free
    assert a.copy_in([p.PrefixRun(1, keys)]) == 0 and a.replicas == set(), "3 to copy, 2 free: not copied"
    assert len(a.pool.lookup(own)) == 10, "nothing evicted for it"
    for page in used[:2]:
        a.pool.decref(page)
    assert a.copy_in([p.PrefixRun(1, keys)]) == 3 and a.replicas == set(keys)
    assert a.pool.num_unused == 1
    a.pool.set_inner(keys, True)  # the pool's word: cached pages follow them (on b): a second copy still goes first
    (read,) = a.pool.lookup(keys[:1])
    a.pool.incref(read)  # a request reads its first page
    a.pool.decref(read)
    a.pool.allocate(), a.pool.allocate(), a.pool.allocate()  # the free page, then two evictions
    assert len(a.pool.lookup(keys)) == 1 and len(a.pool.lookup(own)) == 10, "the unread copy went first"
    a.pool.allocate()
    assert len(a.pool.lookup(own)) == 9 and len(a.pool.lookup(keys)) == 1, "then by use: the read page stays"


def test_an_engines_replicas_take_at_most_one_nth_of_its_pages(pair):
    """pool/heat.py replica_pages: a copy that would leave this engine's replicas holding more than
    1/N of its pages (N: the node's engines) is not made, free pages or not; a segment held here
    already is made a replica only within it too; replicas evicted here since are not counted."""
    a, b = pair  # a: 16 pages, 2 engines: at most 8 in replicas
    keys, _ = held_segment(b, 5)
    assert a.copy_in([p.PrefixRun(1, keys)]) == 5 and a.replicas == set(keys)
    more = chain_page_keys(list(range(900, 900 + 4 * PAGE + 1)), PAGE, [])
    for key in more:  # a second hot segment on the holder (its first one's pages make room)
        page = b.pool.allocate()
        b.pool.register(page, key)
        b.pool.decref(page)
    assert a.pool.num_unused >= 4
    assert a.copy_in([p.PrefixRun(1, more)]) == 0 and a.replicas == set(keys), "5 + 4 pages: over 8"
    assert a.copy_in([p.PrefixRun(1, more[:3])]) == 3 and a.replicas == set(keys) | set(more[:3]), "5 + 3: 8"
    assert a.copy_in([p.PrefixRun(1, keys)]) == 0 and a.replicas == set(keys) | set(more[:3])
    mine = chain_page_keys(list(range(700, 700 + 2 * PAGE + 1)), PAGE, [])
    for key in mine:  # cached here, not a replica
        page = a.pool.allocate()
        a.pool.register(page, key)
        a.pool.decref(page)
    assert a.copy_in([p.PrefixRun(1, mine)]) == 0 and not a.replicas & set(mine), "held here, but 8 + 2: over 8"
    a.pool.unpublish(more[:3])  # evicted here, before any report
    assert a.copy_in([p.PrefixRun(1, mine)]) == 0 and a.replicas == set(keys) | set(mine), \
        "5 + 2: the evicted not counted"


def test_a_copy_that_fails_or_is_cut_short_counts_as_a_replica_only_what_it_holds(pair):
    a, b = pair
    keys, _ = held_segment(b, 3)
    a.set_peers([])  # the holder is gone
    assert a.copy_in([p.PrefixRun(1, keys)]) == 0 and a.replicas == set()
    a.set_peers([p.PoolPeer(1, 1, os.getpid(), 6)])
    b.pool.unpublish(keys[2:])  # the holder let go of its segment's end
    assert len(b.pool.lookup(keys)) == 2
    assert a.copy_in([p.PrefixRun(1, keys)]) == 2 and a.replicas == set(keys[:2]), "what the holder still had"
