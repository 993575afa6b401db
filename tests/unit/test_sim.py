"""The simulator: workloads, cost model, the event loop over the real scheduler, results, calibrate, CLI."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from tokenflowd.buffer import POLICIES, make_policy
from tokenflowd.buffer.policy import Plan, SchedulingPolicy
from tokenflowd.cli import main
from tokenflowd.config import PolicyConfig
from tokenflowd.sim.calibrate import CalibrationPlan, fit_roofline
from tokenflowd.sim.cost import PRESETS, cost_model, fig6_cost_model, save_cost_model
from tokenflowd.sim.result import dumps, summary
from tokenflowd.sim.run import run_simulation
from tokenflowd.sim.scenarios import Scenario, fig6_scenario, scenario
from tokenflowd.sim.simulator import SimulationError, Simulator
from tokenflowd.sim.workload import (
    BLOCK_TOKENS, DEFAULT_TRACE, LengthDist, WorkloadSpec, build_workload, parse_lengths,
    parse_reading_rates, prompt_token_ids,
)


def small_cost(pages: int = 4096, max_num_seqs: int = 8, budget: int = 256):
    """fig6's shapes (2 bytes of KV per token) with a step time that grows with the batch."""
    return fig6_cost_model().replace(name="small", kv_memory=pages * 16 * 2, max_num_seqs=max_num_seqs,
                                     max_num_batched_tokens=budget, step_overhead=0.01, num_params=1e9,
                                     peak_flops=1e12)


def custom(spec: WorkloadSpec, cost, params: PolicyConfig | None = None) -> Scenario:
    return Scenario("custom", "", cost, tuple(build_workload(spec)), params or PolicyConfig(), spec)


# -- workloads --------------------------------------------------------------------------------
def test_burst_puts_every_request_at_zero():
    reqs = build_workload(WorkloadSpec.parse("burst:7", lengths=parse_lengths("fixed:30:40")))
    assert [r.request_id for r in reqs] == [f"r{i}" for i in range(7)]
    assert {r.arrival_time for r in reqs} == {0.0}
    assert {(r.prompt_len, r.output_len) for r in reqs} == {(30, 40)}
    # fresh block ids per request: no two requests share a block
    blocks = [b for r in reqs for b in r.hash_ids]
    assert len(blocks) == len(set(blocks)) == 7


def test_each_seed_sends_its_own_prompts():
    def prompts(seed):
        spec = WorkloadSpec.parse("burst:3", lengths=parse_lengths("fixed:30:40"), seed=seed)
        return [prompt_token_ids(r, 1000) for r in build_workload(spec)]

    assert prompts(1) == prompts(1)
    assert not {tuple(p) for p in prompts(0)} & {tuple(p) for p in prompts(1)}


def test_poisson_rate_and_order():
    reqs = build_workload(WorkloadSpec.parse("poisson:4", num_requests=4000, seed=3))
    t = np.array([r.arrival_time for r in reqs])
    assert t[0] == 0.0 and (np.diff(t) >= 0).all()
    gaps = np.diff(t)
    assert abs(gaps.mean() - 0.25) < 0.02
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.08  # exponential: CV 1


def test_gamma_burstiness_sets_the_spread_not_the_rate():
    reqs = build_workload(WorkloadSpec.parse("gamma:4:0.25", num_requests=4000, seed=3))
    gaps = np.diff([r.arrival_time for r in reqs])
    assert abs(gaps.mean() - 0.25) < 0.03
    assert abs(gaps.std() / gaps.mean() - 2.0) < 0.3  # gamma shape k: CV 1/sqrt(k)


def test_seed_changes_arrivals_and_only_them_when_asked():
    a = build_workload(WorkloadSpec.parse("poisson:5", num_requests=50, seed=1))
    b = build_workload(WorkloadSpec.parse("poisson:5", num_requests=50, seed=1))
    c = build_workload(WorkloadSpec.parse("poisson:5", num_requests=50, seed=2))
    assert a == b
    assert [r.arrival_time for r in a] != [r.arrival_time for r in c]


def test_reading_rate_mix_fractions():
    reqs = build_workload(WorkloadSpec.parse("burst:101", reading_rates=parse_reading_rates("15:0.4,20:0.6"), seed=5))
    n15 = sum(r.reading_rate == 15.0 for r in reqs)
    assert n15 + sum(r.reading_rate == 20.0 for r in reqs) == 101
    assert abs(n15 / 101 - 0.4) <= 1 / 101
    first = [r.reading_rate for r in reqs[:20]]
    assert 15.0 in first and 20.0 in first  # shuffled, not 40 then 61
    assert parse_reading_rates("20") == ((20.0, 1.0),)
    for bad in ("15:0.4,20:0.5", "0", "x", "20:-1"):
        with pytest.raises(ValueError):
            parse_reading_rates(bad)


def test_length_distributions():
    spec = WorkloadSpec.parse("burst:3000", lengths=parse_lengths("SL"), output_scale=2.0, seed=1)
    reqs = build_workload(spec)
    prompts = np.array([r.prompt_len for r in reqs])
    outputs = np.array([r.output_len for r in reqs])
    assert abs(prompts.mean() - 512) < 10 and abs(prompts.std() - 128) < 8
    assert abs(outputs.mean() - 2048) < 40 and abs(outputs.std() - 512) < 30  # H200: outputs ×2
    tiny = build_workload(WorkloadSpec.parse("burst:500", lengths=LengthDist("normal", 1, 10, 1, 10)))
    assert min(min(r.prompt_len, r.output_len) for r in tiny) == 1  # clamped, never 0 or negative
    share = build_workload(WorkloadSpec.parse("burst:3000", lengths=parse_lengths("sharegpt")))
    assert abs(np.median([r.prompt_len for r in share]) - 128) < 10
    for bad in ("XL", "normal:1:2", "fixed:a:b"):
        with pytest.raises(ValueError):
            parse_lengths(bad)
    with pytest.raises(ValueError):
        WorkloadSpec.parse("poisson")  # a rate is needed


def _write_trace(path):
    rows = [
        {"timestamp": 0, "input_length": 1400, "output_length": 5, "hash_ids": [1, 2, 3]},
        {"timestamp": 1000, "input_length": 1300, "output_length": 0, "hash_ids": [1, 2, 9]},
        {"timestamp": 2500, "input_length": 100, "output_length": 7, "hash_ids": [4]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_trace_replay_shares_prefixes_exactly(tmp_path):
    trace = _write_trace(tmp_path / "trace.jsonl")
    a, b, c = build_workload(WorkloadSpec(arrival="trace", num_requests=None, trace=str(trace), time_scale=0.5))
    assert [r.arrival_time for r in (a, b, c)] == [0.0, 0.5, 1.25]
    assert (a.prompt_len, a.output_len, b.output_len) == (1400, 5, 1)  # an output of 0 is clamped to 1
    ta, tb, tc = (prompt_token_ids(r, 32000) for r in (a, b, c))
    assert (len(ta), len(tb), len(tc)) == (1400, 1300, 100)
    k = 2 * BLOCK_TOKENS
    assert ta[:k] == tb[:k]
    assert ta[k:1300] != tb[k:1300]
    assert ta[:100] != tc
    assert max(ta) < 32000 and min(ta) >= 0
    truncated = build_workload(WorkloadSpec(arrival="trace", num_requests=1, trace=str(trace), max_prompt_len=600))
    assert (truncated[0].prompt_len, truncated[0].hash_ids) == (600, (1, 2))


def test_trace_prefix_hits_the_real_prefix_cache(tmp_path):
    """B shares A's first two blocks and arrives after A finished: its admission reuses them."""
    trace = _write_trace(tmp_path / "trace.jsonl")
    spec = WorkloadSpec(arrival="trace", num_requests=2, trace=str(trace), time_scale=10.0)
    result, _ = run_simulation(custom(spec, small_cost()), "fcfs")
    a, b = result.records
    assert a.finish_time < b.arrival
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 2 * BLOCK_TOKENS)


@pytest.mark.skipif(not DEFAULT_TRACE.is_file(), reason="the shared Mooncake trace is not here")
def test_mooncake_trace_prefix_sharing():
    reqs = build_workload(WorkloadSpec(arrival="trace", num_requests=40))
    pairs = [(x, y) for i, x in enumerate(reqs) for y in reqs[i + 1:]
             if x.hash_ids[:1] == y.hash_ids[:1] and x.hash_ids[1:2] != y.hash_ids[1:2]
             and min(x.prompt_len, y.prompt_len) > BLOCK_TOKENS + 16]
    assert pairs, "the first requests of the trace share their first block"
    x, y = pairs[0]
    tx, ty = prompt_token_ids(x, 32000), prompt_token_ids(y, 32000)
    assert tx[:BLOCK_TOKENS] == ty[:BLOCK_TOKENS] and tx[BLOCK_TOKENS:BLOCK_TOKENS + 16] != ty[BLOCK_TOKENS:BLOCK_TOKENS + 16]


# -- cost model -------------------------------------------------------------------------------
def test_h200_decode_is_weight_bandwidth_bound():
    m = cost_model("h200-llama3-8b")
    assert m.kv_bytes_per_token == 128 * 1024
    weights = 2 * 8_030_261_248
    # batch 1, 512 tokens of context: weights + 512 tokens of KV over 80% of 4.8 TB/s, plus 2 ms
    expected = 0.002 + (weights + 512 * 131072) / (0.8 * 4.8e12)
    assert m.decode_step_time(1, 511) == pytest.approx(expected, rel=1e-12)
    assert 0.0061 < expected < 0.0063
    # a full 8192-token prefill chunk is compute-bound at 50% of 989.5 TFLOPS
    flops = 2 * (8_030_261_248 - 128_256 * 4096) * 8192 + 4 * 32 * 32 * 128 * (8192 * 8193 // 2)
    assert m.step_time([(0, 8192)]) == pytest.approx(0.002 + flops / (0.5 * 989.5e12), rel=1e-12)
    # KV pool: 0.3 of 143,771 MiB less the weights, in pages of 16 tokens of 128 KiB
    assert m.num_pages == int(0.3 * 143_771 * 2**20 - weights) // (16 * 131072) == 13907
    assert cost_model("rtx4090-llama3-8b").num_pages == 2743
    assert m.transfer_time(1000) == pytest.approx(1000 * 131072 / (0.8 * 64e9))


def test_fig6_cost_model_runs_40_tokens_per_second_per_request():
    m = fig6_cost_model()
    for batch in (1, 2):
        assert m.decode_step_time(batch, 300) == pytest.approx(1 / 40, rel=1e-6)
    assert m.max_num_seqs == 2


def test_cost_model_validates_and_round_trips(tmp_path):
    m = cost_model("rtx4090-llama3-8b")
    save_cost_model(m, tmp_path / "m.json")
    assert cost_model(f"calibrated:{tmp_path / 'm.json'}") == m == cost_model(str(tmp_path / "m.json"))
    for bad in (dict(compute_efficiency=0.0), dict(kv_memory=10), dict(page_size=12), dict(overlap=1.5)):
        with pytest.raises(ValueError):
            m.replace(**bad)
    with pytest.raises(ValueError, match="unknown cost model"):
        cost_model("a100")


def test_fit_recovers_a_known_roofline():
    truth = small_cost().replace(step_overhead=0.003, peak_flops=2e11, mem_bandwidth=5e9, weight_bytes=2e8)
    chunks = [[(c, 1)] * b for b in (1, 2, 4, 8, 16) for c in (10, 200)] + [[(0, n)] for n in (64, 128, 256, 512)]
    works = [truth.work(c) for c in chunks]
    o, per_flop, per_byte = fit_roofline(works, [truth.time_of(w) for w in works], overlap=1.0)
    assert o == pytest.approx(0.003, rel=1e-6)
    assert 1 / per_flop == pytest.approx(2e11, rel=1e-6)
    assert 1 / per_byte == pytest.approx(5e9, rel=1e-6)


# -- the simulator ----------------------------------------------------------------------------
def test_every_request_gets_its_output_and_pages_come_back():
    spec = WorkloadSpec.parse("poisson:20", num_requests=12, lengths=parse_lengths("normal:100:30:60:20"), seed=4)
    sc = custom(spec, small_cost())
    sim = Simulator(sc.cost, sc.workload, make_policy("fcfs", PolicyConfig()))
    result = sim.run()
    assert sim.pool.num_used == 0
    for w, rec in zip(sc.workload, result.records):
        assert rec.request_id == w.request_id
        assert len(rec.token_times) == w.output_len
        assert rec.token_times == sorted(rec.token_times) and rec.token_times[0] > w.arrival_time
        assert rec.finish_time == rec.token_times[-1]
    assert result.makespan == max(r.token_times[-1] for r in result.records)
    prompt_work = sum(w.prompt_len + w.output_len - 1 for w in sc.workload)
    assert result.computed_tokens == prompt_work  # no preemption, no prefix sharing: each token once


def test_fcfs_preempts_when_memory_runs_out_and_still_finishes():
    # 6 requests of 64 + 150 tokens = 84 pages in all; the pool has 40
    spec = WorkloadSpec.parse("burst:6", lengths=parse_lengths("fixed:64:150"))
    result, doc = run_simulation(custom(spec, small_cost(pages=40)), "fcfs")
    s = doc["summary"]
    assert s["preemptions"] > 0 and s["preemptions"] == result.num_preemptions
    assert s["output_tokens"] == 6 * 150 and s["requests_served"] == 6
    assert result.computed_tokens > 6 * (64 + 149)  # preempted KV was recomputed
    for rec in result.records:
        assert len(rec.resume_times) == len(rec.preempt_times)  # every preempted request came back
        ends = [e for _, e in rec.running_intervals()]
        assert ends[-1] == rec.finish_time and len(ends) == 1 + len(rec.preempt_times)


def test_a_request_larger_than_the_pool_is_refused():
    spec = WorkloadSpec.parse("burst:1", lengths=parse_lengths("fixed:600:100"))
    with pytest.raises(ValueError, match="pool holds"):
        run_simulation(custom(spec, small_cost(pages=40)), "fcfs")


class _Idle(SchedulingPolicy):
    name = "idle"

    def plan(self, view):
        return Plan()


def test_a_policy_that_schedules_nothing_fails_loudly():
    sc = fig6_scenario()
    with pytest.raises(SimulationError, match="scheduled nothing"):
        Simulator(sc.cost, sc.workload, _Idle()).run()


def test_fig6_records_running_intervals_and_token_times():
    result, doc = run_simulation(fig6_scenario(), "fcfs")
    r1, r2, r3 = doc["requests"]
    assert [r["id"] for r in (r1, r2, r3)] == ["R1", "R2", "R3"]
    assert (r1["reading_rate"], r2["reading_rate"], r3["reading_rate"], r3["arrival"]) == (20.0, 30.0, 25.0, 2.0)
    # FCFS, two slots: R1 and R2 run to the end at 40 tokens/s each, then R3
    assert r1["running"] == [[0.0, 10.0]] and r1["token_times"][:2] == [0.025, 0.05]
    assert r3["running"] == [[10.0, 20.0]] and r3["ttft"] == pytest.approx(8.025)
    assert doc["config"]["policy_params"]["schedule_interval"] == 1.0


def test_same_seed_same_bytes_other_seed_other_arrivals():
    def doc(seed):
        sc = custom(WorkloadSpec.parse("poisson:30", num_requests=10, lengths=parse_lengths("fixed:40:30"), seed=seed),
                    small_cost(pages=30))
        return dumps(run_simulation(sc, "fcfs", seed=seed)[1])

    a, b, c = doc(1), doc(1), doc(2)
    assert a == b
    arrivals = lambda d: [r["arrival"] for r in json.loads(d)["requests"]]  # noqa: E731
    assert arrivals(a) != arrivals(c)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_completes_a_tight_burst(policy):
    spec = WorkloadSpec.parse("burst:8", lengths=parse_lengths("normal:64:16:120:30"),
                              reading_rates=parse_reading_rates("15:0.5,30:0.5"))
    sc = custom(spec, small_cost(pages=48, max_num_seqs=6))
    sim = Simulator(sc.cost, sc.workload, make_policy(policy, PolicyConfig(schedule_interval=0.2)))
    result = sim.run()
    assert sim.pool.num_used == 0
    assert [len(r.token_times) for r in result.records] == [w.output_len for w in sc.workload]
    s = summary(result)
    assert s["requests_served"] == 8 and s["throughput"] > 0
    fig6, _ = run_simulation(fig6_scenario(), policy)
    assert [len(r.token_times) for r in fig6.records] == [400, 400, 400]


# -- calibrate and the command line -----------------------------------------------------------
def test_calibrate_writes_a_cost_model_that_loads(hf_dirs, tmp_path):
    out = tmp_path / "cal.json"
    rc = main(["calibrate", "--out", str(out), "--model", str(hf_dirs["llama"]), "--device", "cpu",
               "--dtype", "float32", "--kv-cache-memory", "2MiB",
               "--batch-sizes", "1,3", "--context-lens", "8,40", "--decode-steps", "3"])
    assert rc == 0
    m = cost_model(f"calibrated:{out}")
    assert (m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim, m.kv_dtype_bytes) == (3, 4, 2, 16, 4)
    assert m.kv_memory == m.num_pages * 16 * m.kv_bytes_per_token and m.num_pages > 0
    assert m.peak_flops > 0 and m.mem_bandwidth > 0 and 0 <= m.overlap <= 1
    record = json.loads(out.read_text())["calibration"]
    assert record["num_steps"] == len(record["steps"]) >= 2 * (3 + 1)
    # the host link is timed, not the memory bandwidth copied over; the copier's share of it too
    link = record["link"]
    assert link["write"] > 0 and link["load"] > 0 and link["copier"] > 0
    assert m.host_link_bandwidth == min(link["write"], link["load"]) != m.mem_bandwidth
    assert 0 < m.host_link_efficiency <= 1
    # the host's time in series with each execute is measured and counted in the overhead
    assert all(s["host_seconds"] > 0 for s in record["steps"])
    assert m.step_overhead >= record["host_seconds_median"] > 0
    # the loaded model drives a simulation
    spec = WorkloadSpec.parse("burst:3", lengths=parse_lengths("fixed:20:5"))
    result, _ = run_simulation(custom(spec, m), "fcfs")
    assert [len(r.token_times) for r in result.records] == [5, 5, 5]


def test_the_fit_takes_the_rates_from_execute_times_and_adds_the_host_time_in_series():
    from tokenflowd.sim.calibrate import Link, Observation, fit_cost_model

    truth = PRESETS["h200-llama3-8b"]().replace(step_overhead=0.0, overlap=1.0)
    chunks = [tuple((0, n) for _ in range(b)) for n in (1, 64, 512) for b in (1, 8, 32)]
    obs = [Observation(c, truth.step_time(c), host_seconds=0.004) for c in chunks]
    base = truth.replace(peak_flops=1e12, mem_bandwidth=1e11, compute_efficiency=1.0, bandwidth_efficiency=1.0)
    fitted = fit_cost_model(base, obs, Link(5e10, 4e10, 3.6e10))  # the rates as calibrate starts them
    assert fitted.step_overhead == pytest.approx(0.004, abs=2e-4)
    for o in obs:  # the whole step: the execute as the truth costs it, and the host's time after it
        assert fitted.step_time(o.chunks) == pytest.approx(o.seconds + 0.004, rel=0.05)
    assert (fitted.host_link_bandwidth, fitted.host_link_efficiency) == (4e10, pytest.approx(0.9))


def test_calibration_plan_is_validated():
    with pytest.raises(ValueError):
        CalibrationPlan(batch_sizes=(0,))
    with pytest.raises(ValueError):
        CalibrationPlan(decode_steps=0)


def test_cli_sim_writes_the_summary(tmp_path, capsys):
    out = tmp_path / "r.json"
    args = ["sim", "--preset", "rtx4090-llama3-8b", "--workload", "poisson:8", "--num-prompts", "6",
            "--lengths", "fixed:128:40", "--reading-rate", "15:0.5,20:0.5", "--seed", "3", "--out", str(out),
            "--schedule-interval", "0.7"]
    assert main(args) == 0
    doc = json.loads(out.read_text())
    for key in ("throughput", "effective_throughput", "ttft_mean", "ttft_p99", "rebuffer_total", "qos",
                "preemptions", "makespan"):
        assert isinstance(doc["summary"][key], (int, float)), key
    cfg = doc["config"]
    assert (cfg["preset"], cfg["policy"], cfg["seed"]) == ("rtx4090-llama3-8b", "fcfs", 3)
    assert cfg["policy_params"]["schedule_interval"] == 0.7
    assert cfg["workload"]["rate"] == 8.0 and cfg["workload"]["num_requests"] == 6
    assert len(doc["requests"]) == 6 and all(len(r["token_times"]) == 40 for r in doc["requests"])
    assert "effective_throughput" in capsys.readouterr().out
    first = out.read_bytes()
    assert main(args) == 0 and out.read_bytes() == first


def test_cli_output_does_not_depend_on_the_process(tmp_path):
    """Same seed, another interpreter with another hash seed: the same bytes."""
    args = ["sim", "--scenario", "fig6", "--policy", "all", "--seed", "0"]
    main(args + ["--out", str(tmp_path / "a.json")])
    env = dict(os.environ, PYTHONHASHSEED="12345")
    subprocess.run([sys.executable, "-m", "tokenflowd.cli", *args, "--out", str(tmp_path / "b.json")],
                   check=True, env=env, capture_output=True)
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    runs = json.loads((tmp_path / "a.json").read_text())["runs"]
    assert sorted(runs) == sorted(POLICIES)


def test_cli_scenarios_and_errors(tmp_path, capsys):
    assert main(["sim", "--scenario", "4090-a", "--num-prompts", "4", "--lengths", "fixed:64:16",
                 "--out", str(tmp_path / "s.json")]) == 0
    doc = json.loads((tmp_path / "s.json").read_text())
    assert doc["config"]["scenario"] == "4090-a" and doc["config"]["preset"] == "rtx4090-llama3-8b"
    assert len(doc["requests"]) == 4
    assert main(["sim", "--policy", "nope"]) == 2
    assert main(["sim", "--scenario", "fig6", "--num-prompts", "3"]) == 2
    assert "fixed workload" in capsys.readouterr().err
    assert set(PRESETS) >= {"h200-llama3-8b", "rtx4090-llama3-8b"}
    h200a = scenario("h200-a")
    assert len(h200a.workload) == 400 and h200a.cost.name == "h200-llama3-8b"
    assert math.isclose(np.mean([r.output_len for r in h200a.workload]), 2048, rel_tol=0.03)  # SL outputs ×2


@pytest.mark.parametrize("mode", ["write-through", "write-back"])
def test_a_host_tier_in_the_simulator_reloads_instead_of_recomputing(mode):
    """The real offload manager over a virtual-time copier: a burst the pool cannot hold is
    served with preempted KV loaded back, not recomputed, and no page of either tier is left."""
    spec = WorkloadSpec.parse("burst:8", lengths=parse_lengths("normal:256:16:120:30"),
                              reading_rates=parse_reading_rates("15:0.5,30:0.5"))
    sc = custom(spec, small_cost(pages=96, max_num_seqs=6))
    runs = {}
    for offload in ("none", mode):
        sim = Simulator(sc.cost, sc.workload, make_policy("tokenflow", PolicyConfig(schedule_interval=0.2)),
                        offload=offload, host_kv_memory=2048 * 16 * 2)  # 2048 pages
        runs[offload] = (sim, sim.run())
    sim, result = runs[mode]
    assert sim.pool.num_used == 0 and sim.kv.host.pool.num_used == 0
    assert [len(r.token_times) for r in result.records] == [w.output_len for w in sc.workload]
    assert result.num_preemptions > 0 and sim.kv.stats.pages_loaded > 0
    assert result.computed_tokens < runs["none"][1].computed_tokens  # reloads replaced recomputes


def test_step_jitter_varies_step_times_around_the_cost_model_and_repeats_with_its_seed():
    from tokenflowd.engine.scheduler import ScheduledBatch
    from tokenflowd.sim.clock import VirtualClock
    from tokenflowd.sim.executor import CostModelExecutor

    cost = small_cost()
    batch = ScheduledBatch(request_ids=["a"], positions=[100], num_tokens=[1], sampling=[None])
    exact = cost.step_time([(100, 1)])

    def times(jitter: float, seed: int) -> list[float]:
        ex = CostModelExecutor(cost, {"a": 10}, VirtualClock(), jitter=jitter, jitter_seed=seed)
        return [ex.step_time(batch) for _ in range(2000)]

    assert set(times(0.0, 0)) == {exact}
    jittered = times(0.03, 1)
    assert jittered == times(0.03, 1) and jittered != times(0.03, 2)
    assert np.mean(jittered) == pytest.approx(exact, rel=0.005)  # mean 1: spans stay the cost model's
    assert np.std(np.log(np.array(jittered) / exact)) == pytest.approx(0.03, rel=0.1)
    with pytest.raises(ValueError, match="jitter"):
        CostModelExecutor(cost, {}, VirtualClock(), jitter=-0.1)
