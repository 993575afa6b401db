"""The load generator's workload: who arrives when, with what prompt, reading how fast, as HTTP bodies.

Requests come from tokenflowd.sim.workload (the simulator's own workloads, so `--seed 1` gives the
same requests here as `tokenflowd sim --seed 1`) or from a BurstGPT CSV. Arrivals:

    request_rate inf               one burst at t = 0 (also None, the default, on dataset random)
    request_rate R                 Poisson (burstiness 1) or gamma gaps of shape `burstiness`, mean 1/R
    request_rate None              datasets mooncake and burstgpt: the trace's timestamps × time_scale
    burst_size B, burst_period P   requests in groups of B, group k at k·P (the last may be short)

Prompts are token ids (/v1/completions) from `prompt_token_ids`, so the Mooncake trace's shared
512-token prefix blocks are shared token for token; for /v1/chat/completions the same ids index a
word list: a text of about `prompt_len` tokens that shares the same prefixes.

Every draw is seeded: SeedSequence(seed).spawn(4) gives the simulator's three streams (arrivals,
lengths, reading rates) and a fourth for the clients that abandon.
"""
from __future__ import annotations

import csv
import dataclasses
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import msgspec
import numpy as np

from tokenflowd.sim.workload import (
    BLOCK_TOKENS,
    DEFAULT_TRACE,
    LENGTH_PRESETS,
    LengthDist,
    WorkloadRequest,
    ContextShape,
    WorkloadSpec,
    arrival_times,
    assign_reading_rates,
    build_workload,
    prompt_token_ids,
)

DATASETS = ("random", "synthetic", "mooncake", "burstgpt")
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
BURSTGPT_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")
# Short common words, each one token (with its leading space) in byte-level BPE vocabularies.
WORDS = ("the of and to in is it that was for on are with as his they at be this have from or one had by "
         "but not what all were we when your can said there use an each which she do how their if will up "
         "other about out many then them these so some her would make like him into time has look two more "
         "go see no way could my than first been call who its now find long down day did get come made may "
         "part").split()


@dataclass(frozen=True)
class LoadWorkload:
    dataset: str = "random"
    num_prompts: int = 100  # trace datasets: the first num_prompts records
    request_rate: float | None = None  # requests/s; None or inf: see the module docstring
    burstiness: float = 1.0  # gamma shape of the gaps (vllm bench serve --burstiness)
    burst_size: int | None = None
    burst_period: float | None = None  # s between bursts
    lengths: LengthDist = field(default_factory=lambda: LENGTH_PRESETS["SL"])  # random dataset only
    reading_rates: tuple[tuple[float, float], ...] = ((20.0, 1.0),)
    seed: int = 0
    dataset_path: str | None = None
    time_scale: float = 1.0  # trace datasets: arrival = timestamp · time_scale
    max_prompt_len: int | None = None  # trace datasets: truncate longer prompts
    output_scale: float = 1.0  # trace datasets: output lengths × this (a small model on a CPU: below 1)
    block_tokens: int = 512  # mooncake: tokens per prefix block; fewer scale prompts down, sharing kept
    abandon_fraction: float = 0.0  # share of clients that close their stream partway
    contexts: ContextShape | None = None  # synthetic: the shared long contexts (sim/workload.py)

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"--dataset-name must be one of {', '.join(DATASETS)}, got {self.dataset!r}")
        if (self.dataset == "synthetic") != (self.contexts is not None):
            raise ValueError("--dataset-name synthetic and --contexts go together: documents, sessions or "
                             "system-prompt, with :KEY=VALUE overrides")
        if self.dataset == "burstgpt" and not self.dataset_path:
            raise ValueError("--dataset-name burstgpt needs --dataset-path FILE.csv (a BurstGPT-format CSV)")
        if self.num_prompts < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError(f"--request-rate must be above 0 (or inf), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"--burstiness must be above 0, got {self.burstiness}")
        if self.burst_size is not None:
            if self.burst_size < 1:
                raise ValueError(f"--burst-size must be >= 1, got {self.burst_size}")
            if self.finite_rate:
                raise ValueError("--burst-size and a finite --request-rate both set the arrivals: drop one")
            if self.num_prompts > self.burst_size and self.burst_period is None:
                raise ValueError(f"{self.num_prompts} prompts in bursts of {self.burst_size} need --burst-period "
                                 "(s between bursts)")
        if self.burst_period is not None and (self.burst_size is None or not self.burst_period > 0):
            raise ValueError("--burst-period needs --burst-size and must be above 0")
        if not self.output_scale > 0:
            raise ValueError(f"--output-scale must be above 0, got {self.output_scale}")
        if not self.time_scale > 0:
            raise ValueError(f"--time-scale must be above 0, got {self.time_scale}")
        if not 0 <= self.abandon_fraction <= 1:
            raise ValueError(f"--abandon-fraction must be in [0, 1], got {self.abandon_fraction}")

    @property
    def finite_rate(self) -> bool:
        return self.request_rate is not None and self.request_rate < math.inf

    @property
    def replays_timestamps(self) -> bool:
        return self.dataset not in ("random", "synthetic") and self.request_rate is None and self.burst_size is None


@dataclass(frozen=True, slots=True)
class LoadRequest:
    """One client: its request as plain data, the body it POSTs, and where it gives up reading."""

    request: WorkloadRequest
    body: bytes  # JSON
    abandon_after: int | None  # close the stream after this many tokens; None: read to the end


def build_requests(w: LoadWorkload) -> list[WorkloadRequest]:
    """The workload's requests in arrival order; the same `w` gives the same requests."""
    arrivals_rng = np.random.default_rng(np.random.SeedSequence(w.seed).spawn(3)[0])
    common = dict(reading_rates=w.reading_rates, seed=w.seed)
    if w.dataset in ("random", "synthetic"):
        if w.dataset == "synthetic":
            common.update(contexts=w.contexts, block_tokens=w.block_tokens, output_scale=w.output_scale)
        if w.finite_rate and w.burst_size is None:
            kind = "poisson" if w.burstiness == 1.0 else "gamma"
            spec = WorkloadSpec(kind, w.num_prompts, w.request_rate, w.burstiness, w.lengths, **common)
        else:
            spec = WorkloadSpec("burst", w.num_prompts, lengths=w.lengths, **common)
        reqs = build_workload(spec)
    elif w.dataset == "mooncake":
        reqs = build_workload(WorkloadSpec("trace", w.num_prompts, trace=w.dataset_path or str(DEFAULT_TRACE),
                                           time_scale=w.time_scale, max_prompt_len=w.max_prompt_len,
                                           output_scale=w.output_scale, block_tokens=w.block_tokens, **common))
    else:
        reqs = burstgpt_requests(Path(w.dataset_path), w)
    if w.burst_size is not None:
        arrivals = burst_arrivals(len(reqs), w.burst_size, w.burst_period or 0.0)
    elif w.dataset in ("random", "synthetic") or w.replays_timestamps:
        return reqs
    elif w.finite_rate:
        kind = "poisson" if w.burstiness == 1.0 else "gamma"
        arrivals = arrival_times(kind, len(reqs), w.request_rate, w.burstiness, arrivals_rng)
    else:  # --request-rate inf given with a trace: one burst
        arrivals = [0.0] * len(reqs)
    return [replace(r, arrival_time=t) for r, t in zip(reqs, arrivals)]


def burst_arrivals(n: int, burst_size: int, burst_period: float) -> list[float]:
    return [(i // burst_size) * burst_period for i in range(n)]


def read_burstgpt(path: Path, limit: int | None) -> list[tuple[float, int, int]]:
    """(timestamp s, request tokens, response tokens) of the first `limit` usable rows of a
    BurstGPT-format CSV (Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type),
    sorted by timestamp. Rows with 0 response tokens (failed requests in BurstGPT) are skipped."""
    rows = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in BURSTGPT_COLUMNS if c not in (reader.fieldnames or ())]
        if missing:
            raise ValueError(f"{path}: not a BurstGPT CSV, no column {', '.join(map(repr, missing))} "
                             f"(have {reader.fieldnames})")
        for line_no, row in enumerate(reader, 2):
            try:
                ts, req, resp = float(row["Timestamp"]), int(float(row["Request tokens"])), \
                    int(float(row["Response tokens"]))
            except (TypeError, ValueError) as e:
                raise ValueError(f"{path}:{line_no}: not a BurstGPT row ({e})") from None
            if resp > 0:
                rows.append((ts, max(1, req), resp))
    rows.sort(key=lambda r: r[0])  # stable: rows of one timestamp keep the file's order
    return rows[:limit]


def burstgpt_requests(path: Path, w: LoadWorkload) -> list[WorkloadRequest]:
    rows = read_burstgpt(path, w.num_prompts)
    if not rows:
        raise ValueError(f"{path}: no rows with response tokens")
    rates_rng = np.random.default_rng(np.random.SeedSequence(w.seed).spawn(3)[2])
    rates = assign_reading_rates(w.reading_rates, len(rows), rates_rng)
    t0, out, next_block = rows[0][0], [], w.seed << 32  # from the seed: two seeds, two prompt sets
    width = len(str(len(rows) - 1))
    for i, (ts, prompt_len, output_len) in enumerate(rows):
        prompt_len = min(prompt_len, w.max_prompt_len or prompt_len)
        k = math.ceil(prompt_len / BLOCK_TOKENS)  # fresh blocks: BurstGPT records no shared prefixes
        output_len = max(1, round(output_len * w.output_scale))
        out.append(WorkloadRequest(f"r{i:0{width}d}", (ts - t0) * w.time_scale, prompt_len, output_len, rates[i],
                                   tuple(range(next_block, next_block + k))))
        next_block += k
    return out


def abandon_points(w: LoadWorkload, output_lens: list[int]) -> list[int | None]:
    """round(abandon_fraction · n) seeded clients close their stream after a seeded fraction
    u ~ U(0, 1) of their tokens (at least 1, fewer than all for outputs of 2 tokens or more)."""
    n = len(output_lens)
    k = round(w.abandon_fraction * n)
    rng = np.random.default_rng(np.random.SeedSequence(w.seed).spawn(4)[3])
    chosen = set(rng.choice(n, size=k, replace=False).tolist()) if k else set()
    fractions = rng.random(n)
    return [max(1, int(fractions[i] * out)) if i in chosen else None for i, out in enumerate(output_lens)]


@dataclass(frozen=True)
class BodyFormat:
    endpoint: str = "/v1/completions"
    model: str = ""
    vocab_size: int = 49152  # the embedded model's (SmolLM2)
    reading_rate_field: bool = True  # send `reading_rate` in the body (tokenflowd reads it)

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        if self.vocab_size < 1:
            raise ValueError(f"--vocab-size must be >= 1, got {self.vocab_size}")


def request_body(req: WorkloadRequest, fmt: BodyFormat) -> dict:
    """Streaming, usage at the end, exactly output_len tokens (ignore_eos with max_tokens)."""
    body: dict = {"model": fmt.model}
    if fmt.endpoint == "/v1/completions":
        body["prompt"] = prompt_token_ids(req, fmt.vocab_size)
    else:
        body["messages"] = [{"role": "user", "content": prompt_text(req)}]
    body.update(max_tokens=req.output_len, ignore_eos=True, stream=True, stream_options={"include_usage": True})
    if fmt.reading_rate_field:  # tokenflowd's (and vLLM's) extras: the rate, and the usage in every event
        body["reading_rate"] = req.reading_rate
        body["stream_options"]["continuous_usage_stats"] = True
    return body


def prompt_text(req: WorkloadRequest) -> str:
    """About prompt_len tokens of words; equal prefix blocks give equal text prefixes."""
    return " ".join(WORDS[i] for i in prompt_token_ids(req, len(WORDS)))


def load_requests(w: LoadWorkload, fmt: BodyFormat) -> list[LoadRequest]:
    reqs = build_requests(w)
    stops = abandon_points(w, [r.output_len for r in reqs])
    return [LoadRequest(r, msgspec.json.encode(request_body(r, fmt)), s) for r, s in zip(reqs, stops)]


def describe(w: LoadWorkload) -> dict:
    """The workload as JSON-able config (for the result file)."""
    d = {k: getattr(w, k) for k in ("dataset", "num_prompts", "request_rate", "burstiness", "burst_size",
                                     "burst_period", "seed", "dataset_path", "time_scale", "max_prompt_len",
                                     "output_scale", "block_tokens", "abandon_fraction")}
    d["lengths"] = {k: getattr(w.lengths, k) for k in ("kind", "input_center", "input_spread", "output_center",
                                                        "output_spread")}
    d["reading_rates"] = [list(p) for p in w.reading_rates]
    if w.contexts is not None:
        d["contexts"] = dataclasses.asdict(w.contexts)
    d["arrivals"] = "trace timestamps" if w.replays_timestamps else (
        "bursts" if w.burst_size is not None else (
            ("poisson" if w.burstiness == 1.0 else "gamma") if w.finite_rate else "one burst"))
    if d["request_rate"] is not None and math.isinf(d["request_rate"]):
        d["request_rate"] = "inf"
    return d
