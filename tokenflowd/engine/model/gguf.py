"""GGUF (llama.cpp) files → Hugging Face-named weights, dequantized to the requested dtype, or
with quantization "int4" the Q4_0 / Q4_1 projection weights kept as int4 codes (engine/model/quant.py).

Layout facts this relies on (checked against the embedded SmolLM2 file):
- `tensor.shape` is ggml order ([cols, rows]); `gguf.quants.dequantize` returns numpy [rows, cols],
  already the nn.Linear [out_features, in_features] layout — no transpose.
- llama.cpp's converter permutes the rows of Q and K within each head (interleaved RoPE pairs,
  GPT-J style). HF Llama rotates halves (rotate_half), so the permutation is undone here. Without
  it text still looks plausible but the model cannot do arithmetic. Qwen2 GGUFs are not permuted.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from tokenflowd.engine.model.config import ModelConfig, RopeScaling
from tokenflowd.engine.model.quant import Int4Codes, from_q4_0, from_q4_1
from tokenflowd.engine.model.weights import LoadedModel, ModelLoadError, check_weights
from tokenflowd.text.source import open_gguf
from tokenflowd.text.tokenizer import Tokenizer

_SUPPORTED_ARCHS = ("llama", "qwen2")
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_ROPE_FREQS = "rope_freqs.weight"  # llama3 rope scaling, stored as per-frequency divisors


_INT4_TYPES = {gguf.GGMLQuantizationType.Q4_0: from_q4_0, gguf.GGMLQuantizationType.Q4_1: from_q4_1}


def load_gguf(path: str | Path, dtype: torch.dtype, device: torch.device, quantization: str = "none") -> LoadedModel:
    reader = open_gguf(path)
    try:
        tokenizer = Tokenizer.from_gguf(reader)
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise ModelLoadError(f"cannot build the tokenizer of {path}: {e}") from e
    config = config_from_gguf(reader, path, tokenizer)
    permuted = reader.fields["general.architecture"].contents() == "llama"
    weights: dict[str, torch.Tensor | Int4Codes] = {}
    for t in reader.tensors:
        if t.name == _ROPE_FREQS:
            continue  # folded into config.rope_scaling
        name = hf_name(t.name)
        if name is None:
            raise ModelLoadError(f"unexpected tensor {t.name!r} in {path}: not a llama/qwen2 GGUF")
        if quantization == "int4" and t.tensor_type in _INT4_TYPES and t.name.startswith("blk."):
            codes = _INT4_TYPES[t.tensor_type](t.data, int(t.shape[1]), int(t.shape[0]))
            if permuted and ".self_attn.q_proj." in name:
                codes = _unpermute_codes(codes, config.num_heads)
            elif permuted and ".self_attn.k_proj." in name:
                codes = _unpermute_codes(codes, config.num_kv_heads)
            weights[name] = codes
            continue
        w = gguf.quants.dequantize(t.data, t.tensor_type)  # [rows, cols] float32 numpy
        if permuted and ".self_attn.q_proj." in name:
            w = unpermute_qk(w, config.num_heads)
        elif permuted and ".self_attn.k_proj." in name:
            w = unpermute_qk(w, config.num_kv_heads)
        if not w.flags.writeable or not w.flags.c_contiguous:
            w = np.array(w, copy=True)  # F32/F16 tensors come back as views of the read-only mmap
        weights[name] = torch.from_numpy(w).to(device=device, dtype=dtype)
    check_weights(config, weights, path)
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer)


def _unpermute_codes(c: Int4Codes, num_heads: int) -> Int4Codes:
    """unpermute_qk on the rows of an int4 weight: its codes, scales and zeros alike."""
    def rows(t: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(unpermute_qk(t.numpy(), num_heads)))

    return Int4Codes(rows(c.codes), rows(c.scales), rows(c.zeros))


def hf_name(gguf_name: str) -> str | None:
    """'blk.3.attn_q.weight' → 'model.layers.3.self_attn.q_proj.weight'; None if unknown."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    return None


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave of Q/K (weight [rows, cols] or bias [rows]).

    Within one head llama.cpp stores rows as (pair, half) pairs; HF stores (half, pair):
        gguf rows of head h: x0 y0 x1 y1 … ;  HF rows: x0 x1 … y0 y1 …
    """
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def config_from_gguf(reader: gguf.GGUFReader, path: str | Path, tokenizer: Tokenizer) -> ModelConfig:
    def get(key: str, default: Any = None) -> Any:
        field = reader.fields.get(key)
        return default if field is None else field.contents()

    arch = get("general.architecture")
    if arch not in _SUPPORTED_ARCHS:
        raise ModelLoadError(
            f"unsupported GGUF architecture {arch!r} in {path}; supported: {', '.join(_SUPPORTED_ARCHS)}"
        )
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"GGUF file {path} has no token_embd.weight tensor")
    try:
        hidden = int(get(f"{arch}.embedding_length"))
        num_heads = int(get(f"{arch}.attention.head_count"))
        head_dim = int(get(f"{arch}.attention.key_length", hidden // num_heads))
        rope_dim = int(get(f"{arch}.rope.dimension_count", head_dim))
        if rope_dim != head_dim:
            raise ModelLoadError(
                f"partial rotary embeddings (rope dim {rope_dim} < head dim {head_dim}) are unsupported: {path}"
            )
        theta = _f32(get(f"{arch}.rope.freq_base", 10000.0))
        scaling = None
        if _ROPE_FREQS in tensors:
            factors = gguf.quants.dequantize(tensors[_ROPE_FREQS].data, tensors[_ROPE_FREQS].tensor_type)
            original = int(get(f"{arch}.rope.scaling.original_context_length", 8192))
            scaling = rope_scaling_from_factors(factors, theta, head_dim, original)
        return ModelConfig(
            # The embedding's rows, not the token list: the logits width is what the model has.
            vocab_size=int(tensors["token_embd.weight"].shape[-1]),
            hidden_size=hidden,
            intermediate_size=int(get(f"{arch}.feed_forward_length")),
            num_layers=int(get(f"{arch}.block_count")),
            num_heads=num_heads,
            num_kv_heads=int(get(f"{arch}.attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            max_position_embeddings=int(get(f"{arch}.context_length", 4096)),
            rms_norm_eps=_f32(get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings="output.weight" not in tensors,
            attention_bias="blk.0.attn_q.bias" in tensors,
            eos_token_ids=tokenizer.eos_token_ids,
            bos_token_id=tokenizer.bos_token_id,
            name=str(get("general.name", Path(path).stem)),
            extra={"source": str(path), "gguf_arch": arch},
        )
    except (TypeError, ValueError) as e:  # a missing key shows up as int(None)
        raise ModelLoadError(f"incomplete {arch} metadata in {path}: {e}") from e


def _f32(value: float) -> float:
    """GGUF stores floats as float32: 1e-5 reads back as 9.9999997e-06. Take the shortest decimal
    that is the same float32, so configs compare equal to the Hugging Face ones."""
    return float(str(np.float32(value)))


def rope_scaling_from_factors(factors: np.ndarray, theta: float, head_dim: int, original_ctx: int) -> RopeScaling:
    """Recover llama3 rope-scaling parameters from llama.cpp's `rope_freqs` divisors.

    The converter writes only the divisors; every published Llama 3.x uses low 1 / high 4, so
    fit those with factor = the largest divisor and check the curve matches exactly.
    """
    guess = RopeScaling(float(np.max(factors)), 1.0, 4.0, original_ctx)
    expected = llama3_rope_factors(guess, theta, head_dim)
    if len(expected) != len(factors) or not np.allclose(expected, factors, rtol=1e-4):
        raise ModelLoadError("unsupported rope_freqs tensor: not llama3 scaling with low 1 / high 4")
    return guess


def llama3_rope_factors(s: RopeScaling, theta: float, head_dim: int) -> np.ndarray:
    """Per-frequency divisors as llama.cpp's converter computes them: [head_dim // 2] float32."""
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(s.factor)
        else:
            smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor
            )
            out.append(1 / ((1 - smooth) / s.factor + smooth))
    return np.asarray(out, dtype=np.float32)
