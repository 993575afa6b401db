"""Whether the pool's span throughput is above, below or level with cache-aware routing's, per
workload and load, over bench/node_contexts.py's runs at several seeds: the geometric mean of each
pool mode's ratio to routing, and the 95% interval of that mean (Student's t over the seeds' log
ratios, scipy). A cell whose interval lies above 1 is a win, below 1 a loss, and one that holds 1
a tie at that many seeds. The Mooncake trace does not change with the seed, so its cell is one
placement: its ratio is set beside the noise floor (bench/node_noise.py, --noise: routing against
itself with only its tie-break changed), the spread of two placements of equal merit on that cell.

    python bench/node_seeds.py RESULTS.json [RESULTS.json ...] [--noise bench/results/node_noise.json]
                               [--out FILE]

RESULTS: node_contexts.py outputs, one seed each or merged (a row's seed field, else the file's).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections import defaultdict

from scipy import stats

Cell = tuple[str, str, str]


def interval(ratios: list[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """(geometric mean, low, high): the interval of the mean of the log ratios, Student's t; a
    single ratio, or ratios that do not vary, give the mean as both bounds."""
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    if len(logs) < 2 or max(logs) == min(logs):
        return math.exp(mean), math.exp(mean), math.exp(mean)
    half = stats.t.ppf(0.5 + confidence / 2, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def verdict(low: float, high: float, varies: bool, noise: tuple[float, float] | None) -> str:
    """above / below / tie: from the interval where the ratios vary over seeds; else (one
    placement) from the noise floor's range, where one is given."""
    if varies:
        return "above" if low > 1 else "below" if high < 1 else "tie"
    if noise is not None and min(noise[0], 1 / noise[1]) <= low <= max(noise[1], 1 / noise[0]):
        return "tie (noise floor)"
    return "above" if low > 1 else "below" if low < 1 else "level"


def cells(paths: list[str]) -> dict[Cell, dict[int, dict]]:
    out: dict[Cell, dict[int, dict]] = defaultdict(dict)
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        for row in data["rows"]:
            key = (row["cost_model"].split(":")[0], row["workload"], row["load"])
            seed = row.get("seed")
            out[key][data.get("seed") if seed is None else seed] = row
    return out


def noise_floor(path: str | None) -> dict[Cell, tuple[float, float]]:
    """cell -> (lowest, highest) ratio of routing with random ties over routing with the lowest id."""
    if not path:
        return {}
    with open(path) as f:
        rows = json.load(f)["rows"]
    return {(r["cost_model"].split(":")[0], r["workload"], r["load"]): (min(r["ratios"]), max(r["ratios"]))
            for r in rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+")
    ap.add_argument("--noise", help="bench/node_noise.py's output: the noise floor of each cell")
    ap.add_argument("--out")
    a = ap.parse_args()
    noise = noise_floor(a.noise)
    rows = []
    for key, by_seed in cells(a.results).items():
        seeds = sorted(by_seed)
        modes = [m for m in by_seed[seeds[0]] if isinstance(by_seed[seeds[0]][m], dict) and m != "routing"]
        row = {"cost_model": key[0], "workload": key[1], "load": key[2], "seeds": seeds}
        line = f"{key[0]:>14} {key[1]:>22} {key[2]:>8} n={len(seeds)}"
        for mode in modes:
            ratios = [by_seed[s][mode]["throughput_vs_routing"] for s in seeds]
            mean, low, high = interval(ratios)
            varies = len(set(ratios)) > 1
            v = verdict(low, high, varies, noise.get(key))
            row[mode] = {"ratios": ratios, "geomean": mean, "low": low, "high": high, "verdict": v}
            line += f" | {mode} {mean:.3f} [{low:.3f}, {high:.3f}] {v}"
        if key in noise:
            row["noise_floor"] = noise[key]
            line += f" | noise {noise[key][0]:.3f}-{noise[key][1]:.3f}"
        rows.append(row)
        print(line)
    for mode in sorted({m for r in rows for m in r if isinstance(r[m], dict)}):
        counts = defaultdict(int)
        for r in rows:
            if mode in r:
                counts[r[mode]["verdict"]] += 1
        print(f"{mode}: " + ", ".join(f"{v} {n}" for v, n in sorted(counts.items())))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "confidence": 0.95, "rows": rows}, f, indent=1)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
