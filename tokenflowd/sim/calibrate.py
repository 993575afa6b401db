"""`tokenflowd calibrate`: time our own engine's steps and fit the cost model's roofline to them.

The run: for each context length c and batch size b, b requests with distinct random prompts of c
tokens and `decode_steps` output tokens go through EngineCore's scheduler and runner; every step's
chunks (computed, n) and wall time are recorded (prefill chunks and decodes alike). The model's
shapes come from the loaded model, so each step's FLOPs and bytes are known (CostModel.work), and
the fit finds the three numbers of the roofline

    t = overhead + max(flops / F, bytes / W) + (1 − overlap) · min(flops / F, bytes / W)

by least squares on the relative error. For a given overlap the max makes it piecewise linear:
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
    seconds: float


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

    def run(tag: str, batch_size: int, context: int, keep: bool) -> None:
        for i in range(batch_size):
            prompt = rng.integers(0, vocab, context).tolist()  # random: no prefix-cache hits
            core.add_request(Request(f"{tag}-{i}", prompt, params))
        while core.has_unfinished():
            batch = sched.schedule()
            chunks = tuple(zip(batch.positions, batch.num_tokens))
            t0 = time.perf_counter()
            sampled = runner.execute(batch)
            seconds = time.perf_counter() - t0
            sched.update(batch, sampled)
            if keep:
                out.append(Observation(chunks, seconds))

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


def fit_cost_model(base: CostModel, obs: list[Observation]) -> CostModel:
    """`base` with the overhead, rates and overlap that predict `obs` best (relative error)."""
    works = [base.work(o.chunks) for o in obs]
    t = np.array([o.seconds for o in obs])
    best, best_err = base, np.inf
    for overlap in OVERLAPS:
        overhead, per_flop, per_byte = fit_roofline(works, list(t), overlap)
        model = base.replace(peak_flops=1.0 / per_flop, mem_bandwidth=1.0 / per_byte,
                             host_link_bandwidth=1.0 / per_byte, step_overhead=overhead, overlap=overlap)
        err = float(np.mean(((np.array([model.time_of(w) for w in works]) - t) / t) ** 2))
        if err < best_err:
            best, best_err = model, err
    return best


def calibrate(config: EngineConfig, plan: CalibrationPlan = CalibrationPlan(), loaded=None,
              name: str = "calibrated") -> tuple[CostModel, dict]:
    """Time `config`'s engine on `plan`; the fitted cost model and a record of the run."""
    from tokenflowd.engine.core import EngineCore

    core = EngineCore.from_config(config, loaded)
    obs = measure(core, plan)
    model = fit_cost_model(engine_cost_model(core, name), obs).replace(
        source=f"tokenflowd calibrate: {config.model} on {config.device} ({config.dtype}), {len(obs)} steps")
    pred = np.array([model.step_time(o.chunks) for o in obs])
    t = np.array([o.seconds for o in obs])
    record = {
        "model": config.model, "device": config.device, "dtype": config.dtype, "num_threads": config.num_threads,
        "plan": {"batch_sizes": list(plan.batch_sizes), "context_lens": list(plan.context_lens),
                 "decode_steps": plan.decode_steps},
        "num_steps": len(obs),
        "mean_relative_error": float(np.mean(np.abs(pred - t) / t)),
        "steps": [{"chunks": [list(c) for c in o.chunks], "seconds": o.seconds, "predicted": float(p)}
                  for o, p in zip(obs, pred)],
    }
    log.info("calibrated %s: overhead %.2f ms, %.3g FLOP/s, %.3g B/s, overlap %.1f, mean relative error %.1f%%",
             config.model, model.step_overhead * 1e3, model.peak_flops, model.mem_bandwidth, model.overlap,
             100 * record["mean_relative_error"])
    return model, record
