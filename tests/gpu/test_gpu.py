"""GPU paths (skipped without CUDA), each test asserting the path that ran: flashinfer against the
torch backend and CUDA graphs against eager decoding on models of head_dim 64 and 128 (those
flashinfer has kernels for), preempt-and-reload in flashinfer's layout with graphs on, the
start-up check and its step downs, the KV budget, and the torch backend against transformers."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_hf_dir

from tokenflowd.buffer.fcfs import FCFSPolicy
from tokenflowd.buffer.policy import Plan, SchedulerView, SchedulingPolicy
from tokenflowd.config import EngineConfig
from tokenflowd.daemon.launcher import visible_gpus
from tokenflowd.engine.core import EngineCore
from tokenflowd.engine.request import Request, SamplingParams
from tokenflowd.engine.startup import FastPaths

pytestmark = pytest.mark.gpu
needs_flashinfer = pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="flashinfer not installed")

FLASHINFER_GRAPHS = FastPaths("flashinfer", True, False)
FLASHINFER_EAGER = FastPaths("flashinfer", False, False)
TORCH = FastPaths("torch", False, False)


@pytest.fixture(scope="session")
def gpu_dirs(tmp_path_factory):
    """Models flashinfer can run: head_dim 64 (2 query heads per KV head) and 128 (4 per KV head:
    flashinfer's tensor-core decode); and head_dim 16, which it cannot."""
    root = tmp_path_factory.mktemp("gpu-models")
    return {
        "llama-64": make_hf_dir(root / "llama-64", "llama", head_dim=64, num_heads=4, num_kv_heads=2, num_layers=2,
                                dtype=torch.bfloat16),
        "qwen2-64": make_hf_dir(root / "qwen2-64", "qwen2", head_dim=64, num_heads=4, num_kv_heads=2, num_layers=2,
                                dtype=torch.bfloat16),
        "llama-128": make_hf_dir(root / "llama-128", "llama", head_dim=128, num_heads=4, num_kv_heads=1, num_layers=2,
                                 dtype=torch.bfloat16),
        "llama-16": make_hf_dir(root / "llama-16", "llama"),
    }


def run_logits(core: EngineCore, prompts: list[list[int]], new: int = 16,
               forced: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Each request's logits [new, vocab] at every step it samples. Tokens are greedy, or, with
    `forced` (another run's logits), that run's greedy tokens: both runs then compute the same
    sequences, and their logits compare row for row (a random model's top two logits are often
    closer than bf16 kernels agree, so free-running greedy runs part ways)."""
    got: dict[str, list[torch.Tensor]] = {}
    runner = core.runner

    def execute(batch):
        logits, sampling = runner.compute_logits(batch)
        out: list[int | None] = [None] * len(batch)
        for row, i in enumerate(sampling):
            rid = batch.request_ids[i]
            got.setdefault(rid, []).append(logits[row].float().cpu())
            source = forced[rid][len(got[rid]) - 1] if forced else got[rid][-1]
            out[i] = int(source.argmax())
        return out

    core.overlap = False  # teacher-forced: each step's tokens come from `execute` here
    core.executor.execute = execute
    for i, p in enumerate(prompts):
        core.add_request(Request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)))
    while core.has_unfinished():
        core.step()
    return {k: torch.stack(v) for k, v in got.items()}


def assert_logits_close(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor], rel: float = 0.03,
                        agree: float = 0.9) -> None:
    """Logits of the same sequences by two paths: within `rel` of the logits' range everywhere,
    and the same greedy token in at least `agree` of the rows."""
    assert want.keys() == got.keys()
    a, b = torch.cat(list(want.values())), torch.cat([got[k] for k in want])
    assert a.shape == b.shape
    err = ((a - b).abs().amax(-1) / (a.amax(-1) - a.amin(-1))).max().item()
    assert err < rel, f"relative logit error {err:.4f}"
    same = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    assert same >= agree, f"greedy tokens agree in {same:.0%} of {len(a)} rows"


def prompts(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (int(length),), generator=g).tolist() for length in torch.randint(5, 200, (n,), generator=g)]


def make(path, **kw) -> EngineCore:
    kw.setdefault("dtype", "bfloat16")
    kw.setdefault("kv_cache_memory", "256MiB")
    kw.setdefault("max_num_batched_tokens", 128)
    return EngineCore.from_config(EngineConfig.resolve(model=str(path), device="cuda", **kw))


def assert_paths(core: EngineCore, paths: FastPaths) -> None:
    """The engine runs `paths`, as asked: nothing was stepped down from."""
    from tokenflowd.engine.attention.flashinfer_backend import FlashInferBackend

    assert core.fallback == "", core.fallback
    assert core.runner.paths == paths
    assert isinstance(core.runner.attn, FlashInferBackend) == (paths.attention_backend == "flashinfer")


@needs_flashinfer
@pytest.mark.parametrize("model", ["llama-64", "qwen2-64", "llama-128"])
def test_flashinfer_matches_torch_backend(gpu_dirs, model):
    torch_core = make(gpu_dirs[model], attention_backend="torch", cuda_graphs=False)
    assert_paths(torch_core, TORCH)
    fi_core = make(gpu_dirs[model], attention_backend="flashinfer", cuda_graphs=False)
    assert_paths(fi_core, FLASHINFER_EAGER)
    ref = run_logits(torch_core, prompts())
    assert_logits_close(ref, run_logits(fi_core, prompts(), forced=ref))


@needs_flashinfer
@pytest.mark.parametrize("model", ["llama-64", "llama-128"])
def test_cuda_graphs_match_eager(gpu_dirs, model):
    eager_core = make(gpu_dirs[model], attention_backend="flashinfer", cuda_graphs=False)
    graph_core = make(gpu_dirs[model], attention_backend="flashinfer", cuda_graphs=True, max_num_seqs=8)
    assert_paths(eager_core, FLASHINFER_EAGER)
    assert_paths(graph_core, FLASHINFER_GRAPHS)
    graphs = graph_core.runner.graphs
    assert graphs.sizes == [1, 2, 4, 8]
    assert graphs.num_replays[8] >= 1 and graphs.num_replays[1] >= 1  # the start-up check's: largest and one
    before = sum(graphs.num_replays.values())
    eager = run_logits(eager_core, prompts(seed=1))
    graph = run_logits(graph_core, prompts(seed=1), forced=eager)
    assert sum(graphs.num_replays.values()) - before >= 10, "decode steps replayed their graphs"
    assert_logits_close(eager, graph, rel=0.01, agree=0.97)


@needs_flashinfer
def test_a_head_dim_flashinfer_lacks_steps_down_cleanly_or_is_never_chosen(gpu_dirs):
    asked = make(gpu_dirs["llama-16"], attention_backend="flashinfer")
    assert asked.runner.paths == TORCH and "no kernels for head_dim 16" in asked.fallback
    auto = make(gpu_dirs["llama-16"])  # "auto": flashinfer is installed, but not for this model
    assert auto.config.attention_auto and auto.runner.paths == TORCH
    assert auto.fallback == "" and "head_dim 16" in auto.attention_note
    assert run_logits(asked, prompts(n=2), new=4).keys() == {"r0", "r1"}  # and it serves


@needs_flashinfer
def test_start_up_steps_down_from_failing_graphs_and_from_a_wrong_flashinfer(gpu_dirs, monkeypatch):
    from tokenflowd.engine import cuda_graphs
    from tokenflowd.engine.attention.flashinfer_backend import FlashInferBackend

    def no_capture(self, max_pages):
        raise RuntimeError("capture failed: operation not permitted when stream is capturing")

    with monkeypatch.context() as m:
        m.setattr(cuda_graphs.DecodeGraphs, "_capture", no_capture)
        core = make(gpu_dirs["llama-64"], attention_backend="flashinfer", cuda_graphs=True, max_num_seqs=8)
    assert core.runner.paths == FLASHINFER_EAGER and "graphs: RuntimeError: capture failed" in core.fallback

    forward = FlashInferBackend.forward
    with monkeypatch.context() as m:
        m.setattr(FlashInferBackend, "forward", lambda self, *a: forward(self, *a) * 1.5)
        core = make(gpu_dirs["llama-64"], attention_backend="flashinfer", cuda_graphs=True, max_num_seqs=8)
    assert core.runner.paths == TORCH
    assert core.fallback.startswith("flashinfer, CUDA graphs -> torch, pages gathered: attention: flashinfer against")
    assert run_logits(core, prompts(n=2), new=4).keys() == {"r0", "r1"}


def greedy_outputs(core: EngineCore, texts: list[list[int]], max_tokens: int) -> dict[str, list[int]]:
    """Each prompt's greedy tokens, run to the end; then no page is held in any tier."""
    reqs = [Request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
            for i, p in enumerate(texts)]
    for r in reqs:
        core.add_request(r)
    while core.has_unfinished():
        core.step()
    core.wait_copies()
    assert core.pool.num_used == 0 and core.kv.host.pool.num_used == 0
    return {r.request_id: r.output_token_ids for r in reqs}


class EveryFewSteps(SchedulingPolicy):
    """FCFS, one request at a time, preempting the running one every `every` plans and reloading
    whatever the host holds: every decode is a batch of one, so greedy tokens cannot depend on
    what else ran."""

    name = "every-few-steps"

    def __init__(self, every: int) -> None:
        self.fcfs = FCFSPolicy()
        self.every = every
        self.num_plans = 0

    def plan(self, view: SchedulerView) -> Plan:
        plan = self.fcfs.plan(view)
        self.num_plans += 1
        victims = tuple(r.request_id for r in view.running) if self.num_plans % self.every == 0 else ()
        scheduled = tuple((rid, n) for rid, n in plan.scheduled if rid not in victims)
        return Plan(scheduled, tuple(dict.fromkeys(plan.preempted + victims)),
                    tuple(r.request_id for r in view.waiting if r.host_tokens))


@needs_flashinfer
def test_preempt_and_reload_in_flashinfers_layout_with_graphs_keep_greedy_tokens(gpu_dirs):
    """Write-through on the copy streams from flashinfer's HND pages, preemptions, loads back, with
    decodes replayed from graphs: the same greedy tokens as the run that was never preempted."""
    from tokenflowd.engine.attention.flashinfer_backend import FlashInferBackend

    g = torch.Generator().manual_seed(0)
    texts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (30, 22, 41, 17)]

    def run(preempt_every: int | None) -> tuple[EngineCore, dict[str, list[int]]]:
        core = make(gpu_dirs["llama-64"], attention_backend="flashinfer", cuda_graphs=True, page_size=4,
                    num_pages=64, max_num_seqs=1, enable_prefix_caching=False, kv_cache_memory=None)
        assert_paths(core, FLASHINFER_GRAPHS)
        if preempt_every:
            core.scheduler.policy = EveryFewSteps(preempt_every)
        return core, greedy_outputs(core, texts, 24)

    _, expected = run(None)
    core, got = run(5)
    assert isinstance(core.runner.attn, FlashInferBackend) and core.runner.attn.kv_cache_shape(1)[1] == 1  # HND
    assert core.scheduler.num_preemptions >= 8 and core.kv.stats.pages_loaded > 0
    assert core.kv.host.pages.is_pinned() and core.runner.graphs.num_replays
    assert got == expected


def test_the_kv_budget_is_a_share_of_the_device_less_this_process_own_use(gpu_dirs):
    """--gpu-memory-utilization 0.05 of the device, less what this process holds besides the KV
    cache (weights, workspaces, graph buffers, activations): measured with its own allocations,
    so another process on the GPU does not change it."""
    import gc

    gc.collect()  # the engines of earlier tests, still held by this process, count as its own
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    before = torch.cuda.memory_allocated()
    core = make(gpu_dirs["llama-64"], attention_backend="torch", cuda_graphs=False, kv_cache_memory=None,
                gpu_memory_utilization=before / total + 0.05)  # 5% of the device beyond what is held already
    kv_bytes = core.runner.kv_cache.numel() * core.runner.kv_cache.element_size()
    assert 0 < kv_bytes <= 0.05 * total
    assert torch.cuda.memory_allocated() - before <= 0.05 * total  # what the engine holds fits its share
    num_pages = core.runner.num_pages
    del core
    gc.collect()
    torch.cuda.empty_cache()
    import subprocess
    import sys

    hog = subprocess.Popen([sys.executable, "-c", "import sys, torch; x = torch.empty(int(sys.argv[1]), "
                            "dtype=torch.uint8, device='cuda'); print('held', flush=True); sys.stdin.read()",
                            str(int(0.1 * total))], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert hog.stdout.readline().strip() == "held"  # another process holds 10% of the device
        again = make(gpu_dirs["llama-64"], attention_backend="torch", cuda_graphs=False, kv_cache_memory=None,
                     gpu_memory_utilization=before / total + 0.05)
    finally:
        hog.kill()
        hog.wait()
    assert again.runner.num_pages == num_pages  # the same budget, whoever started first


def test_torch_backend_on_gpu_matches_transformers(gpu_dirs):
    import transformers

    path = gpu_dirs["llama-64"]
    core = make(path, dtype="float32", attention_backend="torch", cuda_graphs=False)
    assert_paths(core, TORCH)
    ours = run_logits(core, prompts(n=3, seed=2), new=8)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).cuda().eval()
    for i, p in enumerate(prompts(n=3, seed=2)):
        got = ours[f"r{i}"]
        seq = p + got.argmax(-1).tolist()[:-1]
        with torch.no_grad():
            ref = hf(torch.tensor([seq], device="cuda")).logits[0, len(p) - 1 :].float().cpu()
        torch.testing.assert_close(got, ref, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("max_run_copies", [8, 0])  # page runs copied as they are; and gathered by index
def test_cuda_copier_round_trip_is_byte_identical(max_run_copies):
    """Pages gathered from the flashinfer layout to pinned host memory on the write stream and
    scattered back on the load stream come back bit for bit; the jobs a step submits start in one
    launch per lane."""
    from tokenflowd.kv.copier import LOAD, WRITE, CopyJob
    from tokenflowd.offload.copier import CudaCopier

    cache = torch.randn(4, 2, 12, 2, 16, 8, device="cuda").to(torch.bfloat16)  # [layers, 2, pages, heads, page, dim]
    dev = cache.movedim(2, 0)
    host = torch.zeros(dev.shape[0], *dev.shape[1:], dtype=dev.dtype, pin_memory=True)
    copier = CudaCopier(dev, host)
    copier.max_run_copies = max_run_copies
    before = dev.clone()
    jobs = [([7, 2, 5, 6], [3, 4, 0, 1]), ([9, 10, 11], [6, 7, 8]), ([0], [11])]
    for d, h in jobs:
        copier.submit(CopyJob(WRITE, d, h, 0))
    copier.flush()
    copier.wait()
    assert len(copier.poll()) == 3 and copier.num_launches == 1
    pages = [p for d, _ in jobs for p in d]
    dev[pages] = 0
    for d, h in jobs:
        copier.submit(CopyJob(LOAD, d, h, 0))
    copier.wait()  # a wait starts what is held
    assert len(copier.poll()) == 3 and copier.num_launches == 2
    torch.cuda.synchronize()
    assert torch.equal(dev.view(torch.int16), before.view(torch.int16))


def test_preempt_and_reload_with_the_torch_backend_keep_greedy_tokens(gpu_dirs):
    """Write-through on the copy streams, preemption under a small pool, loads back: the same greedy
    tokens as a roomy pool without a host tier (fp32, the torch backend on the GPU)."""
    g = torch.Generator().manual_seed(0)
    texts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (30, 22, 41, 17, 35, 26)]

    def run(**kw) -> tuple[EngineCore, dict[str, list[int]]]:
        core = make(gpu_dirs["llama-64"], dtype="float32", attention_backend="torch", cuda_graphs=False, page_size=4,
                    kv_cache_memory=None, **kw)
        assert_paths(core, TORCH)
        return core, greedy_outputs(core, texts, 20)

    _, expected = run(num_pages=200, offload="none")
    core, got = run(num_pages=30, max_num_batched_tokens=24, enable_prefix_caching=False)
    assert core.scheduler.num_preemptions > 0 and core.kv.stats.pages_loaded > 0
    assert core.kv.host.pages.is_pinned()
    assert got == expected


def test_overlap_on_and_off_give_every_client_the_same_stream_on_the_gpu(gpu_dirs):
    """tests/unit/test_overlap.py's check on CUDA: steps queued on the compute stream, tokens read
    through a pinned copy and an event, the next step's rows reading them on the device; with
    preemptions and loads on the copy streams (fp32, the torch backend: greedy tokens are
    batch-invariant there)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "unit"))
    from test_overlap import check

    from tokenflowd.engine.model.loader import load_model_source

    loaded = load_model_source(str(gpu_dirs["llama-64"]), torch.float32, "cuda")
    ran = []
    check(loaded, [list(range(5 + k, 5 + k + n)) for k, n in enumerate((9, 14, 22, 6, 17))], device="cuda",
          dtype="float32", attention_backend="torch", cuda_graphs=False, kv_cache_memory=None, on_core=ran.append)
    assert ran and all(core.runner.device.type == "cuda" and core.overlap for core in ran)
    assert all(core.runner.paths == TORCH for core in ran)
    assert all(core.runner._last_end is not None for core in ran)  # steps went through the CUDA launch path


@needs_flashinfer
def test_overlapped_graph_replays_give_the_stream_of_serial_steps(gpu_dirs):
    """flashinfer with CUDA graphs, overlap on and off: one request, so that both compute the same
    batches, gives the same greedy stream; the overlapped run replayed graphs."""
    def stream(overlap: bool) -> tuple[EngineCore, list[int]]:
        core = make(gpu_dirs["llama-64"], overlap=overlap)
        assert core.overlap is overlap
        assert_paths(core, FLASHINFER_GRAPHS)
        core.add_request(Request("a", list(range(5, 40)), SamplingParams(temperature=0, max_tokens=48,
                                                                         ignore_eos=True)))
        tokens = []
        while core.has_unfinished():
            tokens += [t for out in core.step() for t in out.new_token_ids]
        return core, tokens

    _, off = stream(False)
    core, on = stream(True)
    assert on == off and len(on) == 48
    assert sum(core.runner.graphs.num_replays.values()) >= 40
    assert core.runner._last_end is not None  # launched on the compute stream, collected by its event


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


def pageable_copies(run) -> list[str]:
    """The host-to-device copies from pageable memory while `run()` runs (torch's profiler names
    each memcpy by its source kind)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if "Memcpy" in e.name]
    assert any("Pinned" in n for n in names), names  # the profiler saw the step's copies at all
    return [n for n in names if "HtoD" in n and "Pageable" in n]


@needs_flashinfer
def test_a_decode_step_copies_nothing_from_pageable_memory(gpu_dirs):
    """Overlapped decode steps with graphs, with rows that sample (temperature, top-k, top-p, a
    seed), take penalties, min_tokens and logprobs: every host-to-device copy of a step is from
    page-locked memory (engine/staging.py), so none makes the host wait for the step in flight."""
    core = make(gpu_dirs["llama-64"], overlap=True)
    assert_paths(core, FLASHINFER_GRAPHS)
    kinds = [dict(temperature=0), dict(temperature=0.8, top_k=20, top_p=0.9), dict(temperature=1.0, seed=7),
             dict(temperature=0, frequency_penalty=0.5, repetition_penalty=1.2), dict(temperature=0, min_tokens=8),
             dict(temperature=0, logprobs=3)]
    for i, kw in enumerate(kinds):
        core.add_request(Request(f"r{i}", list(range(5 + i, 40 + i)), SamplingParams(max_tokens=64, ignore_eos=True, **kw)))
    for _ in range(8):  # the prompts, and the first decodes (lazy allocations, first plans)
        core.step()
    replays = sum(core.runner.graphs.num_replays.values())

    def decode():
        for _ in range(16):
            core.step()

    assert pageable_copies(decode) == []
    assert sum(core.runner.graphs.num_replays.values()) >= replays + 12  # the steps were graph replays


@needs_flashinfer
def test_fused_layer_ops_match_the_plain_ones_and_the_flashinfer_engine_runs_them(gpu_dirs):
    """flashinfer's add+RMSNorm, RMSNorm, RoPE (in place, on the strided q and k of a q|k|v
    projection) and SiLU-and-mul against the plain ops, in bf16; and an engine on flashinfer built
    its model's fused ops while the torch backend's did not."""
    from tokenflowd.engine.model.fused import FlashInferOps, TorchOps
    from tokenflowd.engine.model.config import ModelConfig

    core = make(gpu_dirs["llama-128"])
    assert_paths(core, FLASHINFER_GRAPHS)
    fused = core.runner.model._fused_ops
    assert isinstance(fused, FlashInferOps)
    cfg: ModelConfig = core.runner.model_config
    plain = core.runner.model.plain_ops
    assert isinstance(plain, TorchOps) and not isinstance(plain, FlashInferOps)
    g = torch.Generator(device="cuda").manual_seed(0)
    T, hidden = 37, cfg.hidden_size
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x, res, w = (torch.randn(T, hidden, generator=g, **bf) for _ in range(3))

    def close(a, b, what):
        err = (a.float() - b.float()).abs().max().item()
        assert err <= 0.02 * b.float().abs().max().item() + 1e-2, f"{what}: {err}"

    close(fused.rms_norm(x.clone(), w), plain.rms_norm(x, w), "rms_norm")
    want_x, want_res = plain.add_rms_norm(x, res, w)
    got_x, got_res = fused.add_rms_norm(x.clone(), res.clone(), w)
    close(got_res, want_res, "add: residual")
    close(got_x, want_x, "add: norm")
    width = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    qkv = torch.randn(T, width, generator=g, **bf)
    positions = torch.randint(0, 500, (T,), device="cuda", generator=g)
    want_q, want_k = plain.rope(qkv, plain.rope_of(positions))
    got_q, got_k = fused.rope(qkv.clone(), fused.rope_of(positions))
    close(got_q, want_q, "rope q")
    close(got_k, want_k, "rope k")
    gate_up = torch.randn(T, 2 * cfg.intermediate_size, generator=g, **bf)
    close(fused.silu_and_mul(gate_up), plain.silu_and_mul(gate_up), "silu_and_mul")
    from tokenflowd.engine.attention.base import AttentionInputs
    from tokenflowd.engine.attention.flashinfer_backend import Append

    meta = core.runner.attn.prepare(AttentionInputs([0, 3], [3], [[0]], torch.tensor([0, 1, 2], device="cuda")))
    assert isinstance(meta.append, Append)  # the step's K/V go in through flashinfer's append
    torch_core = make(gpu_dirs["llama-128"], attention_backend="torch", cuda_graphs=False)
    assert torch_core.runner.model._fused_ops is None


def test_unseeded_rows_with_top_k_and_top_p_draw_in_flashinfers_kernel_and_seeded_rows_repeat():
    """Unseeded sampled rows go through flashinfer's top-k/top-p kernel (counted), each draw within
    its row's top k; a seeded row draws the same tokens whatever shares its batch."""
    if importlib.util.find_spec("flashinfer") is None:
        pytest.skip("flashinfer not installed")
    from tokenflowd.engine.sampler import Sampler

    logits = torch.randn(3, 5000, device="cuda")
    free = [Request(f"f{i}", [1, 2], SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_tokens=4)).sampling_row()
            for i in range(2)]
    sampler = Sampler(seed=0)
    for _ in range(20):
        tokens = sampler.sample(logits[:2].clone(), free).tolist()
        for row, t in enumerate(tokens):
            assert t in logits[row].topk(5).indices.tolist()
    assert sampler.fused is True and sampler.num_fused_draws == 40

    def seeded_run(with_others: bool) -> list[int]:
        s = Sampler(seed=1)
        row = Request("s", [1, 2], SamplingParams(temperature=1.0, seed=11, max_tokens=4)).sampling_row()
        rows = [row, *free] if with_others else [row]
        return [s.sample(logits[: len(rows)].clone(), rows).tolist()[0] for _ in range(8)]

    assert seeded_run(False) == seeded_run(True)


def _pooled_pair(model: str, mode: str, ipc: bool, gpus: list[str]) -> tuple[list[str], list[str], float, list[dict]]:
    """Two engines of one daemon on `gpus` (one GPU: both on it; two: one each), a 512-token prefix
    computed into its segments' homes on both, then 8 prompts reading it. -> (one engine's greedy
    texts, the pair's, the prompt tokens read from the other engine, /health's engines). In float32,
    for greedy tokens equal to one engine's: the torch backend attends to the peers' pages (asserted;
    flashinfer's attend_pages over other caches' pages: the two-source test below)."""
    import asyncio

    import httpx
    from daemon import Daemon

    from tokenflowd.engine.offline import Engine

    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(10, 1000, (512,), generator=gen).tolist()  # 8 segments, homed on both engines
    prompts = [prefix + torch.randint(10, 1000, (9,), generator=gen).tolist() for _ in range(8)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    reference = Engine(EngineConfig.resolve(model=model, device="cuda", dtype="float32", kv_cache_memory="256MiB"))
    out = reference.generate({f"r{i}": {"prompt": q, "sampling_params": params} for i, q in enumerate(prompts)})
    want = [out[f"r{i}"].text for i in range(len(prompts))]
    del reference
    torch.cuda.empty_cache()

    async def complete(base_url: str, prompt: list[int]) -> str:
        async with httpx.AsyncClient(base_url=base_url, timeout=300) as http:
            r = await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                         "ignore_eos": True})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

    async def run(base_url: str) -> list[str]:
        first = await complete(base_url, prompts[0])  # computes the prefix into its segments' homes
        return [first, *await asyncio.gather(*[complete(base_url, q) for q in prompts[1:]])]

    d = Daemon("--model", model, "--device", "cuda", "--engines", "2", "--dtype", "float32", "--kv-cache-memory",
               "256MiB", "--pool-mode", mode, "--pool-segment-tokens", "64", "--pool-placement", "home",
               *(() if ipc else ("--no-pool-ipc",)),
               start_timeout=600, env={"CUDA_VISIBLE_DEVICES": ",".join(gpus)})
    try:
        d.wait_all_engines(600)
        got = asyncio.run(run(d.base_url))
        peer = sum(d.metric("tokenflowd_prompt_token_sources_total", engine=str(e), source="peer") for e in (0, 1))
        engines = d.health()["engines"]
        for e in engines:  # layers read in place, and layers' rows sent to the peer
            e["pool"]["calls"] = tuple(d.metric(f"tokenflowd_pool_{what}_total", engine=str(e["engine"]))
                                       for what in ("reads", "queries"))
    finally:
        assert d.stop() == 0
    assert [e["attention"] for e in engines] == ["torch, pages gathered"] * 2, engines
    return want, got, peer, engines


@pytest.mark.parametrize("mode,ipc", [("read", True), ("read", False), ("query", True)],
                         ids=["cuda-ipc", "ipc-off", "query-cuda-ipc"])
def test_two_engines_on_one_gpu_read_each_others_pages_with_one_engines_greedy_tokens(gpu_dirs, mode, ipc):
    """Read mode, two engines on one GPU: each opens the other's KV cache over CUDA IPC and attends
    to its pages in place (/health: path "cuda ipc", no peer staged), and every stream's greedy
    tokens equal one engine's. With --no-pool-ipc each queries the other through the host instead,
    and /health names the peer it stages, with why; the tokens are the same. Query mode: each
    ships its rows to the other in a device block the other opened over CUDA IPC (path "cuda ipc
    (query mode)"; a holder that could not open it would be named as staged), the same tokens."""
    want, got, peer, engines = _pooled_pair(str(gpu_dirs["llama-64"]), mode, ipc, visible_gpus()[:1])
    assert peer >= 64, "requests read segments the other engine holds"
    pools = [e["pool"] for e in engines]
    assert all(pool["peer_access"] == {} for pool in pools), "one GPU: no other GPU seen"
    reads, queries = (sum(pool["calls"][i] for pool in pools) for i in (0, 1))
    if mode == "query":
        assert all((pool["path"], pool["staged"]) == ("cuda ipc (query mode)", {}) for pool in pools), pools
        assert reads == 0 and queries > 0, pools
    elif ipc:
        assert all((pool["path"], pool["staged"]) == ("cuda ipc", {}) for pool in pools), pools
        # a peer on this GPU is read in place whatever a step's rows (--pool-read-rows is for other GPUs')
        assert reads > 0 and queries == 0, pools
    else:
        assert all(pool["path"] == "host staging (--no-pool-ipc)" for pool in pools), pools
        assert any(pool["staged"] for pool in pools), "a reader names the peer it queries instead"
    assert got == want


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("mode", ["read", "query"])
def test_two_engines_on_two_gpus_map_each_others_pages_where_peer_access_is_on(gpu_dirs, mode):
    """One engine on each of two GPUs: each sees the other GPU (after its own), checks peer access at
    start (/health `peer_access`), and where it is on maps the other's cache (read) or query
    buffers (query) over CUDA IPC, staging nothing; where it is off, /health names the peer staged
    through the host, with why. Either way the greedy tokens equal one engine's."""
    gpus = visible_gpus()[:2]
    on = [torch.cuda.can_device_access_peer(0, 1), torch.cuda.can_device_access_peer(1, 0)]  # engine i on gpus[i]
    want, got, peer, engines = _pooled_pair(str(gpu_dirs["llama-64"]), mode, True, gpus)
    assert peer >= 64, "requests read segments the other engine holds"
    pools = [e["pool"] for e in sorted(engines, key=lambda e: e["engine"])]
    assert [list(pool["peer_access"].values()) for pool in pools] == [[on[0]], [on[1]]], pools
    for i, pool in enumerate(pools):
        # read: engine i maps the other's cache; query: the other, holding, opens engine i's block
        reach = on[i] if mode == "read" else on[1 - i]
        if reach:
            assert pool["staged"] == {}, pools
        else:
            assert pool["staged"] and all("no peer access" in why for why in pool["staged"].values()), pools
    if mode == "read" and all(on):  # a request's few rows (9 of its own, then one a step) go to the other GPU
        assert sum(pool["calls"][1] for pool in pools) > 0, pools
    assert got == want


def test_a_step_that_samples_nothing_has_finished_on_the_gpu_when_it_returns(gpu_dirs):
    """Serial steps (overlap is off under the pool): the scheduler publishes a step's pages as the
    step returns, and a pool peer reads them from its own process, so a mid-prompt chunk, which has
    no token to read back, must have run to its end by then, even with the GPU far behind the host."""
    core = make(gpu_dirs["llama-64"], max_num_batched_tokens=64)
    core.overlap = False
    runner, execute = core.runner, core.executor.execute
    seen: list[tuple[bool, bool]] = []  # per step: (it sampled nothing, the GPU had finished it)

    def lagging(batch):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued ahead of the step
        out = execute(batch)
        seen.append((all(t is None for t in out), torch.cuda.current_stream(runner.device).query()))
        return out

    core.executor.execute = lagging
    core.add_request(Request("r", list(range(10, 210)), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)))
    while core.has_unfinished():
        core.step()
    assert any(nothing for nothing, _ in seen), "the 200-token prompt ran in chunks of 64 that sample nothing"
    assert all(done for _, done in seen), seen


@needs_flashinfer
@pytest.mark.parametrize("plans", [None, 1], ids=["a-plan-a-source", "one-plan-kept"])
def test_attention_to_two_sources_of_pages_in_turn_runs_each_on_its_own_plan_while_the_gpu_lags(plans, monkeypatch):
    """A step whose requests read pages in two places (their own engine's and a peer's: the pool's
    read mode) attends to each in turn every layer. flashinfer's pages wrappers keep a plan per
    source (PAGES_PLANS): planned once each, the layers then run without a plan or a wait. With one
    plan kept, each call plans again and must first wait for the last plan's copy out of the
    wrapper's page-locked buffer. Queued behind 0.1 s of GPU time, four layers of both sources
    equal the torch backend's either way. (Its CPU twin, with a stand-in flashinfer:
    tests/unit/test_flashinfer_pages_plans.py.)"""
    from tokenflowd.engine.attention import flashinfer_backend
    from tokenflowd.engine.attention.base import PageQuery
    from tokenflowd.engine.attention.flashinfer_backend import FlashInferBackend
    from tokenflowd.engine.attention.torch_backend import TorchAttentionBackend

    if plans is not None:
        monkeypatch.setattr(flashinfer_backend, "PAGES_PLANS", plans)

    args = (8, 2, 64, 16, torch.bfloat16, torch.device("cuda"))
    fi, ref = FlashInferBackend(*args), TorchAttentionBackend(*args)
    g = torch.Generator().manual_seed(0)
    caches = [torch.randn(fi.kv_cache_shape(64), generator=g).to(torch.bfloat16).cuda() for _ in range(2)]  # HND
    queries = [PageQuery([0, 3, 4], [[1, 2, 3], [7]]), PageQuery([0, 1, 4], [list(range(10, 40)), [5, 6]])]
    q = torch.randn(4, 8, 64, generator=g).to(torch.bfloat16).cuda()
    want = [ref.attend_pages(q, kv.transpose(1, 2).contiguous(), query) for kv, query in zip(caches, queries)]
    fi.attend_pages(q, caches[0], queries[0])  # built (a first call may JIT-build for longer than the lag)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    got = [fi.attend_pages(q, kv, query) for _ in range(4) for kv, query in zip(caches, queries)]
    torch.cuda.synchronize()
    for i, (o, lse) in enumerate(got):
        torch.testing.assert_close(o, want[i % 2][0], atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(lse, want[i % 2][1], atol=3e-2, rtol=3e-2)
    assert fi.pages_plans == (2 if plans is None else 8), fi.pages_plans
