"""Scheduling overhead per pass: the policies' `plan(view)` on views of 100 and 1,000 tracked
requests (the paper: ~0.4 ms per TokenFlow pass, ~0.07 ms for SGLang's FCFS), plus the engine's
scheduler itself at as many tracked requests (tokenflow; up to 256 decoding, the rest queued):
the time to build its view from its requests, and a whole schedule() pass.

    python bench/sched_overhead.py [--sizes 100,1000] [--out bench/results/sched_overhead.json]

A tracked request is running (up to max_num_seqs = 256), preempted with a buffer, or new in the
queue. "balance" is a full buffer-balancing pass (what runs every schedule_interval while
stressed); "step" is a plan between passes (carrying the last decision out). Views are fixed, so
the figures are the policy's own cost, not the model's.
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time

from tokenflowd.buffer import make_policy
from tokenflowd.buffer.estimates import StepCost
from tokenflowd.buffer.policy import RequestView, SchedulerView, cdiv
from tokenflowd.config import PolicyConfig
from tokenflowd.engine.request import Request, SamplingParams
from tokenflowd.engine.scheduler import Scheduler
from tokenflowd.kv.manager import KVCacheManager
from tokenflowd.kv.pages import PagePool

PAGE = 16
MAX_SEQS = 256


# Step-time models: H200-like, where Γ feeds the working set (a full balancing pass), and one a
# several times slower, where Σ r > Γ (the FCFS fallback pass).
FAST = StepCost(base=0.006, per_token=2e-5, per_context=1e-8)
SLOW = StepCost(base=0.05, per_token=2e-4, per_context=1e-7)


def make_view(n: int, cost: StepCost, seed: int = 0) -> SchedulerView:
    rng = random.Random(seed)
    running, waiting = [], []
    num_running = min(MAX_SEQS, n // 2)
    num_preempted = (n - num_running) // 2
    for i in range(n):
        prompt = rng.randint(256, 1024)
        out = rng.randint(1, 1024)
        rate = rng.choice([15.0, 20.0])
        rid = f"r{i}"
        if i < num_running:
            ctx = prompt + out
            running.append(RequestView(rid, float(i), ctx, ctx - 1, cdiv(ctx - 1, PAGE), reading_rate=rate,
                                       buffer=rng.uniform(0, 200), num_output_tokens=out, max_output_tokens=2048))
        elif i < num_running + num_preempted:
            waiting.append(RequestView(rid, float(i), prompt + out, 0, 0, reading_rate=rate,
                                       buffer=rng.uniform(0, 100), num_output_tokens=out, max_output_tokens=2048))
        else:
            waiting.append(RequestView(rid, float(i), prompt, 0, 0, reading_rate=rate, max_output_tokens=2048))
    used = sum(r.pages_held for r in running)
    return SchedulerView(now=100.0, running=tuple(running), waiting=tuple(waiting), free_pages=used // 10,
                         total_pages=used + used // 10, page_size=PAGE, token_budget=8192, max_num_seqs=MAX_SEQS,
                         cost=cost)


def make_scheduler(n: int, seed: int = 0) -> Scheduler:
    """The engine's scheduler (tokenflow, a page pool with room for all) with `n` requests of
    256-1,024-token prompts: up to MAX_SEQS of them admitted and decoding, the rest queued."""
    rng = random.Random(seed)
    s = Scheduler(KVCacheManager(PagePool(200_000), PAGE), make_policy("tokenflow", PolicyConfig()), 8192, MAX_SEQS)
    for i in range(n):
        req = Request(f"r{i}", [rng.randrange(32_000) for _ in range(rng.randint(256, 1024))],
                      SamplingParams(max_tokens=2048), reading_rate=rng.choice([15.0, 20.0]))
        req.max_model_len = 1 << 20  # (the engine sets it on validation)
        s.add(req)
    for _ in range(400):  # prefills, until the running set decodes
        if len(s.running) >= min(MAX_SEQS, n // 2) and all(r.num_output_tokens for r in s.running):
            break
        batch = s.schedule()
        s.update(batch, [1 if row is not None else None for row in batch.sampling])
    return s


def scheduler_pass(n: int, repeat: int) -> dict:
    """ms of the scheduler's view (built from its requests every step) and of a whole
    schedule() with the update after it, at `n` tracked requests."""
    s = make_scheduler(n)
    row = {"scheduler_running": len(s.running), "scheduler_waiting": len(s.waiting),
           "scheduler_view_ms": 1e3 * time_calls(s._view, repeat)}
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        batch = s.schedule()
        samples.append(time.perf_counter() - t0)
        s.update(batch, [1 if row is not None else None for row in batch.sampling])
    row["scheduler_schedule_ms"] = 1e3 * statistics.median(samples)
    return row


def time_calls(fn, repeat: int) -> float:
    """Median seconds of one call over `repeat` calls."""
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="100,1000")
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    params = PolicyConfig()
    rows = []
    for n in (int(s) for s in a.sizes.split(",")):
        view = make_view(n, FAST)
        row = {"tracked": n, "running": len(view.running), "waiting": len(view.waiting)}
        fcfs = make_policy("fcfs", params)
        row["fcfs_plan_ms"] = 1e3 * time_calls(lambda: fcfs.plan(view), a.repeat)
        tf = make_policy("tokenflow", params)
        assert not tf.balance(view).fallback
        row["tokenflow_balance_ms"] = 1e3 * time_calls(lambda: tf.balance(view), a.repeat)
        slow = make_view(n, SLOW)
        assert tf.balance(slow).fallback
        row["tokenflow_fallback_ms"] = 1e3 * time_calls(lambda: tf.balance(slow), a.repeat)
        tf.plan(view)  # makes a decision; the next calls (same `now`) carry it out
        row["tokenflow_step_ms"] = 1e3 * time_calls(lambda: tf.plan(view), a.repeat)
        andes = make_policy("andes", params)
        row["andes_pass_ms"] = 1e3 * time_calls(lambda: andes.knapsack_pass(view), a.repeat)  # the knapsack
        andes.plan(view)  # a pass (when contended) whose decision the next calls carry out
        row["andes_step_ms"] = 1e3 * time_calls(lambda: andes.plan(view), a.repeat)
        row.update(scheduler_pass(n, min(a.repeat, 50)))
        rows.append(row)
        print("  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"machine": platform.processor() or platform.machine(), "python": platform.python_version(),
                       "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
