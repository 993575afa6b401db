"""One simulation of a scenario under a named policy, and its result document."""
from __future__ import annotations

import dataclasses

from tokenflowd.buffer import make_policy
from tokenflowd.sim.result import result_document
from tokenflowd.sim.scenarios import Scenario, workload_config
from tokenflowd.sim.simulator import SimResult, Simulator


def run_simulation(sc: Scenario, policy: str, seed: int = 0, enable_prefix_caching: bool = True,
                   max_steps: int | None = None, offload: str = "none", host_kv_memory: int = 0,
                   load_evict_overlap: bool = True, step_jitter: float = 0.0,
                   jitter_seed: int = 0) -> tuple[SimResult, dict]:
    """Run `sc` with a fresh `policy` (built by make_policy from the scenario's parameters): the
    raw result and its JSON document (config, summary, per-request records). With `offload`, a
    host tier of `host_kv_memory` bytes behind the device pool (offload/, copies in virtual time).
    `step_jitter`: σ of each step's lognormal time factor (CostModelExecutor), seeded by `jitter_seed`."""
    sim = Simulator(sc.cost, sc.workload, make_policy(policy, sc.policy_params),
                    enable_prefix_caching=enable_prefix_caching, max_steps=max_steps, offload=offload,
                    host_kv_memory=host_kv_memory, load_evict_overlap=load_evict_overlap,
                    expected_output_len=sc.policy_params.expected_output_len, step_jitter=step_jitter,
                    jitter_seed=jitter_seed)
    result = sim.run()
    config = {
        "scenario": sc.name,
        "preset": sc.cost.name,
        "cost_model": sc.cost.to_dict(),
        "workload": workload_config(sc.spec, sc.workload),
        "policy": policy,
        "policy_params": dataclasses.asdict(sc.policy_params),
        "seed": seed,
        "enable_prefix_caching": enable_prefix_caching,
        "offload": offload,
        "host_kv_memory": host_kv_memory,
        "load_evict_overlap": load_evict_overlap,
        "step_jitter": step_jitter,
        "jitter_seed": jitter_seed,
    }
    return result, result_document(result, config)
