"""The memory budgets of a GPU node, as the engines would size them: the KV cache on each GPU and
the host KV tier in RAM, for 1, 2 and 8 engines (arithmetic only; no GPU needed).

    python bench/memory_budget.py [--ram 2TB] [--gpu-memory 141GB] [--gpus 8]

Llama 3.1 8B in bf16 (dummy:llama3-8b's shapes; its weight bytes are the h200-llama3-8b cost
model's). One engine per GPU, each seeing one GPU. The weights and attention workspaces stand in
for torch.cuda.memory_allocated() at the moment the engine sizes its KV cache.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from tokenflowd.config import EngineConfig  # noqa: E402
from tokenflowd.config.values import parse_size  # noqa: E402
from tokenflowd.engine.model.dummy import DUMMY_PRESETS  # noqa: E402
from tokenflowd.engine.memory import kv_budget, step_reserve  # noqa: E402
from tokenflowd.offload.build import HOST_RAM_SHARE, host_budget  # noqa: E402
from tokenflowd.sim.cost import PRESETS  # noqa: E402

FLASHINFER_WORKSPACES = (256 + 64) << 20  # engine/attention/flashinfer_backend.py: the step's and the pool's


MODEL, COST_PRESET = "llama3-8b", "h200-llama3-8b"


def table(ram: int, gpu_memory: int, gpus: int, engines_list=(1, 2, 8)) -> list[dict]:
    cfg = DUMMY_PRESETS[MODEL]
    weights = int(PRESETS[COST_PRESET]().weight_bytes)
    rows = []
    for engines in engines_list:
        config = EngineConfig(model=f"dummy:{MODEL}", device="cuda", dtype="bfloat16", attention_backend="flashinfer",
                              cuda_graphs=True, max_num_batched_tokens=8192, engines_on_node=engines)
        own = weights + FLASHINFER_WORKSPACES
        reserved = step_reserve(config, cfg, torch.bfloat16, cfg.max_position_embeddings)
        kv = kv_budget(gpu_memory, config.gpu_memory_utilization, own, sum(reserved.values()))
        host = host_budget(config, kv, ram)
        rows.append({"engines": engines, "gpus": gpus, "kv_per_engine": kv, "host_per_engine": host,
                     "host_node": host * engines, "ram_share": host * engines / ram, "own": own,
                     **{f"reserve_{k}": v for k, v in reserved.items()}})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ram", default="2TB")
    ap.add_argument("--gpu-memory", default="141GB")
    ap.add_argument("--gpus", type=int, default=8)
    a = ap.parse_args()
    ram, gpu = parse_size(a.ram), parse_size(a.gpu_memory)
    print(f"node: {a.gpus} GPUs x {gpu / 1e9:.0f} GB, {ram / 1e12:.1f} TB RAM; {MODEL}, bf16, flashinfer + graphs, "
          f"gpu_memory_utilization 0.9; host tiers within {HOST_RAM_SHARE:.0%} of RAM")
    print(f"{'engines':>7} {'weights+ws GB':>13} {'reserved GB':>11} {'KV/engine GB':>12} {'host/engine GB':>14} "
          f"{'host/node GB':>12} {'of RAM':>6}")
    for r in table(ram, gpu, a.gpus):
        reserved = sum(v for k, v in r.items() if k.startswith("reserve_"))
        print(f"{r['engines']:>7} {r['own'] / 1e9:>13.1f} {reserved / 1e9:>11.2f} {r['kv_per_engine'] / 1e9:>12.1f} "
              f"{r['host_per_engine'] / 1e9:>14.1f} {r['host_node'] / 1e9:>12.1f} {r['ram_share']:>6.1%}")


if __name__ == "__main__":
    main()
