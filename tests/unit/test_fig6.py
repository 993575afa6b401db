"""TokenFlow's Fig. 6 toy example (§4.1) in the simulator, under the tokenflow policy: capacity
40 tokens/s per running request, two slots; R1 (20 tokens/s) and R2 (30) at t = 0, R3 (25) at t = 2.

R3 waits at t = 2 (neither buffer covers a swap yet), R1 is swapped out near t = 3 so R3 runs,
R2 (then the fullest buffer) makes way to bring R1 back before its buffer empties (the paper: at
t = 5), and nobody's reader ever stalls."""
from __future__ import annotations

import pytest

from tokenflowd.buffer.qos import Timeline, request_qos
from tokenflowd.sim.run import run_simulation
from tokenflowd.sim.scenarios import fig6_scenario


@pytest.fixture(scope="module")
def runs():
    sc = fig6_scenario()
    return {p: {r.request_id: r for r in run_simulation(sc, p)[0].records} for p in ("tokenflow", "fcfs")}


def test_r3_waits_at_t2_and_r1_is_swapped_out_near_t3(runs):
    r1, r3 = runs["tokenflow"]["R1"], runs["tokenflow"]["R3"]
    assert 2.0 < r3.admit_time <= 3.05  # not at t = 2: R1's 40 tokens do not cover 2.5 × a 1 s swap
    assert 2.5 < r1.preempt_times[0] <= 3.05
    assert r1.preempt_times[0] == pytest.approx(r3.admit_time)


def test_r1_comes_back_before_its_buffer_empties(runs):
    r1, r2 = runs["tokenflow"]["R1"], runs["tokenflow"]["R2"]
    out, back = r1.preempt_times[0], r1.resume_times[0]
    buffer_at_out = len([t for t in r1.token_times if t <= out]) - 20.0 * (out - r1.token_times[0])
    assert back < out + buffer_at_out / 20.0  # before its reader runs dry
    assert back == pytest.approx(r2.preempt_times[0])  # R2, with the fullest buffer, made way
    assert 3.5 <= back <= 5.05  # the paper: t = 5, with 1 s of R1's buffer left; here once it is down to μ·(way back + a pass)


def test_no_reader_stalls_under_tokenflow_while_fcfs_makes_r3_wait(runs):
    for r in runs["tokenflow"].values():
        q = request_qos(Timeline(r.arrival, r.reading_rate, r.token_times))
        assert q.rebuffer == 0.0 and q.num_stalls == 0, r.request_id
        assert len(r.token_times) == r.output_len
    assert runs["tokenflow"]["R1"].preempt_times  # R1 was out and still never stalled
    fcfs_r3 = runs["fcfs"]["R3"]
    assert fcfs_r3.ttft > 5.0 > runs["tokenflow"]["R3"].ttft  # FCFS: R3 waits for R1 to finish
