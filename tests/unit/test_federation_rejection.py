"""Early rejection (federation/rejection.py): on the decode load predicted for when a request would
reach decode, against the current decode load (Mooncake §7), in a small disaggregated cluster: one
FIFO prefill pool, one decode pool of fixed capacity, Poisson arrivals at twice what decode serves."""
from __future__ import annotations

import heapq
import random

import pytest

from tokenflowd.federation.rejection import DecodeLoad, EarlyRejection

PREFILL_SECONDS = 2.0  # each prefill, on one of PREFILL_NODES
PREFILL_NODES = 4
DECODE_SLOTS = 32
DECODE_MEAN = 20.0  # s: decodes last an exponential time of this mean
TTFT_SLO = 12.0


def run(predict: bool, seed: int = 1, n: int = 3000) -> dict:
    rng = random.Random(seed)
    rate = 2 * DECODE_SLOTS / DECODE_MEAN  # twice what the decode pool serves
    load = DecodeLoad(DECODE_SLOTS, DECODE_MEAN)
    conductor = EarlyRejection(load, predict=predict)
    prefill_free = [0.0] * PREFILL_NODES  # when each prefill node is next free
    events: list[tuple[float, int, str, str]] = []  # (time, tiebreak, kind, request)
    t, decisions, ttft_breaks, late = 0.0, [], 0, 0
    for i in range(n):
        t += rng.expovariate(rate)
        while events and events[0][0] <= t:  # decode starts and ends up to now
            when, _, kind, rid = heapq.heappop(events)
            if kind == "start":
                if load.current() >= DECODE_SLOTS:  # no room when it gets there: its prefill was wasted
                    load.finished(rid, when)
                    late += 1
                    continue
                load.started(rid, when)
                heapq.heappush(events, (when + rng.expovariate(1 / DECODE_MEAN), rng.random(), "end", rid))
            else:
                load.finished(rid, when)
        node = min(range(PREFILL_NODES), key=lambda k: prefill_free[k])
        ttft = max(prefill_free[node], t) - t + PREFILL_SECONDS
        ok = ttft <= TTFT_SLO and conductor.admit(t, t + ttft)
        decisions.append(ok)
        if ok:
            rid = f"r{i}"
            prefill_free[node] = t + ttft
            load.accepted(rid, t + ttft)
            heapq.heappush(events, (t + ttft, rng.random(), "start", rid))
            ttft_breaks += ttft > 1.2 * TTFT_SLO
    flips = sum(a != b for a, b in zip(decisions, decisions[1:]))
    return {"shed": decisions.count(False) + late, "late": late, "flips": flips, "ttft_breaks": ttft_breaks}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_predicted_load_sheds_no_more_and_oscillates_less_than_the_current_load(seed):
    current, predicted = run(predict=False, seed=seed), run(predict=True, seed=seed)
    assert predicted["shed"] <= current["shed"], (predicted, current)
    assert predicted["flips"] < current["flips"], (predicted, current)
    assert predicted["ttft_breaks"] == current["ttft_breaks"] == 0
    # judged on the present, requests admitted while the decode pool looked free arrive when it is full
    assert predicted["overfull"] < current["overfull"], (predicted, current)


def test_the_prediction_counts_running_decodes_that_outlast_t_and_accepted_ones_that_reach_it():
    load = DecodeLoad(capacity=3, decode_seconds=10.0)
    load.started("a", 0.0)  # ends at 10
    load.started("b", 5.0)  # ends at 15
    load.accepted("c", 12.0)  # decodes 12..22
    assert load.predicted(8.0, now=6.0) == 2
    assert load.predicted(12.0, now=6.0) == 2  # a ended, c started
    assert load.predicted(16.0, now=6.0) == 1
    assert load.predicted(22.0, now=6.0) == 0
    # A decode that has run longer than T_d is taken to have T_d left, not to have ended.
    assert load.predicted(20.0, now=18.0) == 3  # a and b (both overrun: to 28), and c
    gate = EarlyRejection(load)
    assert gate.admit(6.0, 16.0) and not gate.admit(6.0, 12.5)
    assert EarlyRejection(load, predict=False).admit(6.0, 16.0)  # 2 decoding now, room for one more
    load.finished("a", 30.0)
    assert load.decode_seconds == 30.0, "T_d follows the decodes that finished"
