"""The attention seam. A backend reads and writes the paged KV cache; the model never sees pages.

KV cache of one layer: K and V planes apart; each backend picks the order of the other axes
(`kv_cache_shape`), and every (page, kv head) is a contiguous [page_size, head_dim] block:

    torch:       [2, kv_heads, num_pages, page_size, head_dim]   head-outer: a page gather is one index_select
    flashinfer:  [2, num_pages, kv_heads, page_size, head_dim]   what flashinfer calls HND
    slot s  = page * page_size + offset

A step's tokens are flat: request i owns query rows query_start[i] : query_start[i+1]; they are the
tokens at positions seq_lens[i] - query_len .. seq_lens[i] - 1 of its sequence, and the KV of all
seq_lens[i] tokens lives in the pages block_tables[i] once the step has written the new ones.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionInputs:
    """One step's batch layout, host-side, built once by the runner."""

    query_start: list[int]  # [B+1] cumulative query lengths
    seq_lens: list[int]  # [B] KV length of each request after this step
    block_tables: list[list[int]]  # [B][pages] pages covering seq_lens[i] tokens
    slot_mapping: torch.Tensor  # [T] int64 on the device: where each new token's K/V goes

    @property
    def num_requests(self) -> int:
        return len(self.seq_lens)

    def query_len(self, i: int) -> int:
        return self.query_start[i + 1] - self.query_start[i]


@dataclass(frozen=True)
class PageQuery:
    """Query rows that attend, with no mask, to whole pages of context before all of them (a
    prefix segment held by this cache): request i's rows query_start[i] : query_start[i+1] see
    every token of pages[i]. A request with no pages here gets the empty state (o 0, s −inf)."""

    query_start: list[int]  # [B+1]
    pages: list[list[int]]  # [B][n]


class AttentionBackend(abc.ABC):
    """Invariants: `prepare` runs once per step before any layer; `forward` first writes k/v of the
    step's tokens at `slot_mapping`, then attends each query causally over its request's KV only;
    the output has q's shape and dtype. A backend keeps no per-request state between steps."""

    name: str  # what /health calls it
    fused_ops = False  # whether the model's layers run fused kernels beside it (engine/model/fused.py)

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.page_size = page_size
        self.dtype = dtype
        self.device = device
        self.scale = head_dim**-0.5

    @abc.abstractmethod
    def kv_cache_shape(self, num_pages: int) -> tuple[int, ...]:
        """Shape of one layer's KV cache, K and V planes first."""

    @property
    def page_axis(self) -> int:
        """The axis of kv_cache_shape that indexes pages (where the host tier's copies slice)."""
        a, b = self.kv_cache_shape(1), self.kv_cache_shape(2)
        return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)

    def wait_planned(self) -> None:
        """Block until the copies the last prepare() queued from host buffers it reuses have run
        (a backend whose plan reuses none has nothing to wait for)."""

    @abc.abstractmethod
    def prepare(self, inputs: AttentionInputs) -> object:
        """Per-step metadata shared by every layer."""

    @abc.abstractmethod
    def forward(
        self,
        layer: int,
        q: torch.Tensor,  # [T, heads, head_dim]
        k: torch.Tensor,  # [T, kv_heads, head_dim]
        v: torch.Tensor,  # [T, kv_heads, head_dim]
        kv_cache: torch.Tensor,  # kv_cache_shape(num_pages)
        meta: object,
    ) -> torch.Tensor:  # [T, heads, head_dim]
        ...

    @abc.abstractmethod
    def forward_with_lse(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         kv_cache: torch.Tensor, meta: object) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`, also returning each row's log-sum-exp (base e, [T, heads] fp32), so that the
        output can be merged exactly with attention over context held elsewhere (partial.py)."""

    @abc.abstractmethod
    def attend_pages(self, q: torch.Tensor, kv_cache: torch.Tensor,
                     query: PageQuery) -> tuple[torch.Tensor, torch.Tensor]:
        """Partial attention of q's rows over whole pages of this cache, unmasked: (o [T, heads, d],
        s [T, heads] fp32, base e). Reads the cache only; the pool's query service calls it for
        the segments this engine holds on behalf of another."""
