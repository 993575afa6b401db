"""The three policies on the real engine (CPU, the embedded model): one seeded burst of about 3×
what the engine runs at once, readers at two rates (40% / 60%) scaled to this CPU's speed.

    python bench/policies_cpu.py [--slots 8] [--burst 3] [--out bench/results/policies_cpu.json]

First the engine's decode rate per request at a full batch, g, is measured; readers then read at
0.375·g and 0.5·g — the ratio of the paper's 15 and 20 tokens/s readers to the ~40 tokens/s a
request gets in a full H200 batch. Each policy then serves the same burst on a fresh engine, in
process, on the wall clock; a token's time is the end of the step that made it. The summary is
buffer/qos.py's, with ratios to fcfs measured in this one run.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import random
import time

import torch

from tokenflowd.buffer.qos import Timeline, summarize
from tokenflowd.config import EngineConfig, PolicyConfig
from tokenflowd.engine.core import EngineCore
from tokenflowd.engine.model.loader import load_model_source
from tokenflowd.engine.request import Request, SamplingParams

TEXT = ("Streaming chat sends each token as soon as it exists, but people read at their own pace; "
        "a server that knows how far ahead each reader is can spend its time where it is needed. ")


def engine(loaded, policy: str, slots: int, params: PolicyConfig) -> EngineCore:
    cfg = EngineConfig.resolve(device="cpu", dtype="float32", max_num_seqs=slots, max_num_batched_tokens=256,
                               policy=policy, policy_params=params)
    return EngineCore.from_config(cfg, loaded)


def decode_rate(core: EngineCore, slots: int) -> float:
    """Tokens/s one request gets when `slots` requests decode together on `core` (a fresh engine)."""
    ids = core.tokenizer.encode(TEXT * 4)
    for i in range(slots):
        core.add_request(Request(f"w{i}", ids[i : i + 48], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)))
    for _ in range(8):  # prefill and settle
        core.step()
    t0, steps = time.perf_counter(), 0
    while core.has_unfinished():
        core.step()
        steps += 1
    return steps / (time.perf_counter() - t0)


def workload(tokenizer, n: int, rates: tuple[float, float], seed: int, prompt_mean: int = 64,
             output_mean: int = 64) -> list[tuple[list[int], int, float]]:
    """(prompt ids, output length, reading rate) per request: prompts ~N(prompt_mean, prompt_mean/4)
    tokens of varied text, outputs ~N(output_mean, output_mean/4), 40% at the lower rate."""
    rng = random.Random(seed)
    ids = tokenizer.encode(TEXT * max(40, 2 * prompt_mean // 20))
    out = []
    for _ in range(n):
        plen = max(8, int(rng.gauss(prompt_mean, prompt_mean / 4)))
        start = rng.randrange(0, len(ids) - plen)
        olen = max(8, int(rng.gauss(output_mean, output_mean / 4)))
        out.append((ids[start : start + plen], olen, rates[0] if rng.random() < 0.4 else rates[1]))
    return out


def run(core: EngineCore, work: list[tuple[list[int], int, float]]) -> dict:
    t0 = time.monotonic()
    times: dict[str, list[float]] = {}
    for i, (prompt, olen, rate) in enumerate(work):
        core.add_request(Request(f"r{i}", list(prompt), SamplingParams(temperature=0, max_tokens=olen, ignore_eos=True),
                                 arrival_time=t0, reading_rate=rate))
        times[f"r{i}"] = []
    while core.has_unfinished():
        outs = core.step()
        now = time.monotonic()
        for o in outs:
            times[o.request_id] += [now] * len(o.new_token_ids)
    timelines = [Timeline(t0, rate, times[f"r{i}"]) for i, (_, _, rate) in enumerate(work)]
    summary = summarize(timelines)
    summary["preemptions"] = core.scheduler.num_preemptions
    core.wait_copies()  # host-tier copies still in flight pin their pages
    assert core.pool.num_used == 0
    assert all(len(times[f"r{i}"]) == olen for i, (_, olen, _) in enumerate(work)), "a stream came out short"
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=8, help="max_num_seqs: requests the engine runs at once")
    ap.add_argument("--burst", type=float, default=3.0, help="burst size as a multiple of the slots")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", default="fcfs,andes,tokenflow")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    loaded = load_model_source("smollm2-135m", torch.float32, "cpu")
    g = decode_rate(engine(loaded, "fcfs", a.slots, PolicyConfig()), a.slots)
    rates = (round(0.375 * g, 2), round(0.5 * g, 2))
    n = int(a.burst * a.slots)
    print(f"decode rate at {a.slots} slots: {g:.1f} tokens/s per request; readers at {rates[0]} (40%) and "
          f"{rates[1]} (60%) tokens/s; burst of {n}")
    params = PolicyConfig()
    results = {}
    for policy in a.policies.split(","):
        core = engine(loaded, policy, a.slots, params)
        results[policy] = run(core, workload(core.tokenizer, n, rates, a.seed))
    keys = ["effective_throughput", "throughput", "ttft_mean", "ttft_p99", "rebuffer_total", "qos", "preemptions", "span"]
    print(f"{'':22}" + "".join(f"{p:>14}" for p in results))
    for k in keys:
        print(f"{k:22}" + "".join(f"{results[p][k]:14.2f}" for p in results))
    if "fcfs" in results:
        base = results["fcfs"]
        for p in results:
            if p != "fcfs":
                print(f"{p} vs fcfs: effective throughput x{results[p]['effective_throughput'] / base['effective_throughput']:.2f}, "
                      f"throughput x{results[p]['throughput'] / base['throughput']:.2f}, "
                      f"P99 TTFT x{results[p]['ttft_p99'] / base['ttft_p99']:.2f}, "
                      f"mean TTFT x{results[p]['ttft_mean'] / base['ttft_mean']:.2f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                       "slots": a.slots, "burst": n, "decode_rate_per_request": g, "reading_rates": rates,
                       "seed": a.seed, "params": dataclasses.asdict(params), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
