"""Which segments are hot: decayed access counts, and the heavy hitters among them (TokenLake §4).

The front counts each whole segment of a request's prompt as it comes (its key: the chained key of
its last page), read or computed: one computed now is read by the requests after it. Counts
halve every `half_life` seconds, so a prefix that stops being used cools down. The heavy hitters
are the ⌈N ln N⌉ + N hottest segments for N engines, the number the paper's balls-into-bins bound
asks for (pool/homes.py uses the same), among those read at least twice per engine (with
fewer segments than that, every segment would otherwise be a hitter from its first read).

Every new segment of every prompt is counted, so the counts are kept as decay-free scores: a count
c as of time t is the score log2(c) + t / half_life, and since every count decays alike, the order
of the scores is the order of the counts at any time. The hottest are kept as they change, at each
count (O(hitters)), not ranked over every segment seen; a segment counted once is forgotten within
about seven half-lives (a bounded sweep at each count), so the memory follows the recent prompts.
Torch-free: the API server process runs it.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import Collection, Iterable

FORGET = 0.01  # a count decayed below this is forgotten
SWEEP = 2  # segments looked at for forgetting at each count: more than the one it may add


def num_heavy_hitters(num_engines: int) -> int:
    n = max(1, num_engines)
    return math.ceil(n * math.log(n)) + n


def replica_pages(num_pages: int, num_engines: int) -> int:
    """The most pages an engine of `num_pages` may hold in replicas (copies of hot segments it reads
    on peers: PoolMember.copy_in) in a node of `num_engines`: 1/N of its pages. A replica in every
    engine costs the node N - 1 copies of one segment; capped so, replicas take at most about one
    engine's worth of the node's memory from what it holds once. The heavy hitters are counted in
    segments, not pages: where KV is short, a hot 12K-token document (24 segments, 43% of an engine
    with a quarter of an A100's KV) was copied whole into each engine that read it, and the engines
    holding it took its readers (node simulator, read mode, 16 documents read with a Zipf skew, a
    quarter of the A100's KV: with no cap, access CV 0.49 and hit rate 0.892 at 2 req/s, seed 2;
    962 tokens/s at 16 req/s, seed 0; capped, 0.17, 0.925 and 1,063). A system prompt's few
    segments fit under it."""
    return num_pages // max(1, num_engines)


def within_replica_cap(replicas: Collection[bytes], keys: Iterable[bytes], num_pages: int, num_engines: int) -> bool:
    """Whether `keys` may all be replicas here: with those of them not replicas yet (copied in, or
    held here already), the replicas hold at most `replica_pages`."""
    return len(replicas) + sum(key not in replicas for key in keys) <= replica_pages(num_pages, num_engines)


class SegmentHeat:
    def __init__(self, half_life: float = 60.0) -> None:
        self.half_life = half_life
        # key -> score (log2 of its count, as of time 0); the order is the sweep's, not the scores'
        self._scores: OrderedDict[bytes, float] = OrderedDict()
        self._top: dict[bytes, float] = {}  # the `_k` highest scores
        self._k = 0

    def _value(self, score: float, now: float) -> float:
        return 2.0 ** (score - now / self.half_life)

    def hit(self, key: bytes, now: float) -> None:
        fresh = now / self.half_life  # a count of 1 now
        old = self._scores.pop(key, None)
        score = fresh if old is None else max(old, fresh) + math.log2(1.0 + 2.0 ** -abs(old - fresh))
        self._sweep(now)
        self._scores[key] = score
        if key in self._top or len(self._top) < self._k:
            self._top[key] = score
        elif self._k:
            coldest = min(self._top, key=self._top.__getitem__)
            if score > self._top[coldest]:
                del self._top[coldest]
                self._top[key] = score

    def _sweep(self, now: float) -> None:
        """Forget the first of the sweep's order that have cooled down; the others go to its end."""
        floor = math.log2(FORGET) + now / self.half_life
        for _ in range(min(SWEEP, len(self._scores))):
            key, score = self._scores.popitem(last=False)
            if score >= floor:
                self._scores[key] = score
            else:
                self._top.pop(key, None)  # (a hitter this cold: none is one now)

    def count(self, key: bytes, now: float) -> float:
        """Its decayed count now (0 for one never counted, or forgotten)."""
        score = self._scores.get(key)
        return 0.0 if score is None else self._value(score, now)

    def is_heavy(self, key: bytes, num_engines: int, now: float) -> bool:
        k = num_heavy_hitters(num_engines)
        if k != self._k:  # (the engines changed: ranked once)
            self._k = k
            self._top = dict(sorted(self._scores.items(), key=lambda item: item[1], reverse=True)[:k])
        score = self._top.get(key)
        return score is not None and self._value(score, now) >= 2 * num_engines
