"""The scheduler's host time per step on the two bursts recorded on the H200, replayed in the
simulator (bench/sim_vs_h200.py's bursts: its calibrated cost model, 4 GiB of KV, write-through to
16 GiB of host KV, so pages are evicted and loaded as on the device): the time in
Scheduler.schedule per step, and within it in KVCacheManager.view_matches (each waiting request's
prefix match, kept or walked again), for tokenflow and fcfs. Simulated steps cost no wall time, so
what is timed is the engine's own host work, the part that runs in series with a GPU's step.

    python bench/sched_host.py [--rounds 3] [--out FILE.json]

To compare two commits, run it in a worktree of each (`git worktree add /tmp/old COMMIT`) on the
same machine, alternating; the figures depend on the CPU.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import time
from contextlib import redirect_stderr

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sim_vs_h200 as bursts  # noqa: E402
from machine import cpu_info  # noqa: E402

from tokenflowd.engine.scheduler import Scheduler  # noqa: E402
from tokenflowd.kv.manager import KVCacheManager  # noqa: E402


def timed(cls: type, name: str, acc: dict) -> None:
    """Wrap cls.name to add its wall time and call count to acc[name]."""
    fn = getattr(cls, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[name][0] += time.perf_counter() - t
            acc[name][1] += 1

    setattr(cls, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    recorded = json.loads(bursts.RECORDED.read_text())
    acc = {"schedule": [0.0, 0], "view_matches": [0.0, 0]}
    timed(Scheduler, "schedule", acc)
    timed(KVCacheManager, "view_matches", acc)
    rounds = []
    for _ in range(args.rounds):
        for v in acc.values():
            v[:] = [0.0, 0]
        with redirect_stderr(io.StringIO()):
            for burst in recorded["bursts"].values():
                for policy in ("tokenflow", "fcfs"):
                    bursts.simulate(bursts.with_link(recorded, bursts.LINK), bursts.burst_args(burst["args"]), policy)
        steps = acc["schedule"][1]
        rounds.append({"steps": steps, "schedule_ms_per_step": 1e3 * acc["schedule"][0] / steps,
                       "view_matches_ms_per_step": 1e3 * acc["view_matches"][0] / steps})
        print(f"{steps} steps: schedule {rounds[-1]['schedule_ms_per_step']:.3f} ms/step, of which view_matches "
              f"{rounds[-1]['view_matches_ms_per_step']:.3f}", flush=True)
    out = {"command": " ".join(["python", *sys.argv]), "machine": cpu_info(),
           "rounds": rounds, **{f"median_{k}": statistics.median(r[k] for r in rounds)
                                for k in ("schedule_ms_per_step", "view_matches_ms_per_step")}}
    print(json.dumps({k: v for k, v in out.items() if k.startswith("median")}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
