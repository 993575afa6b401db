"""The offload ablation (Table 2 of tokenflow.txt) in the simulator, on the paper's setup for it
(4090 (b)) by default: the buffer-aware policy with (a) no offload, (b) write-back, (c) write-
through without load–evict overlap, (d) everything; the same seeded workload, virtual time (copies
at the cost model's host link, beside the steps), so one run each is exact.

    python bench/sim_offload_ablation.py [--setup 4090-b] [--host-kv-memory 64GiB] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import time

from tokenflowd.config import parse_size
from tokenflowd.sim.run import run_simulation
from tokenflowd.sim.scenarios import scenario

CONFIGS = {  # name -> (offload, load_evict_overlap)
    "a_recompute": ("none", True),
    "b_write_back": ("write-back", True),
    "c_write_through_serial": ("write-through", False),
    "d_full": ("write-through", True),
}
KEYS = ("makespan", "effective_throughput", "ttft_p99", "ttft_mean", "rebuffer_total", "qos", "preemptions",
        "computed_tokens")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setup", default="4090-b")
    ap.add_argument("--policy", default="tokenflow")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--host-kv-memory", default="64GiB")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    sc = scenario(a.setup, seed=a.seed)
    rows = {}
    for name, (offload, overlap) in CONFIGS.items():
        t0 = time.perf_counter()
        _, doc = run_simulation(sc, a.policy, seed=a.seed, offload=offload, load_evict_overlap=overlap,
                                host_kv_memory=parse_size(a.host_kv_memory) if offload != "none" else 0)
        rows[name] = {k: doc["summary"][k] for k in KEYS}
        print(f"[{name}: {time.perf_counter() - t0:.0f} s wall]", flush=True)
    print(f"\n{sc.description}\n{'':24}" + "".join(f"{k:>22}" for k in KEYS))
    base = rows["a_recompute"]
    for name, r in rows.items():
        print(f"{name:24}" + "".join(f"{r[k]:14.4g} (x{r[k] / base[k]:.2f})" if base[k] else f"{r[k]:22.4g}"
                                     for k in KEYS))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"setup": a.setup, "policy": a.policy, "seed": a.seed, "host_kv_memory": a.host_kv_memory,
                       "description": sc.description, "results": rows}, f, indent=2, sort_keys=True)


if __name__ == "__main__":
    main()
