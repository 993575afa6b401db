"""N engines' prefix caches on a trace: the node pool (tokenflowd/pool/) against cache-aware routing.

A replay at the level of prefix segments (one trace block of 512 tokens is one segment, near the
paper's 568-token threshold). Each request's full blocks form a chain of keys, so equal keys mean
equal prefixes.

    routing   today's router (router.py): each engine caches its own segments with LRU eviction;
              a request goes to the engine with the best score (cached segments − load, where load
              is its requests in flight), and every prefix access of the request lands there.
    pool      the segment pool: one node-wide tree; a request's cached segments are served where
              their replicas live (power of two choices); its new segments go to their homes by
              hash; overloaded engines' heavy hitters are replicated every `rebalance_period`;
              each engine evicts its least recently accessed replicas when over capacity.

A request is in flight from its arrival for prefill (uncached tokens at `prefill_rate`) plus its
output at `tbt` a token; that is the load the router sees. The load measured per engine is prefix
tokens served from its cache per window (TokenLake's Figure 10: cache accesses per instance); its
coefficient of variation (std / mean over engines) is averaged over windows with any access.
"""
from __future__ import annotations

import heapq
import statistics
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

from tokenflowd.daemon.prefix_index import PrefixIndex
from tokenflowd.daemon.router import Router
from tokenflowd.kv.pages import chain_page_keys
from tokenflowd.pool.homes import Placement
from tokenflowd.sim.workload import BLOCK_TOKENS, WorkloadRequest

MODES = ("routing", "pool")


@dataclass(frozen=True)
class PoolSimConfig:
    engines: int = 8
    capacity_tokens: int = 400 * BLOCK_TOKENS  # prefix cache per engine
    window: float = 60.0  # s, per-engine load windows for the CV
    rebalance_period: float = 1.0  # s of trace time between the pool's rebalancing passes
    half_life: float = 60.0  # s, decay of accesses (heavy hitters, engine loads)
    prefill_rate: float = 10_000.0  # tokens/s of one engine's prefill, for time in flight
    tbt: float = 0.03  # s per output token, for time in flight
    seed: int = 0


@dataclass
class PoolSimResult:
    mode: str
    requests: int
    prompt_tokens: int
    hit_tokens: int
    load_cv_mean: float
    load_cv_max: float
    window_loads: list[list[float]] = field(default_factory=list)  # [window][engine] tokens served
    replications: int = 0
    replicated_tokens: int = 0
    held_tokens_end: list[int] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / max(self.prompt_tokens, 1)

    def summary(self) -> dict:
        return {"mode": self.mode, "requests": self.requests, "hit_rate": round(self.hit_rate, 4),
                "load_cv_mean": round(self.load_cv_mean, 4), "load_cv_max": round(self.load_cv_max, 4),
                "replications": self.replications, "replicated_tokens": self.replicated_tokens,
                "held_tokens_end": self.held_tokens_end}


def config_from_cost(cost, engines: int, capacity_tokens: int | None = None, seed: int = 0) -> PoolSimConfig:
    """Each engine's prefix cache is its KV pool (unless given); time in flight from the roofline:
    prefill at the rate of an 8,192-token prompt, decode at a batch of 32 over 8,192 tokens."""
    return PoolSimConfig(engines=engines, capacity_tokens=capacity_tokens or cost.max_tokens_in_pool,
                         prefill_rate=8192 / cost.prefill_time(8192), tbt=cost.decode_step_time(32, 8192), seed=seed)


def chain_keys(hash_ids: Sequence[int], full_blocks: int) -> list[bytes]:
    """The segment keys of a trace prompt's full blocks: the engine's chained page keys, with a
    block's id as its one "token"."""
    return chain_page_keys(hash_ids, 1, [], full_blocks)


def coefficient_of_variation(values: Sequence[float]) -> float:
    mean = statistics.fmean(values)
    return statistics.pstdev(values, mean) / mean if mean > 0 else 0.0


class _Loads:
    """Tokens served per engine per window."""

    def __init__(self, engines: int, window: float) -> None:
        self.engines, self.window = engines, window
        self.windows: list[list[float]] = []

    def add(self, t: float, engine: int, tokens: float) -> None:
        w = int(t // self.window)
        while len(self.windows) <= w:
            self.windows.append([0.0] * self.engines)
        self.windows[w][engine] += tokens

    def cvs(self) -> list[float]:
        return [coefficient_of_variation(w) for w in self.windows if sum(w) > 0]


@dataclass
class _EngineLoad:
    engine_id: int
    load: int = 0


def _in_flight(req: WorkloadRequest, hit_tokens: int, cfg: PoolSimConfig) -> float:
    return (req.prompt_len - hit_tokens) / cfg.prefill_rate + req.output_len * cfg.tbt


def replay_routing(requests: Sequence[WorkloadRequest], cfg: PoolSimConfig) -> PoolSimResult:
    index = PrefixIndex()
    router = Router(BLOCK_TOKENS, index)
    engines = [_EngineLoad(e) for e in range(cfg.engines)]
    caches: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(cfg.engines)]
    cap = cfg.capacity_tokens // BLOCK_TOKENS
    ends: list[tuple[float, int]] = []
    loads = _Loads(cfg.engines, cfg.window)
    prompt = hits = 0
    for req in requests:
        t = req.arrival_time
        while ends and ends[0][0] <= t:
            engines[heapq.heappop(ends)[1]].load -= 1
        keys = chain_keys(req.hash_ids, req.prompt_len // BLOCK_TOKENS)
        choice = router.pick_keys(engines, keys)
        e, cache = choice.engine_id, caches[choice.engine_id]
        for key in keys[: choice.cached_pages]:
            cache.move_to_end(key)
        hit = choice.cached_pages * BLOCK_TOKENS
        loads.add(t, e, hit)
        prompt, hits = prompt + req.prompt_len, hits + hit
        added = [k for k in keys[choice.cached_pages:] if k not in cache]
        for key in added:
            cache[key] = None
        removed = []
        while len(cache) > cap:
            removed.append(cache.popitem(last=False)[0])
        index.update(e, [k for k in added if k in cache], removed)  # removed first, then added
        engines[e].load += 1
        heapq.heappush(ends, (t + _in_flight(req, hit, cfg), e))
    cvs = loads.cvs()
    return PoolSimResult("routing", len(requests), prompt, hits, sum(cvs) / max(len(cvs), 1), max(cvs, default=0.0),
                         loads.windows, held_tokens_end=[len(c) * BLOCK_TOKENS for c in caches])


def replay_pool(requests: Sequence[WorkloadRequest], cfg: PoolSimConfig) -> PoolSimResult:
    placement = Placement(range(cfg.engines), half_life=cfg.half_life, seed=cfg.seed)
    loads = _Loads(cfg.engines, cfg.window)
    prompt = hits = replications = replicated = 0
    next_rebalance = 0.0
    for req in requests:
        t = req.arrival_time
        if t >= next_rebalance:
            plans = placement.rebalance(t)
            replications += len(plans)
            replicated += sum(p.tokens for p in plans)
            for p in plans:
                _fit(placement, p.target, cfg)
            next_rebalance = t + cfg.rebalance_period
        keys = chain_keys(req.hash_ids, req.prompt_len // BLOCK_TOKENS)
        served = placement.route(keys, t)
        for node, engine in served:
            loads.add(t, engine, node.tokens)
        hit = len(served) * BLOCK_TOKENS
        prompt, hits = prompt + req.prompt_len, hits + hit
        for node, engine in served:  # pinned while the request reads them
            placement.pin(node, engine)
        placed = placement.put(keys, [BLOCK_TOKENS] * len(keys), t)
        for engine in {e for _, e in placed}:
            _fit(placement, engine, cfg)
        for node, engine in served:
            placement.unpin(node.key, engine)
    cvs = loads.cvs()
    return PoolSimResult("pool", len(requests), prompt, hits, sum(cvs) / max(len(cvs), 1), max(cvs, default=0.0),
                         loads.windows, replications, replicated,
                         [placement.held_tokens(e) for e in range(cfg.engines)])


def _fit(placement: Placement, engine: int, cfg: PoolSimConfig) -> None:
    over = placement.held_tokens(engine) - cfg.capacity_tokens
    if over > 0:
        placement.evict(engine, over)


def replay(mode: str, requests: Sequence[WorkloadRequest], cfg: PoolSimConfig) -> PoolSimResult:
    if mode not in MODES:
        raise ValueError(f"unknown pool-sim mode {mode!r}: one of {', '.join(MODES)}")
    return (replay_pool if mode == "pool" else replay_routing)(requests, cfg)
