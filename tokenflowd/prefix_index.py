"""Which prefix-cache pages each engine holds, as the router sees them.

Each engine's step messages carry the chained page keys its prefix cache published and evicted
since the last one (kv/pages.py drain_key_events); the index keeps one key set per engine from
them, and answers how many leading pages of a request an engine has. An engine that goes away
takes its keys with it (its successor starts with an empty cache). A front process that starts
beside running engines asks each for a snapshot of its keys first (QueryKeys, KeySnapshot)."""
from __future__ import annotations

from typing import Iterable, Sequence


class PrefixIndex:
    def __init__(self) -> None:
        self._keys: dict[int, set[bytes]] = {}

    def update(self, engine_id: int, added: Iterable[bytes], removed: Iterable[bytes]) -> None:
        """Apply one step message's key events, in order: removed, then added (a key can be in both)."""
        keys = self._keys.setdefault(engine_id, set())
        keys.difference_update(removed)
        keys.update(added)

    def replace(self, engine_id: int, keys: Iterable[bytes]) -> None:
        """All the engine holds now (a snapshot): what was known of it before is dropped."""
        self._keys[engine_id] = set(keys)

    def forget(self, engine_id: int) -> None:
        self._keys.pop(engine_id, None)

    def num_keys(self, engine_id: int) -> int:
        return len(self._keys.get(engine_id, ()))

    def num_replicated(self) -> int:
        """Keys held by more than one engine."""
        seen: set[bytes] = set()
        twice: set[bytes] = set()
        for held in self._keys.values():
            twice.update(held & seen)
            seen.update(held)
        return len(twice)

    def holders(self, key: bytes) -> list[int]:
        """The engines that hold the page of `key`."""
        return [e for e, held in self._keys.items() if key in held]

    def cached_pages(self, engine_id: int, keys: Sequence[bytes]) -> int:
        """Leading pages of a request (by chained key) that the engine holds."""
        held = self._keys.get(engine_id, ())
        n = 0
        for key in keys:
            if key not in held:
                break
            n += 1
        return n
