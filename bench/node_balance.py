"""Balance where TokenLake measures it (§7, Figure 10: each instance's cache accesses "at a request
rate approaching the P90 SLO threshold"): for each search of a bench/node_goodput.py result file,
routing and the pool modes at the highest rate one mode met the SLO at (--at, default routing: the
same load for all), 8 engines in the node simulator, the same requests as that search's probe.

    python bench/node_balance.py --goodput bench/results/node_goodput_small_cache_pin1.json
                                 [--at routing] [--modes routing,pool-local,pool-write]
                                 [--calibrated FILE] [--offload write-through] [--out FILE]

Per run: the access CV (TokenLake's measure: the CV across engines of the KV tokens read from each
one's memory per second while requests arrive, averaged; sim/node.py NodeResult.access_cv), the
same with each second weighted by its reads (access_cv_by_reads), the same for the lookups alone
(the prefix tokens each request found cached, once: cache_access_cv), the busy-time and
router-load CVs, hit rate, throughput and the TTFT SLO's attainment. The cost model,
KV scale, policy, hand-off and seeds are the goodput file's; a goodput file names a calibrated
cost model only as "calibrated", so its calibration is --calibrated (default the H200's).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from node_contexts import H200, add_offload, at_rate, mode_base, scaled_cost, simulate  # noqa: E402
from tokenflowd.sim.node import MODES, NodeConfig  # noqa: E402
from tokenflowd.sim.result import json_safe  # noqa: E402

KEYS = ("cache_access_cv", "access_cv", "access_cv_by_reads", "served_cv", "own_access_share", "busy_cv", "load_cv",
        "hit_rate", "throughput", "ttft_slo_attainment")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--goodput", required=True, help="a bench/node_goodput.py result file")
    ap.add_argument("--at", default="routing", help="the mode whose highest rate under the SLO each search runs at")
    ap.add_argument("--modes", default="routing,pool-local,pool-write")
    ap.add_argument("--calibrated", default=H200.removeprefix("calibrated:"),
                    help="the calibration file of the goodput file's calibrated cost model")
    ap.add_argument("--no-follow", action="store_true",
                    help="pool-write: readers of a sender's copy of what it wrote into the homes keep reading it "
                         "there until they end (sim/node.py NodeConfig.follow; the daemon before protocol.Moved)")
    ap.add_argument("--let-go-after", type=float, default=0.0,
                    help="pool-write: s an engine keeps its own copy of what it wrote into the homes cached "
                         "(sim/node.py NodeConfig.let_go_after; the daemon kept it 1 s)")
    add_offload(ap)
    ap.add_argument("--out")
    a = ap.parse_args()
    with open(a.goodput) as f:
        good = json.load(f)
    modes = [m for m in a.modes.split(",") if mode_base(m) in MODES]
    rows = []
    for search in good["rows"]:
        met = search.get(a.at, {}).get("met")
        if not met:
            continue
        seed = search.get("seed", good.get("seed", 0))
        name = search["cost_model"]
        cost, cap = scaled_cost(f"calibrated:{a.calibrated}" if name.startswith("calibrated") else name,
                                good["kv_scale"])
        spec, rate = search["workload"], met["rate"]
        w = at_rate(spec, rate, met["requests"], seed, cap)
        config = NodeConfig(seed=seed, policy=good["policy"], hand_off=good["hand_off"], let_go_after=a.let_go_after,
                            follow=not a.no_follow, offload=a.offload)
        row = {"cost_model": cost.name, "workload": spec, "seed": seed, "rate": rate, "requests": met["requests"]}
        for m in modes:
            s = simulate(cost, w, m, config).summary()
            row[m] = {k: s[k] for k in KEYS}
        rows.append(row)
        print(f"{cost.name:>15} {spec:>44} seed {seed} {rate:6.3g}/s " + "  ".join(
            f"{m}: cache cv {row[m]['cache_access_cv']:.2f} access cv {row[m]['access_cv']:.2f} "
            f"hit {row[m]['hit_rate']:.3f} slo {row[m]['ttft_slo_attainment']:.2f}" for m in modes), flush=True)
    summary = {m: {k: statistics.mean(r[m][k] for r in rows) for k in KEYS} for m in modes} if rows else {}
    for m, s in summary.items():
        print(f"mean over {len(rows)}: {m}: " + " ".join(f"{k} {v:.3f}" for k, v in s.items()))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(json_safe({"command": "python " + " ".join(sys.argv),
                                 "machine": platform.processor() or platform.machine(), "goodput": a.goodput,
                                 "at": a.at, "kv_scale": good["kv_scale"], "policy": good["policy"],
                                 "hand_off": good["hand_off"], "let_go_after": a.let_go_after,
                                 "follow": not a.no_follow, "offload": a.offload, "mean": summary,
                                 "rows": rows}), f, indent=1)
        print("wrote", a.out)


if __name__ == "__main__":
    main()
