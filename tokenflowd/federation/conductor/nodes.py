"""A node as the conductor last heard of it (its /federation/state)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class NodeView:
    """A node as the conductor last heard of it."""

    name: str
    url: str
    healthy: bool = False
    role: str = "both"
    page_size: int = 16
    engines: list[dict] = field(default_factory=list)
    keys: set[bytes] = field(default_factory=set)
    seq: int = -1  # the last key change applied
    kv_token_bytes: int = 0  # a token's KV, all layers (0: not said)
    kv_endpoints: set[str] = field(default_factory=set)  # its engines' transfer engines
    links: dict[str, float] = field(default_factory=dict)  # peer transfer engine -> bytes/s its writes achieved
    retransmits: float | None = None  # share of its TCP segments sent again lately (None: not measured)
    egress: float = 0.0  # bytes/s its writes to all peers together achieved (0: not measured)

    def apply(self, state: dict) -> None:
        """All of it or nothing: a state with a field of the wrong kind raises before any changes."""
        role, page_size, engines = str(state["role"]), int(state["page_size"]), list(state["engines"])
        token_bytes = int(state.get("kv_token_bytes", 0))
        endpoints = set(state.get("kv_endpoints", ()))
        links = {str(peer): float(bps) for peer, bps in dict(state.get("links", {})).items()}
        retransmits = state.get("tcp_retransmits")
        retransmits = None if retransmits is None else float(retransmits)
        egress = float(state.get("egress", 0.0))
        keys = state["keys"]
        seq = int(keys["seq"])
        snapshot = {bytes.fromhex(k) for k in keys["snapshot"]} if "snapshot" in keys else None
        changes = [] if snapshot is not None else [(bytes.fromhex(k), bool(p)) for k, p in keys["changes"]]
        self.role, self.page_size, self.engines, self.kv_token_bytes = role, page_size, engines, token_bytes
        self.kv_endpoints, self.links, self.seq, self.retransmits, self.egress = endpoints, links, seq, retransmits, egress
        if snapshot is not None:
            self.keys = snapshot
        for key, present in changes:
            (self.keys.add if present else self.keys.discard)(key)

    def prefix_tokens(self, keys: list[bytes]) -> int:
        n = 0
        for key in keys:
            if key not in self.keys:
                break
            n += 1
        return n * self.page_size

    def _best(self) -> dict:
        return min(self.engines, key=lambda e: e["waiting_tokens"] * e["step_per_token"] + e["running"] * 1e-9)

    def queue_seconds(self) -> float:
        e = self._best()
        budget = max(1, e["max_num_batched_tokens"])
        return e["waiting_tokens"] * e["step_per_token"] + math.ceil(e["waiting_tokens"] / budget) * e["step_base"]

    def prefill_seconds(self, prompt: int, cached: int) -> float:
        e = self._best()
        n = max(1, prompt - cached)
        return n * e["step_per_token"] + math.ceil(n / max(1, e["max_num_batched_tokens"])) * e["step_base"]

    def tbt_seconds(self) -> float:
        e = min(self.engines, key=lambda e: e["running"])
        return e["step_base"] + (e["running"] + 1) * e["step_per_token"]

    @property
    def capacity(self) -> int:
        return sum(e["max_num_seqs"] for e in self.engines)

    @property
    def serving(self) -> bool:
        return self.healthy and bool(self.engines)
