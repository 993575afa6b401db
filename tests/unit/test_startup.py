"""The engine's start-up on the CPU: the check's comparison (the torch backend agrees with itself, a
backend that computes wrong attention or raises is caught), and the sequence that steps down one
fast path at a time, with fakes for flashinfer and CUDA graphs that fail at build, at capture and
at check. tests/gpu runs the real ones."""
from __future__ import annotations

import shutil

import pytest
import torch

from tokenflowd.engine.attention.torch_backend import TorchAttentionBackend
from tokenflowd.engine.model.loader import load_model_source
from tokenflowd.engine.model.llama import LlamaModel
from tokenflowd.engine.errors import FastPathFailed
from tokenflowd.engine.self_check import check_attention, logits_differ, self_check
from tokenflowd.engine import startup
from tokenflowd.engine.startup import ATTENTION, FUSED, GRAPHS, FastPaths, guarded, start, supported


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
    assert self_check(core.runner) == {} and core.fallback == ""
    assert core.runner.paths == FastPaths("torch", False, True)

    kernel = cpu_kernels.paged_decode()
    monkeypatch.setattr(cpu_kernels, "paged_decode", lambda: lambda *args: kernel(*args) * 1.5)
    core = EngineCore.from_config(config)
    assert core.fallback.startswith("torch, paged decode kernel -> torch, pages gathered: attention: torch against")
    assert core.runner.attn.kernel is None and not core.runner.config.paged_kernel
    assert core.runner.paths == FastPaths("torch", False, False)


def test_a_kernel_that_cannot_be_built_is_a_reported_step_down(hf_dirs, monkeypatch):
    from tokenflowd.config import EngineConfig
    from tokenflowd.engine.attention import cpu_kernels
    from tokenflowd.engine.core import EngineCore

    def unavailable():
        raise cpu_kernels.KernelUnavailable("the paged decode kernel cannot be built here: no C++ compiler")

    monkeypatch.setattr(cpu_kernels, "paged_decode", unavailable)
    core = EngineCore.from_config(EngineConfig.resolve(model=str(hf_dirs["llama"]), device="cpu", dtype="float32",
                                                       num_pages=16))
    assert "no C++ compiler" in core.fallback and core.runner.paths == FastPaths("torch", False, False)


# -- the sequence, with fakes for the GPU's fast paths ----------------------------------------------
class FakeRunner:
    def __init__(self, paths: FastPaths) -> None:
        self.paths = paths


def fake_engine(faults: set[str], device: str = "cpu"):
    """build and check for start(): flashinfer fails at "build" or "check", its fused layer ops at
    "ops-build" or "ops-check", graphs at "capture" or "graph-check", each only when that path is
    asked for; records what was built."""
    built: list[FastPaths] = []

    def fail(message):
        def stage():
            raise RuntimeError(message)
        return stage

    def build(paths: FastPaths) -> FakeRunner:
        built.append(paths)
        if paths.attention_backend == "flashinfer" and "build" in faults:
            guarded(ATTENTION, fail("Unsupported head_dim: 16"), device)
        if paths.attention_backend == "flashinfer" and not paths.plain_ops and "ops-build" in faults:
            guarded(FUSED, fail("rope: no kernel for this architecture"), device)
        if paths.cuda_graphs and "capture" in faults:
            guarded(GRAPHS, fail("VariableLengthMergeStates: invalid configuration"), device)
        return FakeRunner(paths)

    def check(runner: FakeRunner) -> dict[str, str]:
        failed = {}
        if runner.paths.attention_backend == "flashinfer" and "check" in faults:
            failed[ATTENTION] = "flashinfer against the torch backend: greedy tokens [3] != [5]"
        elif runner.paths.attention_backend == "flashinfer" and not runner.paths.plain_ops and "ops-check" in faults:
            failed[FUSED] = "flashinfer's fused layer ops against the torch backend: logits differ by 3.1"
        elif runner.paths.cuda_graphs and "graph-check" in faults:
            failed[GRAPHS] = "CUDA graph replay against eager: batch of 256: non-finite logits"
        return failed

    return build, check, built


ASKED = FastPaths("flashinfer", True, False)
FLASHINFER_EAGER = FastPaths("flashinfer", False, False)
TORCH = FastPaths("torch", False, False)
PLAIN_OPS = FastPaths("flashinfer", True, False, plain_ops=True)


@pytest.mark.parametrize("faults, lands_on, reason", [
    (set(), ASKED, None),
    ({"capture"}, FLASHINFER_EAGER, "invalid configuration"),
    ({"graph-check"}, FLASHINFER_EAGER, "batch of 256"),
    ({"build"}, TORCH, "Unsupported head_dim"),
    ({"check"}, TORCH, "greedy tokens"),
    ({"capture", "check"}, TORCH, "greedy tokens"),  # graphs first, then flashinfer itself
    ({"ops-check"}, PLAIN_OPS, "fused layer ops"),  # flashinfer and its graphs stay
    ({"ops-build"}, PLAIN_OPS, "no kernel for this architecture"),
    ({"ops-check", "capture"}, FastPaths("flashinfer", False, False, plain_ops=True), "fused layer ops"),
])
def test_start_up_steps_down_one_path_at_a_time(faults, lands_on, reason):
    build, check, built = fake_engine(faults)
    runner, paths, fallback = start(ASKED, build, check)
    assert paths == lands_on and runner.paths == lands_on and built[-1] == lands_on
    if reason is None:
        assert fallback == "" and built == [ASKED]
    else:
        assert reason in fallback and fallback.count("->") == len(built) - 1
        assert f"-> {lands_on.describe('cuda')}" in fallback.split("; ")[-1]


def test_a_capture_failure_keeps_flashinfer_and_names_both_paths():
    build, check, built = fake_engine({"capture"})
    _, paths, fallback = start(ASKED, build, check, "cpu")
    assert built == [ASKED, FLASHINFER_EAGER]
    assert fallback.startswith("flashinfer, CUDA graphs -> flashinfer, eager: graphs: RuntimeError: "
                               "VariableLengthMergeStates")


def test_a_head_dim_flashinfer_lacks_is_never_built_and_is_reported_when_asked_for():
    assert supported(ASKED, 16) and supported(ASKED, 128) is None and supported(TORCH, 16) is None
    build, check, built = fake_engine(set())
    _, paths, fallback = start(ASKED, build, check, why_not=supported(ASKED, 16))
    assert paths == TORCH and built == [TORCH] and "no kernels for head_dim 16" in fallback


def test_a_lost_device_is_not_stepped_down_from(monkeypatch):
    monkeypatch.setattr(startup, "device_alive", lambda device: False)
    build, check, built = fake_engine({"capture"}, device="cuda")
    with pytest.raises(RuntimeError, match="VariableLengthMergeStates"):
        start(ASKED, build, check, "cuda")
    assert built == [ASKED]


def test_the_plain_path_failing_is_the_engines_failure():
    def build(paths):
        guarded(ATTENTION, lambda: (_ for _ in ()).throw(RuntimeError("out of memory")), "cpu")

    with pytest.raises(RuntimeError, match="plain path failed"):
        start(TORCH, build, lambda runner: {})
    assert FastPaths("torch", False, True).without(ATTENTION) == TORCH and TORCH.without(ATTENTION) is None
    assert isinstance(FastPathFailed("graphs", "x"), RuntimeError)


def test_the_check_tells_failing_fused_layer_ops_from_failing_attention(hf_dirs, monkeypatch):
    """A backend whose fused layer ops are wrong fails "fused ops" alone (the same check with plain
    ops passes), so only they step down; one whose attention is wrong too fails "attention"."""
    from types import SimpleNamespace

    from tokenflowd.engine.model.fused import TorchOps

    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler for the paged decode kernel (the checked fast path here)")
    model, vocab, args = model_and_backends(hf_dirs)

    class WrongOps(TorchOps):
        def silu_and_mul(self, gate_up):
            return super().silu_and_mul(gate_up) * 1.5

    cfg = model.cfg
    wrong = WrongOps(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, model.rope_cos, model.rope_sin)
    monkeypatch.setattr(model, "ops_for", lambda attn: wrong if attn.fused_ops else model.plain_ops)

    def checked(backend):
        backend.fused_ops = True  # (an instance's: the class's stays as it is)
        assert backend.kernel is not None
        return self_check(SimpleNamespace(attn=backend, model=model, model_config=SimpleNamespace(vocab_size=vocab),
                                          graphs=None))

    failed = checked(TorchAttentionBackend(*args, paged_kernel=True))
    assert list(failed) == [FUSED] and "fused layer ops" in failed[FUSED], failed
    failed = checked(Skewed(*args, paged_kernel=True))
    assert list(failed) == [ATTENTION], failed
