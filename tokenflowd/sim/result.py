"""A simulation's result as JSON (the same summary keys as the load generator's) and as a table.

Byte-identical for the same inputs: keys sorted, no wall-clock values, token times rounded to the
virtual microsecond (the summary is computed before rounding).
"""
from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Mapping, Sequence

from tokenflowd.buffer.qos import Timeline, summarize

if TYPE_CHECKING:  # types only: the load generator formats its results here without the engine
    from tokenflowd.sim.simulator import RequestRecord, SimResult

TIME_DECIMALS = 6  # virtual microseconds


def summary(result: SimResult) -> dict[str, float]:
    """buffer.qos.summarize's keys (throughput, effective_throughput, ttft_mean, ttft_p99,
    rebuffer_total, qos, span, requests, requests_served) plus the scheduler's side."""
    out = summarize([Timeline(r.arrival, r.reading_rate, r.token_times) for r in result.records])
    out.update(
        preemptions=result.num_preemptions,
        preempted_requests=sum(1 for r in result.records if r.preempt_times),
        makespan=result.makespan,
        num_steps=result.num_steps,
        computed_tokens=result.computed_tokens,
        output_tokens=sum(len(r.token_times) for r in result.records),
    )
    return out


def _t(x: float | None) -> float | None:
    return None if x is None else round(x, TIME_DECIMALS)


def record_dict(r: RequestRecord) -> dict:
    return {
        "id": r.request_id,
        "arrival": _t(r.arrival),
        "reading_rate": r.reading_rate,
        "prompt_len": r.prompt_len,
        "output_len": r.output_len,
        "num_cached_tokens": r.num_cached_tokens,
        "ttft": _t(r.ttft),
        "finish": _t(r.finish_time),
        "preempt_times": [_t(t) for t in r.preempt_times],
        "resume_times": [_t(t) for t in r.resume_times],
        "running": [[_t(s), _t(e)] for s, e in r.running_intervals()],
        "token_times": [_t(t) for t in r.token_times],
    }


def result_document(result: SimResult, config: dict) -> dict:
    return {"config": config, "summary": summary(result), "requests": [record_dict(r) for r in result.records]}


def dumps(doc: dict) -> str:
    # NaN (a TTFT over no served request) is written as JSON null, which every reader accepts.
    return json.dumps(json_safe(doc), sort_keys=True, separators=(",", ":"), allow_nan=False) + "\n"


def json_safe(x):
    """`x` with every NaN or infinity (a percentile over nothing, an unbounded rate) as None: JSON null."""
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


TABLE_KEYS = ("throughput", "effective_throughput", "ttft_mean", "ttft_p99", "rebuffer_total", "qos",
              "preemptions", "preempted_requests", "computed_tokens", "makespan", "num_steps")


def format_table(summaries: Mapping[str, Mapping[str, float]], baseline: str = "fcfs",
                 keys: Sequence[str] = TABLE_KEYS) -> str:
    """Summary keys as rows, policies as columns, then each policy's ratio to `baseline` when it ran."""
    names = list(summaries)
    others = [n for n in names if n != baseline] if baseline in summaries else []
    head = ["metric", *names, *(f"{n}/{baseline}" for n in others)]
    rows = [head]
    for key in keys:
        vals = [summaries[n].get(key) for n in names]
        row = [key, *(_fmt(v) for v in vals)]
        base = summaries[baseline].get(key) if others else None
        for n in others:
            v = summaries[n].get(key)
            finite = all(isinstance(x, (int, float)) and math.isfinite(x) for x in (v, base))
            row.append(f"{v / base:.3f}" if finite and base else "-")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in rows)


def _fmt(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, int):
        return str(v)
    return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}"
