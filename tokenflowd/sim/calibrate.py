"""`tokenflowd calibrate`: time our own engine's steps and fit the cost model's roofline to them.

The run: for each context length c and batch size b, b requests with distinct random prompts of c
tokens and `decode_steps` output tokens go through EngineCore's scheduler and runner; every step's
chunks (computed, n) and wall time are recorded (prefill chunks and decodes alike). The model's
shapes come from the loaded model, so each step's FLOPs and bytes are known (CostModel.work), and
the fit finds the three numbers of the roofline

    t = overhead + max(flops / F, bytes / W) + (1 − overlap) · min(flops / F, bytes / W)

by least squares on the relative error, over each step's execute time: on a GPU the device's own
time between CUDA events, on a CPU the execute call's wall time. What runs in series with it on
the host (scheduling, batch building, launches and the sampler's sync that the events exclude,
applying the tokens) is measured apart, and its median is added to the fitted overhead: folded
into the fit it read as bandwidth (an H200 fitted 0.00 ms of overhead). The host link is timed
apart too: contiguous copies both ways (pinned memory and CUDA copies on a GPU, memcpy on a CPU),
and the engine's own copier moving pages between its KV cache and its host tier gives the
efficiency against that. For a given overlap the max makes it piecewise linear:
each step is assigned to the roof that bounds it (compute or memory) and the assignment is refitted
until it settles (alternating least squares, a few rounds); a roof no step reached is set just high
enough never to bind at the steps seen. The overlap is the best of a grid from 0 (a CPU: compute
and memory time add up) to 1 (a GPU: the plain roofline). The result is a CostModel with
efficiencies 1 (F and W are the effective rates), the engine's KV pool and limits;
`--preset calibrated:FILE.json` loads it. CPU timings are noisy when other work shares the cores:
run it on an idle machine, with `--threads` set to the cores it may use.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from tokenflowd.config import EngineConfig
from tokenflowd.sim.cost import CostModel, StepWork

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CalibrationPlan:
    batch_sizes: tuple[int, ...] = (1, 4, 8)
    context_lens: tuple[int, ...] = (16, 160)
    decode_steps: int = 5
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError("calibration batch sizes must be >= 1")
        if not self.context_lens or min(self.context_lens) < 1:
            raise ValueError("calibration context lengths must be >= 1")
        if self.decode_steps < 1:
            raise ValueError("calibration needs at least one decode step per request")


@dataclass(frozen=True, slots=True)
class Observation:
    chunks: tuple[tuple[int, int], ...]  # (computed, n) per request of the step
    seconds: float  # the execute's time: the device's (CUDA events) on a GPU, its wall time on a CPU
    host_seconds: float = 0.0  # the rest of the step's wall time, in series with it on the host


@dataclass(frozen=True)
class Link:
    """The host link as measured: contiguous copies each way, and the engine's copier (0: no host tier)."""

    write: float  # bytes/s device -> host
    load: float  # bytes/s host -> device
    copier: float = 0.0  # bytes/s of the copier's page jobs, the slower lane

    @property
    def bandwidth(self) -> float:
        return min(self.write, self.load)

    @property
    def efficiency(self) -> float:
        return min(1.0, self.copier / self.bandwidth) if self.copier else 1.0


def measure_link(device: str, nbytes: int = 256 << 20, repeat: int = 3) -> Link:
    """Bytes/s of `nbytes` contiguous copies each way between the device and host memory, the best
    of `repeat`: pinned memory and CUDA events on a GPU, memcpy on a CPU."""
    import torch

    cuda = device.startswith("cuda")
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)

    def best(dst, src) -> float:
        times = []
        for _ in range(repeat + 1):  # the first is a warm-up
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                dst.copy_(src, non_blocking=True)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                dst.copy_(src)
                times.append(time.perf_counter() - t0)
        return nbytes / min(times[1:])

    return Link(write=best(host, dev), load=best(dev, host))


def measure_copier(core, repeat: int = 3, pages_per_job: int = 64) -> float:
    """Bytes/s the engine's copier moves between free device pages and host pages (both lanes,
    the slower); 0 without a host tier. Run before any request holds a page."""
    from tokenflowd.kv.copier import LOAD, WRITE, CopyJob

    kv = core.kv
    if not kv.can_reload:
        return 0.0
    n = min(kv.host.num_pages, core.pool.num_pages, 4 * pages_per_job)
    pages = list(range(n))
    rates = []
    for lane in (WRITE, LOAD):
        best = 0.0
        for _ in range(repeat + 1):
            t0 = time.perf_counter()
            for i in range(0, n, pages_per_job):
                chunk = pages[i : i + pages_per_job]
                kv.copier.submit(CopyJob(lane, chunk, chunk, len(chunk) * kv.page_bytes))
            kv.copier.wait()
            kv.copier.poll()
            best = max(best, n * kv.page_bytes / (time.perf_counter() - t0))
        rates.append(best)
    return min(rates)


def engine_cost_model(core, name: str = "calibrated") -> CostModel:
    """The roofline's shape terms for the engine's model, pool and limits; rates to be fitted."""
    cfg, config, runner = core.model_config, core.config, core.runner
    tensors = runner.model.state_tensors()
    el = tensors[0].element_size()
    total = sum(t.numel() for t in tensors)
    # The input embedding is a lookup; with tied embeddings the same matrix is the LM head (a matmul).
    lookup = 0 if cfg.tie_word_embeddings else runner.model.embed.numel()
    kv_el = runner.kv_cache.element_size()
    return CostModel(
        name=name, num_params=float(total - lookup), weight_bytes=float(total * el),
        num_layers=cfg.num_layers, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        kv_dtype_bytes=kv_el, peak_flops=1e12, mem_bandwidth=1e11,
        kv_memory=runner.num_pages * config.page_size * cfg.kv_elements_per_token * kv_el,
        host_link_bandwidth=1e11, compute_efficiency=1.0, bandwidth_efficiency=1.0, host_link_efficiency=1.0,
        step_overhead=0.0, page_size=config.page_size, max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
    )


def measure(core, plan: CalibrationPlan) -> list[Observation]:
    """Run the plan through the engine's scheduler and runner, timing each step's execute."""
    from tokenflowd.engine.request import Request, SamplingParams

    rng = np.random.default_rng(plan.seed)
    vocab = core.model_config.vocab_size
    params = SamplingParams(max_tokens=plan.decode_steps, temperature=0.0, ignore_eos=True)
    sched, runner = core.scheduler, core.runner
    out: list[Observation] = []

    cuda = str(runner.device).startswith("cuda")

    def run(tag: str, batch_size: int, context: int, keep: bool) -> None:
        import torch

        for i in range(batch_size):
            prompt = rng.integers(0, vocab, context).tolist()  # random: no prefix-cache hits
            core.add_request(Request(f"{tag}-{i}", prompt, params))
        while core.has_unfinished():
            t0 = time.perf_counter()
            batch = sched.schedule()
            chunks = tuple(zip(batch.positions, batch.num_tokens))
            t1 = time.perf_counter()
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            sampled = runner.execute(batch)  # its sampled tokens reach the host: the device is done
            if cuda:
                end.record()
                end.synchronize()
            t2 = time.perf_counter()
            sched.update(batch, sampled)
            t3 = time.perf_counter()
            device = start.elapsed_time(end) / 1e3 if cuda else t2 - t1
            if keep:
                out.append(Observation(chunks, device, (t3 - t0) - device))

    run("warmup", 2, min(plan.context_lens), keep=False)  # first calls allocate and pick kernels
    for context in plan.context_lens:
        for b in plan.batch_sizes:
            run(f"c{context}-b{b}", b, context, keep=True)
    return out


def _nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0: drop the most negative column until none is."""
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return coef


OVERLAPS = tuple(i / 10 for i in range(11))  # the grid the fit tries for CostModel.overlap


def fit_roofline(works: list[StepWork], seconds: list[float], overlap: float,
                 rounds: int = 20) -> tuple[float, float, float]:
    """(overhead s, 1/F s per FLOP, 1/W s per byte) at a given `overlap`, minimising the squared
    relative error Σ ((t − predicted) / t)²: relative, so that a 50 ms decode step counts as much
    as a 2 s prefill step (the simulator runs far more of the former)."""
    f = np.array([w.flops for w in works])
    b = np.array([w.bytes for w in works])
    t = np.array(seconds)
    w = 1.0 / t
    hidden = 1.0 - overlap  # weight of the shorter term
    # Start from the linear fit t ≈ o + a·f + c·b, whose larger term names each step's roof.
    o, a, c = _nonneg_lstsq(np.column_stack([w, f * w, b * w]), np.ones_like(t))
    compute = a * f >= c * b
    for _ in range(rounds):
        x = np.column_stack([np.ones_like(t), f * np.where(compute, 1.0, hidden), b * np.where(compute, hidden, 1.0)])
        o, a, c = _nonneg_lstsq(x * w[:, None], np.ones_like(t))
        if not compute.any() or a == 0:
            a = float(np.min(c * b / f))  # the compute roof touches, never crosses, the steps seen
        if compute.all() or c == 0:
            c = float(np.min(a * f / b))
        new = a * f >= c * b
        if (new == compute).all():
            break
        compute = new
    # Floors keep both rates finite when the steps cannot tell a roof from nothing.
    return float(o), max(float(a), 1e-30), max(float(c), 1e-30)


def fit_cost_model(base: CostModel, obs: list[Observation], link: Link | None = None) -> CostModel:
    """`base` with the rates and overlap that predict `obs`'s execute times best (relative error),
    an overhead of the fitted one plus the median host time in series with them, and the link
    as measured (`link`; None: the base's)."""
    works = [base.work(o.chunks) for o in obs]
    t = np.array([o.seconds for o in obs])
    best, best_err = base, np.inf
    for overlap in OVERLAPS:
        overhead, per_flop, per_byte = fit_roofline(works, list(t), overlap)
        model = base.replace(peak_flops=1.0 / per_flop, mem_bandwidth=1.0 / per_byte, step_overhead=overhead,
                             overlap=overlap)
        err = float(np.mean(((np.array([model.time_of(w) for w in works]) - t) / t) ** 2))
        if err < best_err:
            best, best_err = model, err
    host = float(np.median([o.host_seconds for o in obs])) if obs else 0.0
    best = best.replace(step_overhead=best.step_overhead + host)
    if link is not None:
        best = best.replace(host_link_bandwidth=link.bandwidth, host_link_efficiency=link.efficiency)
    return best


def calibrate(config: EngineConfig, plan: CalibrationPlan = CalibrationPlan(), loaded=None,
              name: str = "calibrated") -> tuple[CostModel, dict]:
    """Time `config`'s engine on `plan`; the fitted cost model and a record of the run."""
    from tokenflowd.engine.core import EngineCore

    core = EngineCore.from_config(config, loaded)
    raw = measure_link(config.device)
    link = Link(raw.write, raw.load, measure_copier(core))
    obs = measure(core, plan)
    model = fit_cost_model(engine_cost_model(core, name), obs, link).replace(
        source=f"tokenflowd calibrate: {config.model} on {config.device} ({config.dtype}), {len(obs)} steps")
    pred = np.array([model.step_time(o.chunks) for o in obs])
    t = np.array([o.seconds + o.host_seconds for o in obs])  # whole steps: what the simulator's step costs
    record = {
        "model": config.model, "device": config.device, "dtype": config.dtype, "num_threads": config.num_threads,
        "plan": {"batch_sizes": list(plan.batch_sizes), "context_lens": list(plan.context_lens),
                 "decode_steps": plan.decode_steps},
        "num_steps": len(obs),
        "link": {"write": link.write, "load": link.load, "copier": link.copier},
        "host_seconds_median": float(np.median([o.host_seconds for o in obs])),
        "mean_relative_error": float(np.mean(np.abs(pred - t) / t)),
        "steps": [{"chunks": [list(c) for c in o.chunks], "seconds": o.seconds, "host_seconds": o.host_seconds,
                   "predicted": float(p)} for o, p in zip(obs, pred)],
    }
    log.info("calibrated %s: overhead %.2f ms (host %.2f ms), %.3g FLOP/s, %.3g B/s, overlap %.1f, host link "
             "%.3g B/s x %.2f, mean relative error %.1f%%", config.model, model.step_overhead * 1e3,
             record["host_seconds_median"] * 1e3, model.peak_flops, model.mem_bandwidth, model.overlap,
             model.host_link_bandwidth, model.host_link_efficiency, 100 * record["mean_relative_error"])
    return model, record
