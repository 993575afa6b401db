"""Throughput under an SLO (TokenLake's P90 goodput, §7): for each workload, the highest arrival rate
at which 90% of requests meet the SLO, for cache-aware routing and the pool, 8 engines in the node
simulator. The SLO (sim/node.py SLO_FACTOR): TTFT within 10x the prompt's prefill alone (--slo
ttft, the default), and with --slo both also a mean time between tokens within 10x a decode step
of one request (TokenLake's; the simulator charges the pool's per-layer query round trip in series
with each step, which the daemon overlaps with its own attention, so that bound is the
conservative one for the pool).

    python bench/node_goodput.py [--presets a100-llama2-7b,calibrated:FILE] [--runs SPEC@START;...]
                                 [--kv-scale F] [--modes routing,pool-write] [--num-prompts 300]
                                 [--seconds 30] [--min-seconds 10] [--slo ttft|both] [--policy tokenflow]
                                 [--hand-off prompt|segment] [--out FILE]

The rate doubles from the workload's light rate (bench/node_contexts.py RUNS) until the SLO fails,
then is bisected three times between the last rate met and the first failed. Each probe is one run
of --seconds of arrivals at its rate (at least --num-prompts requests, at most --max-prompts, but
never under --min-seconds of arrivals), the same seed: a fixed count at a high rate would be one
burst, not a load (capped at 1,200 requests alone, the system prompt's search on the H200 preset
ended at 3,320 req/s: 0.36 s of arrivals, which the engines absorb into their batches). Attainment need not fall
monotonically with the rate in a finite run; the search reports the boundary it finds. The
Mooncake trace's knob is its speed (1 / the time scale; its requests are --num-prompts).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from node_contexts import (H200, MIN_SECONDS, RUNS, add_offload, at_rate, mode_base, requests,  # noqa: E402
                           scaled_cost, simulate)
from tokenflowd.sim.node import MODES, SLO_FACTOR, NodeConfig  # noqa: E402
from tokenflowd.sim.result import json_safe  # noqa: E402

ATTAINMENT = 0.9


def probe(cost, spec: str, rate: float, mode: str, a, cap: int) -> dict:
    n = requests(spec, rate, a.num_prompts if spec == "trace" else
                 min(a.max_prompts, max(a.num_prompts, round(rate * a.seconds))), a.min_seconds)
    r = simulate(cost, at_rate(spec, rate, n, a.seed, cap), mode,
                 NodeConfig(seed=a.seed, policy=a.policy, hand_off=a.hand_off, offload=a.offload)).summary()
    return {"rate": rate, "requests": n,
            "slo_attainment": r["ttft_slo_attainment" if a.slo == "ttft" else "slo_attainment"],
            "throughput": r["throughput"], "hit_rate": r["hit_rate"], "ttft_p99": r["ttft_p99"]}


def goodput(cost, spec: str, start: float, mode: str, a, cap: int) -> dict:
    probes = [probe(cost, spec, start, mode, a, cap)]
    if probes[-1]["slo_attainment"] < ATTAINMENT:
        return {"met": None, "probes": probes}
    lo, hi = start, None
    for _ in range(8):
        probes.append(probe(cost, spec, 2 * lo, mode, a, cap))
        if probes[-1]["slo_attainment"] < ATTAINMENT:
            hi = 2 * lo
            break
        lo *= 2
    if hi is not None:
        for _ in range(3):
            mid = (lo * hi) ** 0.5
            probes.append(probe(cost, spec, mid, mode, a, cap))
            if probes[-1]["slo_attainment"] >= ATTAINMENT:
                lo = mid
            else:
                hi = mid
    met = max((p for p in probes if p["slo_attainment"] >= ATTAINMENT and p["rate"] <= lo), key=lambda p: p["rate"])
    return {"met": met, "first_failed": hi, "probes": probes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default=f"a100-llama2-7b,{H200}")
    ap.add_argument("--runs", help="instead of RUNS: workloads with the rate to start from, e.g. "
                    "'documents:active=16:scale=0.5:uses=32@2;system-prompt@20' (the trace: its time scale, "
                    "as in RUNS)")
    ap.add_argument("--kv-scale", type=float, default=1.0)
    ap.add_argument("--modes", default="routing,pool-write")
    ap.add_argument("--policy", default="tokenflow")
    ap.add_argument("--hand-off", default="auto", choices=["auto", "prompt", "segment"],
                    help="pool-write: when new segments go to their homes (pool/hand_off.py)")
    ap.add_argument("--num-prompts", type=int, default=300)
    ap.add_argument("--seconds", type=float, default=30.0, help="of arrivals a probe offers")
    ap.add_argument("--max-prompts", type=int, default=1200)
    ap.add_argument("--min-seconds", type=float, default=MIN_SECONDS,
                    help="of arrivals a probe offers however many requests that takes (past --max-prompts)")
    ap.add_argument("--slo", default="ttft", choices=["ttft", "both"])
    ap.add_argument("--seed", type=int, default=0)
    add_offload(ap)
    ap.add_argument("--out")
    a = ap.parse_args()
    modes = [m for m in a.modes.split(",") if mode_base(m) in MODES]
    rows = []
    for preset in a.presets.split(","):
        cost, cap = scaled_cost(preset, a.kv_scale)
        runs = [(spec, light) for spec, light, _ in RUNS["calibrated" if preset.startswith("calibrated") else preset]]
        if a.runs:
            runs = [(spec, float(rate)) for spec, rate in (r.split("@") for r in a.runs.split(";"))]
        for spec, start in runs:
            start = 1.0 / start if spec == "trace" else start  # RUNS gives the trace's time scale
            t0 = time.perf_counter()
            row = {"cost_model": cost.name, "kv_tokens_per_engine": cost.max_tokens_in_pool, "workload": spec,
                   **{m: goodput(cost, spec, start, m, a, cap) for m in modes}}
            row["seconds"] = time.perf_counter() - t0
            base = row[modes[0]]["met"]
            for m in modes[1:]:
                met = row[m]["met"]
                row[m]["rate_vs_" + modes[0]] = met["rate"] / base["rate"] if met and base else None
            rows.append(row)
            print(f"{cost.name:>15} {spec:>40} " + "  ".join(
                f"{m}: " + (f"{row[m]['met']['rate']:7.3g}/s thr {row[m]['met']['throughput']:7.1f} "
                            f"hit {row[m]['met']['hit_rate']:.3f}" if row[m]["met"] else "SLO not met at the start")
                for m in modes) + "".join(f"  {m}/{modes[0]} {row[m]['rate_vs_' + modes[0]]:.2f}"
                                          for m in modes[1:] if row[m].get("rate_vs_" + modes[0])), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(json_safe({"machine": platform.processor() or platform.machine(), "engines": 8,
                                 "attainment": ATTAINMENT, "slo": a.slo, "slo_factor": SLO_FACTOR,
                                 "seconds": a.seconds, "max_prompts": a.max_prompts,
                                 "min_seconds": a.min_seconds, "kv_scale": a.kv_scale,
                                 "policy": a.policy,
                                 "hand_off": a.hand_off, "num_prompts": a.num_prompts, "seed": a.seed,
                                 "offload": a.offload,
                                 "rows": rows}), f, indent=1)
        print("wrote", a.out)


if __name__ == "__main__":
    main()
