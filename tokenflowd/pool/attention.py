"""Attention for a step whose requests read prefix pages held elsewhere in the pool.

Each layer: the backend's own causal attention over the engine's KV, with its log-sum-exp, merged
exactly with each holder's partial attention over that request's pinned pages
(engine/attention/partial.py). Pinned pages come before every token of the request, so they need
no mask, and their order does not matter. Query mode sends the rows before the local attention
runs and collects after it, so the holder computes while this engine does.

    PooledAttention.forward(layer, q, k, v, cache, meta)   what the model's layers call
      QueriedHolder   ships the rows to a peer's query service (query.py)
      PeerCache       attends in place over a cache mapped here (a peer's in read mode, or its own)
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from tokenflowd.engine.attention.base import PageQuery
from tokenflowd.engine.attention.partial import merge_states
from tokenflowd.engine.errors import ForeignPrefixLost
from tokenflowd.pool.query import PeerGone


@dataclass
class HolderRows:
    """The rows of a step's requests that read pages of one holder."""

    request_ids: list[str] = field(default_factory=list)
    query_start: list[int] = field(default_factory=lambda: [0])  # over the gathered rows
    pages: list[list[int]] = field(default_factory=list)
    _index: list[int] = field(default_factory=list)

    def add(self, request_id: str, start: int, end: int, pages: list[int]) -> None:
        self.request_ids.append(request_id)
        self._index.extend(range(start, end))
        self.query_start.append(self.query_start[-1] + end - start)
        self.pages.append(pages)

    def index(self, device: torch.device) -> torch.Tensor:
        return torch.tensor(self._index, dtype=torch.int64, device=device)


class QueriedHolder:
    def __init__(self, rows: HolderRows, client, stats: dict) -> None:
        self.rows, self.client, self.stats = rows, client, stats

    def submit(self, layer: int, q: torch.Tensor) -> None:
        try:
            self.client.submit(layer, q, self.rows.query_start, self.rows.request_ids)  # copied to shared memory
        except PeerGone as e:
            raise ForeignPrefixLost(self.rows.request_ids, str(e)) from e
        self.stats["query_calls"] += 1
        self.stats["query_bytes"] += 2 * q.numel() * q.element_size()

    def collect(self, layer: int, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t0 = time.perf_counter()
        try:
            o, s = self.client.collect()
        except PeerGone as e:
            raise ForeignPrefixLost(self.rows.request_ids, str(e)) from e
        self.stats["query_seconds"] += time.perf_counter() - t0
        return o.to(q.device), s.to(q.device)


class PeerCache:
    def __init__(self, rows: HolderRows, backend, layers: list[torch.Tensor], stats: dict | None = None) -> None:
        """`stats`: a peer's cache, mapped here: each layer's read in place is counted."""
        self.rows, self.backend, self.layers, self.stats = rows, backend, layers, stats
        self.query = PageQuery(rows.query_start, rows.pages)

    def submit(self, layer: int, q: torch.Tensor) -> None:
        if self.stats is not None:
            self.stats["read_calls"] += 1

    def collect(self, layer: int, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.backend.attend_pages(q, self.layers[layer], self.query)


class PooledAttention:
    """What the model's layers call (model.py: `attn.forward`) for a step with foreign prefixes."""

    def __init__(self, backend, holders: list) -> None:
        self.backend = backend
        self.holders = holders
        self._index: list[torch.Tensor | None] = [None] * len(holders)
        self.fused_ops = getattr(backend, "fused_ops", False)  # the layers' small ops: as the backend's

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: object) -> torch.Tensor:
        rows = []
        for j, h in enumerate(self.holders):
            if self._index[j] is None:
                self._index[j] = h.rows.index(q.device)
            rows.append(q[self._index[j]])
            h.submit(layer, rows[-1])
        o, s = self.backend.forward_with_lse(layer, q, k, v, kv_cache, meta)
        for j, h in enumerate(self.holders):
            o_h, s_h = h.collect(layer, rows[j])
            idx = self._index[j]
            merged, lse = merge_states(o[idx], s[idx], o_h, s_h)
            o[idx], s[idx] = merged, lse
        return o
