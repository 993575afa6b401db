"""The start-up check's comparison, on the CPU: the torch backend agrees with itself, and a backend
that computes wrong attention (or raises) is caught. tests/gpu runs it on flashinfer and graphs."""
from __future__ import annotations

import shutil

import pytest
import torch

from tokenflowd.engine.attention.torch_backend import TorchAttentionBackend
from tokenflowd.engine.model.loader import load_model_source
from tokenflowd.engine.model.llama import LlamaModel
from tokenflowd.engine.self_check import check_attention, logits_differ, self_check


class Skewed(TorchAttentionBackend):
    """Attention that is slightly wrong: what a broken kernel looks like from outside."""

    def forward(self, layer, q, k, v, kv_cache, meta):
        return super().forward(layer, q, k, v, kv_cache, meta) * 1.5


class Raising(TorchAttentionBackend):
    def forward(self, layer, q, k, v, kv_cache, meta):
        raise RuntimeError("no kernel image is available for execution on the device")


def model_and_backends(hf_dirs):
    loaded = load_model_source(str(hf_dirs["llama"]), torch.float32, "cpu")
    cfg = loaded.config
    model = LlamaModel(cfg, 256, torch.float32, torch.device("cpu"))
    model.load_weights(dict(loaded.weights))
    args = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 16, torch.float32, torch.device("cpu"))
    return model, cfg.vocab_size, args


def test_the_comparison_passes_a_correct_backend_and_catches_wrong_or_failing_ones(hf_dirs):
    model, vocab, args = model_and_backends(hf_dirs)
    reference = TorchAttentionBackend(*args)
    assert check_attention(model, TorchAttentionBackend(*args), reference, vocab) is None
    assert check_attention(model, Skewed(*args), reference, vocab) is not None
    assert "no kernel image" in check_attention(model, Raising(*args), reference, vocab)


def test_logits_differ_on_the_greedy_token_or_beyond_tolerance():
    want = torch.tensor([[0.0, 1.0, 5.0], [2.0, 0.0, 1.0]])
    assert logits_differ(want + 0.01, want) is None
    assert "greedy tokens" in logits_differ(want[:, [2, 1, 0]], want)
    assert "differ by" in logits_differ(want + torch.tensor([[0.0, 0.0, 0.5], [0.0, 0.0, 0.0]]), want)
    assert logits_differ(want * float("nan"), want) == "non-finite logits"


def test_a_cpu_runner_checks_its_paged_decode_kernel_and_drops_a_wrong_one(hf_dirs, monkeypatch):
    from tokenflowd.config import EngineConfig
    from tokenflowd.engine.attention import cpu_kernels
    from tokenflowd.engine.core import EngineCore

    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler to build the kernel")
    config = EngineConfig.resolve(model=str(hf_dirs["llama"]), device="cpu", dtype="float32", num_pages=16)
    core = EngineCore.from_config(config)
    assert core.runner.attn.kernel is not None, "the kernel builds where a compiler is"
    assert self_check(core.runner) is None and core.fallback == ""

    kernel = cpu_kernels.paged_decode()
    monkeypatch.setattr(cpu_kernels, "paged_decode", lambda: lambda *args: kernel(*args) * 1.5)
    core = EngineCore.from_config(config)
    assert core.fallback.startswith("TorchAttentionBackend against the torch backend")
    assert core.runner.attn.kernel is None and not core.runner.config.paged_kernel
