"""`dummy:<preset>`: real model shapes with random weights, for benchmarks without real weights.

Weights are drawn directly on the target device in the target dtype: the 8B preset in fp32 on
the host would need 32 GB and a slow copy, and timings are all these models are for.
"""
from __future__ import annotations

import dataclasses

import torch

from tokenflowd.engine.model.config import ModelConfig, RopeScaling
from tokenflowd.engine.model.weights import LoadedModel, ModelLoadError, expected_weight_shapes
from tokenflowd.text.source import DUMMY_PRESET_NAMES, dummy_tokenizer

DUMMY_PRESETS: dict[str, ModelConfig] = {
    "llama3-8b": ModelConfig(  # Llama 3.1 8B
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192),
        tie_word_embeddings=False,
        name="dummy:llama3-8b",
    ),
    "qwen2.5-32b": ModelConfig(
        vocab_size=152064,
        hidden_size=5120,
        intermediate_size=27648,
        num_layers=64,
        num_heads=40,
        num_kv_heads=8,
        head_dim=128,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        attention_bias=True,
        name="dummy:qwen2.5-32b",
    ),
    "smollm2-135m": ModelConfig(  # the embedded model's shapes
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        name="dummy:smollm2-135m",
    ),
}
assert tuple(DUMMY_PRESETS) == DUMMY_PRESET_NAMES, "the front names the presets it accepts (text/source.py)"


def load_dummy(preset: str, dtype: torch.dtype, device: torch.device, seed: int = 0) -> LoadedModel:
    if preset not in DUMMY_PRESETS:
        raise ModelLoadError(f"unknown dummy preset {preset!r}; presets: {', '.join(DUMMY_PRESETS)}")
    tokenizer = dummy_tokenizer()
    # Stop on the tokenizer's turn end: it is the tokenizer the engine will decode with.
    config = dataclasses.replace(
        DUMMY_PRESETS[preset], eos_token_ids=tokenizer.eos_token_ids, bos_token_id=tokenizer.bos_token_id
    )
    return LoadedModel(config=config, weights=random_weights(config, dtype, device, seed), tokenizer=tokenizer)


def random_weights(
    config: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Normal(0, 0.02) matrices and biases, ones for RMSNorm weights; deterministic per seed and device."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for name, shape in expected_weight_shapes(config).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape, dtype=dtype, device=device)
        else:
            weights[name] = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen)
    return weights
