"""The node simulator (tokenflowd/sim/node.py) on TokenLake's kind of workload: cache-aware routing
against the pool, placing new segments at their homes (`pool`) or keeping them where they were
computed (`pool-local`), 8 engines, at a light load and in overload, per cost model. Idle engines
take queued requests from busy ones in every pool mode (pool/steal.py) unless the mode is named
with -nosteal (`--modes routing,pool-local,pool-local-nosteal`), and an engine copies in the hot
segments it reads elsewhere unless the mode is named with -nocopy (`pool-write-nocopy`). A pool mode
named with -read runs in read mode (`pool-write-read`: a request's rows in a step from the link's
ridge on read its holders' pages in place, fewer are sent to them; -readall: every row read in place).

    python bench/node_contexts.py [--presets a100-llama2-7b,calibrated:FILE] [--num-prompts 300] [--min-seconds 10]
                                  [--workloads documents,...] [--runs SPEC@LIGHT/OVER;...]
                                  [--kv-scale F] [--policy fcfs|tokenflow] [--hand-off prompt|segment]
                                  [--out FILE]

Workloads (sim/workload.py CONTEXT_SHAPES, synthetic with the datasets' published shapes, Poisson
arrivals), each at two rates (requests/s) per cost model; contexts are scaled where one engine's
KV pool could not hold one (sessions' 227K-token mean on an A100's 113K). The Mooncake trace
(its first --num-prompts requests, prompts capped at 32K) runs at its own rate and 3x slower. The
other workloads offer --num-prompts requests, or --min-seconds of arrivals where that is more: the
system prompt's short chats, 300 at a time, were a burst of one or two seconds that every mode served
within the SLO (its overload ran at a third of what the node sustains; bench/node_goodput.py).
Prompts are capped at 32K tokens (a longer context is cut, a session that would outgrow it ends).
Per run: the workload's ideal hit rate (every page any earlier request had, read: sim/node.py
ideal_hit_rate; no placement beats it), hit rate, throughput (output tokens/s to the last token), the
loaded throughput (to the moment every request has its first token: without the last decodes'
drain, which one long output begun late decides; sim/node.py NodeResult.loaded_throughput), P99
TTFT, the CVs across engines (sim/node.py NodeResult: busy time, the router's load, the KV read from
each, as TokenLake measures it and weighted by each second's reads, and the lookups alone: the
prefix tokens each request found cached there), and the SLO's attainment and throughput (output
tokens/s of the requests that met it; TokenLake's SLO, sim/node.py SLO_FACTOR), with each pool
mode's ratios to routing. bench/node_goodput.py finds the highest rate at which 90% of requests
meet it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenflowd.config import OFFLOAD_MODES  # noqa: E402
from tokenflowd.sim.cost import cost_model  # noqa: E402
from tokenflowd.sim.node import MODES, NodeConfig, NodeResult, NodeSimulator, ideal_hit_rate, link_ridge_rows  # noqa: E402
from tokenflowd.sim.result import json_safe  # noqa: E402
from tokenflowd.sim.workload import WorkloadSpec, build_workload, parse_context_shape  # noqa: E402

H200 = "calibrated:" + os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data", "h200",
                                    "calibrated_h200.json")
# (workload, light rate, overload rate) per cost model, req/s; an A100 engine's pool is 113K tokens,
# the calibrated H200's 803K. The system prompt's overload is ~1.4x the highest rate routing holds
# within the TTFT SLO over 10 s of arrivals (226 and 320 req/s: node_goodput_system_prompt_sustained.json).
# The documents' overload is where routing keeps under 90% of requests within the SLO: at 4 req/s on
# the A100 and 16 on the H200 it kept 94-100% (node_contexts_midprompt_s0-1.json), so those runs'
# throughput was the offered rate and their ratio the end of the last request
# (node_contexts_overload_s0-1.json)
RUNS = {
    "a100-llama2-7b": [("documents:active=16", 1.0, 8.0), ("documents:active=32", 1.0, 8.0),
                       ("sessions:scale=0.1", 1.0, 4.0), ("system-prompt", 20.0, 320.0), ("trace", 3.0, 1.0)],
    "calibrated": [("documents:active=64", 4.0, 24.0), ("documents:active=128", 4.0, 16.0),
                   ("sessions:scale=0.1", 4.0, 16.0), ("system-prompt", 40.0, 480.0), ("trace", 3.0, 1.0)],
}
MIN_SECONDS = 10.0  # of arrivals a run offers at least (--min-seconds)
KEYS = ("hit_rate", "throughput", "loaded_throughput", "ttft_p99", "busy_cv", "load_cv", "access_cv",
        "access_cv_by_reads", "served_cv", "own_access_share", "cache_access_cv", "slo_attainment", "slo_throughput")


def scaled_cost(preset: str, kv_scale: float):
    """-> (the preset's cost model with its KV memory times kv_scale, the prompt cap: half an
    engine's pool, at most 32K tokens)."""
    cost = cost_model(preset)
    cost = cost.replace(kv_memory=int(cost.kv_memory * kv_scale))
    return cost, min(32_768, cost.max_tokens_in_pool // 2)


def at_rate(spec: str, rate: float, n: int, seed: int, max_prompt_len: int):
    """`workload` at an arrival rate: the trace's rate is its speed (1 / the time scale)."""
    return workload(spec, 1.0 / rate if spec == "trace" else rate, n, seed, max_prompt_len)


def requests(spec: str, rate: float, num_prompts: int, min_seconds: float = MIN_SECONDS) -> int:
    """A run's requests: `num_prompts`, or `min_seconds` of arrivals at `rate` where that is more
    (the trace: its first `num_prompts`)."""
    return num_prompts if spec == "trace" else max(num_prompts, round(rate * min_seconds))


def workload(spec: str, rate: float, n: int, seed: int, max_prompt_len: int = 32_768):
    if spec == "trace":  # rate: the time scale (3: three times slower than recorded)
        return build_workload(WorkloadSpec("trace", n, time_scale=rate, max_prompt_len=max_prompt_len, seed=seed))
    return build_workload(WorkloadSpec("poisson", n, rate=rate, seed=seed, contexts=parse_context_shape(spec),
                                       max_prompt_len=max_prompt_len))


SUFFIXES = ("-nocopy", "-nosteal", "-readall", "-read")


def simulate(cost, w, mode: str, config: NodeConfig) -> NodeResult:
    """One mode's run; a pool mode named with -nosteal runs without pool/steal.py (--no-pool-steal),
    with -nocopy without copying hot segments in (--no-pool-copy), with -read in read mode (a request
    whose rows in a step reach the link's ridge reads its holders' pages in place, fewer rows are
    sent: --pool-mode read), with -readall in read mode reading every row in place."""
    base, suffixes = mode_base(mode), mode.split("-")
    read = 1 if "readall" in suffixes else link_ridge_rows(cost, config) if "read" in suffixes else 0
    return NodeSimulator(cost, w, base, replace(config, steal="nosteal" not in suffixes,
                                                copy="nocopy" not in suffixes, read_rows=read)).run()


def mode_base(mode: str) -> str:
    """The simulator's mode of a bench mode: its suffixes (SUFFIXES) off, in any order."""
    while mode.endswith(SUFFIXES):
        mode = next(mode.removesuffix(s) for s in SUFFIXES if mode.endswith(s))
    return mode


def add_offload(ap: argparse.ArgumentParser) -> None:
    """--offload, as the node benches share it."""
    ap.add_argument("--offload", default="none", choices=OFFLOAD_MODES,
                    help="each engine's host KV tier, as the daemon's --offload (whose default is write-through): "
                         "preempted KV comes back from it instead of being computed again (sim/node.py "
                         "NodeConfig.offload); the figures before it had none")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default=f"a100-llama2-7b,{H200}")
    ap.add_argument("--workloads", help="only these (comma-separated names from RUNS, e.g. documents:active=32,trace)")
    ap.add_argument("--runs", help="instead of RUNS, for every preset: workloads with their light and overload "
                    "rates, e.g. 'documents:active=36:uses=32@1/4;documents:active=32:skew=1@1/4'")
    ap.add_argument("--kv-scale", type=float, default=1.0,
                    help="each engine's KV memory times this (a cache one engine's working set outgrows); prompts "
                         "are capped at half an engine's pool")
    ap.add_argument("--modes", default=",".join(MODES),
                    help="routing and the pool modes to run (routing always; a pool mode with -nosteal: without "
                         "idle engines taking queued requests, pool/steal.py); pool, which puts new segments at "
                         "their homes after the prompt while the request keeps its copy, can stall in overload "
                         "at a small cache (every engine's pages held)")
    ap.add_argument("--policy", default="fcfs", help="every engine's scheduling policy (the daemon's default is "
                    "tokenflow; fcfs admits a long prompt by its first chunk and, where KV is short, preempts and "
                    "recomputes often)")
    ap.add_argument("--hand-off", default="auto", choices=["auto", "prompt", "segment"],
                    help="pool-write: new segments go to their homes once the prompt is computed (prompt), each "
                         "as it is computed (segment), or segment by segment where the prompt is over a quarter "
                         "of an engine's KV (auto, the daemon's default: pool/hand_off.py)")
    ap.add_argument("--no-follow", action="store_true",
                    help="pool-write: readers of a sender's copy of what it wrote into the homes keep reading it "
                         "there until they end (sim/node.py NodeConfig.follow; the daemon before protocol.Moved)")
    ap.add_argument("--serial-queries", action="store_true",
                    help="the simulator's costing before: every query round trip adds to the step in full and the "
                         "holder's answer is not waited for (sim/node.py NodeConfig.overlap_queries False); default: "
                         "they overlap each layer's own attention, as pool/attention.py sends and collects them")
    ap.add_argument("--let-go-after", type=float, default=0.0,
                    help="pool-write: s an engine keeps its own copy of what it wrote into the homes cached, the "
                         "router finding it there too (the daemon kept it 1 s before its step message said where "
                         "the segments went; sim/node.py NodeConfig.let_go_after)")
    add_offload(ap)
    ap.add_argument("--host-kv-scale", type=float, default=1.0,
                    help="with --offload, each engine's host tier in pages, times its device pool")
    ap.add_argument("--max-num-batched-tokens", type=int,
                    help="each engine's chunk: the most tokens a step computes (default: the preset's, SGLang's "
                         "chunked-prefill size for the card: sim/cost.py)")
    ap.add_argument("--num-prompts", type=int, default=300)
    ap.add_argument("--min-seconds", type=float, default=MIN_SECONDS,
                    help="of arrivals a run offers, past --num-prompts (not the trace's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    a = ap.parse_args()
    modes = ("routing", *[m for m in a.modes.split(",") if mode_base(m) in MODES and m != "routing"])
    rows = []
    for preset in a.presets.split(","):
        cost, cap = scaled_cost(preset, a.kv_scale)
        if a.max_num_batched_tokens:
            cost = cost.replace(max_num_batched_tokens=a.max_num_batched_tokens)
        runs = RUNS["calibrated" if preset.startswith("calibrated") else preset]
        if a.runs:
            runs = [(spec, *map(float, rates.split("/"))) for spec, rates in (r.split("@") for r in a.runs.split(";"))]
        for spec, *rates in runs:
            if a.workloads and spec not in a.workloads.split(","):
                continue
            for load, rate in zip(("light", "overload"), rates):
                t0 = time.perf_counter()
                n = requests(spec, rate, a.num_prompts, a.min_seconds)
                w = workload(spec, rate, n, a.seed, cap)
                results = {m: simulate(cost, w, m, NodeConfig(seed=a.seed, policy=a.policy, hand_off=a.hand_off,
                                                                 let_go_after=a.let_go_after,
                                                                 follow=not a.no_follow,
                                                                 overlap_queries=not a.serial_queries,
                                                                 offload=a.offload, host_kv_scale=a.host_kv_scale))
                           for m in modes}
                s = {m: r.summary() for m, r in results.items()}
                row = {"cost_model": cost.name, "kv_tokens_per_engine": cost.max_tokens_in_pool,
                       "max_num_batched_tokens": cost.max_num_batched_tokens, "workload": spec,
                       "load": load, "rate": rate, "requests": n, "seconds": time.perf_counter() - t0,
                       "ideal_hit_rate": ideal_hit_rate(w, cost.page_size),
                       **{m: {k: s[m][k] for k in KEYS} | {"put_pages": results[m].put_pages} for m in modes}}
                for m in modes[1:]:
                    row[m]["throughput_vs_routing"] = s[m]["throughput"] / s["routing"]["throughput"]
                    loaded = s["routing"]["loaded_throughput"]
                    row[m]["loaded_throughput_vs_routing"] = s[m]["loaded_throughput"] / loaded if loaded else None
                    row[m]["hit_rate_vs_routing"] = (s[m]["hit_rate"] / s["routing"]["hit_rate"]
                                                     if s["routing"]["hit_rate"] else None)
                rows.append(row)
                print(f"{cost.name:>15} {spec:>22} {load:>8} {rate:>6g} ideal hit {row['ideal_hit_rate']:.3f} "
                      + "  ".join(
                    f"{m}: hit {row[m]['hit_rate']:.3f} thr {row[m]['throughput']:7.1f} "
                    f"loaded {row[m]['loaded_throughput']:7.1f} p99 {row[m]['ttft_p99']:7.2f} "
                    f"cv {row[m]['busy_cv']:.2f} load cv {row[m]['load_cv']:.2f} access cv {row[m]['access_cv']:.2f} "
                    f"by reads {row[m]['access_cv_by_reads']:.2f} served cv {row[m]['served_cv']:.2f} "
                    f"own {row[m]['own_access_share']:.2f} cache cv {row[m]['cache_access_cv']:.2f} "
                    f"slo {row[m]['slo_attainment']:.2f}" for m in modes), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(json_safe({"command": "python " + " ".join(sys.argv),
                                 "machine": platform.processor() or platform.machine(), "engines": 8,
                                 "kv_scale": a.kv_scale, "policy": a.policy, "hand_off": a.hand_off,
                                 "let_go_after": a.let_go_after, "follow": not a.no_follow,
                                 "overlap_queries": not a.serial_queries, "offload": a.offload,
                                 "host_kv_scale": a.host_kv_scale,
                                 "num_prompts": a.num_prompts, "min_seconds": a.min_seconds, "seed": a.seed,
                                 "rows": rows}), f, indent=1)
        print("wrote", a.out)


if __name__ == "__main__":
    main()
