"""The pool's control plane (TokenLake §3.2): the node-wide prefix tree, the pool's share of the
engines' resources, and each iteration's plans.

    get_prefix_tree()                    the tree of segments and their replicas (tree.py)
    get_cache_load(reqs, step_seconds)   the fraction of the engines the pool's prefix attention
                                         takes for `reqs` (§6.1's roofline bound), for the
                                         scheduler's step-time model
    gen_plans(batches, now)              query plans (which engine serves each cached segment of
                                         each request), transfer plans (where each new segment
                                         goes) and groups (which engine runs each batch)

Requests name their prompts by chained page keys (kv/pages.py); a segment is `pages_per_segment`
of them (segments.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from tokenflowd.pool.dispatch import BatchTraffic, dispatch
from tokenflowd.pool.homes import Placement
from tokenflowd.pool.segments import segment_keys
from tokenflowd.pool.tree import PrefixTree


@dataclass(frozen=True)
class Hardware:
    """One engine's device, for get_cache_load: memory bandwidth (bytes/s) and compute (FLOP/s)."""

    mem_bandwidth: float
    flops: float


@dataclass(frozen=True)
class PoolRequest:
    request_id: str
    page_keys: Sequence[bytes]  # chained keys of its full prompt pages
    query_rows: int  # tokens it computes this iteration (its query rows)


@dataclass
class Plans:
    query: dict[str, dict[int, list[bytes]]] = field(default_factory=dict)  # request -> engine -> segments it serves
    transfer: dict[str, list[tuple[bytes, int]]] = field(default_factory=dict)  # request -> (new segment, its home)
    groups: list[int] = field(default_factory=list)  # batch -> the engine that runs it
    cached_tokens: dict[str, int] = field(default_factory=dict)  # request -> prompt tokens the pool serves


class PoolIndex:
    def __init__(self, engines: Sequence[int], page_size: int, pages_per_segment: int, *,
                 query_bytes_per_row: int, kv_bytes_per_token: int, half_life: float = 60.0, seed: int = 0) -> None:
        self.page_size = page_size
        self.pages_per_segment = pages_per_segment
        self.segment_tokens = page_size * pages_per_segment
        self.query_bytes_per_row = query_bytes_per_row  # all layers
        self.kv_bytes_per_token = kv_bytes_per_token  # all layers
        self.placement = Placement(engines, half_life=half_life, seed=seed)

    # -- control plane ------------------------------------------------------------------------
    def get_prefix_tree(self) -> PrefixTree:
        return self.placement.tree

    def get_cache_load(self, reqs: Sequence[tuple[int, int]], step_seconds: float, hidden: int,
                       hardware: Hardware) -> float:
        """The pool's share of the engines for requests (prefix_len, input_len) run in a step of
        `step_seconds` with every engine busy (TokenLake §6.1):
            M = Σ 4·d·(prefix + input)   F = Σ 2·d·prefix·input
            L = max(M / (M + N·B_mem·T), F / (F + N·F_dev·T))"""
        n = len(self.placement.engines)
        mem = sum(4 * hidden * (p + i) for p, i in reqs)
        flops = sum(2 * hidden * p * i for p, i in reqs)
        if mem == 0:
            return 0.0
        t = max(step_seconds, 1e-9)
        return max(mem / (mem + n * hardware.mem_bandwidth * t), flops / (flops + n * hardware.flops * t))

    def gen_plans(self, batches: Sequence[Sequence[PoolRequest]], now: float) -> Plans:
        plans = Plans()
        traffic = []
        planned: set[bytes] = set()
        for batch in batches:
            queries: dict[int, int] = {}
            kv: dict[int, int] = {}
            for req in batch:
                keys = segment_keys(req.page_keys, self.pages_per_segment)
                served = self.placement.route(keys, now)
                by_engine: dict[int, list[bytes]] = {}
                for node, engine in served:
                    by_engine.setdefault(engine, []).append(node.key)
                plans.query[req.request_id] = by_engine
                plans.cached_tokens[req.request_id] = len(served) * self.segment_tokens
                for engine in by_engine:
                    queries[engine] = queries.get(engine, 0) + req.query_rows * self.query_bytes_per_row
                tree = self.placement.tree
                placed = [(key, self.placement.home(key)) for key in keys if key not in tree and key not in planned]
                planned.update(key for key, _ in placed)  # two requests of one call computing it: one put
                plans.transfer[req.request_id] = placed
                for _, home in placed:
                    kv[home] = kv.get(home, 0) + self.segment_tokens * self.kv_bytes_per_token
            traffic.append(BatchTraffic(queries, kv))
        plans.groups = dispatch(traffic, self.placement.engines)
        return plans

    def stored(self, page_keys: Sequence[bytes], now: float) -> list[tuple[bytes, int]]:
        """A request's new segments are computed and put at their homes: they become matchable.
        (A segment is never matchable before its KV exists.)"""
        keys = segment_keys(page_keys, self.pages_per_segment)
        return self.placement.put(keys, [self.segment_tokens] * len(keys), now)

    # -- membership ---------------------------------------------------------------------------
    def engine_gone(self, engine: int) -> list[tuple[bytes, int]]:
        """Drop a dead engine's segments at once. -> replicas elsewhere that are now unreachable."""
        return self.placement.drop_engine(engine)
