"""The pool's placement: homes by hash that never move, heavy hitters replicated under skew, power
of two choices balancing 8 engines on the Mooncake trace, global LRU with pins, an engine's death,
the segment-size threshold, and dispatch by minimum-cost matching."""
from __future__ import annotations

import itertools
import math
import random

import pytest

from tokenflowd.kv.pages import chain_page_keys
from tokenflowd.pool.dispatch import BatchTraffic, dispatch
from tokenflowd.pool.index import Hardware, PoolIndex, PoolRequest
from tokenflowd.pool.homes import Placement, rendezvous_home
from tokenflowd.pool.segments import SegmentCosts, pages_per_segment, query_payload, segment_keys
from tokenflowd.sim.pool import PoolSimConfig, coefficient_of_variation, replay
from tokenflowd.sim.workload import DEFAULT_TRACE, WorkloadSpec, build_workload

SEG = 512


def chain(*ids: int) -> list[bytes]:
    """Chained keys of pages of one "token" each (kv/pages.py)."""
    return chain_page_keys(ids, 1, [])


def test_homes_are_by_hash_and_only_a_dead_engines_segments_move():
    keys = [k for i in range(300) for k in chain(i, 10_000 + i)]
    homes = {k: rendezvous_home(k, range(8)) for k in keys}
    assert len(set(homes.values())) == 8
    after = {k: rendezvous_home(k, [0, 1, 2, 4, 5, 6, 7]) for k in keys}
    assert all(after[k] == homes[k] for k in keys if homes[k] != 3)


def test_normal_segments_never_move_and_heavy_hitters_are_replicated_under_skew():
    p = Placement(range(8), half_life=30.0, seed=1)
    rng = random.Random(0)
    hot = chain(7, 8, 9)  # a system prompt most requests start with
    now = 0.0
    prefixes = []
    for i in range(3000):
        now += 0.01
        keys = hot + chain(7, 8, 9, 100 + i)[3:] if rng.random() < 0.6 else chain(5000 + i, 1, 2)
        p.route(keys, now)
        p.put(keys, [SEG] * len(keys), now)
        prefixes.append(keys)
        if i % 50 == 0:
            p.rebalance(now)
    hot_nodes = [p.tree.get(k) for k in hot]
    # All the reuse is the hot prefix's: its replicas must reach every engine between them.
    assert all(len(n.replicas) >= 2 for n in hot_nodes), [len(n.replicas) for n in hot_nodes]
    assert set().union(*(n.replicas for n in hot_nodes)) == set(range(8))
    hitters = {n.key for n in p.tree.heavy_hitters(p.num_heavy_hitters(), now)}
    for node in p.tree.nodes.values():
        if node.key not in hitters and node.key not in p._replicated:
            assert set(node.replicas) == {node.home} == {rendezvous_home(node.key, range(8))}
    # accesses of the last stretch: the hot prefix's replicas share them
    window = {e: 0 for e in range(8)}
    for keys in prefixes[-500:]:
        for node, engine in p.route(keys, now):
            window[engine] += node.tokens
    assert coefficient_of_variation(list(window.values())) < 0.3


def test_heavy_hitters_are_the_most_accessed_segments_found_from_the_root():
    p = Placement(range(4), half_life=1e9)
    rng = random.Random(3)
    counts = {}
    for i in range(400):
        ids = [rng.randrange(3), rng.randrange(4), rng.randrange(50)]
        keys = chain(*ids)
        p.put(keys, [SEG] * 3, 0.0)
        p.route(keys, 0.0)
        for k in keys:
            counts[k] = counts.get(k, 0) + 1
    k = p.num_heavy_hitters()
    assert k == math.ceil(4 * math.log(4)) + 4
    got = [n.key for n in p.tree.heavy_hitters(k, 0.0)]
    want = sorted(counts, key=lambda key: -counts[key])[:k]
    assert sorted(counts[x] for x in got) == sorted(counts[x] for x in want)


@pytest.mark.skipif(not DEFAULT_TRACE.is_file(), reason="the Mooncake trace is not on this machine")
def test_power_of_two_choices_keeps_load_cv_under_15_percent_on_the_mooncake_trace():
    requests = build_workload(WorkloadSpec.parse("trace", num_requests=4000))
    for blocks in (200, 1000):
        cfg = PoolSimConfig(engines=8, capacity_tokens=blocks * SEG)
        pool, routing = replay("pool", requests, cfg), replay("routing", requests, cfg)
        assert pool.load_cv_mean < 0.15, pool.summary()
        assert routing.load_cv_mean > 2 * pool.load_cv_mean, routing.summary()
        assert pool.hit_rate >= 0.95 * routing.hit_rate
        assert max(pool.held_tokens_end) <= cfg.capacity_tokens + SEG


def test_lru_over_replicas_keeps_pinned_ones_and_takes_the_unreachable_below_a_last_replica():
    p = Placement([0, 1], half_life=1e9)
    old, new = chain(1, 2, 3), chain(4, 5)
    p.put(old, [SEG] * 3, 0.0)
    pinned = p.route(old, 0.5)[0]  # a running request reads the old prefix's first segment
    p.pin(*pinned)
    p.put(new, [SEG] * 2, 1.0)
    p.route(new, 2.0)
    on0 = [k for k in old + new if p.tree.get(k).home == 0]
    assert on0, "some segment lives on engine 0"
    dropped = p.evict(0, 10 * SEG)
    assert (pinned[0].key, pinned[1]) not in dropped
    assert all(p.tree.get(k) is None for k, _ in dropped)
    p.unpin(pinned[0].key, pinned[1])
    p.evict(pinned[1], 10 * SEG)
    assert p.tree.get(old[0]) is None and p.tree.get(old[-1]) is None, "below a dropped prefix nothing stays"
    assert p.held_tokens(0) + p.held_tokens(1) == SEG * len(p.tree)


def test_eviction_takes_a_chains_leaves_first_and_counts_what_it_freed():
    p = Placement([0], half_life=1e9)
    keys = chain(1, 2, 3, 4)
    p.put(keys, [SEG] * 4, 0.0)
    p.route(keys, 1.0)
    assert p.evict(0, 1) == [(keys[-1], 0)]
    assert p.held_tokens(0) == 3 * SEG and len(p.tree.match(keys)) == 3
    assert p.evict(0, 2 * SEG) == [(keys[2], 0), (keys[1], 0)]


def test_a_dead_engine_leaves_the_index_at_once_with_what_only_it_led_to():
    p = Placement(range(3))
    keys = chain(*range(30))
    p.put(keys, [SEG] * 30, 0.0)
    first_on_1 = next(i for i, k in enumerate(keys) if p.tree.get(k).home == 1)
    freed = p.drop_engine(1)
    assert all(1 not in n.replicas for n in p.tree.nodes.values())
    assert len(p.tree.match(keys)) == first_on_1
    assert {k for k, _ in freed} == {k for k in keys[first_on_1:] if rendezvous_home(k, range(3)) != 1}
    assert sum(p.held_tokens(e) for e in p.engines) == SEG * len(p.tree)
    p.add_engine(1, 1.0)  # its successor: new segments hash over all three again
    assert [e for _, e in p.put(keys, [SEG] * 30, 1.0)] == [rendezvous_home(k, range(3)) for k in keys[first_on_1:]]


def test_segment_threshold_follows_the_formula_and_rounds_to_pages():
    costs = SegmentCosts(alpha=5e-6, bandwidth=50e9, k_comp=2e-8, payload=query_payload(32, 128, 2))
    want = 2 * 5e-6 / 2e-8 + costs.payload / (2e-8 * 50e9)
    assert costs.threshold_tokens() == pytest.approx(want)
    assert pages_per_segment(costs, 16) == math.ceil(want / 16)
    assert pages_per_segment(costs, 16, max_pages=4) == 4
    keys = [bytes([i]) for i in range(10)]
    assert segment_keys(keys, 4) == [keys[3], keys[7]]


def test_link_and_compute_measures_recover_known_costs(monkeypatch):
    from tokenflowd.pool import segments
    from tokenflowd.pool.segments import measure_k_comp, measure_link

    clock = [0.0]
    monkeypatch.setattr(segments.time, "perf_counter", lambda: clock[0])

    def round_trip(rows):  # 50 us each way, 10 GB/s, 1,000 bytes a row
        clock[0] += 2 * 50e-6 + rows * 1000 / 10e9

    def attend(tokens):  # 10 us a call, 2 ns a token
        clock[0] += 10e-6 + tokens * 2e-9

    alpha, bandwidth = measure_link(round_trip, 1000, rows=101, repeats=3)
    assert alpha == pytest.approx(50e-6 + 1000 / 10e9 / 2)
    assert bandwidth == pytest.approx(10e9)
    assert measure_k_comp(attend, 4096, repeats=3) == pytest.approx(2e-9)


def test_dispatch_is_the_least_cost_assignment():
    rng = random.Random(5)
    engines = [0, 1, 2, 3]
    batches = [BatchTraffic({e: rng.randrange(100) for e in rng.sample(engines, 2)},
                            {rng.choice(engines): rng.randrange(1000)}) for _ in range(4)]
    got = dispatch(batches, engines)
    best = min(itertools.permutations(engines), key=lambda perm: sum(b.cost_on(e) for b, e in zip(batches, perm)))
    assert sum(b.cost_on(e) for b, e in zip(batches, got)) == sum(b.cost_on(e) for b, e in zip(batches, best))
    assert sorted(dispatch(batches * 2, engines)) == sorted(engines * 2)


def test_gen_plans_serves_cached_segments_where_they_live_and_runs_a_batch_beside_its_data():
    index = PoolIndex([0, 1, 2], page_size=16, pages_per_segment=2, query_bytes_per_row=1000,
                      kv_bytes_per_token=10_000)
    pages = chain(*range(8))  # four segments
    assert index.gen_plans([[PoolRequest("a", pages, 128)]], 0.0).cached_tokens["a"] == 0
    index.stored(pages, 0.0)
    plans = index.gen_plans([[PoolRequest("b", pages + chain(*range(8), 99)[8:], 1)]], 1.0)
    assert plans.cached_tokens["b"] == 4 * 32
    served = {k: e for e, ks in plans.query["b"].items() for k in ks}
    assert served == {k: index.get_prefix_tree().get(k).home for k in segment_keys(pages, 2)}
    assert plans.transfer["b"] == []  # its ninth page fills no segment
    hw = Hardware(mem_bandwidth=1e12, flops=1e14)
    assert index.get_cache_load([], 0.01, 4096, hw) == 0.0
    # 32 decodes over 4,096-token prefixes, d 4096, 3 engines, a 20 ms step:
    # M = 32·4·4096·4097 = 2.148e9, F = 32·2·4096·4096 = 1.074e9; memory binds.
    mem, flops = 32 * 4 * 4096 * 4097, 32 * 2 * 4096 * 4096
    want = max(mem / (mem + 3 * 1e12 * 0.02), flops / (flops + 3 * 1e14 * 0.02))
    assert index.get_cache_load([(4096, 1)] * 32, 0.02, 4096, hw) == pytest.approx(want)
    assert want == pytest.approx(mem / (mem + 6e10))


@pytest.mark.skipif(not DEFAULT_TRACE.is_file(), reason="the Mooncake trace is not on this machine")
def test_sim_pool_command_compares_both_modes_and_writes_json(tmp_path, capsys):
    import json

    from tokenflowd.cli import main

    out = tmp_path / "pool.json"
    assert main(["sim-pool", "--engines", "4", "--num-prompts", "300", "--capacity-tokens", "50000,200000",
                 "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [(r["capacity_tokens"], r["mode"]) for r in doc["results"]] == [
        (50000, "routing"), (50000, "pool"), (200000, "routing"), (200000, "pool")]
    assert "hit rate" in capsys.readouterr().out


def test_two_engines_hold_a_shared_system_prompt_once_and_replicate_it_only_when_hot():
    """20 requests share a 1,024-token system prompt (64 pages of 16, segments of 4 pages): the
    pool holds each of its 16 segments once, at its home, whichever engine runs the request; a
    rebalance under the load they make copies hot segments to the other engine, at most once."""
    index = PoolIndex([0, 1], page_size=16, pages_per_segment=4, query_bytes_per_row=1000,
                      kv_bytes_per_token=10_000)
    system = list(range(64))
    for i in range(20):
        pages = chain(*system, 1000 + i, 2000 + i, 3000 + i, 4000 + i)  # the prompt's own last segment
        plans = index.gen_plans([[PoolRequest(f"r{i}", pages, 1)]], float(i))
        assert plans.cached_tokens[f"r{i}"] == (16 * 64 if i else 0)
        index.stored(pages, float(i))
    tree = index.get_prefix_tree()
    shared = segment_keys(chain(*system), 4)
    assert all(len(tree.get(k).replicas) == 1 for k in shared)
    assert len(tree) == 16 + 20
    held = sum(index.placement.held_tokens(e) for e in (0, 1))
    assert held == (16 + 20) * 64, "each segment once"
    plans = index.placement.rebalance(20.0)
    assert all(len(tree.get(k).replicas) <= 2 for k in shared)
    assert all(p.key in set(shared) for p in plans), "only the hot segments are copied"
