"""The conductor's choice of a (prefill node, decode node) pair for a request: Mooncake's Algorithm 1
(KVCache-centric scheduling, §6), on what the conductor knows of each node.

For every prefill node p, with prefix_len(p) the leading prompt tokens p's prefix cache holds and
best the longest such match on any node:

    best / prefix_len(p) < balancing_threshold        (p's own match is nearly as good)
        TTFT(p) = queue(p) + prefill(prompt, prefix_len(p))
    otherwise                                           (fetch the better prefix first)
        TTFT(p) = transfer(best − prefix_len(p) tokens, best's node → p) + queue(p) + prefill(prompt, best)

The request goes to the prefill node of least TTFT, and to the decode node whose predicted time
between tokens is least when the request reaches it (the decode node's buffer-aware policy and the
reading rates of its clients decide that figure; the conductor asks for it). If the TTFT or the
TBT breaks its SLO, the request is rejected before any prefill is spent. When p fetches a remote
prefix, the copy stays on p (hot prefixes replicate by use, as in Mooncake).

Transfer times use each link's measured bandwidth (the transport's figure: delivery.py over TCP,
as the nodes publish it); the conductor falls back to a configured nominal one only before anything was measured.
Everything here is torch-free: the conductor is an API server process.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence


@dataclass(frozen=True)
class PrefillNode:
    name: str
    prefix_tokens: int  # leading prompt tokens its prefix cache holds (the conductor's index)
    queue_seconds: float  # predicted wait before this request's prefill starts
    prefill_seconds: Callable[[int, int], float]  # (prompt tokens, cached tokens) -> seconds to prefill


@dataclass(frozen=True)
class DecodeNode:
    name: str
    tbt_seconds: float  # predicted time between tokens once this request joins its batch


@dataclass(frozen=True)
class Placement:
    prefill: str
    decode: str
    ttft_seconds: float
    tbt_seconds: float
    fetch_from: str | None = None  # the node whose longer prefix the prefill node pulls first
    fetch_tokens: int = 0


@dataclass(frozen=True)
class Rejection:
    reason: str  # "ttft" | "tbt" | "no prefill node" | "no decode node"
    ttft_seconds: float = math.inf
    tbt_seconds: float = math.inf


def place(prompt_tokens: int, prefill: Sequence[PrefillNode], decode: Sequence[DecodeNode], *,
          bandwidth: Callable[[str, str], float], kv_bytes_per_token: int, balancing_threshold: float,
          ttft_slo: float, tbt_slo: float) -> Placement | Rejection:
    """Algorithm 1. `bandwidth(src, dst)`: measured bytes/s from one node to another (0: no link)."""
    if not prefill:
        return Rejection("no prefill node")
    if not decode:
        return Rejection("no decode node")
    best_node = max(prefill, key=lambda p: (p.prefix_tokens, -p.queue_seconds))
    best = best_node.prefix_tokens
    choice: tuple[float, PrefillNode, int] | None = None  # (ttft, node, tokens fetched)
    for p in prefill:
        if p.prefix_tokens and best / p.prefix_tokens < balancing_threshold or best == p.prefix_tokens:
            ttft, fetched = p.queue_seconds + p.prefill_seconds(prompt_tokens, p.prefix_tokens), 0
        else:
            fetched = best - p.prefix_tokens
            link = bandwidth(best_node.name, p.name)
            transfer = fetched * kv_bytes_per_token / link if link > 0 else math.inf
            ttft = transfer + p.queue_seconds + p.prefill_seconds(prompt_tokens, best)
            if not math.isfinite(ttft):  # no link to the best prefix: p computes what it lacks
                ttft, fetched = p.queue_seconds + p.prefill_seconds(prompt_tokens, p.prefix_tokens), 0
        if choice is None or ttft < choice[0]:
            choice = (ttft, p, fetched)
    assert choice is not None
    ttft, p, fetched = choice
    d = min(decode, key=lambda n: n.tbt_seconds)
    if ttft > ttft_slo:
        return Rejection("ttft", ttft, d.tbt_seconds)
    if d.tbt_seconds > tbt_slo:
        return Rejection("tbt", ttft, d.tbt_seconds)
    return Placement(p.name, d.name, ttft, d.tbt_seconds, best_node.name if fetched else None, fetched)
