"""What every loader returns, and the check that its weights are exactly the model's."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tokenflowd.engine.model.config import ModelConfig
from tokenflowd.text.source import ModelLoadError
from tokenflowd.text.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # HF Llama names → tensors in the requested dtype/device
    tokenizer: Tokenizer


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight a model of `config` has, by HF name, with its nn.Linear ([out, in]) shape."""
    h, hd, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q_rows, kv_rows = config.num_heads * hd, config.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q_rows, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv_rows, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv_rows, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_rows)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_rows,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_rows,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_rows,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def check_weights(config: ModelConfig, weights: dict[str, torch.Tensor], source: str | Path) -> None:
    """Raise ModelLoadError unless `weights` has exactly the expected names and shapes."""
    expected = expected_weight_shapes(config)
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    wrong = [
        f"{n} {tuple(weights[n].shape)} != {expected[n]}"
        for n in expected
        if n in weights and tuple(weights[n].shape) != expected[n]
    ]
    problems = [
        f"{label}: {', '.join(items[:5])}{' …' if len(items) > 5 else ''}"
        for label, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong))
        if items
    ]
    if problems:
        raise ModelLoadError(f"weights of {source} do not match its config ({'; '.join(problems)})")
