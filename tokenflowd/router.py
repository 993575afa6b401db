"""Picks the engine for a request: the longest prefix-cache match, unless that engine is
much busier than the least busy one.

Each engine reports the keys of the full pages its prefix cache holds (published and evicted
keys ride on its step messages, kept in prefix_index.py); the router computes the request's
chained page keys the same way the engine does and counts how many leading pages an engine has. Load is the number of
requests an engine holds (running + waiting, and those sent but not yet seen in its stats).

    score(e) = cached_prompt_tokens(e) − load_weight · page_size · load(e)

A cached page saves its prefill; a request ahead in the queue costs about a page of waiting at
load_weight 1, so the router gives up a match only for a clearly busier engine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from tokenflowd.kv.pages import chain_page_keys
from tokenflowd.prefix_index import PrefixIndex


class EngineLoad(Protocol):
    engine_id: int

    @property
    def load(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Choice:
    engine_id: int
    cached_pages: int


class Router:
    def __init__(self, page_size: int, index: PrefixIndex, load_weight: float = 1.0) -> None:
        self.page_size = page_size
        self.index = index
        self.load_weight = load_weight

    def pick(self, engines: Sequence[EngineLoad], prompt_token_ids: Sequence[int]) -> Choice:
        """`engines` must be non-empty (the serving ones). Ties go to the lower engine id."""
        if len(engines) == 1:
            return Choice(engines[0].engine_id, 0)
        # The last prompt token is always computed, so only pages before it can be hits.
        keys = chain_page_keys(prompt_token_ids, self.page_size, [], max(0, len(prompt_token_ids) - 1))
        return self.pick_keys(engines, keys)

    def pick_keys(self, engines: Sequence[EngineLoad], keys: Sequence[bytes]) -> Choice:
        """`pick` for a request whose chained page keys are known (its cached pages counted even
        with one engine)."""
        best: tuple[float, int, Choice] | None = None
        for e in engines:
            hit = self.index.cached_pages(e.engine_id, keys) if keys else 0
            score = (hit - self.load_weight * e.load) * self.page_size
            cand = (score, -e.engine_id, Choice(e.engine_id, hit))
            if best is None or cand[:2] > best[:2]:
                best = cand
        assert best is not None
        return best[2]
