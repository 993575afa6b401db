"""Which prefix-cache pages the node's engines hold, as the router sees them: one node-wide map from
each page's chained key to the engines holding it.

Each engine's step messages carry the chained page keys its prefix cache published and evicted
since the last one (kv/pages.py drain_key_events); the index applies them, and answers how many
leading pages of a request an engine has and which engines hold a page (the pool's holders). An
engine that goes away takes its keys with it (its successor starts with an empty cache). A front
process that starts beside running engines asks each for a snapshot of its keys first (QueryKeys,
KeySnapshot)."""
from __future__ import annotations

from typing import Iterable, Sequence


class PrefixIndex:
    def __init__(self) -> None:
        self._holders: dict[bytes, set[int]] = {}  # key -> engines holding its page
        self._num_keys: dict[int, int] = {}  # engine -> keys it holds
        self._num_replicated = 0  # keys held by more than one engine

    def _add(self, engine_id: int, key: bytes) -> None:
        held = self._holders.setdefault(key, set())
        if engine_id in held:
            return
        held.add(engine_id)
        self._num_keys[engine_id] = self._num_keys.get(engine_id, 0) + 1
        if len(held) == 2:
            self._num_replicated += 1

    def _remove(self, engine_id: int, key: bytes) -> None:
        if engine_id in self._holders.get(key, ()):
            self._num_keys[engine_id] -= 1
            self._discard(engine_id, key)

    def _discard(self, engine_id: int, key: bytes) -> None:
        held = self._holders[key]
        held.discard(engine_id)
        if len(held) == 1:
            self._num_replicated -= 1
        elif not held:
            del self._holders[key]

    def update(self, engine_id: int, added: Iterable[bytes], removed: Iterable[bytes]) -> None:
        """Apply one step message's key events, in order: removed, then added (a key can be in both)."""
        for key in removed:
            self._remove(engine_id, key)
        for key in added:
            self._add(engine_id, key)

    def replace(self, engine_id: int, keys: Iterable[bytes]) -> None:
        """All the engine holds now (a snapshot): what was known of it before is dropped."""
        self.forget(engine_id)
        for key in keys:
            self._add(engine_id, key)

    def forget(self, engine_id: int) -> None:
        if self._num_keys.pop(engine_id, 0):
            for key in [k for k, held in self._holders.items() if engine_id in held]:
                self._discard(engine_id, key)

    def num_keys(self, engine_id: int) -> int:
        return self._num_keys.get(engine_id, 0)

    def num_replicated(self) -> int:
        """Keys held by more than one engine."""
        return self._num_replicated

    def keys(self) -> list[bytes]:
        """Every key some engine holds."""
        return list(self._holders)

    def holders(self, key: bytes) -> list[int]:
        """The engines that hold the page of `key`."""
        return sorted(self._holders.get(key, ()))

    def cached_pages(self, engine_id: int, keys: Sequence[bytes]) -> int:
        """Leading pages of a request (by chained key) that the engine holds."""
        n = 0
        for key in keys:
            if engine_id not in self._holders.get(key, ()):
                break
            n += 1
        return n
