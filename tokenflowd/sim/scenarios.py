"""Canned simulations: TokenFlow's Fig. 6 toy example and its Table 1 setups.

Table 1 (tokenflow.txt §7.3): Llama3-8B, inputs ~512 (SL) / ~1024 (LL), outputs ~1024 / ~2048,
normally distributed, H200 outputs ×2, H200 at mem-frac 0.3. Readers at 20 tokens/s (the lowest
rate of the paper's Fig. 20, and this project's default reader). The paper gives no request count
for its Poisson runs; we send as many requests as the burst setups of the same card (400 on the
H200, 80 on the 4090), which keeps each run minutes long at the stated rates. A quarter of the
clients set a loose max_tokens (4,096) and the rest none: the policy knows no request's length.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tokenflowd.config import PolicyConfig
from tokenflowd.sim.cost import CostModel, cost_model, fig6_cost_model
from tokenflowd.sim.workload import LENGTH_PRESETS, WorkloadRequest, WorkloadSpec, build_workload

FIG6_PROMPT_LEN = 16
FIG6_OUTPUT_LEN = 400  # at 40 tokens/s, requests run until well past t = 10 s


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    cost: CostModel
    workload: tuple[WorkloadRequest, ...]
    policy_params: PolicyConfig
    spec: WorkloadSpec | None = None  # None: hand-built requests (fig6)


def fig6_scenario(policy_params: PolicyConfig | None = None) -> Scenario:
    """TokenFlow Fig. 6 (§4.1): 40 tokens/s per running request, two at a time; R1 (20 tokens/s)
    and R2 (30) at t = 0, R3 (25) at t = 2. Interval 1 s and μ = 2.5 unless `policy_params` says otherwise."""
    params = policy_params or PolicyConfig(schedule_interval=1.0, buffer_conservativeness=2.5)
    reqs = tuple(
        WorkloadRequest(rid, t, FIG6_PROMPT_LEN, FIG6_OUTPUT_LEN, rate, (block,))
        for block, (rid, t, rate) in enumerate((("R1", 0.0, 20.0), ("R2", 0.0, 30.0), ("R3", 2.0, 25.0)))
    )
    return Scenario("fig6", fig6_scenario.__doc__.split("\n")[0], fig6_cost_model(), reqs, params)


# name -> (preset, arrival spec, lengths, output scale, number of requests)
TABLE1 = {
    "h200-a": ("h200-llama3-8b", "burst", "SL", 2.0, 400),
    "h200-b": ("h200-llama3-8b", "burst", "LL", 2.0, 200),
    "h200-c": ("h200-llama3-8b", "poisson:5", "SL", 2.0, 400),
    "h200-d": ("h200-llama3-8b", "poisson:10", "SL", 2.0, 400),
    "4090-a": ("rtx4090-llama3-8b", "burst", "SL", 1.0, 60),
    "4090-b": ("rtx4090-llama3-8b", "burst", "LL", 1.0, 80),
    "4090-c": ("rtx4090-llama3-8b", "poisson:2", "SL", 1.0, 80),
    "4090-d": ("rtx4090-llama3-8b", "poisson:4", "SL", 1.0, 80),
}
SCENARIOS = ("fig6", *TABLE1)
TABLE1_MAX_TOKENS_SHARE = 0.25


def table1_spec(name: str, seed: int = 0, **overrides) -> WorkloadSpec:
    preset, arrival, lengths, scale, n = TABLE1[name]
    kw = dict(num_requests=n, lengths=LENGTH_PRESETS[lengths], output_scale=scale, seed=seed,
              max_tokens_share=TABLE1_MAX_TOKENS_SHARE)
    kw.update(overrides)
    return WorkloadSpec.parse(arrival, **kw)


def scenario(name: str, seed: int = 0, policy_params: PolicyConfig | None = None, **workload_overrides) -> Scenario:
    """A canned scenario; `workload_overrides` are WorkloadSpec fields (Table 1 setups only)."""
    if name == "fig6":
        if workload_overrides:
            raise ValueError(f"the fig6 scenario has a fixed workload; drop {', '.join(workload_overrides)}")
        return fig6_scenario(policy_params)
    if name not in TABLE1:
        raise ValueError(f"unknown scenario {name!r}; choose one of {', '.join(SCENARIOS)}")
    spec = table1_spec(name, seed, **workload_overrides)
    preset = TABLE1[name][0]
    desc = f"TokenFlow Table 1 ({name}): {preset}, {spec.arrival} of {spec.num_requests}"
    return Scenario(name, desc, cost_model(preset), tuple(build_workload(spec)), policy_params or PolicyConfig(), spec)


def workload_config(spec: WorkloadSpec | None, requests: tuple[WorkloadRequest, ...]) -> dict:
    """The workload as the result's config records it."""
    if spec is not None:
        return dataclasses.asdict(spec)
    return {"requests": [dataclasses.asdict(r) for r in requests]}
