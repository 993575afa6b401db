"""CPU decode of the embedded model with overlap scheduling on and off, in one run.

    python bench/cpu_overlap.py [--batches 1,16,32] [--repeats 3] [--out bench/results/cpu_overlap.json]

Decode tokens/s as bench/cpu_decode.py counts them (from the batch's last first token on), int4
weights and the CPU's default dtype (the engine's defaults here). On and off alternate, `--repeats`
times each, and the median of each is reported with their ratio. Off is the serial step (schedule,
compute, update); on, a worker thread computes step N while the engine's thread schedules N+1.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics

import torch

from cpu_decode import decode_rate  # bench/, the script's folder
from tokenflowd.config import EngineConfig
from tokenflowd.engine.model.loader import load_model_source
from tokenflowd.engine.offline import Engine


def rate(loaded, dtype: str, batch: int, prompt_len: int, new: int, overlap: bool) -> float:
    cfg = EngineConfig.resolve(device="cpu", dtype=dtype, enable_prefix_caching=False, quantization="int4",
                               max_num_batched_tokens=max(512, prompt_len), overlap=overlap)
    eng = Engine(cfg, loaded)
    try:
        return decode_rate(eng, batch, prompt_len, new)
    finally:
        eng.core.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,16,32")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out")
    a = ap.parse_args()
    dtype = EngineConfig.resolve(device="cpu").dtype
    loaded = load_model_source("smollm2-135m", getattr(torch, dtype), "cpu", "int4")
    rows = []
    for b in (int(x) for x in a.batches.split(",")):
        runs = {True: [], False: []}
        for _ in range(a.repeats):
            for on in (False, True):
                runs[on].append(rate(loaded, dtype, b, a.prompt_len, a.new_tokens, on))
        off, on = statistics.median(runs[False]), statistics.median(runs[True])
        rows.append({"batch": b, "off": off, "on": on, "on_over_off": on / off, "runs": {"off": runs[False],
                                                                                      "on": runs[True]}})
        print(f"batch {b:>3}: off {off:7.1f} tok/s  on {on:7.1f} tok/s  on/off {on / off:.3f}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"machine": {"cpu": platform.processor() or platform.machine(),
                                   "cpu_threads": torch.get_num_threads(), "torch": torch.__version__},
                       "dtype": dtype, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens, "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
