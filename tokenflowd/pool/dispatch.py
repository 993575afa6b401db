"""Batches to engines by minimum-cost bipartite matching (TokenLake §5).

Each iteration the scheduler has formed batches; where a batch runs decides what crosses between
engines: its query rows go to every other engine that holds segments it reads, and its new full
pages go to their segments' homes. The cost of running batch u on engine v is those bytes:

    cost(u, v) = Σ_{k ∈ Q(u), k ≠ v} query_bytes(u)  +  Σ_{k ∈ P(u), k ≠ v} kv_bytes(u, k)

Q(u): engines holding segments u reads; P(u): engines where u's new KV goes (with its bytes).
scipy's linear_sum_assignment finds the matching of least total cost. With more batches than
engines, each engine appears ⌈B/N⌉ times as a column: no engine takes more than ⌈B/N⌉ batches.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
from scipy.optimize import linear_sum_assignment


@dataclass(frozen=True)
class BatchTraffic:
    """What one batch moves, by engine: the query bytes it ships to each holder of its segments
    (one entry per holder), and the new-KV bytes it puts to each home."""

    query_bytes: Mapping[int, int] = field(default_factory=dict)
    kv_bytes: Mapping[int, int] = field(default_factory=dict)

    def cost_on(self, engine: int) -> int:
        return (sum(b for e, b in self.query_bytes.items() if e != engine)
                + sum(b for e, b in self.kv_bytes.items() if e != engine))


def cost_matrix(batches: Sequence[BatchTraffic], engines: Sequence[int]) -> np.ndarray:
    return np.array([[b.cost_on(e) for e in engines] for b in batches], dtype=np.float64).reshape(len(batches),
                                                                                                 len(engines))


def balanced_slots(loads: Mapping[int, int], n: int) -> dict[int, int]:
    """How many of `n` new batches each engine takes so that the busiest ends as little loaded as it
    can (water-filling: the least loaded are topped up to a common level first)."""
    if not loads:
        raise ValueError("no engine to dispatch to")
    level = min(loads.values())
    while sum(max(0, level - load) for load in loads.values()) < n:
        level += 1
    return {e: max(0, level - load) for e, load in loads.items()}


def assign(costs: np.ndarray, engines: Sequence[int], slots: Mapping[int, int]) -> list[int]:
    """The engine for each row of `costs` (rows: batches, columns: `engines`), of least total cost,
    engine e taking at most slots[e] rows (their sum must cover the rows)."""
    if sum(slots.get(e, 0) for e in engines) < costs.shape[0]:
        raise ValueError("fewer slots than batches")
    columns = [i for i, e in enumerate(engines) for _ in range(slots.get(e, 0))]
    rows, cols = linear_sum_assignment(costs[:, columns])
    out = [0] * costs.shape[0]
    for r, c in zip(rows, cols):
        out[r] = engines[columns[c]]
    return out


def dispatch(batches: Sequence[BatchTraffic], engines: Sequence[int]) -> list[int]:
    """The engine for each batch, minimising the bytes moved; no engine takes more than ⌈B/N⌉."""
    if not batches:
        return []
    if not engines:
        raise ValueError("no engine to dispatch to")
    copies = math.ceil(len(batches) / len(engines))
    return assign(cost_matrix(batches, engines), engines, {e: copies for e in engines})
