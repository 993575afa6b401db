"""The simulator against the two bursts recorded on a real H200 (../shared/data/h200/): fcfs's P99
TTFT and the tokenflow/fcfs ratios (effective throughput, raw throughput, P99 TTFT), each as the
simulator predicts it from the recorded calibration and as the H200 measured it.

    python bench/sim_vs_h200.py [--data ../shared/data/h200] [--link 5e10] [--step-overhead-ms 0,2.5]

The recorded calibration (calibrated_h200.json) was fitted before calibrate measured the host
link and the host's time per step: its link is the memory bandwidth and its overhead 0. --link
sets the link as measured (bench/offload_bandwidth.py: 5.0e10); --step-overhead-ms tries host
overheads per step on top of the fit (what calibrate now measures).
"""
from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
from contextlib import redirect_stdout
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenflowd.cli import main as tokenflowd  # noqa: E402

BURSTS = {  # the daemons' limits and loadgen's workload of each recorded burst
    "compare.json": ["--num-prompts", "96", "--lengths", "fixed:512:512", "--reading-rate", "15:0.5,25:0.5",
                     "--seed", "1"],
    "compare2.json": ["--num-prompts", "160", "--lengths", "fixed:256:768", "--reading-rate", "10:0.3,20:0.4,30:0.3",
                      "--seed", "7"],
}
LIMITS = ["--workload", "burst", "--kv-memory", "4GiB", "--offload", "write-through", "--host-kv-memory", "16GiB"]
RATIOS = ("effective_throughput", "throughput", "ttft_p99")


def simulate(cost_file: Path, args: list[str], policy: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        with redirect_stdout(io.StringIO()):
            rc = tokenflowd(["sim", "--cost-model", str(cost_file), *LIMITS, *args, "--policy", policy,
                             "--out", str(out)])
        assert rc == 0
        return json.loads(out.read_text())["summary"]


def compare(data: Path, link: float, overhead_s: float) -> list[dict]:
    doc = json.loads((data / "calibrated_h200.json").read_text())
    doc["cost_model"]["host_link_bandwidth"] = link
    doc["cost_model"]["step_overhead"] = doc["cost_model"]["step_overhead"] + overhead_s
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cost_file = Path(tmp) / "cost.json"
        cost_file.write_text(json.dumps(doc))
        for name, args in BURSTS.items():
            real = json.loads((data / name).read_text())
            sim = {p: simulate(cost_file, args, p) for p in ("fcfs", "tokenflow")}
            row = {"burst": name, "overhead_ms": overhead_s * 1e3,
                   "fcfs_ttft_p99": (sim["fcfs"]["ttft_p99"], real["runs"]["fcfs"]["summary"]["ttft_p99"])}
            for key in RATIOS:
                row[key] = (sim["tokenflow"][key] / sim["fcfs"][key], real["ratios"][key])
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared" / "data" / "h200"))
    ap.add_argument("--link", type=float, default=5.0e10)
    ap.add_argument("--step-overhead-ms", default="0")
    ap.add_argument("--out")
    a = ap.parse_args()
    rows = [r for ms in a.step_overhead_ms.split(",") for r in compare(Path(a.data), a.link, float(ms) / 1e3)]
    print(f"{'burst':<14} {'+ms':>4} {'fcfs P99 TTFT sim/real':>24} " + " ".join(f"{k + ' ratio':>26}" for k in RATIOS))
    for r in rows:
        s, real = r["fcfs_ttft_p99"]
        cells = [f"{r[k][0]:.3f}/{r[k][1]:.3f} ({r[k][0] / r[k][1] - 1:+.0%})" for k in RATIOS]
        print(f"{r['burst']:<14} {r['overhead_ms']:>4.1f} {f'{s:.2f}/{real:.2f} ({s / real - 1:+.0%})':>24} "
              + " ".join(f"{c:>26}" for c in cells))
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
