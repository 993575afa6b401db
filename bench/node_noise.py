"""The noise floor of the node simulator's throughput ratios: cache-aware routing against itself, its
ties between engines of the best score broken at random (seeded) rather than to the lower id, on
bench/node_contexts.py's workloads, loads and seeds. Neither way is the better router; what the
choice alone moves the span throughput (output tokens over the time from the first arrival to the
last token) by is how far apart two placements of equal merit land, so a pool ratio within that
band of 1 is a tie, not a loss or a win.

    python bench/node_noise.py [--presets a100-llama2-7b,calibrated:FILE] [--seeds 0,1,2,3]
                               [--workloads documents:active=32,...] [--kv-scale F]
                               [--num-prompts 300] [--offload write-through] [--jobs 2] [--out FILE]

Each run offers --num-prompts requests, or node_contexts' MIN_SECONDS of arrivals where that is more.

Per workload and load: each seed's ratio (random ties over the lower id) and their geometric mean;
overall, the ratios' range and geometric mean. The policy is tokenflow, as node_contexts' runs.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from node_contexts import H200, RUNS, add_offload, requests, scaled_cost, workload  # noqa: E402
from tokenflowd.sim.node import NodeConfig, NodeSimulator  # noqa: E402
from tokenflowd.sim.result import json_safe  # noqa: E402


def run(preset: str, spec: str, rate: float, seed: int, kv_scale: float, n: int, offload: str, random_ties: bool
        ) -> float:
    cost, cap = scaled_cost(preset, kv_scale)
    w = workload(spec, rate, requests(spec, rate, n), seed, cap)
    config = NodeConfig(seed=seed, policy="tokenflow", random_ties=random_ties, offload=offload)
    return NodeSimulator(cost, w, "routing", config).run().summary()["throughput"]


def geomean(xs: list[float]) -> float:
    return math.exp(sum(map(math.log, xs)) / len(xs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default=f"a100-llama2-7b,{H200}")
    ap.add_argument("--workloads", help="only these (comma-separated names from node_contexts.py RUNS)")
    ap.add_argument("--seeds", default="0,1,2,3")
    ap.add_argument("--kv-scale", type=float, default=1.0)
    ap.add_argument("--num-prompts", type=int, default=300)
    ap.add_argument("--jobs", type=int, default=2)
    add_offload(ap)
    ap.add_argument("--out")
    a = ap.parse_args()
    seeds = [int(s) for s in a.seeds.split(",")]
    cells = []
    for preset in a.presets.split(","):
        for spec, *rates in RUNS["calibrated" if preset.startswith("calibrated") else preset]:
            if a.workloads and spec not in a.workloads.split(","):
                continue
            cells += [(preset, spec, load, rate) for load, rate in zip(("light", "overload"), rates)]
    jobs = {(cell, seed, ties): (cell[0], cell[1], cell[3], seed, a.kv_scale, a.num_prompts, a.offload, ties)
            for cell in cells for seed in seeds for ties in (False, True)}
    with ProcessPoolExecutor(a.jobs) as pool:
        futures = {key: pool.submit(run, *args) for key, args in jobs.items()}
        thr = {key: f.result() for key, f in futures.items()}
    rows, every = [], []
    for cell in cells:
        preset, spec, load, rate = cell
        ratios = [thr[(cell, s, True)] / thr[(cell, s, False)] for s in seeds]
        every += ratios
        rows.append({"cost_model": scaled_cost(preset, a.kv_scale)[0].name, "workload": spec, "load": load,
                     "rate": rate, "seeds": seeds, "ratios": ratios, "geomean": geomean(ratios),
                     "throughput_lowest_id": [thr[(cell, s, False)] for s in seeds]})
        print(f"{rows[-1]['cost_model']:>15} {spec:>22} {load:>8} {rate:>6g}  random ties / lowest id: "
              f"{rows[-1]['geomean']:.4f} ({' '.join(f'{r:.3f}' for r in ratios)})", flush=True)
    summary = {"geomean": geomean(every), "min": min(every), "max": max(every),
               "cells_geomean_min": min(r["geomean"] for r in rows),
               "cells_geomean_max": max(r["geomean"] for r in rows)}
    print(f"all {len(every)} runs: geomean {summary['geomean']:.4f}, range {summary['min']:.3f}-{summary['max']:.3f}; "
          f"per workload and load over seeds {summary['cells_geomean_min']:.4f}-{summary['cells_geomean_max']:.4f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(json_safe({"command": "python " + " ".join(sys.argv),
                                 "machine": platform.processor() or platform.machine(), "engines": 8,
                                 "kv_scale": a.kv_scale, "policy": "tokenflow", "num_prompts": a.num_prompts,
                                 "offload": a.offload,
                                 "summary": summary, "rows": rows}), f, indent=1)
        print("wrote", a.out)


if __name__ == "__main__":
    main()
