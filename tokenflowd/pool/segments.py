"""Segments: a prefix cache cut into runs of whole pages, and how long a run should be.

A segment is `pages_per_segment` consecutive full pages of one prefix. Its key is the chained key
of its last page (kv/pages.py), which names the whole prefix up to its end, so equal segment keys
mean equal prefixes and a segment's parent is the segment before it. A prompt's trailing pages that
do not fill a segment stay with the engine that computed them (they are not pooled).

Size (TokenLake §4.2). Attending to a segment of C tokens held by a peer instead of locally saves
k_comp·C of compute (k_comp: seconds per prefix token of one query's attention in one layer) and
costs one round trip plus the query and its partial result on the link:

    T_comm = 2·α + payload / B        payload = the query row out and (o, lse) back, per layer

so shipping pays for itself when C ≥ 2α/k_comp + payload/(k_comp·B). α, B and k_comp are measured
at start-up (`measure_segment_costs`); the threshold rounds up to whole pages.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch


@dataclass(frozen=True)
class SegmentCosts:
    alpha: float  # s, one-way latency of the query path between two engines
    bandwidth: float  # bytes/s of the query path
    k_comp: float  # s per prefix token, one query row, one layer
    payload: int  # bytes on the link per query row and layer: q out, o and lse back

    def threshold_tokens(self) -> float:
        """The least segment length at which a peer's attention costs no more than one's own."""
        return 2 * self.alpha / self.k_comp + self.payload / (self.k_comp * self.bandwidth)


def query_payload(num_heads: int, head_dim: int, itemsize: int) -> int:
    """Bytes per query row and layer: q [heads, d] out, o [heads, d] and lse [heads] fp32 back."""
    return 2 * num_heads * head_dim * itemsize + 4 * num_heads


def pages_per_segment(costs: SegmentCosts, page_size: int, max_pages: int | None = None) -> int:
    """The threshold in whole pages (at least one, at most `max_pages`)."""
    pages = max(1, math.ceil(costs.threshold_tokens() / page_size))
    return min(pages, max_pages) if max_pages else pages


def segment_keys(page_keys: Sequence[bytes], per_segment: int) -> list[bytes]:
    """The keys of the full segments of a prefix whose pages have `page_keys`."""
    return [page_keys[(i + 1) * per_segment - 1] for i in range(len(page_keys) // per_segment)]


def typical_time(call: Callable[[], object], repeats: int) -> float:
    """The median of `repeats` timed calls, after one to warm up: what a call usually costs, not
    its luckiest run (the threshold weighs a typical round trip)."""
    call()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_k_comp(attend: Callable[[int], object], tokens: int = 4096, repeats: int = 20) -> float:
    """Seconds per prefix token of one query row's attention in one layer: `attend(n)` runs it
    over n tokens. The slope between n/4 and n cancels the fixed cost of a call."""
    small = typical_time(lambda: attend(tokens // 4), repeats)
    large = typical_time(lambda: attend(tokens), repeats)
    return max((large - small) / (tokens - tokens // 4), 1e-12)


def attend_probe(backend, num_pages: int) -> Callable[[int], object]:
    """A k_comp probe over the backend's own `attend_pages`: one query row over random pages."""
    from tokenflowd.engine.attention.base import PageQuery

    cache = torch.randn(backend.kv_cache_shape(num_pages)).to(backend.dtype).to(backend.device)
    q = torch.randn(1, backend.num_heads, backend.head_dim).to(backend.dtype).to(backend.device)

    def attend(tokens: int) -> None:
        pages = list(range(min(num_pages, max(1, tokens // backend.page_size))))
        backend.attend_pages(q, cache, PageQuery([0, 1], [pages]))
        if backend.device.type == "cuda":
            torch.cuda.synchronize(backend.device)

    return attend


def measure_link(round_trip: Callable[[int], object], payload: int, rows: int = 256,
                 repeats: int = 50) -> tuple[float, float]:
    """(α s, B bytes/s) of a query path: `round_trip(n)` sends n query rows to a peer and waits
    for their results, `payload` bytes a row. α is half the round trip of one row; B comes from
    the extra time of `rows` rows."""
    one = typical_time(lambda: round_trip(1), repeats)
    many = typical_time(lambda: round_trip(rows), repeats)
    return one / 2, (rows - 1) * payload / max(many - one, 1e-9)
