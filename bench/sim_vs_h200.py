"""The simulator against the two bursts recorded on a real H200: fcfs's P99 TTFT and the
tokenflow/fcfs ratios (effective throughput, raw throughput, P99 TTFT), each as the simulator
predicts it and as the H200 measured it.

    python bench/sim_vs_h200.py [--link 5e10] [--step-overhead-ms 0,fit] [--out FILE]

The recorded figures (tests/data/h200_recorded.json, taken from ../shared/data/h200) are the
calibrated cost model and each burst's summaries. That calibration timed the runner's execute
alone: its link is the memory bandwidth (--link sets the measured 5.0e10) and its overhead 0,
although the daemon's engine spends host time in series with every step (scheduling, the
update, its messages to the front). `fit` takes that time from each policy's recorded spans: a
policy runs about the same steps whatever the overhead (fcfs exactly the same), so its span is
the simulated span plus steps × overhead, and one least-squares figure over both bursts gives
the overhead.

The two policies are fitted apart: tokenflow's scheduling (its view of every reader and the
policy) costs the host more per step than fcfs's, and the recorded spans say by how much. The
raw throughput ratio is then the spans' ratio and follows from the fit; fcfs's P99 TTFT, the
effective throughput ratio and the P99 TTFT ratio do not.

A P99 of 96 or 160 requests is the last one or two first tokens. Without jitter the simulator
breaks every tie the same way, and that figure moves by 15% on a 0.2 ms change of the overhead;
a real device's steps of one shape vary by about 3% (calibrated_h200.json's residuals), so each
simulated figure is the median over 5 seeds of that jitter (`tokenflowd sim --step-jitter`).
"""
from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
from contextlib import redirect_stdout
from statistics import median
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenflowd.cli import main as tokenflowd  # noqa: E402
from tokenflowd.sim.cost import CostModel, save_cost_model  # noqa: E402

RECORDED = Path(__file__).resolve().parents[1] / "tests" / "data" / "h200_recorded.json"
LINK = 5.0e10  # B/s: bench/offload_bandwidth.py on the H200 (../shared/data/h200/offload_bandwidth.json)
LIMITS = ["--workload", "burst", "--kv-memory", "4GiB", "--offload", "write-through", "--host-kv-memory", "16GiB"]
RATIOS = ("effective_throughput", "throughput", "ttft_p99")
POLICIES = ("fcfs", "tokenflow")
JITTER = 0.03  # σ of the H200's step times among steps of one shape (calibrated_h200.json's residuals)
SEEDS = 5


def burst_args(args: dict) -> list[str]:
    """The sim's workload flags for a burst recorded with these loadgen arguments."""
    return ["--num-prompts", str(args["num_prompts"]), "--lengths", args["lengths"],
            "--reading-rate", args["reading_rate"], "--seed", str(args["seed"])]


def simulate(cost: dict, args: list[str], policy: str, jitter: float = 0.0, seed: int = 0) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cost_file, out = Path(tmp) / "cost.json", Path(tmp) / "r.json"
        save_cost_model(CostModel.from_dict(cost), cost_file)
        with redirect_stdout(io.StringIO()):
            rc = tokenflowd(["sim", "--cost-model", str(cost_file), *LIMITS, *args, "--policy", policy,
                             "--step-jitter", str(jitter), "--jitter-seed", str(seed), "--out", str(out)])
        if rc != 0:
            raise RuntimeError(f"tokenflowd sim exited {rc}")
        return json.loads(out.read_text())["summary"]


def with_link(recorded: dict, link: float, overhead_s: float = 0.0) -> dict:
    """The recorded cost model with the host link set and `overhead_s` of host time per step added."""
    cost = dict(recorded["cost_model"], host_link_bandwidth=link)
    cost["step_overhead"] = cost["step_overhead"] + overhead_s
    return cost


def fit_overhead(recorded: dict, link: float, policy: str) -> float:
    """s per step: least squares of `policy`'s recorded spans over its simulated steps."""
    cost = with_link(recorded, link)
    num = den = 0.0
    for burst in recorded["bursts"].values():
        sim = simulate(cost, burst_args(burst["args"]), policy)
        steps, gap = sim["num_steps"], burst["summary"][policy]["span"] - sim["span"]
        num, den = num + steps * gap, den + steps * steps
    return max(0.0, num / den)


def compare(recorded: dict, link: float, overheads: dict[str, float], jitter: float = JITTER,
            seeds: int = SEEDS) -> list[dict]:
    """Per burst: (simulated, recorded) for fcfs's P99 TTFT and each tokenflow/fcfs ratio, each
    policy with its host time per step (`overheads`, s); with `jitter`, each simulated figure is
    the median over `seeds` seeds of it."""
    rows = []
    for name, burst in recorded["bursts"].items():
        runs = []
        for seed in range(seeds if jitter else 1):
            sim = {p: simulate(with_link(recorded, link, overheads[p]), burst_args(burst["args"]), p, jitter, seed)
                   for p in POLICIES}
            runs.append({"fcfs_ttft_p99": sim["fcfs"]["ttft_p99"],
                         **{k: sim["tokenflow"][k] / sim["fcfs"][k] for k in RATIOS}})
        row = {"burst": name, "overhead_ms": {p: overheads[p] * 1e3 for p in POLICIES}, "jitter": jitter,
               "seeds": len(runs), "fcfs_ttft_p99": (median([r["fcfs_ttft_p99"] for r in runs]),
                                                     burst["summary"]["fcfs"]["ttft_p99"])}
        for key in RATIOS:
            row[key] = (median([r[key] for r in runs]), burst["ratios"][key])
        row["spread"] = {k: (min(r[k] for r in runs), max(r[k] for r in runs)) for k in ("fcfs_ttft_p99", *RATIOS)}
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recorded", default=str(RECORDED))
    ap.add_argument("--link", type=float, default=LINK)
    ap.add_argument("--step-overhead-ms", default="0,fit",
                    help="host ms per step, each a run: a figure for both policies, or fit (default 0,fit)")
    ap.add_argument("--jitter", type=float, default=JITTER, help=f"σ of each step's time factor (default {JITTER})")
    ap.add_argument("--seeds", type=int, default=SEEDS, help=f"jitter seeds, figures their medians (default {SEEDS})")
    ap.add_argument("--out")
    a = ap.parse_args()
    recorded = json.loads(Path(a.recorded).read_text())
    overheads = [{p: fit_overhead(recorded, a.link, p) for p in POLICIES} if ms == "fit"
                 else dict.fromkeys(POLICIES, float(ms) / 1e3) for ms in a.step_overhead_ms.split(",")]
    rows = [r for o in overheads for r in compare(recorded, a.link, o, a.jitter, a.seeds)]
    print(f"{'burst':<14} {'+ms fcfs/tf':>11} {'fcfs P99 TTFT sim/real':>24} " + " ".join(f"{k + ' ratio':>26}" for k in RATIOS))
    for r in rows:
        s, real = r["fcfs_ttft_p99"]
        cells = [f"{r[k][0]:.3f}/{r[k][1]:.3f} ({r[k][0] / r[k][1] - 1:+.0%})" for k in RATIOS]
        ms = f"{r['overhead_ms']['fcfs']:.2f}/{r['overhead_ms']['tokenflow']:.2f}"
        print(f"{r['burst']:<14} {ms:>11} {f'{s:.2f}/{real:.2f} ({s / real - 1:+.0%})':>24} "
              + " ".join(f"{c:>26}" for c in cells))
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
