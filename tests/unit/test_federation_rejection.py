"""Early rejection (federation/conductor/rejection.py) on hand-computed decode pools: the load predicted for
when a request would reach decode (Mooncake §7.4), against the current one (§7.2). The comparison
in a cluster is tests/unit/test_cluster_sim.py's."""
from __future__ import annotations

import pytest

from tokenflowd.federation.conductor.rejection import DecodeLoad, EarlyRejection


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
    predicted, current = EarlyRejection(load), EarlyRejection(load, predict="current")
    # Reaching decode at 16: a and b will have ended, c decodes: room. Now the pool is full.
    # (earliest=16: the prefill queues are such that nobody arriving later reaches decode first.)
    assert predicted.admit(6.0, 16.0, earliest=16.0) and not current.admit(6.0, 16.0)
    load.accepted("d", 12.5)
    assert not predicted.admit(6.0, 13.0, earliest=13.0)  # b, c and d at 13: no room for a fourth
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


def test_requests_still_to_arrive_count_at_the_rate_decodes_started_after_the_shortest_prefill_queue():
    load = DecodeLoad(capacity=4, decode_seconds=10.0)
    load.started("old", 5.0)
    for i, t in enumerate((12.0, 14.0, 16.0, 18.0)):
        load.started(f"r{i}", t)
    # At 20, four decodes started in the last T_d = 10 s ("old" before): 0.4/s.
    assert load.inflow(20.0) == pytest.approx(0.4)
    assert load.predicted(31.0, now=20.0) == 0  # all have ended by 28 under T_d
    # Arrivals from 20 on can reach decode from 21 (the shortest prefill queue is 1 s): 10 s × 0.4.
    assert load.arriving(31.0, now=20.0, earliest=21.0) == pytest.approx(4.0)
    assert load.arriving(31.0, now=20.0, earliest=35.0) == 0.0  # every queue is longer: none overtakes
    # one that reaches decode more than T_d before t has ended by t: never more than T_d × the rate
    assert load.arriving(80.0, now=20.0, earliest=21.0) == pytest.approx(4.0)
    gate, uniform = EarlyRejection(load), EarlyRejection(load, predict="uniform")
    load.capacity = 2
    assert uniform.admit(20.0, 31.0, earliest=21.0)  # the paper's count sees an empty pool at 31
    assert not gate.admit(20.0, 31.0, earliest=21.0)  # 4 arriving + itself > 2
    assert gate.admit(20.0, 31.0, earliest=28.5)  # 1 arriving + itself <= 2
    with pytest.raises(ValueError):
        EarlyRejection(load, predict=True)


def test_the_uniform_count_alone_favours_requests_that_reach_decode_late():
    """Without the arrivals, the further ahead a request's decode starts, the emptier the pool looks:
    a long prompt is taken where a short one is refused."""
    load = DecodeLoad(capacity=3, decode_seconds=10.0)
    for i in range(3):
        load.started(f"r{i}", 10.0 + 3 * i)  # a full pool, ending at 20, 23 and 26
    uniform, gate = EarlyRejection(load, predict="uniform"), EarlyRejection(load)
    assert not uniform.admit(19.0, 19.5, earliest=19.0) and uniform.admit(19.0, 27.0, earliest=19.0)
    # three decodes started in the last T_d: 0.3/s, so 8 s on, 2.4 more are expected
    assert not gate.admit(19.0, 27.0, earliest=19.0)
