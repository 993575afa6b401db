"""Which segments are hot: decayed access counts, and the heavy hitters among them (TokenLake §4).

The front counts each segment a request reads (its key: the chained key of its last page). Counts
halve every `half_life` seconds, so a prefix that stops being used cools down. The heavy hitters
are the ⌈N ln N⌉ + N hottest segments for N engines, the number the paper's balls-into-bins bound
asks for (pool/homes.py uses the same), among those read at least twice per engine (with
fewer segments than that, every segment would otherwise be a hitter from its first read).
Torch-free: the API server process runs it.
"""
from __future__ import annotations

import math


def num_heavy_hitters(num_engines: int) -> int:
    n = max(1, num_engines)
    return math.ceil(n * math.log(n)) + n


class SegmentHeat:
    def __init__(self, half_life: float = 60.0, refresh: float = 1.0) -> None:
        self.half_life = half_life
        self.refresh = refresh  # s between recomputations of the hitter set
        self._hits: dict[bytes, tuple[float, float]] = {}  # key -> (decayed count, as of)
        self._hot: set[bytes] = set()
        self._hot_at = -math.inf
        self._hot_k = 0
        self._floor = 0.0  # the k-th hottest value when the set was made (0: fewer keys than k)

    def _value(self, key: bytes, now: float) -> float:
        count, at = self._hits.get(key, (0.0, now))
        return count * 0.5 ** ((now - at) / self.half_life)

    def hit(self, key: bytes, now: float) -> None:
        self._hits[key] = (self._value(key, now) + 1.0, now)

    def is_heavy(self, key: bytes, num_engines: int, now: float) -> bool:
        k = num_heavy_hitters(num_engines)
        value = self._value(key, now)
        # made again every `refresh` s, and at once when a key outside it has grown past its coldest
        # (values decay alike, so that one's value then, decayed to now): a prefix that turns hot
        # in a burst is a hitter from the read that makes it one, not up to `refresh` s later
        floor = self._floor * 0.5 ** ((now - self._hot_at) / self.half_life)
        entered = key not in self._hot and value >= 2 * num_engines and value > floor
        if now - self._hot_at >= self.refresh or k != self._hot_k or entered:
            values = {key: self._value(key, now) for key in self._hits}
            for cold in [key for key, v in values.items() if v < 0.01]:  # forgotten
                del self._hits[cold]
                del values[cold]
            ranked = sorted(values, key=values.__getitem__, reverse=True)
            self._hot = set(ranked[:k])
            self._floor = values[ranked[k - 1]] if len(ranked) >= k else 0.0
            self._hot_at, self._hot_k = now, k
        return key in self._hot and value >= 2 * num_engines
