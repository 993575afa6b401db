"""GPU decode throughput and the fraction of the memory roofline reached.

    python bench/gpu_decode.py [--model dummy:llama3-8b] [--batches 1,64,256] [--context 1024]

For each batch size: B requests with `--context`-token prompts decode `--new-tokens` tokens
(ignore_eos); decode tokens/s is measured over the steps after every request has its first token.
Roofline: bytes a decode step must read (all weights once + each request's KV) / step time,
over the device-to-device copy bandwidth measured in the same run (bytes read + written).
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

from tokenflowd.config import EngineConfig
from tokenflowd.engine.core import EngineCore
from tokenflowd.engine.request import Request, SamplingParams


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times)


def run(core: EngineCore, batch: int, context: int, new: int, seed: int) -> dict:
    """Prefill, then time the decode steps with every request running, as the engine runs them: no
    synchronize between steps (with overlap, the next is launched while one runs). step_s is their
    wall time over their count; busy_s the median of each step's compute time (CUDA events with
    overlap; without it the step's own synchronized time)."""
    g = torch.Generator().manual_seed(seed)
    vocab = core.model_config.vocab_size
    for i in range(batch):
        core.add_request(Request(f"b{batch}-{i}", torch.randint(0, vocab, (context,), generator=g).tolist(),
                                 SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)))
    while not (all(r.num_output_tokens > 1 for r in core.scheduler.running) and not core.scheduler.waiting
               and len(core.scheduler.running) == batch):
        core.step()
    busy, ctx, steps = [], [], 0
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while len(core.scheduler.running) == batch and all(r.num_output_tokens < new - 2 for r in core.scheduler.running):
        core.step()
        busy.append(core.stats.last_step_time)
        ctx.append(sum(r.num_tokens for r in core.scheduler.running))
        steps += 1
    torch.cuda.synchronize()
    step = (time.perf_counter() - t0) / max(steps, 1)
    while core.has_unfinished():
        core.step()
    cfg = core.model_config
    el = torch.empty((), dtype=core.runner.dtype).element_size()
    weight_bytes = sum(t.numel() * t.element_size() for t in core.runner.model.state_tensors())
    kv_bytes = statistics.median(ctx) * cfg.kv_elements_per_token * el
    return {"batch": batch, "step_s": step, "busy_s": statistics.median(busy), "overlap": core.overlap,
            "tokens_per_s": batch / step, "bytes_per_step": weight_bytes + kv_bytes,
            "weight_bytes": weight_bytes, "kv_bytes": kv_bytes, "steps_measured": steps}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dummy:llama3-8b")
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--offload", default="",
                    help="host KV tier modes to run, comma-separated: none, write-back, write-through (default: "
                         "the engine's, write-through); its copies run beside the steps timed here")
    ap.add_argument("--overlap", default="on,off", help="overlap scheduling modes to run, comma-separated")
    ap.add_argument("--out", default="bench/results/gpu_decode.json")
    a = ap.parse_args()
    bw = copy_bandwidth()
    batches = [int(b) for b in a.batches.split(",")]
    rows, core = [], None
    modes = [(m, o) for m in (a.offload.split(",") if a.offload else [None]) for o in a.overlap.split(",")]
    for mode, overlap in modes:
        if core is not None:
            core.close()
            del core
            gc.collect()
            torch.cuda.empty_cache()
        extra = {"offload": mode} if mode else {}
        core = EngineCore.from_config(EngineConfig.resolve(model=a.model, device="cuda", max_num_seqs=max(batches),
                                                           cuda_graphs=False if a.no_cuda_graphs else None,
                                                           overlap=overlap == "on", **extra))
        for b in batches:
            r = {"offload": core.config.offload, **run(core, b, a.context, a.new_tokens, seed=b)}
            r["roofline_fraction"] = r["bytes_per_step"] / r["step_s"] / bw
            rows.append(r)
            print(json.dumps(r), flush=True)
    out = {"device": torch.cuda.get_device_name(), "model": a.model, "dtype": core.config.dtype,
           "attention_backend": core.config.attention_backend, "cuda_graphs": core.config.cuda_graphs,
           "attention": core.runner.paths.describe("cuda"), "fallback": core.fallback,
           "copy_bandwidth_bytes_per_s": bw, "context": a.context, "rows": rows}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=2)
    print(f"\n{out['device']}  {a.model}  {core.config.dtype}  backend={core.config.attention_backend} "
          f"graphs={core.config.cuda_graphs}  d2d copy {bw / 1e12:.2f} TB/s")
    print("offload        overlap  batch  step_ms  busy_ms  tokens/s  roofline")
    for r in rows:
        print(f"{r['offload']:<14} {'on' if r['overlap'] else 'off':<7}  {r['batch']:>5}  {r['step_s'] * 1e3:7.2f}  "
              f"{r['busy_s'] * 1e3:7.2f}  {r['tokens_per_s']:8.0f}  {r['roofline_fraction']:7.1%}")


if __name__ == "__main__":
    main()
