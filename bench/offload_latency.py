"""Preempt and resume latency of one 2k-token request, per offload mode, in one run.

    python bench/offload_latency.py [--tokens 2048] [--device cpu] [--model smollm2-135m]
                                    [--out bench/results/offload_latency.json]

The request prefills its prompt and decodes a few tokens, the write-through (if any) catches up
as it would between steps, then the scheduler is told to preempt it:
  preempt latency  decision -> every device page of the request free (the preemption call, plus
                   waiting for the eviction copy where the host lacked pages);
  pages in place   admission -> its KV back in device pages (the loads; none without a host tier);
  resume latency   admission -> its next token (loads, then one decode step; a recompute of its
                   whole context without a host tier).
Prefix caching is off, so nothing of the request survives on the device: every page comes back.
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from tokenflowd.buffer.fcfs import FCFSPolicy
from tokenflowd.buffer.policy import Plan, SchedulerView, SchedulingPolicy
from tokenflowd.config import EngineConfig
from tokenflowd.engine.core import EngineCore
from tokenflowd.engine.model.loader import load_model_source
from tokenflowd.engine.request import Request, RequestStatus, SamplingParams
from tokenflowd.engine.scheduler import ScheduledBatch


class PreemptOnCue(SchedulingPolicy):
    """FCFS; preempts the running requests named in `victims` (reload is the scheduler's choice)."""

    name = "preempt-on-cue"

    def __init__(self) -> None:
        self.fcfs = FCFSPolicy()
        self.victims: set[str] = set()

    def plan(self, view: SchedulerView) -> Plan:
        plan = self.fcfs.plan(view)
        victims = tuple(r.request_id for r in view.running if r.request_id in self.victims)
        self.victims.clear()
        return Plan(tuple(s for s in plan.scheduled if s[0] not in victims), plan.preempted + victims)


def measure(loaded, device: str, dtype: str, offload: str, prompt: list[int]) -> dict:
    # Prefix caching off: the preempted pages must not simply wait on the device (under memory
    # pressure, what preemption is for, they would be reused at once).
    cfg = EngineConfig.resolve(device=device, dtype=dtype, offload=offload, max_num_batched_tokens=512,
                               enable_prefix_caching=False)
    core = EngineCore.from_config(cfg, loaded)
    policy = PreemptOnCue()
    core.scheduler.policy = policy
    req = Request("r", prompt, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    core.add_request(req)
    while req.num_output_tokens < 8:
        core.step()
    core.scheduler.issue_copies(ScheduledBatch())  # the write-through of the last step's pages
    core.wait_copies()
    pages = len(core.kv.block_table(req))
    computed = req.num_computed_tokens
    offloaded = core.kv.num_host_tokens(req)

    policy.victims.add("r")
    t0 = time.perf_counter()
    core.scheduler.schedule()
    freed_at_once = pages - core.pool.num_used
    t_call = time.perf_counter() - t0
    while core.pool.num_used:
        core.kv.wait_oldest()
        core.scheduler.poll_copies()
    t_preempt = time.perf_counter() - t0
    assert req.status is RequestStatus.PREEMPTED

    n_out = req.num_output_tokens
    t0 = time.perf_counter()
    t_in_place = None
    core.scheduler.issue_copies(core.scheduler.schedule())  # admitted: its loads are queued
    while req.status is RequestStatus.LOADING:
        core.kv.wait_oldest()
        core.scheduler.poll_copies()
        core.scheduler.issue_copies(ScheduledBatch())  # the next chunk of its loads, if any
    if req.num_computed_tokens >= computed:
        t_in_place = time.perf_counter() - t0
    while req.num_output_tokens == n_out:  # without a host tier: the recompute's prompt chunks
        core.step()
    t_resume = time.perf_counter() - t0
    core.close()
    return {"context_tokens": computed, "pages": pages, "offloaded_tokens_before": offloaded,
            "pages_freed_at_once": freed_at_once, "preempt_call_s": t_call, "preempt_s": t_preempt,
            "pages_in_place_s": t_in_place, "resume_s": t_resume}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dtype = "float32" if a.device == "cpu" else "bfloat16"
    loaded = load_model_source(a.model, getattr(torch, dtype), a.device)
    text = "People read streamed answers at their own pace, a few words a second. " * 400
    prompt = loaded.tokenizer.encode(text)[: a.tokens - 8]
    rows = {}
    for mode in ("write-through", "write-back", "none"):
        rows[mode] = r = measure(loaded, a.device, dtype, mode, prompt)
        print(f"{mode:14} context {r['context_tokens']} tokens ({r['pages']} pages, {r['offloaded_tokens_before']} "
              f"on the host): preempt {1e3 * r['preempt_s']:8.2f} ms ({r['pages_freed_at_once']} pages free at "
              f"once, call {1e3 * r['preempt_call_s']:.2f} ms)  in place "
              f"{'-' if r['pages_in_place_s'] is None else format(1e3 * r['pages_in_place_s'], '.2f')} ms  "
              f"resume -> next token {1e3 * r['resume_s']:8.1f} ms")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"machine": platform.processor() or platform.machine(), "device": a.device, "model": a.model,
                       "threads": torch.get_num_threads(), "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
