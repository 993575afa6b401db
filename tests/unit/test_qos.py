"""The QoS metric (tokenflow eq. 1–2) and effective throughput (§7.1.3) on hand-computed timelines."""
import math

import pytest

from tokenflowd.buffer.qos import (Timeline, effective_weight, effective_weights, percentile, request_qos, summarize,
                                   token_weight)


def test_token_weight_is_eq_1():
    assert token_weight(3.0, tau=5.0, alpha=0.5) == 1.0
    assert token_weight(5.0, tau=5.0, alpha=0.5) == 1.0
    assert token_weight(6.0, tau=5.0, alpha=0.5) == pytest.approx(0.5)
    assert token_weight(9.0, tau=5.0, alpha=0.5) == 0.0


def test_effective_weight_is_the_10_20_rule():
    # output of 100 tokens: full up to 10 buffered, 0.5 at 15, nothing from 20 on
    assert effective_weight(10, 100) == 1.0
    assert effective_weight(15, 100) == pytest.approx(0.5)
    assert effective_weight(20, 100) == 0.0
    assert effective_weight(50, 100) == 0.0


def test_effective_weights_is_the_same_rule_elementwise():
    import numpy as np

    buffers = np.array([0.0, 10.0, 15.0, 20.0, 50.0, 3.0])
    lens = np.array([100.0, 100.0, 100.0, 100.0, 100.0, 10.0])
    assert effective_weights(buffers, lens).tolist() == pytest.approx(
        [effective_weight(b, int(n)) for b, n in zip(buffers, lens)])


def test_stall_and_ttft_by_hand():
    # 2 tokens/s. Tokens at 1, 1.5, 2 are read as they come (buffer 0 before each); the third is
    # read by 2.5, so the reader waits from 2.5 until the fourth token at 5: one 2.5 s stall.
    r = request_qos(Timeline(arrival=0.0, reading_rate=2.0, token_times=[1.0, 1.5, 2.0, 5.0]))
    assert r.ttft == 1.0
    assert r.buffers == (0.0, 0.0, 0.0, 0.0)
    assert r.rebuffer == pytest.approx(2.5)
    assert r.num_stalls == 1
    assert r.effective_tokens == 4.0


def test_buffer_grows_when_tokens_come_faster_than_reading():
    # 1 token/s, tokens every 0.25 s: before token j the reader has read 0.25·(j−1) of j−1 tokens
    times = [0.25 * j for j in range(5)]
    r = request_qos(Timeline(0.0, 1.0, times))
    assert r.buffers == pytest.approx([0.0, 0.75, 1.5, 2.25, 3.0])
    assert r.rebuffer == 0.0 and r.num_stalls == 0


def test_effective_throughput_of_a_flood():
    # 100 tokens in one message at t=1: token j lands on j−1 unread tokens. Weights: 1 for
    # B = 0..10 (11 tokens), 0.9, 0.8, …, 0.1 for B = 11..19 (sum 4.5), 0 beyond: 15.5 tokens.
    s = summarize([Timeline(0.0, 10.0, [1.0] * 100)])
    assert s["span"] == 1.0
    assert s["throughput"] == 100.0
    assert s["effective_throughput"] == pytest.approx(15.5)


def test_qos_is_eq_2():
    # the stalled request above (effective 4, TTFT 1 s, rebuffer 2.5 s, T = 5 s)
    t = Timeline(0.0, 2.0, [1.0, 1.5, 2.0, 5.0])
    assert summarize([t], ttft_weight=1.0, rebuffer_weight=1.0)["qos"] == pytest.approx((4 - 1 - 2.5) / 5)
    # by default λ = μ = the reading rate (2 tokens/s)
    assert summarize([t])["qos"] == pytest.approx((4 - 2 * 1 - 2 * 2.5) / 5)


def test_summary_of_two_requests():
    a = Timeline(0.0, 2.0, [1.0, 1.5, 2.0, 5.0])
    b = Timeline(1.0, 4.0, [3.0, 3.25, 3.5])  # read as it comes: no stall
    s = summarize([a, b], ttft_weight=0.0, rebuffer_weight=0.0)
    assert s["requests"] == 2 and s["requests_served"] == 2
    assert s["span"] == 5.0
    assert s["throughput"] == pytest.approx(7 / 5)
    assert s["ttft_mean"] == pytest.approx(1.5)
    assert s["ttft_p99"] == pytest.approx(1.0 + 0.99 * 1.0)
    assert s["rebuffer_total"] == pytest.approx(2.5)
    assert s["stall_max"] == pytest.approx(2.5)  # a's reader, dry from 2.5 s to 5.0 s
    assert s["qos"] == pytest.approx(7 / 5)


def test_an_unserved_request_counts_its_wait_to_the_end():
    a = Timeline(0.0, 2.0, [1.0, 2.0])
    never = Timeline(0.5, 2.0, [])
    s = summarize([a, never], ttft_weight=1.0, rebuffer_weight=0.0)
    assert s["requests_served"] == 1
    assert s["ttft_mean"] == 1.0
    assert s["qos"] == pytest.approx((2 - 1 - 1.5) / 2)


def test_percentile_matches_linear_interpolation():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)
    assert math.isnan(percentile([], 99))
