"""The engine's CPU fast paths against their twins, in one run, each pair alternated over rounds
(pairs are what count: this box's speed drifts):

    paged       decode attention through the paged C++ kernel vs gathering pages per layer
    packed      dense fp32 projections packed once for oneDNN vs plain F.linear

    .venv/bin/python bench/cpu_fast_paths.py [--rounds 2] [--out bench/results/cpu_fast_paths.json]

Each run is bench/cpu_decode.py's shape: distinct prompts of one length, 48 new tokens, greedy, the
embedded model in fp32 (quantization none: the default), decode tokens/s from the first token of
the last request to the end. The other fast path stays on while one is toggled.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_decode import decode_rate  # noqa: E402
from machine import cpu_info  # noqa: E402

import tokenflowd.engine.model.packed as packed  # noqa: E402
from tokenflowd.config import EngineConfig  # noqa: E402
from tokenflowd.engine.offline import Engine  # noqa: E402
from tokenflowd.engine.model.loader import load_model_source  # noqa: E402

NEW = 48
CASES = {"paged": [(1, 128), (16, 128), (32, 128), (16, 512)], "packed": [(1, 128), (16, 128), (32, 128)]}
PACK = packed.PackedDense.make


def rate(loaded, batch: int, prompt_len: int, paged: bool, pack: bool) -> float:
    packed.PackedDense.make = PACK if pack else classmethod(lambda cls, w: None)
    try:
        config = EngineConfig.resolve(device="cpu", dtype="float32", enable_prefix_caching=False,
                                      max_num_batched_tokens=512)
        eng = Engine(dataclasses.replace(config, paged_kernel=paged), loaded)
    finally:
        packed.PackedDense.make = PACK
    return decode_rate(eng, batch, prompt_len, NEW)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="bench/results/cpu_fast_paths.json")
    a = ap.parse_args()
    loaded = load_model_source("smollm2-135m", torch.float32, "cpu", "none")
    cpu = cpu_info()["cpu"]
    rows = []
    for path, cases in CASES.items():
        for batch, prompt_len in cases:
            runs = {True: [], False: []}
            for r in range(a.rounds):
                for on in ((False, True) if r % 2 == 0 else (True, False)):
                    kw = {"paged": on, "pack": True} if path == "paged" else {"paged": True, "pack": on}
                    runs[on].append(rate(loaded, batch, prompt_len, **kw))
            row = {"path": path, "batch": batch, "prompt": prompt_len, "on_tokens_per_s": runs[True],
                   "off_tokens_per_s": runs[False], "ratio": sum(runs[True]) / sum(runs[False])}
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(a.out, "w") as f:
        json.dump({"cpu": cpu, "threads": torch.get_num_threads(), "torch": torch.__version__, "rows": rows}, f,
                  indent=2)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
