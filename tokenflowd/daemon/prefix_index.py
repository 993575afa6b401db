"""Which prefix-cache pages the node's engines hold, as the router sees them: one node-wide map from
each page's chained key to the engines holding it.

Each engine's step messages carry the chained page keys its prefix cache published and evicted
since the last one (kv/pages.py drain_key_events); the index applies them, and answers how many
leading pages of a request an engine has and which engines hold a page (the pool's holders). An
engine that goes away takes its keys with it (its successor starts with an empty cache). A front
process that starts beside running engines asks each for a snapshot of its keys first (QueryKeys,
KeySnapshot).

With the pool, it also follows where chains end, node-wide. The router links each pooled prompt's
keys (`link`: a page's key and the key before it); a key is inner while some engine holds it and
some engine holds a page that follows it. When a key becomes inner or stops being so, or is
orphaned (no engine holds the page before it any more, so no match reaches it), the engines holding
it are told (`drain_marks`, applied by kv/pages.py `set_inner`): eviction then takes chains from
their ends across the node, not a middle page that cuts every later one off. Links of keys that no
engine holds are pruned once the links outnumber twice the held keys (a later reader links them
again)."""
from __future__ import annotations

from typing import Iterable, Sequence


MIN_LINKS = 65_536  # links kept whatever is held, before unheld ones are pruned


class PrefixIndex:
    def __init__(self) -> None:
        self._holders: dict[bytes, set[int]] = {}  # key -> engines holding its page
        self._num_keys: dict[int, int] = {}  # engine -> keys it holds
        self._num_replicated = 0  # keys held by more than one engine
        self._parent: dict[bytes, bytes] = {}  # key -> the key before it (linked prompts)
        self._children: dict[bytes, dict[bytes, None]] = {}  # ordered sets: runs repeat whatever the hash seed
        # engine -> (inner, ends or orphans), ordered sets: a key in one of them, by its last mark
        self._marks: dict[int, tuple[dict[bytes, None], dict[bytes, None]]] = {}

    def _add(self, engine_id: int, key: bytes) -> None:
        held = self._holders.setdefault(key, set())
        if engine_id in held:
            return
        held.add(engine_id)
        self._num_keys[engine_id] = self._num_keys.get(engine_id, 0) + 1
        if len(held) == 2:
            self._num_replicated += 1
        if self._parent or self._children:
            self._gained(key, engine_id, first=len(held) == 1)

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
            if self._parent or self._children:
                self._lost(key)

    # -- where chains end ---------------------------------------------------------------------
    def link(self, keys: Sequence[bytes]) -> None:
        """A prompt's chained page keys, in order: each follows the one before it."""
        for before, key in zip(keys, keys[1:]):
            if key in self._parent:
                continue
            self._parent[key] = before
            self._children.setdefault(before, {})[key] = None
            if key in self._holders and before in self._holders:
                self._mark(before, True)
        if len(self._parent) > max(MIN_LINKS, 2 * len(self._holders)):
            self._prune()

    def drain_marks(self) -> dict[int, tuple[list[bytes], list[bytes]]]:
        """engine -> (keys now inner, keys now a chain's end or orphaned) since the last call, each
        key in one list only, by its last mark (the engine applies the inner ones first)."""
        marks, self._marks = self._marks, {}
        return {e: (list(inner), list(ends)) for e, (inner, ends) in marks.items()}

    def _is_inner(self, key: bytes) -> bool:
        return any(c in self._holders for c in self._children.get(key, ()))

    def _mark(self, key: bytes, inner: bool, engines: Iterable[int] | None = None) -> None:
        for e in self._holders.get(key, ()) if engines is None else engines:
            marks = self._marks.setdefault(e, ({}, {}))
            marks[1 if inner else 0].pop(key, None)  # (a later mark overrides an earlier one)
            marks[0 if inner else 1][key] = None

    def _gained(self, key: bytes, engine_id: int, first: bool) -> None:
        if not first:  # a replica: as inner as the others
            if self._is_inner(key):
                self._mark(key, True, (engine_id,))
            return
        parent = self._parent.get(key)
        if parent in self._holders and sum(c in self._holders for c in self._children[parent]) == 1:
            self._mark(parent, True)  # its first cached follower
        stack = [key]  # a hole filled: what follows it is reachable again
        while stack:
            k = stack.pop()
            held = [c for c in self._children.get(k, ()) if c in self._holders]
            if held:
                self._mark(k, True)
                stack += held

    def _lost(self, key: bytes) -> None:
        parent = self._parent.get(key)
        if parent in self._holders and not self._is_inner(parent):
            self._mark(parent, False)  # a chain's end now
        stack = [c for c in self._children.get(key, ()) if c in self._holders]
        while stack:  # orphans: no match reaches them
            k = stack.pop()
            self._mark(k, False)
            stack += [c for c in self._children.get(k, ()) if c in self._holders]

    def _prune(self) -> None:
        for key in [k for k in self._parent if k not in self._holders]:  # (a reader links them again)
            parent = self._parent.pop(key)
            kids = self._children.get(parent)
            if kids is not None:
                kids.pop(key, None)
                if not kids:
                    del self._children[parent]

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
