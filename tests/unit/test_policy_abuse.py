"""A client cannot switch the buffer-aware policy off for everyone by stating an absurd reading
rate: in the simulator (the real scheduler and policy on 4090-a's burst of 60 honest readers), one
more request claiming 1e6 tokens/s instead of 20 changes the honest readers' effective throughput
by less than 5%. (The front also clamps stated rates at --max-reading-rate; this is the policy's
own defence, for rates that pass the clamp or come from a learned estimate.)"""
from __future__ import annotations

import dataclasses

import pytest

from tokenflowd.buffer.qos import Timeline, summarize
from tokenflowd.sim.run import run_simulation
from tokenflowd.sim.scenarios import scenario
from tokenflowd.sim.workload import WorkloadRequest


def honest_effective_throughput(claimed_rate: float, seed: int) -> float:
    sc = scenario("4090-a", seed=seed)
    first = sc.workload[0]
    greedy = WorkloadRequest("greedy", 0.0, first.prompt_len, first.output_len, claimed_rate, (10**9,))
    sc = dataclasses.replace(sc, workload=(greedy, *sc.workload))  # it reaches the engine first
    result, _ = run_simulation(sc, "tokenflow", seed=seed, offload="write-through", host_kv_memory=sc.cost.kv_memory)
    honest = [Timeline(r.arrival, r.reading_rate, r.token_times) for r in result.records if r.request_id != "greedy"]
    return summarize(honest)["effective_throughput"]


@pytest.mark.parametrize("seed", [0, 1])
def test_one_client_claiming_a_million_tokens_per_second_barely_moves_the_honest_readers(seed):
    fair = honest_effective_throughput(20.0, seed)
    abused = honest_effective_throughput(1e6, seed)
    assert abs(abused / fair - 1.0) < 0.05, (fair, abused)
