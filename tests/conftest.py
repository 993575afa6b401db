"""Shared fixtures: tiny Hugging Face model directories built from random weights, and the
embedded model loaded once per session."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tokenflowd.config import EngineConfig


# The files that take longest, longest first. With `make test`'s workers (pytest-xdist, a file to a
# worker, handed out in collection order) they go first, so that none is left to run alone at the end.
# The random order (pytest-random-order) still shuffles the tests within each file, and the other files.
# (Seconds each took on two workers, 2 cores, AMD EPYC: 526, 252, 172, 143, 133, 129, 124, 113, 110, 106;
# the first since split in two, writing into the homes and the rest, ~320 s each.)
LONGEST_FIRST = ("integration/test_pool_write_home.py", "integration/test_pool_daemon.py", "integration/test_daemon.py",
                 "unit/test_node_sim.py", "integration/test_soak.py", "unit/test_sim_vs_h200.py",
                 "integration/test_federation_cluster.py", "integration/test_front_limits.py", "unit/test_table1_quick.py",
                 "integration/test_federation_pull.py", "integration/test_prfaas_cluster.py")


@pytest.hookimpl(trylast=True)  # after the random order's shuffle
def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    rank = {name: k for k, name in enumerate(LONGEST_FIRST)}
    here = Path(__file__).parent
    # stable: the order within each file, and among the rest, stays
    items.sort(key=lambda item: rank.get(item.path.relative_to(here).as_posix(), len(rank)))


@pytest.fixture
def denormals_on():
    """A CPU ModelRunner flushes denormals to zero process-wide (an engine owns its process); in
    the test process that outlives the engine, and hypothesis refuses to draw floats under it.
    Modules that draw floats use this fixture (pytestmark) to turn them back on first."""
    torch.set_flush_denormal(False)


def make_hf_dir(path: Path, arch: str, seed: int = 0, head_dim: int = 16, num_heads: int = 4, num_kv_heads: int = 2,
                num_layers: int = 3, dtype: torch.dtype = torch.float32) -> Path:
    """Save a small random Llama- or Qwen2-shaped model as a Hugging Face directory, with the
    embedded model's tokenizer (ids line up: the vocab sizes agree). head_dim 16 (the default)
    keeps CPU tests fast; flashinfer has kernels only for 64, 128 and 256 (tests/gpu)."""
    import transformers

    from tokenflowd.text.source import embedded_gguf_path, open_gguf
    from tokenflowd.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(open_gguf(embedded_gguf_path()))
    common = dict(
        vocab_size=tok.vocab_size, hidden_size=head_dim * num_heads, intermediate_size=2 * head_dim * num_heads,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6, eos_token_id=2, bos_token_id=1,
    )
    torch.manual_seed(seed)
    if arch == "llama":
        cfg = transformers.LlamaConfig(
            **common, tie_word_embeddings=False, rope_theta=10000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 128},
        )
        model = transformers.LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1e6)
        model = transformers.Qwen2ForCausalLM(cfg)
        # Qwen2 initialises biases to zero; random ones make the parity check see them.
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    else:
        raise ValueError(arch)
    with torch.no_grad():  # larger weights than the default init, so logits differ visibly
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    path.mkdir(parents=True, exist_ok=True)
    model.to(dtype).save_pretrained(path)
    tok.backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": "<|im_start|>"}))
    return path


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {arch: make_hf_dir(root / arch, arch) for arch in ("llama", "qwen2")}


@pytest.fixture(scope="module")
def tiny(hf_dirs):
    """The tiny random llama of `hf_dirs`, fp32 on the CPU, loaded once per test module."""
    from tokenflowd.engine.model.loader import load_model_source

    return load_model_source(str(hf_dirs["llama"]), torch.float32, "cpu")


_EMBEDDED: dict[str, object] = {}


def embedded_model(dtype: str):
    """The embedded model's LoadedModel in `dtype`, loaded once per test session. Engines copy its
    weight dict and share the tensors."""
    from tokenflowd.engine.model.loader import load_model_source

    if dtype not in _EMBEDDED:
        _EMBEDDED[dtype] = load_model_source("smollm2-135m", getattr(torch, dtype), "cpu")
    return _EMBEDDED[dtype]


@pytest.fixture
def embedded():
    """(dtype, LoadedModel) in the engine's default CPU dtype (bf16 where the CPU has it)."""
    dtype = EngineConfig.resolve(device="cpu").dtype
    return dtype, embedded_model(dtype)


@pytest.fixture
def embedded_fp32():
    """fp32: the dtype in which a GEMM's result for a row does not depend on the rows beside it
    closely enough for greedy decoding to be batch-invariant."""
    return "float32", embedded_model("float32")
