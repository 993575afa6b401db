"""Where segments live and which replica serves an access (TokenLake §4.3).

- **Homes by hash.** A new segment goes to its home engine, picked by rendezvous hashing of its key
  over the live engines (the engine with the highest hash of (key, engine)). It is put there
  whichever engine computed it, and it never migrates. When an engine dies its replicas leave
  the index; a segment computed again later hashes over the engines left, and the other engines'
  segments keep their homes (that is what rendezvous hashing buys over a modulo). The front's
  router deals a prompt's segments round the engines instead (`segment_homes`), which keeps
  both: a prompt's reads spread evenly, and an engine that goes moves only its own segments.
- **Heavy hitters are replicated.** Each engine's load is the prefix tokens it served for others
  and itself, decayed with the tree's half-life. When an engine's load exceeds (1 + slack) times
  the mean, its heavy hitters (the top ⌈N·ln N⌉ + N segments by accesses, found by best-first
  search from the roots) are copied, most accessed first, to the least-loaded engine without a
  copy, until its expected load is back under the bound.
- **Power of two choices.** An access to a segment with several replicas goes to the less loaded
  of two replicas drawn at random.
- **Global LRU over replicas.** When an engine needs room, its replicas that nobody pins go in the
  order of their segment's last access (an access through any replica refreshes them all: power of
  two choices serves a hot segment from each of them in turn, and a replica left out of a few
  draws must not be lost to churn). A path is refreshed deepest first, so a parent is never older
  than its children and LRU reaches leaves first. A segment's last replica takes the segments
  below it along (wherever they are: no match can reach them), unless one of them is pinned. A
  segment that falls out of the heavy hitters is trimmed back to one replica at the next
  rebalance: its home's (the one used last if its home lost it).

Everything here is bookkeeping over keys and engine ids; the engines move the bytes.
"""
from __future__ import annotations

import hashlib
import math
import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

from tokenflowd.pool.tree import Node, PrefixTree


def _rank(key: bytes, engine: int) -> bytes:
    return hashlib.blake2b(key + engine.to_bytes(4, "little"), digest_size=8).digest()


def rendezvous_home(key: bytes, engines: Sequence[int]) -> int:
    """The engine with the highest hash of (key, engine): stable while engines come and go."""
    return max(engines, key=lambda e: _rank(key, e))


def segment_homes(ends: Sequence[bytes], engines: Sequence[int], live: Sequence[int] | None = None) -> list[int]:
    """The home of each whole segment of a prompt, given the keys that end them, in order: the
    segments are dealt round the node's engines in groups of len(engines), each group in the
    rendezvous order of its first segment's key; a segment dealt to an engine not in `live` (gone,
    or not serving yet) goes where its own key hashes over the live ones. Hashed one by one, a
    document's 24 segments over 8 engines put 3 on each only on average (as many as 6, or none):
    every step of every request reading it asks some engines twice as much as others. Dealt in
    groups, each engine holds a whole group's share of it. A segment's home depends only on the
    chain up to it and on which engines serve (a request that computes it again after a cut names
    the same home), and an engine that goes or comes back moves only the segments dealt to it,
    as rendezvous hashing alone would."""
    n = len(engines)
    live = engines if live is None else live
    homes: list[int] = []
    order: list[int] = []
    for i, key in enumerate(ends):
        if i % n == 0:
            order = sorted(engines, key=lambda e: _rank(key, e), reverse=True)
        home = order[i % n]
        homes.append(home if home in live else rendezvous_home(key, live))
    return homes


@dataclass(frozen=True)
class Replication:
    key: bytes
    source: int
    target: int
    tokens: int


class Placement:
    def __init__(self, engines: Sequence[int], *, half_life: float = 60.0, slack: float = 0.1,
                 seed: int = 0) -> None:
        self.engines: list[int] = sorted(engines)
        self.tree = PrefixTree(half_life)
        self.slack = slack
        self.rng = random.Random(seed)
        self._load = {e: 0.0 for e in self.engines}
        self._load_at = {e: 0.0 for e in self.engines}
        self._held = {e: 0 for e in self.engines}  # tokens of replicas each engine holds
        self._lru: dict[int, OrderedDict[bytes, None]] = {e: OrderedDict() for e in self.engines}  # oldest first
        self._replicated: dict[bytes, None] = {}  # segments given more than their home's replica (ordered)

    # -- load ---------------------------------------------------------------------------------
    def load(self, engine: int, now: float) -> float:
        dt = now - self._load_at[engine]
        if dt > 0:
            self._load[engine] *= math.exp2(-dt / self.tree.half_life)
            self._load_at[engine] = now
        return self._load[engine]

    def loads(self, now: float) -> dict[int, float]:
        return {e: self.load(e, now) for e in self.engines}

    def held_tokens(self, engine: int) -> int:
        return self._held[engine]

    def _charge(self, engine: int, tokens: float, now: float) -> None:
        self.load(engine, now)
        self._load[engine] += tokens

    # -- segments -----------------------------------------------------------------------------
    def home(self, key: bytes) -> int:
        return rendezvous_home(key, self.engines)

    def put(self, keys: Sequence[bytes], tokens: Sequence[int], now: float) -> list[tuple[bytes, int]]:
        """A prefix's segments (in order) exist: each one not held anywhere gets a replica at its
        home. -> (key, engine) of each new one: where its KV must be stored."""
        placed = []
        parent: bytes | None = None
        for key, n in zip(keys, tokens):
            if key not in self.tree:
                home = self.home(key)
                self.tree.add_replica(key, parent, n, home, home, now)
                self._held[home] += n
                self._lru[home][key] = None
                placed.append((key, home))
            parent = key
        self._refresh(self.tree.match(keys))
        return placed

    def add_replica(self, key: bytes, engine: int, now: float) -> None:
        node = self.tree.nodes[key]
        if engine not in node.replicas:
            self.tree.add_replica(key, node.parent, node.tokens, node.home, engine, now)
            self._held[engine] += node.tokens
            self._lru[engine][key] = None
            self._replicated[key] = None

    def route(self, keys: Sequence[bytes], now: float) -> list[tuple[Node, int]]:
        """The cached leading segments of a prefix, each with the replica that serves this access
        (power of two choices), charged to that replica's engine."""
        out = []
        for node in self.tree.match(keys):
            engine = self._choose(node, now)
            self.tree.hit(node, engine, now)
            self._charge(engine, node.tokens, now)
            out.append((node, engine))
        self._refresh([node for node, _ in out])
        return out

    def _refresh(self, path: Sequence[Node]) -> None:
        """An access keeps every replica of the path's segments (each serves a share of the
        segment's accesses), deepest first: a parent is never older than its children, so LRU
        reaches a chain's leaves before the prefix they hang from."""
        for node in reversed(path):
            for holder in node.replicas:
                self._lru[holder].move_to_end(node.key)

    def _choose(self, node: Node, now: float) -> int:
        holders = list(node.replicas)
        if len(holders) == 1:
            return holders[0]
        a, b = self.rng.sample(holders, 2)
        return a if self.load(a, now) <= self.load(b, now) else b

    # -- balance ------------------------------------------------------------------------------
    def num_heavy_hitters(self) -> int:
        n = len(self.engines)
        return math.ceil(n * math.log(max(n, 2))) + n

    def rebalance(self, now: float) -> list[Replication]:
        """Replicate the heavy hitters of every overloaded engine (see the module docstring)."""
        loads = self.loads(now)
        if len(self.engines) < 2:
            return []
        mean = sum(loads.values()) / len(loads)
        bound = (1 + self.slack) * mean
        hitters = self.tree.heavy_hitters(self.num_heavy_hitters(), now)
        self._trim(hitters)
        plans = []
        for engine in sorted(self.engines, key=lambda e: -loads[e]):
            if loads[engine] <= bound:
                break
            for node in hitters:
                if engine not in node.replicas or loads[engine] <= bound:
                    continue
                targets = [e for e in self.engines if e not in node.replicas]
                if not targets:
                    continue
                target = min(targets, key=lambda e: loads[e])
                if loads[target] >= loads[engine]:
                    continue
                # The node's recent load, spread evenly over r replicas, spreads over r + 1: the
                # target takes 1/(r + 1) of it, each holder gives up 1/(r(r + 1)).
                total, r = self.tree.hits(node, now) * node.tokens, len(node.replicas)
                for holder in node.replicas:
                    loads[holder] -= total / (r * (r + 1))
                loads[target] += total / (r + 1)
                self.add_replica(node.key, target, now)
                plans.append(Replication(node.key, engine, target, node.tokens))
        for e, value in loads.items():  # the expected loads, until accesses say otherwise
            self._load[e], self._load_at[e] = max(value, 0.0), now
        return plans

    def _trim(self, hitters: list[Node]) -> None:
        """A segment that is no longer a heavy hitter keeps one replica: its home's where it has one."""
        hot = {node.key for node in hitters}
        for key in [k for k in self._replicated if k not in hot]:
            node = self.tree.get(key)
            if node is None or len(node.replicas) < 2:
                self._replicated.pop(key, None)
                continue
            keep = node.home if node.home in node.replicas else max(node.replicas,
                                                                     key=lambda e: node.replicas[e].last_access)
            for engine in [e for e, r in node.replicas.items() if e != keep and not r.pins]:
                for k, e, n in self.tree.remove_replica(key, engine):
                    self._held[e] -= n
                    self._lru[e].pop(k, None)
            if len(node.replicas) < 2:  # a pinned extra replica is trimmed at a later pass
                self._replicated.pop(key, None)

    # -- eviction -----------------------------------------------------------------------------
    def _may_evict(self, node: Node, engine: int) -> bool:
        """Not pinned; and if it is the segment's last replica, nothing below it is pinned either
        (its descendants go with it)."""
        if node.replicas[engine].pins:
            return False
        if len(node.replicas) > 1 or not node.children:
            return True
        return not any(r.pins for below in self.tree.subtree(node.key) for r in below.replicas.values())

    def evictable(self, engine: int) -> list[Node]:
        """This engine's replicas that may go, least recently accessed first."""
        nodes = (self.tree.nodes[key] for key in self._lru[engine])
        return [node for node in nodes if self._may_evict(node, engine)]

    def evict(self, engine: int, tokens: int) -> list[tuple[bytes, int]]:
        """Free at least `tokens` of this engine's replicas (fewer if not enough may go), by global
        LRU. -> every (key, engine) replica dropped."""
        dropped: list[tuple[bytes, int]] = []
        freed = 0
        progress = True
        while freed < tokens and progress:
            progress = False
            for key in list(self._lru[engine]):
                if freed >= tokens:
                    break
                node = self.tree.get(key)
                if node is None or engine not in node.replicas or not self._may_evict(node, engine):
                    continue
                for k, e, n in self.tree.remove_replica(key, engine):
                    self._held[e] -= n
                    self._lru[e].pop(k, None)
                    dropped.append((k, e))
                    freed += n if e == engine else 0
                progress = True
        return dropped

    def pin(self, node: Node, engine: int) -> None:
        node.replicas[engine].pins += 1

    def unpin(self, key: bytes, engine: int) -> None:
        node = self.tree.get(key)
        if node is not None and engine in node.replicas:
            replica = node.replicas[engine]
            if replica.pins <= 0:
                raise ValueError("unpin of a replica nobody pinned")
            replica.pins -= 1

    # -- engines ------------------------------------------------------------------------------
    def drop_engine(self, engine: int) -> list[tuple[bytes, int]]:
        """An engine is gone: its replicas leave the index at once, and so does every segment no
        longer reachable (its only copy of an ancestor died). -> (key, engine) of replicas other
        engines must free."""
        dropped = []
        for node in [n for n in self.tree.nodes.values() if engine in n.replicas]:
            if node.key in self.tree and engine in node.replicas:
                dropped += self.tree.remove_replica(node.key, engine)
        self.engines.remove(engine)
        for k, e, n in dropped:
            self._held[e] -= n
            self._lru[e].pop(k, None)
        del self._load[engine], self._load_at[engine], self._held[engine], self._lru[engine]
        return [(k, e) for k, e, _ in dropped if e != engine]

    def add_engine(self, engine: int, now: float) -> None:
        if engine not in self.engines:
            self.engines = sorted([*self.engines, engine])
            self._load[engine], self._load_at[engine], self._held[engine] = 0.0, now, 0
            self._lru[engine] = OrderedDict()
