"""`tokenflowd sim` and `tokenflowd calibrate` (registered by tokenflowd/cli.py).

    tokenflowd sim --scenario h200-a --policy all
    tokenflowd sim --preset rtx4090-llama3-8b --workload poisson:2 --num-prompts 80 --lengths SL \\
                   --reading-rate 15:0.4,20:0.6 --policy tokenflow --seed 1 --out result.json
    tokenflowd sim --preset calibrated:cpu.json --workload trace --time-scale 0.1 --num-prompts 200
    tokenflowd calibrate --out cpu.json --threads 2
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time

from tokenflowd.config import OFFLOAD_MODES, PolicyConfig, parse_size


def add_commands(sub, common: argparse.ArgumentParser) -> None:
    from tokenflowd.config.flags import engine_args, policy_args
    from tokenflowd.sim import pool as pool_sim
    from tokenflowd.sim.cost import PRESETS
    from tokenflowd.sim.scenarios import SCENARIOS

    s = sub.add_parser("sim", parents=[common], help="simulate the scheduler and a policy on a virtual clock",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--scenario", choices=SCENARIOS,
                   help="a canned setup: fig6 (TokenFlow Fig. 6) or a Table 1 setup; workload flags override it")
    s.add_argument("--preset", help=f"cost model: {', '.join(PRESETS)} or calibrated:FILE.json (default h200-llama3-8b)")
    s.add_argument("--cost-model", metavar="FILE.json", help="a cost model file from `tokenflowd calibrate`")
    s.add_argument("--policy", default="fcfs", help="a policy, several (fcfs,tokenflow) or all, run on the same workload")
    s.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    s.add_argument("--out", help="write the result as JSON here")
    w = s.add_argument_group("workload (defaults: burst of 100 SL requests reading at 20 tokens/s)")
    w.add_argument("--workload", help="burst[:N] | poisson:RATE | gamma:RATE:SHAPE | trace[:PATH] (rates in requests/s)")
    w.add_argument("--num-prompts", "--burst-size", dest="num_prompts", type=int, help="number of requests")
    w.add_argument("--lengths", help="SL | LL | sharegpt | normal:IN:SD:OUT:SD | lognormal:IN:SIGMA:OUT:SIGMA | fixed:IN:OUT")
    w.add_argument("--output-scale", type=float, help="multiply output lengths (TokenFlow's H200 runs: 2)")
    w.add_argument("--reading-rate", help="tokens/s, one rate (20) or a mix (15:0.4,20:0.6)")
    w.add_argument("--trace", help="Mooncake conversation_trace.jsonl (default: the shared copy, if present)")
    w.add_argument("--time-scale", type=float, help="trace arrivals × this (below 1 replays faster)")
    w.add_argument("--max-prompt-len", type=int, help="truncate longer trace prompts to this many tokens")
    w.add_argument("--burst-spread", type=float, help="s: a burst's arrivals spread uniformly over [0, S] (default 0)")
    w.add_argument("--max-tokens-share", type=float,
                   help="share of requests whose client sets a loose max_tokens (--max-tokens-bound); the "
                        "engine learns output lengths either way (default 0; Table 1 scenarios 0.25)")
    w.add_argument("--max-tokens-bound", type=int, help="that max_tokens (default 4096)")
    e = s.add_argument_group("engine limits (override the cost model's)")
    e.add_argument("--kv-memory", help="KV pool size, e.g. 4GiB")
    e.add_argument("--max-num-seqs", type=int)
    e.add_argument("--max-num-batched-tokens", type=int)
    e.add_argument("--page-size", type=int)
    e.add_argument("--no-prefix-caching", action="store_true")
    e.add_argument("--offload", choices=OFFLOAD_MODES, default="none",
                   help="a host KV tier behind the pool, copies at the cost model's host link (default none)")
    e.add_argument("--host-kv-memory", default="64GiB", help="its size with --offload (default 64GiB)")
    e.add_argument("--max-steps", type=int, help="fail beyond this many steps (default: from the workload)")
    e.add_argument("--step-jitter", type=float, default=0.0,
                   help="σ of a lognormal factor (mean 1) on each step's time, as a real device varies "
                        "(an H200's steps of one shape: 0.03; default 0)")
    e.add_argument("--jitter-seed", type=int, default=0, help="its seed (default 0)")
    policy_args(s)
    s.set_defaults(func=cmd_sim)

    sp = sub.add_parser("sim-pool", parents=[common],
                        help="N engines' prefix caches on the Mooncake trace: the node pool against "
                             "cache-aware routing",
                        description=pool_sim.__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("--engines", type=int, default=8)
    sp.add_argument("--preset", default="a100-llama2-7b",
                    help=f"cost model for the KV pool's size and time in flight: {', '.join(PRESETS)} "
                         "or calibrated:FILE.json")
    sp.add_argument("--capacity-tokens", help="prefix cache per engine, tokens; several: 100000,500000 "
                                              "(default: the cost model's KV pool)")
    sp.add_argument("--trace", help="Mooncake conversation_trace.jsonl (default: the shared copy)")
    sp.add_argument("--num-prompts", type=int, help="the trace's first N requests (default all)")
    contexts_args(sp)
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--out", help="write the results as JSON here")
    sp.set_defaults(func=cmd_sim_pool)

    sn = sub.add_parser("sim-node", parents=[common],
                        help="N engines on one virtual clock, the trace replayed: throughput and TTFT of the node "
                             "pool against cache-aware routing",
                        description="N engines of one node on one virtual timeline, each the engine's own EngineCore "
                                    "over the cost model, arrivals routed by the daemon's router: cache-aware routing "
                                    "against the pool (requests read prefix pages where other engines hold them; "
                                    "query shipping costed on the link). See tokenflowd/sim/node.py.")
    sn.add_argument("--engines", type=int, default=8)
    sn.add_argument("--preset", default="a100-llama2-7b",
                    help=f"cost model: {', '.join(PRESETS)} or calibrated:FILE.json")
    sn.add_argument("--trace", help="Mooncake conversation_trace.jsonl (default: the shared copy)")
    contexts_args(sn)
    sn.add_argument("--num-prompts", type=int, default=2000, help="the trace's first N requests (or N synthetic ones)")
    sn.add_argument("--time-scale", type=float, default=1.0, help="trace arrivals × this (below 1: faster)")
    sn.add_argument("--max-prompt-len", type=int, help="truncate longer prompts to this many tokens")
    sn.add_argument("--policy", default="fcfs", help="each engine's scheduling policy (default fcfs)")
    sn.add_argument("--segment-tokens", type=int, default=512, help="the pool's segment (default 512)")
    sn.add_argument("--no-pool-steal", action="store_true",
                    help="pool modes: an idle engine takes no queued request from a busy one (pool/steal.py)")
    sn.add_argument("--no-pool-copy", action="store_true",
                    help="pool modes: hot segments an engine reads elsewhere are not copied into it")
    sn.add_argument("--pool-mode", choices=["query", "read"], default="query",
                    help="pool modes: every row sent to its holders (query, the default), or read mode: a request "
                         "whose rows in a step reach the link's ridge reads its holders' pages in place, fewer are "
                         "sent (the daemon's --pool-mode read, --pool-read-rows)")
    sn.add_argument("--offload", choices=OFFLOAD_MODES, default="none",
                    help="each engine's host KV tier, as the daemon's --offload (whose default is write-through): "
                         "preempted KV comes back over the cost model's host link instead of being computed again "
                         "(default none)")
    sn.add_argument("--host-kv-scale", type=float, default=1.0,
                    help="with --offload, each engine's host tier in pages, times its device pool (default 1)")
    sn.add_argument("--seed", type=int, default=0)
    sn.add_argument("--out", help="write the summaries as JSON here")
    sn.set_defaults(func=cmd_sim_node)

    from tokenflowd.sim import cluster as cluster_sim

    sc = sub.add_parser("sim-cluster", parents=[common],
                        help="N prefill and M decode nodes behind the conductor, the trace replayed: early "
                             "rejection off, on the current decode load or on the predicted one (Mooncake §7)",
                        description=cluster_sim.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sc.add_argument("--prefill", type=int, default=8, help="prefill nodes (default 8, Mooncake §8.2)")
    sc.add_argument("--decode", type=int, default=8, help="decode nodes (default 8)")
    sc.add_argument("--speed", type=float, default=1.0, help="replay speed: 2 = arrivals twice as fast (§8.2: 2)")
    sc.add_argument("--num-prompts", type=int, help="the trace's first N requests (default all)")
    sc.add_argument("--rejection", default="off,current,predicted,uniform",
                    help=f"gates to compare, from {', '.join(cluster_sim.MODES)} (default off,current,predicted,uniform)")
    sc.add_argument("--preset", default="a100-llama2-7b",
                    help=f"cost model of every node: {', '.join(PRESETS)} or calibrated:FILE.json")
    sc.add_argument("--trace", help="Mooncake conversation_trace.jsonl (default: the shared copy)")
    sc.add_argument("--ttft-slo", type=float, default=30.0, help="s (default 30, Mooncake §8.1.3)")
    sc.add_argument("--tbt-slo", type=float, default=0.1, help="s (default 0.1)")
    sc.add_argument("--link-gbps", type=float, default=800.0, help="KV link per node, Gbit/s (default 800)")
    sc.add_argument("--decode-batch", type=int, help="a decode node's most requests (default: the requests of "
                                                     "the workload's mean size its KV pool holds)")
    sc.add_argument("--cache-blocks", type=int, help="a prefill node's prefix cache in 512-token blocks "
                                                     "(default: its KV pool)")
    sc.add_argument("--decode-seconds", type=float, default=20.0, help="T_d before any decode has finished")
    sc.add_argument("--decode-choice", choices=cluster_sim.DECODE_CHOICES, default="predicted",
                    help="how place() rates decode nodes (default predicted)")
    sc.add_argument("--decode-admission", choices=cluster_sim.DECODE_ADMISSIONS, default="pool",
                    help="pool: a request whose KV is ready takes a seat on any decode node; bound: only on the "
                         "node chosen at its arrival (default pool)")
    sc.add_argument("--ties", choices=cluster_sim.TIES, default="file",
                    help="order of the trace's arrivals that share a timestamp (default file)")
    sc.add_argument("--out", help="write the summaries and the load samples as JSON here")
    sc.set_defaults(func=cmd_sim_cluster)

    from tokenflowd.sim import prfaas_case

    sp = sub.add_parser("sim-prfaas", parents=[common],
                        help="PrfaaS's case study through its throughput model: PrfaaS-PD, homogeneous PD and "
                             "naive heterogeneous PD (prfaas.txt §4)",
                        description=prfaas_case.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("--egress-gbps", type=float, default=100.0, help="the PrfaaS cluster's egress (default 100)")
    sp.add_argument("--samples", type=int, default=200_000, help="prompt lengths drawn (default 200000)")
    sp.add_argument("--requests", type=int, default=20_000,
                    help="requests per simulated run of each deployment (sim/prfaas_cluster.py; 0: the model only)")
    sp.add_argument("--ttft-rates", default="0.2,2.0",
                    help="offered req/s at which to simulate each deployment's TTFT (default 0.2,2.0)")
    sp.add_argument("--out", help="write the three plans and the simulated runs as JSON here")
    sp.set_defaults(func=cmd_sim_prfaas)

    c = sub.add_parser("calibrate", parents=[common], help="time our engine's steps and fit a cost model for `sim`")
    c.add_argument("--out", required=True, help="the cost model file to write (load with --preset calibrated:FILE)")
    c.add_argument("--batch-sizes", default="1,4,8", help="requests per run (default 1,4,8)")
    c.add_argument("--context-lens", default="16,160", help="prompt lengths in tokens (default 16,160)")
    c.add_argument("--decode-steps", type=int, default=5, help="output tokens per request (default 5)")
    engine_args(c)
    c.set_defaults(func=cmd_calibrate)


def contexts_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--contexts", help="instead of the trace, a synthetic workload of shared long contexts at Poisson "
                                      "arrivals (TokenLake's kind): documents | sessions | system-prompt, with "
                                      ":KEY=VALUE overrides (context_tokens, uses, active, scale); needs --rate")
    p.add_argument("--rate", type=float, help="--contexts: requests/s")


def _node_workload(a: argparse.Namespace) -> list:
    """sim-pool's and sim-node's requests: the trace's first --num-prompts, or as many synthetic ones
    sharing long contexts (--contexts) at Poisson arrivals of --rate."""
    from tokenflowd.sim.workload import WorkloadSpec, build_workload, parse_context_shape

    if a.contexts:
        if a.rate is None:
            raise ValueError("--contexts needs --rate (requests/s)")
        return build_workload(WorkloadSpec("poisson", a.num_prompts, rate=a.rate, seed=a.seed,
                                           contexts=parse_context_shape(a.contexts)))
    return build_workload(WorkloadSpec.parse("trace", trace=a.trace, num_requests=a.num_prompts, seed=a.seed,
                                             time_scale=getattr(a, "time_scale", 1.0),
                                             max_prompt_len=getattr(a, "max_prompt_len", None)))


def cmd_sim_pool(a: argparse.Namespace) -> int:
    import json

    from tokenflowd.sim.cost import cost_model
    from tokenflowd.sim.pool import MODES, config_from_cost, replay
    if a.engines < 1:
        raise ValueError("--engines must be at least 1")
    cost = cost_model(a.preset)
    capacities = _ints(a.capacity_tokens, "--capacity-tokens") if a.capacity_tokens else (None,)
    requests = _node_workload(a)
    rows = []
    print(f"{len(requests)} {'synthetic ' + a.contexts if a.contexts else 'trace'} requests, {a.engines} engines, cost model {cost.name}")
    print(f"{'capacity':>10} {'mode':>8} {'hit rate':>9} {'load CV':>8} {'CV max':>7} {'replicas made':>14}")
    for capacity in capacities:
        cfg = config_from_cost(cost, a.engines, capacity, a.seed)
        for mode in MODES:
            s = replay(mode, requests, cfg).summary()
            rows.append({"capacity_tokens": cfg.capacity_tokens, **s})
            print(f"{cfg.capacity_tokens:>10} {mode:>8} {s['hit_rate']:>9.3f} {s['load_cv_mean']:>8.3f} "
                  f"{s['load_cv_max']:>7.3f} {s['replications']:>14}")
    if a.out:
        doc = {"engines": a.engines, "cost_model": cost.name, "cost_source": cost.source,
               "requests": len(requests), "results": rows}
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
        print("wrote", a.out)
    return 0


def cmd_sim_node(a: argparse.Namespace) -> int:
    import json

    from tokenflowd.sim.cost import cost_model
    from tokenflowd.sim.node import MODES, NodeConfig, link_ridge_rows, simulate_node
    from tokenflowd.sim.result import json_safe
    if a.engines < 1:
        raise ValueError("--engines must be at least 1")
    cost = cost_model(a.preset)
    if a.segment_tokens < cost.page_size or a.segment_tokens % cost.page_size:
        raise ValueError(f"--segment-tokens must be a multiple of the page size {cost.page_size}")
    if a.host_kv_scale <= 0:
        raise ValueError("--host-kv-scale must be above 0")
    requests = _node_workload(a)
    config = NodeConfig(engines=a.engines, policy=a.policy, segment_pages=a.segment_tokens // cost.page_size,
                        seed=a.seed, steal=not a.no_pool_steal, copy=not a.no_pool_copy, offload=a.offload,
                        host_kv_scale=a.host_kv_scale)
    if a.pool_mode == "read":
        config = dataclasses.replace(config, read_rows=link_ridge_rows(cost, config))
    print(f"{len(requests)} {'synthetic ' + a.contexts if a.contexts else 'trace'} requests, {a.engines} engines, cost model {cost.name}, policy {a.policy}")
    keys = ("throughput", "effective_throughput", "ttft_mean", "ttft_p99", "hit_rate", "busy_cv", "load_cv",
            "access_cv", "cache_access_cv", "computed_tokens")
    print(f"{'mode':>10} " + " ".join(f"{k:>20}" for k in keys))
    summaries = {}
    for mode, result in simulate_node(cost, requests, MODES, config).items():
        s = summaries[mode] = result.summary()
        print(f"{mode:>10} " + " ".join(f"{s[k]:>20.4g}" for k in keys))
    if a.out:
        doc = {"engines": a.engines, "cost_model": cost.name, "cost_source": cost.source, "policy": a.policy,
               "requests": len(requests), "workload": f"synthetic {a.contexts} at {a.rate} req/s" if a.contexts
               else "mooncake trace", "time_scale": a.time_scale, "max_prompt_len": a.max_prompt_len,
               "segment_tokens": a.segment_tokens, "steal": not a.no_pool_steal,
               "copy": not a.no_pool_copy, "pool_mode": a.pool_mode, "read_rows": config.read_rows,
               "offload": a.offload, "host_kv_scale": a.host_kv_scale,
               "summaries": summaries}
        with open(a.out, "w") as f:
            json.dump(json_safe(doc), f, indent=1)
        print("wrote", a.out)
    return 0


# Mooncake Table 3 (§8.2): 8 prefill + 8 decode instances, its 23,000-request trace at 2x speed.
MOONCAKE_REJECTED = {"off": 4183, "current": 3771, "predicted": 3589}


def cmd_sim_cluster(a: argparse.Namespace) -> int:
    import json

    from tokenflowd.sim.cluster import ClusterConfig, simulate_cluster
    from tokenflowd.sim.cost import cost_model
    from tokenflowd.sim.result import json_safe
    from tokenflowd.sim.workload import WorkloadSpec, build_workload

    if not a.speed > 0:
        raise ValueError("--speed must be above 0")
    modes = [m.strip() for m in a.rejection.split(",") if m.strip()]
    cost = cost_model(a.preset)
    requests = build_workload(WorkloadSpec.parse("trace", trace=a.trace, num_requests=a.num_prompts,
                                                 time_scale=1.0 / a.speed))
    config = ClusterConfig(prefill_nodes=a.prefill, decode_nodes=a.decode, ttft_slo=a.ttft_slo, tbt_slo=a.tbt_slo,
                           link_bandwidth=a.link_gbps * 1e9 / 8, decode_batch=a.decode_batch,
                           cache_blocks=a.cache_blocks, decode_seconds=a.decode_seconds,
                           decode_choice=a.decode_choice, decode_admission=a.decode_admission).resolve(cost, requests)
    t0 = time.perf_counter()
    results = simulate_cluster(cost, requests, modes, config, ties=a.ties)
    print(f"{len(requests)} trace requests at {a.speed:g}x, {a.prefill}P + {a.decode}D of {cost.name}, "
          f"decode batch {config.decode_batch}, prefix cache {config.cache_blocks} blocks, TTFT SLO {a.ttft_slo:g} s, "
          f"TBT SLO {a.tbt_slo:g} s, ties {a.ties}, decode admission {a.decode_admission} "
          f"({time.perf_counter() - t0:.1f} s wall)")
    keys = ("rejected", "rejected_ttft", "rejected_early", "rejected_late", "goodput_requests", "goodput_tokens_per_s",
            "ttft_mean", "ttft_p99", "ttft_over_slo_20pct", "flips", "phase_flips", "decode_load_sd", "prefill_load_sd")
    heads = ("rejected", "by TTFT", "early", "late", "goodput", "good tok/s", "TTFT mean", "TTFT p99", ">1.2 SLO",
             "flips", "phases", "dec SD", "pre SD")
    paper = MOONCAKE_REJECTED if a.speed == 2 else {}  # its figures are for 2x only
    print(f"{'gate':>10} " + " ".join(f"{h:>10}" for h in heads) + (f" {'Mooncake':>9}" if paper else ""))
    summaries = {}
    for mode, result in results.items():
        s = summaries[mode] = result.summary()
        row = " ".join(f"{s[k]:>10.4g}" for k in keys)
        print(f"{mode:>10} {row}" + (f" {paper.get(mode, ''):>9}" if paper else ""))
    if a.out:
        doc = {"setup": {"preset": cost.name, "cost_source": cost.source, "speed": a.speed, "ties": a.ties,
                         "requests": len(requests), "trace": a.trace or "default", **vars(config), "rejection": modes},
               "mooncake_table3_rejected": MOONCAKE_REJECTED, "summaries": summaries,
               "decode_load": {m: r.decode_samples for m, r in results.items()},
               "prefill_load": {m: r.prefill_samples for m, r in results.items()}}
        with open(a.out, "w") as f:
            json.dump(json_safe(doc), f, indent=1)
        print("wrote", a.out)
    return 0


def cmd_sim_prfaas(a: argparse.Namespace) -> int:
    import json

    from tokenflowd.sim.prfaas_case import PAPER, case_study, lognormal_lengths
    from tokenflowd.sim.result import json_safe

    if not a.egress_gbps > 0 or a.samples < 1 or not (a.requests == 0 or a.requests >= 1000):
        raise ValueError("--egress-gbps must be above 0, --samples at least 1 and --requests 0 or at least 1000 "
                         "(fewer: the last arrivals' TTFT alone reads as a backlog)")
    lengths = lognormal_lengths(a.samples)
    study = case_study(lengths, egress=a.egress_gbps * 1e9 / 8)
    print(f"{'deployment':>12} {'t':>9} {'N_prfaas/N_p/N_d':>17} {'offloaded':>9} {'Θ_prfaas':>9} {'Θ_pd-p':>8} "
          f"{'Θ_pd-d':>8} {'Λ_max':>7} {'egress Gb/s':>11} {'paper Λ':>8}")
    for name, plan, remote in (("prfaas", study.prfaas, 4), ("homogeneous", study.homogeneous, 0),
                               ("naive", study.naive, 4)):
        t = "-" if plan.threshold in (0.0, float("inf")) else f"{plan.threshold / 1000:.1f}K"
        print(f"{name:>12} {t:>9} {f'{remote}/{plan.n_prefill}/{plan.n_decode}':>17} {plan.offloaded:>9.1%} "
              f"{plan.theta_prfaas:>9.2f} {plan.theta_pd_p:>8.2f} {plan.theta_pd_d:>8.2f} {plan.throughput:>7.2f} "
              f"{plan.egress * 8 / 1e9:>11.1f} {PAPER[name]:>8.2f}")
    print(f"paper: t = {PAPER['threshold'] / 1000:.1f}K, {PAPER['offloaded']:.1%} offloaded, "
          f"~{PAPER['egress_gbps']:g} Gb/s egress")
    simulated = simulate_case(study, lengths, a.requests, _floats(a.ttft_rates, "--ttft-rates")) if a.requests else {}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(json_safe({"egress_gbps": a.egress_gbps, "samples": a.samples, **study.to_dict(),
                                 "simulated": simulated, "requests": a.requests}), f, indent=1)
        print("wrote", a.out)
    return 0


def simulate_case(study, lengths, requests: int, rates: tuple[float, ...]) -> dict:
    """The three deployments on a virtual clock (sim/prfaas_cluster.py): the largest rate each
    sustains, against the model's Λ_max, and TTFT at the offered rates."""
    from tokenflowd.sim.prfaas_case import PAPER
    from tokenflowd.sim.prfaas_cluster import simulate, sustainable

    out = {}
    print(f"\nsimulated (sim/prfaas_cluster.py), {requests} Poisson arrivals a run; TTFT mean / P90 s")
    print(f"{'deployment':>12} {'Λ_max model':>11} {'sustained':>9}"
          + "".join(f" {f'TTFT @{r:g}/s':>16}" for r in rates) + f" {'paper TTFT':>12}")
    for d in study.deployments():
        model = getattr(study, d.name).throughput
        sustained = sustainable(d, lengths, 2 * model, requests)
        runs = [simulate(d, lengths, r, requests) for r in rates]
        out[d.name] = {"model": model, "sustained": sustained, "runs": [r.to_dict() for r in runs]}
        mean, p90 = PAPER["ttft"][d.name]
        print(f"{d.name:>12} {model:>11.2f} {sustained:>9.2f}"
              + "".join(f" {f'{r.ttft_mean:.2f} / {r.ttft_p90:.2f}':>16}" for r in runs) + f" {f'{mean} / {p90}':>12}")
    return out


def _floats(text: str, what: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{what} must be comma-separated numbers, got {text!r}") from None
    if not all(0 < v < math.inf for v in values):
        raise ValueError(f"{what} must be above 0, got {text!r}")
    return values


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers, got {text!r}") from None


def cmd_calibrate(a: argparse.Namespace) -> int:
    from tokenflowd.config.flags import engine_config
    from tokenflowd.sim.calibrate import CalibrationPlan, calibrate
    from tokenflowd.sim.cost import save_cost_model

    plan = CalibrationPlan(_ints(a.batch_sizes, "--batch-sizes"), _ints(a.context_lens, "--context-lens"),
                           a.decode_steps)
    model, record = calibrate(engine_config(a), plan)
    save_cost_model(model, a.out, record)
    print(f"wrote {a.out}: overhead {model.step_overhead * 1e3:.2f} ms (host {record['host_seconds_median'] * 1e3:.2f} "
          f"ms), {model.peak_flops:.3g} FLOP/s, {model.mem_bandwidth:.3g} B/s, overlap {model.overlap:.1f}, host link "
          f"{model.host_link_bandwidth:.3g} B/s x {model.host_link_efficiency:.2f}, "
          f"mean relative error {100 * record['mean_relative_error']:.1f}% over {record['num_steps']} steps")
    return 0


def _policy_params(a: argparse.Namespace, base: PolicyConfig) -> PolicyConfig:
    from tokenflowd.config.flags import POLICY_FLAGS

    given = {f: getattr(a, f) for f in POLICY_FLAGS if getattr(a, f, None) is not None}
    return dataclasses.replace(base, **given)


def _workload_overrides(a: argparse.Namespace) -> dict:
    from tokenflowd.sim.workload import parse_lengths, parse_reading_rates

    kw = {}
    if a.num_prompts is not None:
        kw["num_requests"] = a.num_prompts
    if a.lengths is not None:
        kw["lengths"] = parse_lengths(a.lengths)
    if a.reading_rate is not None:
        kw["reading_rates"] = parse_reading_rates(a.reading_rate)
    for flag in ("output_scale", "trace", "time_scale", "max_prompt_len", "burst_spread", "max_tokens_share",
                 "max_tokens_bound"):
        if getattr(a, flag) is not None:
            kw[flag] = getattr(a, flag)
    return kw


def _cost_overrides(a: argparse.Namespace) -> dict:
    kw = {}
    if a.kv_memory is not None:
        kw["kv_memory"] = parse_size(a.kv_memory)
    for flag in ("max_num_seqs", "max_num_batched_tokens", "page_size"):
        if getattr(a, flag) is not None:
            kw[flag] = getattr(a, flag)
    return kw


def _policies(spec: str) -> list[str]:
    from tokenflowd.buffer import POLICIES

    names = list(POLICIES) if spec == "all" else [p.strip() for p in spec.split(",") if p.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if unknown or not names:
        raise ValueError(f"unknown policy {', '.join(unknown) or spec!r}; choose from {', '.join(POLICIES)} or all")
    return names


def cmd_sim(a: argparse.Namespace) -> int:
    from tokenflowd.sim.cost import cost_model
    from tokenflowd.sim.result import dumps, format_table
    from tokenflowd.sim.run import run_simulation
    from tokenflowd.sim.scenarios import Scenario, scenario
    from tokenflowd.sim.workload import WorkloadSpec, build_workload

    policies = _policies(a.policy)
    overrides = _workload_overrides(a)
    if a.preset and a.cost_model:
        raise ValueError("give --preset or --cost-model, not both")
    if a.scenario:
        if a.workload:
            raise ValueError("--workload and --scenario both set the arrivals: drop one")
        sc = scenario(a.scenario, a.seed, **overrides)
        sc = dataclasses.replace(sc, policy_params=_policy_params(a, sc.policy_params))
        if a.preset or a.cost_model:
            sc = dataclasses.replace(sc, cost=cost_model(a.cost_model or a.preset))
    else:
        spec = WorkloadSpec.parse(a.workload or "burst", seed=a.seed, **overrides)
        sc = Scenario("custom", "", cost_model(a.cost_model or a.preset or "h200-llama3-8b"),
                      tuple(build_workload(spec)), _policy_params(a, PolicyConfig()), spec)
    sc = dataclasses.replace(sc, cost=sc.cost.replace(**_cost_overrides(a)))
    docs = {}
    for name in policies:
        t0 = time.perf_counter()
        result, doc = run_simulation(sc, name, seed=a.seed, enable_prefix_caching=not a.no_prefix_caching,
                                     max_steps=a.max_steps, offload=a.offload,
                                     host_kv_memory=parse_size(a.host_kv_memory) if a.offload != "none" else 0,
                                     step_jitter=a.step_jitter, jitter_seed=a.jitter_seed)
        print(f"[sim] {sc.name} {name}: {result.num_steps} steps, {result.makespan:.1f} virtual s, "
              f"{time.perf_counter() - t0:.1f} s wall", file=sys.stderr)
        docs[name] = doc
    print(format_table({n: d["summary"] for n, d in docs.items()}))
    if a.out:
        out = docs[policies[0]] if len(policies) == 1 else {"runs": docs}
        with open(a.out, "w") as f:
            f.write(dumps(out))
    return 0
