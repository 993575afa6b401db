"""The TokenFlow paper's controlled setups (Table 1 of tokenflow.txt) in the simulator, under
fcfs, andes and tokenflow on the same seeded workloads: effective and raw throughput, mean and
P99 TTFT, total rebuffer time, the longest single stall, QoS and preemptions, with each policy's ratio to fcfs, per seed and
as the geometric mean over seeds.

    python bench/sim_table1.py [--setups h200-a,...] [--seeds 0,1,2] [--out bench/results/sim_table1.json]

A policy written `name+offload` runs with a write-through host KV tier of --host-kv-memory behind
the device pool (the paper's full TokenFlow is tokenflow+offload, and the daemon's default); the
others recompute preempted KV. The workloads are honest (sim/workload.py, sim/simulator.py): a
burst's requests reach the engine in a fixed order that preemption does not change, and the
policy learns output lengths from finished requests (a quarter of clients set a loose max_tokens).

Virtual time: the figures are the cost model's (sim/cost.py), not this machine's.
"""
from __future__ import annotations

import argparse
import json
import math
import time

from tokenflowd.config import parse_size
from tokenflowd.offload.build import HOST_POOLS_PER_DEVICE_POOL
from tokenflowd.sim.run import run_simulation
from tokenflowd.sim.scenarios import TABLE1, scenario

SETUPS = tuple(TABLE1)
POLICIES = ("fcfs", "andes", "tokenflow+offload")  # tokenflow+offload: the daemon's default
KEYS = ("effective_throughput", "throughput", "ttft_mean", "ttft_p99", "rebuffer_total", "stall_max", "qos", "preemptions",
        "computed_tokens", "makespan")
RATIO_KEYS = ("effective_throughput", "throughput", "ttft_mean", "ttft_p99")


def run_policy(name: str, policy: str, seed: int, host_kv_memory: int | None, **overrides) -> dict:
    """One setup under one policy (`name+offload`: with a write-through host tier of
    `host_kv_memory` bytes, None: the daemon's default on a GPU box with RAM to spare, 4× the
    device pool): its summary."""
    base, _, extra = policy.partition("+")
    sc = scenario(name, seed=seed, **overrides)
    _, doc = run_simulation(sc, base, seed=seed, offload="write-through" if extra == "offload" else "none",
                            host_kv_memory=(host_kv_memory or HOST_POOLS_PER_DEVICE_POOL * sc.cost.kv_memory)
                            if extra == "offload" else 0)
    return {k: doc["summary"][k] for k in KEYS}


def geomean(xs: list[float]) -> float:
    xs = [x for x in xs if x > 0 and math.isfinite(x)]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else math.nan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setups", default=",".join(SETUPS))
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--host-kv-memory", default="default",
                    help="the host tier of the +offload runs: a size, or default (the daemon's GPU default, 4× the device pool)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    policies, seeds = a.policies.split(","), [int(s) for s in a.seeds.split(",")]
    host = None if a.host_kv_memory == "default" else parse_size(a.host_kv_memory)
    out = {}
    for name in a.setups.split(","):
        runs = {}
        for seed in seeds:
            for policy in policies:
                t0 = time.perf_counter()
                runs.setdefault(policy, []).append(run_policy(name, policy, seed, host))
                print(f"[{name} seed {seed} {policy}: {time.perf_counter() - t0:.0f} s wall]", flush=True)
        ratios = {p: {k: [r[k] / b[k] if b[k] else math.nan for r, b in zip(runs[p], runs["fcfs"])]
                      for k in RATIO_KEYS} for p in policies if p != "fcfs" and "fcfs" in runs}
        print(f"\n{scenario(name).description}, seeds {a.seeds}")
        print(f"{'':22}" + "".join(f"{p:>19}" for p in policies))
        for k in KEYS:
            print(f"{k:22}" + "".join(f"{sum(r[k] for r in runs[p]) / len(seeds):19.4g}" for p in policies))
        for k in RATIO_KEYS:
            print(f"{k + '/fcfs':22}" + f"{'':19}" * ("fcfs" in runs) + "".join(
                f"{geomean(ratios[p][k]):.3f} ({min(ratios[p][k]):.2f}-{max(ratios[p][k]):.2f})".rjust(19)
                for p in policies if p in ratios))
        print()
        out[name] = {"description": scenario(name).description, "runs": runs, "ratios_to_fcfs": ratios}
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"seeds": seeds, "host_kv_memory": a.host_kv_memory, "setups": out}, f, indent=2, sort_keys=True)


if __name__ == "__main__":
    main()
