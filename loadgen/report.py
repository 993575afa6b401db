"""A run's result: the summary, per-request records, the terminal table, the JSON document.

Every reader metric comes from tokenflowd.buffer.qos, the implementation the engine and the
simulator use: `summarize` gives the keys the simulator's JSON shares (throughput,
effective_throughput, ttft_mean, ttft_p99, rebuffer_total, qos, span, requests, requests_served)
and `request_qos` each request's TTFT, rebuffer time, stalls and effective tokens. A request's
timeline starts when it was sent (`arrival`), so a --max-concurrency wait is the client's, not TTFT.

Added here:
    ttft_p50, ttft_p90             over requests that got a token
    itl_mean, itl_p99              gaps between consecutive tokens of a request (0 within one event)
    rebuffer_mean, num_stalls      over all requests
    slo_attainment                 share of all requests that got a first token, were not cut off by
                                   a timeout or an error, and met --slo-ttft and --slo-rebuffer
                                   (an unset bound holds for everyone)
    goodput                        completed requests meeting the SLO per second of `span`
    completed, abandoned, aborted (timeouts), errors, output_tokens, duration (wall s of the run)
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from loadgen.client import RequestRecord, RunResult
from tokenflowd.buffer.qos import RequestQoS, Timeline, percentile, request_qos, summarize
from tokenflowd.sim.result import format_table as sim_table
from tokenflowd.sim.result import json_safe

TIME_DECIMALS = 6  # µs
TABLE_KEYS = ("requests", "completed", "abandoned", "aborted", "errors", "output_tokens", "span", "throughput",
              "effective_throughput", "ttft_mean", "ttft_p50", "ttft_p90", "ttft_p99", "itl_mean", "itl_p99",
              "rebuffer_total", "rebuffer_mean", "num_stalls", "stall_max", "qos", "slo_attainment", "goodput")


@dataclass(frozen=True)
class SLO:
    ttft: float | None = None  # s; None: no bound
    rebuffer: float | None = None  # s of stall per request; None: no bound

    def __post_init__(self) -> None:
        for name, v in (("--slo-ttft", self.ttft), ("--slo-rebuffer", self.rebuffer)):
            if v is not None and not v >= 0:
                raise ValueError(f"{name} must be >= 0 s, got {v}")

    def met(self, rec: RequestRecord, q: RequestQoS) -> bool:
        return (rec.outcome in ("completed", "abandoned") and q.ttft is not None
                and (self.ttft is None or q.ttft <= self.ttft)
                and (self.rebuffer is None or q.rebuffer <= self.rebuffer))


def timeline(rec: RequestRecord) -> Timeline:
    return Timeline(rec.scheduled if rec.arrival is None else rec.arrival, rec.reading_rate, rec.token_times)


def summary(records: Sequence[RequestRecord], slo: SLO, duration: float) -> dict:
    timelines = [timeline(r) for r in records]
    out: dict = summarize(timelines)
    per = [request_qos(t) for t in timelines]
    ttfts = [q.ttft for q in per if q.ttft is not None]
    itls = [b - a for r in records for a, b in zip(r.token_times, r.token_times[1:])]
    met = [slo.met(r, q) for r, q in zip(records, per)]
    span = out["span"]
    outcomes = [r.outcome for r in records]
    out.update(
        ttft_p50=percentile(ttfts, 50),
        ttft_p90=percentile(ttfts, 90),
        itl_mean=sum(itls) / len(itls) if itls else math.nan,
        itl_p99=percentile(itls, 99),
        rebuffer_mean=out["rebuffer_total"] / len(records),
        num_stalls=sum(q.num_stalls for q in per),
        slo_attainment=sum(met) / len(records),
        goodput=sum(1 for r, m in zip(records, met) if m and r.outcome == "completed") / span if span > 0 else 0.0,
        completed=outcomes.count("completed"),
        abandoned=outcomes.count("abandoned"),
        aborted=outcomes.count("timeout"),
        errors=outcomes.count("error"),
        output_tokens=sum(len(r.token_times) for r in records),
        duration=duration,
    )
    return out


def _t(x: float | None) -> float | None:
    return None if x is None else round(x, TIME_DECIMALS)


def record_dict(rec: RequestRecord) -> dict:
    q = request_qos(timeline(rec))
    return {
        "id": rec.request_id,
        "scheduled": _t(rec.scheduled),
        "arrival": _t(rec.arrival),
        "reading_rate": rec.reading_rate,
        "prompt_len": rec.prompt_len,
        "output_len": rec.output_len,
        "ttft": _t(q.ttft),
        "token_times": [_t(t) for t in rec.token_times],
        "rebuffer": _t(q.rebuffer),
        "num_stalls": q.num_stalls,
        "effective_tokens": q.effective_tokens,
        "outcome": rec.outcome,
        "finish_reason": rec.finish_reason,
        "usage_tokens": rec.usage_tokens,
        "num_events": rec.num_events,
        "abandon_after": rec.abandon_after,
        "error": rec.error,
    }


def document(config: dict, result: RunResult, slo: SLO) -> dict:
    """{"config", "summary", "requests"}; times in s since the run's start."""
    return {"config": config, "summary": summary(result.records, slo, result.duration),
            "requests": [record_dict(r) for r in result.records]}


def dumps(doc: dict) -> str:
    # NaN (a TTFT percentile over no served request) is written as JSON null.
    return json.dumps(json_safe(doc), separators=(",", ":"), allow_nan=False) + "\n"


def format_table(summaries: Mapping[str, Mapping], keys: Sequence[str] = TABLE_KEYS) -> str:
    """Summary keys as rows, runs as columns; with two or more runs, each later run's ratio to the first."""
    return sim_table(summaries, baseline=next(iter(summaries)), keys=keys)


def ratios(a: Mapping, b: Mapping, keys: Sequence[str] = TABLE_KEYS) -> dict[str, float | None]:
    """b / a for each key (None where either is missing or NaN, or a is 0)."""
    out = {}
    for k in keys:
        x, y = a.get(k), b.get(k)
        ok = all(isinstance(v, (int, float)) and not math.isnan(v) for v in (x, y)) and x != 0
        out[k] = y / x if ok else None
    return out
