"""What a run was worth to its readers: TTFT, rebuffering, effective throughput and QoS.

Input: each request's timeline as its client saw it (arrival, reading rate, the time each token
arrived). The buffer a token lands in is replayed with the same TokenBuffer the scheduler uses.

    B_ij   unread tokens in request i's buffer just before token j arrives (0 for the first)
    w_ij   = 1 if B_ij ≤ τ, else max(1 − α·(B_ij − τ), 0)                      (tokenflow eq. 1)
    QoS    = (1/T) · Σ_i ( Σ_j w_ij − λ·TTFT_i − μ·Rebuffer_i )                 (tokenflow eq. 2)

Effective throughput (§7.1.3) is eq. 1 with τ = 10% of the request's output length and the weight
reaching 0 at 20% (α = 1 / (10% of it)), summed over all requests and divided by T, the span from
the first arrival to the last token. QoS uses those same weights. The paper leaves λ and μ open;
by default each request's own reading rate is used, so a second of TTFT or of stall costs the
tokens its reader could have read in it.

One implementation, for the engine's bookkeeping, the simulator and the load generator; the
summary keys are the ones their JSON results share.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from tokenflowd.buffer.tracker import TokenBuffer

EFFECTIVE_FULL = 0.10  # a token counts fully while the buffer holds at most this share of the output
EFFECTIVE_ZERO = 0.20  # ... and not at all from this share on


@dataclass(frozen=True, slots=True)
class Timeline:
    """One request as its client saw it. `token_times` is non-decreasing; tokens that came in
    one message share a time."""

    arrival: float
    reading_rate: float
    token_times: Sequence[float]


@dataclass(frozen=True, slots=True)
class RequestQoS:
    ttft: float | None  # None: no token came
    num_tokens: int
    rebuffer: float  # seconds the reader waited on an empty buffer, up to the last token
    num_stalls: int
    effective_tokens: float  # Σ_j w_ij with the §7.1.3 thresholds
    buffers: tuple[float, ...]  # B_ij
    longest_stall: float = 0.0  # s: the longest single wait on an empty buffer (a silent stream)


def token_weight(buffer: float, tau: float, alpha: float) -> float:
    """Eq. 1: the utility of a token that lands in a buffer already holding `buffer` tokens."""
    if buffer <= tau:
        return 1.0
    return max(1.0 - alpha * (buffer - tau), 0.0)


def effective_weight(buffer: float, output_len: int) -> float:
    """§7.1.3: full weight up to 10% of the output length buffered, falling linearly to 0 at 20%."""
    tau = EFFECTIVE_FULL * output_len
    return token_weight(buffer, tau, 1.0 / ((EFFECTIVE_ZERO - EFFECTIVE_FULL) * output_len))


def effective_weights(buffers: np.ndarray, output_lens: np.ndarray) -> np.ndarray:
    """`effective_weight` elementwise over arrays (eq. 1 clipped to [0, 1] is the same rule)."""
    alpha = 1.0 / ((EFFECTIVE_ZERO - EFFECTIVE_FULL) * output_lens)
    return np.clip(1.0 - alpha * (buffers - EFFECTIVE_FULL * output_lens), 0.0, 1.0)


def request_qos(t: Timeline) -> RequestQoS:
    times = t.token_times
    if not times:
        return RequestQoS(None, 0, 0.0, 0, 0.0, ())
    buf = TokenBuffer(t.reading_rate)
    buffers = []
    longest = 0.0
    for now in times:
        buffers.append(buf.buffer(now))
        longest = max(longest, buf.dry_for(now))
        buf.on_tokens(1, now)
    n = len(times)
    effective = sum(effective_weight(b, n) for b in buffers)
    return RequestQoS(times[0] - t.arrival, n, buf.stall_time_at(times[-1]), buf.num_stalls, effective,
                      tuple(buffers), longest)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0–100) with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(timelines: Sequence[Timeline], ttft_weight: float | None = None,
              rebuffer_weight: float | None = None) -> dict[str, float]:
    """The run's summary: `throughput` and `effective_throughput` (tokens/s), `ttft_mean` and
    `ttft_p99` (s, over requests that got a token), `rebuffer_total` (s), `stall_max` (s, the
    longest time one reader waited on an empty buffer at once), `qos` (eq. 2 with
    λ = `ttft_weight`, μ = `rebuffer_weight`; None: each request's reading rate), `span` (T, s)
    and request counts."""
    per = [request_qos(t) for t in timelines]
    ends = [t.token_times[-1] for t in timelines if t.token_times]
    run_end = max(ends) if ends else 0.0
    span = run_end - min(t.arrival for t in timelines) if ends else 0.0
    ttfts = [r.ttft for r in per if r.ttft is not None]
    value = 0.0
    for t, r in zip(timelines, per):
        lam = t.reading_rate if ttft_weight is None else ttft_weight
        mu = t.reading_rate if rebuffer_weight is None else rebuffer_weight
        ttft = r.ttft if r.ttft is not None else max(0.0, run_end - t.arrival)  # waited to the end, unserved
        value += r.effective_tokens - lam * ttft - mu * r.rebuffer
    tokens = sum(r.num_tokens for r in per)
    return {
        "requests": len(timelines),
        "requests_served": len(ttfts),
        "span": span,
        "throughput": tokens / span if span > 0 else 0.0,
        "effective_throughput": sum(r.effective_tokens for r in per) / span if span > 0 else 0.0,
        "ttft_mean": sum(ttfts) / len(ttfts) if ttfts else math.nan,
        "ttft_p99": percentile(ttfts, 99),
        "rebuffer_total": sum(r.rebuffer for r in per),
        "stall_max": max((r.longest_stall for r in per), default=0.0),
        "qos": value / span if span > 0 else 0.0,
    }
