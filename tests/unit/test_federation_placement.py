"""The conductor's placement (federation/conductor/placement.py): Mooncake's Algorithm 1 on hand-computed cases."""
from __future__ import annotations

import math

import pytest

from tokenflowd.federation.conductor.placement import DecodeNode, Placement, PrefillNode, Rejection, place

KV = 1000  # bytes per token


def prefill_time(prompt: int, cached: int) -> float:
    return 0.001 * (prompt - cached)  # 1 ms a computed token


def node(name: str, prefix: int, queue: float) -> PrefillNode:
    return PrefillNode(name, prefix, queue, prefill_time)


def run(prefill, decode=(DecodeNode("d0", 0.05),), bandwidth=lambda a, b: 1e6, threshold=2.0, ttft_slo=10.0,
        tbt_slo=0.1):
    return place(4000, prefill, list(decode), bandwidth=bandwidth, kv_bytes_per_token=KV,
                 balancing_threshold=threshold, ttft_slo=ttft_slo, tbt_slo=tbt_slo)


def test_a_node_whose_own_match_is_nearly_the_best_is_judged_on_queue_and_prefill():
    # best 3000 on a; b holds 2000: 3000/2000 = 1.5 < 2, so b computes what it lacks.
    got = run([node("a", 3000, queue=2.0), node("b", 2000, queue=0.0)])
    assert got == Placement("b", "d0", pytest.approx(2.0), 0.05)  # b: 0 + 2.0; a: 2.0 + 1.0


def test_a_node_far_behind_the_best_match_fetches_it_when_that_is_faster():
    # best 3000 on a (busy); c holds 500: 3000/500 = 6 ≥ 2, so c would fetch 2500 tokens (2.5 MB at
    # 1 MB/s: 2.5 s) and compute 1000: 3.5 s; a: queue 5 + 1.0 = 6 s.
    got = run([node("a", 3000, queue=5.0), node("c", 500, queue=0.0)])
    assert got == Placement("c", "d0", pytest.approx(3.5), 0.05, fetch_from="a", fetch_tokens=2500)
    # On a slow link computing at a is better: c's fetch takes 25 s.
    slow = run([node("a", 3000, queue=5.0), node("c", 500, queue=0.0)], bandwidth=lambda a, b: 1e5)
    assert (slow.prefill, slow.fetch_from, slow.ttft_seconds) == ("a", None, pytest.approx(6.0))
    # No link at all: c computes its own 3500 tokens (3.5 s), as good as fetching was.
    cut = run([node("a", 3000, queue=5.0), node("c", 500, queue=0.0)], bandwidth=lambda a, b: 0.0)
    assert (cut.prefill, cut.fetch_from, cut.ttft_seconds) == ("c", None, pytest.approx(3.5))


def test_the_decode_node_is_the_one_of_least_predicted_tbt_and_slos_reject_before_prefill():
    decode = [DecodeNode("d0", 0.08), DecodeNode("d1", 0.03)]
    assert run([node("a", 0, 0.0)], decode).decode == "d1"
    assert run([node("a", 0, 9.0)], decode, ttft_slo=10.0) == Rejection("ttft", pytest.approx(13.0), 0.03)
    assert run([node("a", 0, 0.0)], [DecodeNode("d0", 0.2)]) == Rejection("tbt", pytest.approx(4.0), 0.2)
    assert run([], decode) == Rejection("no prefill node")
    assert run([node("a", 0, 0.0)], []) == Rejection("no decode node")
    assert math.isinf(Rejection("no decode node").ttft_seconds)
