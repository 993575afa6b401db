"""What a GPU engine's memory holds besides its weights, and what is left for the KV cache.

    device total × gpu_memory_utilization        the engine's share (the launcher splits it among
                                                 the engines sharing a GPU)
      − this process's allocations so far        weights, attention workspaces
      − activations, CUDA graphs, copy staging   what its steps will hold (step_reserve)
      = the KV cache                             (kv_budget)
"""
from __future__ import annotations

import torch

from tokenflowd.config import EngineConfig
from tokenflowd.engine.cuda_graphs import GRAPH_BATCH_SIZES
from tokenflowd.engine.model.config import ModelConfig


def kv_budget(total: int, utilization: float, own: int, reserved: int) -> int:
    """The KV cache's bytes on a device of `total` bytes: the engine's share (`utilization`) less
    what its process already holds (`own`: weights, workspaces; torch.cuda.memory_allocated) and
    what its steps will hold (`reserved`). Another process on the device does not change it, so
    the engines sharing a GPU get the same budgets in any start order."""
    return int(utilization * total) - own - reserved


def step_reserve(config: EngineConfig, cfg: ModelConfig, dtype: torch.dtype, max_model_len: int) -> dict[str, int]:
    """Bytes a GPU engine holds beyond its weights, workspaces and KV cache, by what holds them:
    a step's activations, the CUDA graphs' pool and page table, the copier's device staging, the
    pool's planned pages wrappers (made as its steps first read each source)."""
    reserve = {"activations": activation_bytes(cfg, config.max_num_batched_tokens, config.max_num_seqs, dtype)}
    if config.pool_mode != "off" and config.attention_backend == "flashinfer":
        from tokenflowd.engine.attention.flashinfer_backend import PAGES_PLANS, PLAN_BYTES

        reserve["pool pages plans"] = PAGES_PLANS * PLAN_BYTES
    if config.cuda_graphs:
        reserve["CUDA graphs"] = graph_bytes(cfg, config.max_num_seqs, max_model_len, config.page_size, dtype)
    if config.offload != "none":
        from tokenflowd.offload.copier import CudaCopier

        reserve["copy staging"] = 2 * CudaCopier.staging_limit  # both lanes
    return reserve


def graph_bytes(cfg: ModelConfig, max_batch: int, max_model_len: int, page_size: int, dtype: torch.dtype) -> int:
    """What the decode graphs hold: the largest batch's activations in their private pool (the
    smaller ones share it) and the page table every size reads (shared too: cuda_graphs.py)."""
    n = max([s for s in GRAPH_BATCH_SIZES if s <= max_batch] or [1])
    return activation_bytes(cfg, n, n, dtype) + 4 * (n * -(-max_model_len // page_size) + 2 * n + 1)


def activation_bytes(cfg: ModelConfig, num_tokens: int, num_seqs: int, dtype: torch.dtype) -> int:
    """A generous bound on one step's transient memory: a layer's activations for the token budget
    (q|k|v, attention out, gate|up, the SwiGLU product, residual stream) twice over, plus fp32
    logits of every sampled row and the sampler's sorted copy."""
    el = torch.empty((), dtype=dtype).element_size()
    per_token = (2 * cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim + 3 * cfg.intermediate_size + 4 * cfg.hidden_size
    return 2 * num_tokens * per_token * el + 3 * num_seqs * cfg.vocab_size * 4
