"""How the engine's torch threads, the front and the KV copier share a small CPU: the same burst
through `tokenflowd serve` with the engine's torch threads at 1 and at every core (the default),
in one run, alternating the order over rounds (this box's speed drifts; pairs are what count).

    .venv/bin/python bench/thread_split.py [--rounds 2] [--out bench/results/thread_split.json]

The burst is bench/peer_llamacpp.py's: 24 chat readers at 5 and 7 tokens/s, 64-token prompts, 128
tokens out, 8 slots, tokenflow policy, the embedded model as the daemon serves it by default. Each run
reports the load generator's TTFT mean and p99, rebuffer and effective throughput, and the CPU
seconds each process spent during the burst: the front (the supervisor) against the engine (its
torch threads, the copier's lanes and its endpoint together).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
from daemon import Daemon  # noqa: E402
from machine import cpu_info  # noqa: E402
from peer_llamacpp import READERS, SLOTS, burst  # noqa: E402


def cpu_seconds(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def one(threads: int, logs: Path) -> dict:
    d = Daemon("--max-num-seqs", str(SLOTS), "--policy", "tokenflow", "--threads", str(threads),
               log_path=str(logs / f"thread_split-{threads}.log"))
    try:
        front = psutil.Process(d.proc.pid)
        engines = front.children(recursive=True)
        before = {p.pid: cpu_seconds(p) for p in [front, *engines]}
        t0 = time.monotonic()
        s = burst(d.base_url, READERS["burst"], tokenflowd=True)
        wall = time.monotonic() - t0
        spent = {p.pid: cpu_seconds(p) - before[p.pid] for p in [front, *engines]}
        s["front_cpu_s"] = spent[front.pid]
        s["engine_cpu_s"] = sum(spent[p.pid] for p in engines)
        s["wall_s"] = wall
        s["engine_threads_os"] = sum(p.num_threads() for p in engines)
        return s
    finally:
        d.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="bench/results/thread_split.json")
    a = ap.parse_args()
    cores = os.cpu_count() or 2
    choices = sorted({1, cores})
    logs = ROOT / "bench" / "results" / "peer_llamacpp_logs"
    logs.mkdir(parents=True, exist_ok=True)
    runs: dict[int, list[dict]] = {t: [] for t in choices}
    for r in range(a.rounds):
        for t in (choices if r % 2 == 0 else choices[::-1]):
            s = one(t, logs)
            runs[t].append(s)
            print(f"round {r} threads {t}: " + ", ".join(f"{k} {v:.2f}" for k, v in s.items()), flush=True)
    cpu = cpu_info()["cpu"]
    mean = {t: {k: sum(s[k] for s in rs) / len(rs) for k in rs[0]} for t, rs in runs.items()}
    with open(a.out, "w") as f:
        json.dump({"cpu": cpu, "cores": cores, "runs": runs, "mean": mean}, f, indent=2)
    for t, m in mean.items():
        print(f"threads {t} (mean of {a.rounds}): " + ", ".join(f"{k} {v:.2f}" for k, v in m.items()))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
