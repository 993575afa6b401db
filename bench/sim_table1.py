"""The TokenFlow paper's controlled setups (Table 1 of tokenflow.txt) in the simulator, under
fcfs, andes and tokenflow on the same seeded workloads: effective and raw throughput, mean and
P99 TTFT, total rebuffer time, QoS and preemptions, with each policy's ratio to fcfs.

    python bench/sim_table1.py [--setups h200-a,h200-b,...] [--seed 0] [--out bench/results/sim_table1.json]

A policy written `name+offload` runs with a write-through host KV tier of --host-kv-memory behind
the device pool (the paper's full TokenFlow is tokenflow+offload); the others recompute preempted KV.

Virtual time: the figures are the cost model's (sim/cost.py), not this machine's.
"""
from __future__ import annotations

import argparse
import json
import time

from tokenflowd.config import parse_size
from tokenflowd.sim.run import run_simulation
from tokenflowd.sim.scenarios import scenario

SETUPS = ("h200-a", "h200-b", "h200-c", "h200-d", "4090-a", "4090-b")
POLICIES = ("fcfs", "andes", "tokenflow", "tokenflow+offload")
KEYS = ("effective_throughput", "throughput", "ttft_mean", "ttft_p99", "rebuffer_total", "qos", "preemptions",
        "computed_tokens", "makespan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setups", default=",".join(SETUPS))
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--host-kv-memory", default="64GiB", help="the host tier of the +offload runs")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    out = {}
    for name in a.setups.split(","):
        sc = scenario(name, seed=a.seed)
        rows = {}
        for policy in a.policies.split(","):
            t0 = time.perf_counter()
            name_, _, extra = policy.partition("+")
            _, doc = run_simulation(sc, name_, seed=a.seed, offload="write-through" if extra == "offload" else "none",
                                    host_kv_memory=parse_size(a.host_kv_memory) if extra == "offload" else 0)
            rows[policy] = {k: doc["summary"][k] for k in KEYS}
            print(f"[{name} {policy}: {time.perf_counter() - t0:.0f} s wall]", flush=True)
        base = rows.get("fcfs")
        print(f"\n{sc.description}")
        print(f"{'':22}" + "".join(f"{p:>12}" for p in rows) + "".join(f"{p + '/fcfs':>16}" for p in rows if p != "fcfs"))
        for k in KEYS:
            line = f"{k:22}" + "".join(f"{rows[p][k]:12.4g}" for p in rows)
            if base:
                line += "".join(f"{rows[p][k] / base[k]:16.3f}" if base[k] else f"{'-':>16}" for p in rows if p != "fcfs")
            print(line)
        print()
        out[name] = {"description": sc.description, "summary": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"seed": a.seed, "host_kv_memory": a.host_kv_memory, "setups": out}, f, indent=2, sort_keys=True)


if __name__ == "__main__":
    main()
