"""Early rejection (federation/rejection.py) on hand-computed decode pools: the load predicted for
when a request would reach decode (Mooncake §7.4), against the current one (§7.2). The comparison
in a cluster is tests/unit/test_cluster_sim.py's."""
from __future__ import annotations

import pytest

from tokenflowd.federation.rejection import DecodeLoad, EarlyRejection


def pool(capacity: int = 2) -> DecodeLoad:
    load = DecodeLoad(capacity=capacity, decode_seconds=10.0)
    load.started("a", 0.0)  # T_d says it ends at 10
    load.started("b", 5.0)  # ends at 15
    load.accepted("c", 12.0)  # its prefill ends at 12: decodes 12..22
    return load


def test_the_prediction_counts_running_decodes_that_outlast_t_and_accepted_ones_that_reach_it():
    load = pool()
    assert load.current() == 2
    assert load.predicted(8.0, now=6.0) == 2  # a and b; c not there yet
    assert load.predicted(12.0, now=6.0) == 2  # a ended, c started
    assert load.predicted(16.0, now=6.0) == 1
    assert load.predicted(22.0, now=6.0) == 0
    # The uniform time, as the paper has it: a decode older than T_d counts as ended.
    assert load.predicted(20.0, now=18.0) == 1  # only c


def test_the_predicted_gate_judges_the_pool_at_the_requests_decode_start_the_current_one_now():
    load = pool(capacity=2)
    predicted, current = EarlyRejection(load), EarlyRejection(load, predict=False)
    # Reaching decode at 16: a and b will have ended, c decodes: room. Now the pool is full.
    assert predicted.admit(6.0, 16.0) and not current.admit(6.0, 16.0)
    load.accepted("d", 12.5)
    assert not predicted.admit(6.0, 13.0)  # b, c and d at 13: no room for a fourth
    load.finished("a", 6.0)
    assert current.admit(6.0, 13.0), "the current load sees one decoding and not the two on their way"


def test_t_d_is_the_mean_of_the_decodes_that_finished():
    load = pool()
    load.finished("a", 30.0)
    assert load.decode_seconds == 30.0
    load.finished("c", 31.0)  # never started (rejected on its decode node): no decode time
    assert load.decode_seconds == 30.0 and load.predicted(12.0, now=6.0) == 1  # c is gone
    load.finished("b", 15.0)
    assert load.decode_seconds == 20.0


def test_the_survival_estimate_weighs_each_request_by_how_likely_it_is_still_decoding():
    load = DecodeLoad(capacity=4, decode_seconds=10.0)
    for i in range(16):  # half the decodes last 10 s, half 30 s
        load.started(f"h{i}", 0.0)
        load.finished(f"h{i}", 10.0 if i % 2 else 30.0)
    load.started("x", 100.0)  # age 0 at 100
    load.accepted("y", 105.0)
    # At 120: x has lasted 20 s (S(20)/S(0) = 0.5), y 15 s (S(15) = 0.5).
    assert load.expected(120.0, now=100.0) == pytest.approx(1.0)
    assert load.predicted(120.0, now=100.0) == 1  # T_d = 20: x has ended at 120, y decodes to 125
