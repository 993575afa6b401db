"""GPU paths (skipped without CUDA): flashinfer against the torch backend, CUDA graphs against
eager decoding, and the torch backend against transformers on the device."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from tokenflowd.config import EngineConfig
from tokenflowd.engine.core import EngineCore
from tokenflowd.engine.request import Request, SamplingParams

pytestmark = pytest.mark.gpu
needs_flashinfer = pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="flashinfer not installed")


def run_logits(core: EngineCore, prompts: list[list[int]], new: int = 16) -> dict[str, torch.Tensor]:
    got: dict[str, list[torch.Tensor]] = {}
    inner = core.runner.compute_logits

    def record(batch):
        logits, sampling = inner(batch)
        for row, i in enumerate(sampling):
            got.setdefault(batch.request_ids[i], []).append(logits[row].float().cpu())
        return logits, sampling

    core.runner.compute_logits = record
    for i, p in enumerate(prompts):
        core.add_request(Request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)))
    while core.has_unfinished():
        core.step()
    return {k: torch.stack(v) for k, v in got.items()}


def assert_close_until_divergence(a: torch.Tensor, b: torch.Tensor, rel: float = 0.03) -> None:
    """bf16 logits of two kernels agree; rows are compared up to the first step where greedy picks
    differ (after it the two runs feed different tokens)."""
    same = int((a.argmax(-1) == b.argmax(-1)).int().cumprod(0).sum())
    n = min(same + 1, len(a), len(b))
    assert same >= min(4, len(a)), f"greedy picks diverge at step {same}"
    err = (a[:n] - b[:n]).abs().max() / a[:n].abs().max()
    assert err < rel, f"relative logit error {err:.4f}"


def prompts(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (int(length),), generator=g).tolist() for length in torch.randint(5, 200, (n,), generator=g)]


def make(path, **kw) -> EngineCore:
    kw.setdefault("dtype", "bfloat16")
    return EngineCore.from_config(EngineConfig.resolve(model=str(path), device="cuda", kv_cache_memory="256MiB",
                                           max_num_batched_tokens=128, **kw))


@needs_flashinfer
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_flashinfer_matches_torch_backend(hf_dirs, arch):
    ref = run_logits(make(hf_dirs[arch], attention_backend="torch", cuda_graphs=False), prompts())
    fi = run_logits(make(hf_dirs[arch], attention_backend="flashinfer", cuda_graphs=False), prompts())
    assert ref.keys() == fi.keys()
    for rid in ref:
        assert_close_until_divergence(ref[rid], fi[rid])


@needs_flashinfer
def test_cuda_graphs_match_eager(hf_dirs):
    eager = run_logits(make(hf_dirs["llama"], attention_backend="flashinfer", cuda_graphs=False), prompts(seed=1))
    graph = run_logits(make(hf_dirs["llama"], attention_backend="flashinfer", cuda_graphs=True, max_num_seqs=8), prompts(seed=1))
    assert eager.keys() == graph.keys()
    for rid in eager:
        assert_close_until_divergence(eager[rid], graph[rid], rel=0.01)


def test_torch_backend_on_gpu_matches_transformers(hf_dirs):
    import transformers

    path = hf_dirs["llama"]
    ours = run_logits(make(path, dtype="float32", attention_backend="torch", cuda_graphs=False), prompts(n=3, seed=2), new=8)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).cuda().eval()
    for i, p in enumerate(prompts(n=3, seed=2)):
        got = ours[f"r{i}"]
        seq = p + got.argmax(-1).tolist()[:-1]
        with torch.no_grad():
            ref = hf(torch.tensor([seq], device="cuda")).logits[0, len(p) - 1 :].float().cpu()
        torch.testing.assert_close(got, ref, atol=2e-3, rtol=2e-3)


def test_cuda_copier_round_trip_is_byte_identical():
    """Pages gathered from the flashinfer layout to pinned host memory on the write stream and
    scattered back on the load stream come back bit for bit."""
    from tokenflowd.kv.copier import LOAD, WRITE, CopyJob
    from tokenflowd.offload.copier import CudaCopier

    cache = torch.randn(4, 2, 12, 2, 16, 8, device="cuda").to(torch.bfloat16)  # [layers, 2, pages, heads, page, dim]
    dev = cache.movedim(2, 0)
    host = torch.zeros(dev.shape[0], *dev.shape[1:], dtype=dev.dtype, pin_memory=True)
    copier = CudaCopier(dev, host)
    before = dev.clone()
    copier.submit(CopyJob(WRITE, [7, 2, 5, 6], [3, 4, 0, 1], 0))
    copier.wait()
    assert len(copier.poll()) == 1
    dev[[7, 2, 5, 6]] = 0
    copier.submit(CopyJob(LOAD, [7, 2, 5, 6], [3, 4, 0, 1], 0))
    copier.wait()
    copier.poll()
    torch.cuda.synchronize()
    assert torch.equal(dev.view(torch.int16), before.view(torch.int16))


def test_preempt_and_reload_on_gpu_keep_greedy_tokens(hf_dirs):
    """Write-through on the copy streams, preemption under a small pool, loads back: the same greedy
    tokens as a roomy pool without a host tier (fp32, the torch backend on the GPU)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (30, 22, 41, 17, 35, 26)]

    def run(**kw) -> tuple[EngineCore, dict[str, list[int]]]:
        core = EngineCore.from_config(EngineConfig.resolve(model=str(hf_dirs["llama"]), device="cuda", dtype="float32",
                                               attention_backend="torch", cuda_graphs=False, page_size=4, **kw))
        reqs = [Request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
                for i, p in enumerate(prompts)]
        for r in reqs:
            core.add_request(r)
        while core.has_unfinished():
            core.step()
        core.wait_copies()
        assert core.pool.num_used == 0
        return core, {r.request_id: r.output_token_ids for r in reqs}

    _, expected = run(num_pages=200, offload="none")
    core, got = run(num_pages=30, max_num_batched_tokens=24, enable_prefix_caching=False)
    assert core.scheduler.num_preemptions > 0 and core.kv.stats.pages_loaded > 0
    assert core.kv.host.pages.is_pinned()
    assert got == expected


def test_unseeded_rows_draw_on_the_device():
    from tokenflowd.engine.sampler import Sampler

    sampler = Sampler(seed=0)
    logits = torch.randn(4, 1000, device="cuda")
    reqs = [Request(f"r{i}", [1, 2], SamplingParams(temperature=1.0, max_tokens=4)).sampling_row() for i in range(4)]
    tokens = sampler(logits, reqs)
    assert len(tokens) == 4 and all(0 <= t < 1000 for t in tokens)
    assert sampler.generator.device.type == "cuda"
    generator = sampler.generator
    sampler(torch.randn(4, 1000, device="cuda"), reqs)
    assert sampler.generator is generator  # one stream, not re-seeded each step


def test_dummy_llama3_8b_on_gpu() -> None:
    from tokenflowd.engine.model.loader import load_model_source
    from tokenflowd.engine.model.weights import expected_weight_shapes

    free_before = torch.cuda.mem_get_info()[0]
    loaded = load_model_source("dummy:llama3-8b", dtype=torch.bfloat16, device="cuda")
    w = loaded.weights
    assert {n: tuple(t.shape) for n, t in w.items()} == expected_weight_shapes(loaded.config)
    assert all(t.device.type == "cuda" and t.dtype == torch.bfloat16 for t in w.values())
    assert tuple(w["lm_head.weight"].shape) == (128256, 4096)
    assert w["model.layers.31.mlp.gate_proj.weight"].float().std().item() == pytest.approx(0.02, rel=0.05)
    used = free_before - torch.cuda.mem_get_info()[0]
    assert used >= 2 * 8_030_261_248 * 0.99  # bf16, on the device
    del loaded, w
    torch.cuda.empty_cache()


@needs_flashinfer
def test_the_start_up_check_passes_flashinfer_and_graphs_and_falls_back_on_a_broken_kernel(hf_dirs, monkeypatch):
    from tokenflowd.engine.attention.flashinfer_backend import FlashInferBackend
    from tokenflowd.engine.self_check import self_check

    def build():
        return EngineCore.from_config(EngineConfig.resolve(model=str(hf_dirs["llama"]), device="cuda", dtype="bfloat16",
                                                           kv_cache_memory="64MiB", max_num_seqs=8))

    core = build()
    assert core.config.attention_backend == "flashinfer" and core.runner.graphs is not None
    assert self_check(core.runner) is None and core.fallback == ""
    del core
    forward = FlashInferBackend.forward
    monkeypatch.setattr(FlashInferBackend, "forward", lambda self, *a: forward(self, *a) * 1.5)
    core = build()
    assert "FlashInferBackend against the torch backend" in core.fallback
    assert core.config.attention_backend == "torch" and core.runner.graphs is None


@needs_flashinfer
def test_flashinfer_partial_attention_matches_the_torch_backend():
    """The pool's partial attention on flashinfer (base-2 lse converted, requests with no pages
    here left empty) against the torch backend, over the same pages in each one's layout."""
    from tokenflowd.engine.attention.base import AttentionInputs, PageQuery
    from tokenflowd.engine.attention.flashinfer_backend import FlashInferBackend
    from tokenflowd.engine.attention.torch_backend import TorchAttentionBackend

    dev, heads, kvh, d, ps, num_pages = torch.device("cuda"), 8, 2, 128, 16, 32
    fi = FlashInferBackend(heads, kvh, d, ps, torch.bfloat16, dev)
    ref = TorchAttentionBackend(heads, kvh, d, ps, torch.bfloat16, dev)
    g = torch.Generator(device=dev).manual_seed(0)
    cache_ref = torch.randn(ref.kv_cache_shape(num_pages), generator=g, device=dev).to(torch.bfloat16)
    cache_fi = cache_ref.permute(0, 2, 1, 3, 4).contiguous()  # [2, kvh, P, ps, d] -> HND [2, P, kvh, ps, d]
    q = torch.randn(5, heads, d, generator=g, device=dev).to(torch.bfloat16)
    query = PageQuery([0, 1, 1, 5], [[3, 7, 9], [], [11, 12]])  # a decode, a request with no rows, a chunk
    o_fi, s_fi = fi.attend_pages(q, cache_fi, query)
    o_ref, s_ref = ref.attend_pages(q, cache_ref, query)
    assert (o_fi.float() - o_ref.float()).abs().max() < 2e-2 and (s_fi - s_ref).abs().max() < 2e-2
    query = PageQuery([0, 1, 2], [[], [4]])  # no pages: the empty state
    o, s = fi.attend_pages(q[:2], cache_fi, query)
    assert torch.isneginf(s[0]).all() and not o[0].any() and torch.isfinite(s[1]).all()
    # forward_with_lse: the step's own attention with its lse, against the torch backend's.
    inputs = AttentionInputs([0, 1, 4], [20, 40], [[1, 2], [5, 6, 8]],
                             torch.tensor([2 * ps + 3, 8 * ps + 5, 8 * ps + 6, 8 * ps + 7], device=dev))
    k = torch.randn(4, kvh, d, generator=g, device=dev).to(torch.bfloat16)
    v = torch.randn(4, kvh, d, generator=g, device=dev).to(torch.bfloat16)
    o_fi, s_fi = fi.forward_with_lse(0, q[:4], k, v, cache_fi.clone(), fi.prepare(inputs))
    o_ref, s_ref = ref.forward_with_lse(0, q[:4], k, v, cache_ref.clone(), ref.prepare(inputs))
    assert (o_fi.float() - o_ref.float()).abs().max() < 2e-2 and (s_fi - s_ref).abs().max() < 2e-2
