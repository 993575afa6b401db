"""Chunked prefill on a CPU: the torch backend's attention over a chunk's whole context through
torch's fused SDPA kernel (4-D inputs, as the backend passes them) against the math path that 3-D
inputs take, in one run, each pair alternated over rounds:

    .venv/bin/python bench/cpu_prefill.py [--rounds 2] [--out bench/results/cpu_prefill.json]

One prompt of each length, computed in chunks of the step's token budget (512, the CPU default,
and 256, the pool's daemon tests'), the embedded model in fp32, one new token; seconds from the
request to its token. The 3-D run calls the same SDPA with the batch dimension taken off.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_info  # noqa: E402

import tokenflowd.engine.attention.torch_backend as torch_backend  # noqa: E402
from tokenflowd.config import EngineConfig  # noqa: E402
from tokenflowd.engine.model.loader import load_model_source  # noqa: E402
from tokenflowd.engine.offline import Engine  # noqa: E402
from tokenflowd.engine.request import SamplingParams  # noqa: E402

CASES = [(1024, 512), (4096, 512), (4096, 256)]  # (prompt tokens, step token budget)
SDPA = F.scaled_dot_product_attention


def _three_d(q, k, v, **kw):
    return SDPA(q[0], k[0], v[0], **kw)[None]


def seconds(loaded, prompt_len: int, budget: int, fused: bool) -> float:
    torch_backend.F.scaled_dot_product_attention = SDPA if fused else _three_d
    try:
        config = EngineConfig.resolve(device="cpu", dtype="float32", enable_prefix_caching=False,
                                      max_num_batched_tokens=budget)
        eng = Engine(config, loaded)
        text = " ".join(f"Entry {i}: the archive holds letters, maps and ledgers from the old port." for i in range(600))
        prompt = eng.tokenizer.encode(text)[:prompt_len]
        assert len(prompt) == prompt_len
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        eng.generate({"r": {"prompt": prompt, "sampling_params": params}})
        return time.perf_counter() - start
    finally:
        torch_backend.F.scaled_dot_product_attention = SDPA


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="bench/results/cpu_prefill.json")
    a = ap.parse_args()
    loaded = load_model_source("smollm2-135m", torch.float32, "cpu", "none")
    rows = []
    for prompt_len, budget in CASES:
        runs = {True: [], False: []}
        for r in range(a.rounds):
            for fused in ((False, True) if r % 2 == 0 else (True, False)):
                runs[fused].append(seconds(loaded, prompt_len, budget, fused))
        row = {"prompt": prompt_len, "budget": budget, "fused_s": runs[True], "math_s": runs[False],
               "speedup": sum(runs[False]) / sum(runs[True])}
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(a.out, "w") as f:
        json.dump({"cpu": cpu_info(), "threads": torch.get_num_threads(), "torch": torch.__version__, "rows": rows},
                  f, indent=2)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
