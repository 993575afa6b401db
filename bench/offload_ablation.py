"""Ablation of the hierarchical KV cache, like Table 2 of tokenflow.txt: the buffer-aware policy
on one seeded burst with (a) no offload (preempted KV is recomputed), (b) write-back on
preemption, (c) write-through without load–evict overlap, (d) everything.

    python bench/offload_ablation.py [--slots 8] [--burst 3] [--prompt 384] [--kv-cache-memory 96MiB]
                                     [--device cpu] [--model smollm2-135m] [--out bench/results/offload_ablation.json]

CPU-sized on the embedded model by default; on a GPU pass --device cuda --model dummy:llama3-8b.
Long prompts make a preempted request's KV worth keeping (recompute costs a prefill of its whole
context); the burst is `burst`× the slots the engine runs at once, readers at two rates scaled to
the measured decode rate (bench/policies_cpu.py). One run per configuration, the same workload,
in one process; ratios are to (a).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform

import torch

from policies_cpu import decode_rate, run, workload
from tokenflowd.config import EngineConfig, PolicyConfig
from tokenflowd.engine.core import EngineCore
from tokenflowd.engine.model.loader import load_model_source

CONFIGS = {  # name -> (offload, load_evict_overlap)
    "a_recompute": ("none", True),
    "b_write_back": ("write-back", True),
    "c_write_through_serial": ("write-through", False),
    "d_full": ("write-through", True),
}


def engine(loaded, device: str, dtype: str, slots: int, offload: str, overlap: bool, kv_memory: str | None) -> EngineCore:
    cfg = EngineConfig.resolve(device=device, dtype=dtype, max_num_seqs=slots, max_num_batched_tokens=512,
                               policy="tokenflow", policy_params=PolicyConfig(), offload=offload,
                               load_evict_overlap=overlap, kv_cache_memory=kv_memory)
    return EngineCore.from_config(cfg, loaded)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--burst", type=float, default=3.0)
    ap.add_argument("--prompt", type=int, default=384, help="mean prompt length in tokens")
    ap.add_argument("--output", type=int, default=64, help="mean output length in tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--kv-cache-memory", default="96MiB",
                    help="device KV pool (default 96MiB: on the embedded model about half of what the slots' "
                         "contexts need, so preemption is what memory forces, as on the paper's 4090)")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dtype = "float32" if a.device == "cpu" else "bfloat16"
    loaded = load_model_source(a.model, getattr(torch, dtype), a.device)
    g = decode_rate(engine(loaded, a.device, dtype, a.slots, "none", True, a.kv_cache_memory), a.slots)
    rates = (round(0.375 * g, 2), round(0.5 * g, 2))
    n = int(a.burst * a.slots)
    print(f"decode rate at {a.slots} slots: {g:.1f} tokens/s per request; readers at {rates}; burst of {n}, "
          f"prompts ~{a.prompt} tokens")
    results = {}
    for name in a.configs.split(","):
        offload, overlap = CONFIGS[name]
        core = engine(loaded, a.device, dtype, a.slots, offload, overlap, a.kv_cache_memory)
        results[name] = run(core, workload(core.tokenizer, n, rates, a.seed, a.prompt, a.output))
        if core.kv.can_reload:
            results[name]["offload"] = dataclasses.asdict(core.kv.stats)
        core.close()
        r = results[name]
        print(f"{name:24} span {r['span']:7.2f} s  effective {r['effective_throughput']:7.2f} tok/s  "
              f"P99 TTFT {r['ttft_p99']:6.2f} s  preemptions {r['preemptions']}", flush=True)
    base = results.get("a_recompute")
    if base:
        for name, r in results.items():
            print(f"{name:24} total time x{r['span'] / base['span']:.3f}  effective throughput "
                  f"x{r['effective_throughput'] / base['effective_throughput']:.3f}  P99 TTFT x{r['ttft_p99'] / base['ttft_p99']:.3f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"machine": platform.processor() or platform.machine(), "device": a.device, "model": a.model,
                       "threads": torch.get_num_threads(), "slots": a.slots, "burst": n, "prompt_mean": a.prompt,
                       "output_mean": a.output, "decode_rate_per_request": g, "reading_rates": rates, "seed": a.seed,
                       "results": results}, f, indent=2)



if __name__ == "__main__":
    main()
