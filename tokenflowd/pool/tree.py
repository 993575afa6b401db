"""The node-wide prefix tree of segments, and where each segment has replicas.

A node is a segment (segments.py): its key names the whole prefix up to its end, its parent is the
segment before it (None for a prompt's first segment). A node lives while some engine holds a
replica of it. Per replica the tree keeps the time of its last access (eviction is global LRU over
replicas) and how many running queries pin it. Per node it keeps a decayed count of accesses: the
heavy hitters are the nodes with the most.

Accesses decay with a half-life, so the hitters follow the workload: a system prompt that stops
being used stops being replicated.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Iterator, Sequence


@dataclass
class Replica:
    last_access: float
    pins: int = 0


@dataclass
class Node:
    key: bytes
    parent: bytes | None
    tokens: int
    home: int
    replicas: dict[int, Replica] = field(default_factory=dict)
    children: dict[bytes, None] = field(default_factory=dict)  # an ordered set: runs repeat whatever the hash seed
    hits: float = 0.0  # decayed accesses, as of `hits_at`
    hits_at: float = 0.0


class PrefixTree:
    def __init__(self, half_life: float = 60.0) -> None:
        self.half_life = half_life
        self.nodes: dict[bytes, Node] = {}
        self.roots: dict[bytes, None] = {}  # (ordered, as children)

    def __len__(self) -> int:
        return len(self.nodes)

    def __contains__(self, key: bytes) -> bool:
        return key in self.nodes

    def get(self, key: bytes) -> Node | None:
        return self.nodes.get(key)

    # -- shape --------------------------------------------------------------------------------
    def add_replica(self, key: bytes, parent: bytes | None, tokens: int, home: int, engine: int, now: float) -> Node:
        node = self.nodes.get(key)
        if node is None:
            node = self.nodes[key] = Node(key, parent, tokens, home, hits_at=now)
            (self.nodes[parent].children if parent in self.nodes else self.roots)[key] = None
        node.replicas.setdefault(engine, Replica(now))
        return node

    def remove_replica(self, key: bytes, engine: int) -> list[tuple[bytes, int, int]]:
        """Drop one replica. The node goes with its last one, and so does everything below it,
        which no match can reach any more. -> every replica dropped: (key, engine, tokens)."""
        node = self.nodes[key]
        node.replicas.pop(engine, None)
        dropped = [(key, engine, node.tokens)]
        if node.replicas:
            return dropped
        if node.parent in self.nodes:
            self.nodes[node.parent].children.pop(key, None)
        else:
            self.roots.pop(key, None)
        for below in list(self.subtree(key)):
            del self.nodes[below.key]
            dropped.extend((below.key, e, below.tokens) for e in below.replicas)
        return dropped

    def match(self, keys: Sequence[bytes]) -> list[Node]:
        """The nodes of the longest leading run of `keys` that has replicas."""
        found = []
        for key in keys:
            node = self.nodes.get(key)
            if node is None:
                break
            found.append(node)
        return found

    def subtree(self, key: bytes) -> Iterator[Node]:
        stack = [key]
        while stack:
            node = self.nodes.get(stack.pop())
            if node is not None:
                yield node
                stack.extend(node.children)

    # -- accesses -----------------------------------------------------------------------------
    def _decay(self, node: Node, now: float) -> float:
        if now > node.hits_at:
            node.hits *= math.exp2(-(now - node.hits_at) / self.half_life)
            node.hits_at = now
        return node.hits

    def hit(self, node: Node, engine: int, now: float) -> None:
        self._decay(node, now)
        node.hits += 1.0
        node.replicas[engine].last_access = now

    def hits(self, node: Node, now: float) -> float:
        return self._decay(node, now)

    def heavy_hitters(self, k: int, now: float) -> list[Node]:
        """The k nodes with the most (decayed) accesses, by best-first search from the roots.

        A prefix is accessed whenever any extension of it is, so a node has at least as many
        accesses as any child (up to decay) and the search never needs to open a node below the
        k-th best: it visits O(k · fan-out) nodes, not the tree."""
        frontier = [(-self._decay(self.nodes[r], now), r) for r in self.roots]
        heapq.heapify(frontier)
        out: list[Node] = []
        while frontier and len(out) < k:
            _, key = heapq.heappop(frontier)
            node = self.nodes[key]
            out.append(node)
            for child in node.children:
                heapq.heappush(frontier, (-self._decay(self.nodes[child], now), child))
        return out
