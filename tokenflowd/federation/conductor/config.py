"""The conductor's configuration: its cluster file (`tokenflowd conductor --config cluster.toml`)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import tomllib


@dataclass(frozen=True)
class ConductorConfig:
    """The [conductor] table of cluster.toml, and its [[nodes]] (name, url).

    `link_gbps` is the bandwidth placement assumes between two nodes until any has been measured:
    a prefill node's transfer engine measures what its writes achieved (delivery.py), and the conductor
    prices a prefix fetch from node A to node B at A's measured bandwidth to B, else at A's mean
    measured egress to any peer, else at link_gbps (10 Gb/s, low for RDMA, so that an unmeasured
    link is not oversold). 0: no fetch before a link has been measured."""

    nodes: tuple[tuple[str, str], ...]  # (name, base URL)
    model: str = "smollm2-135m"  # the nodes' model: its tokenizer keys prompts as they do
    host: str = "127.0.0.1"
    port: int = 8000
    ttft_slo: float = 30.0  # s: a request predicted to wait longer for its first token is refused
    tbt_slo: float = 1.0  # s between tokens on the decode node
    balancing_threshold: float = 1.5  # Mooncake's kvcache_balancing_threshold (Algorithm 1)
    rejection: str = "predicted"  # off | current | predicted (Mooncake §7)
    decode_seconds: float = 20.0  # a decode's uniform time until finished ones say otherwise
    poll_interval: float = 0.25  # s between state polls of each node
    api_key: str = ""  # the nodes' API key, for their /federation/state (clients' requests carry their own)
    remote: tuple[str, ...] = ()  # nodes of [[nodes]] with remote = true: the PrfaaS prefill cluster
    # PrfaaS (federation/conductor/remote_prefill.py): a prompt whose uncached part is longer than the threshold is
    # prefilled on a remote node; the threshold is solved again every period from measured figures
    prfaas_threshold: float = 8192  # tokens, until a remote node's transfer to a local one was measured
    prfaas_period: float = 5.0  # s between solves
    prfaas_queue_seconds: float | None = None  # a remote prefill queue beyond this raises t (None: ttft_slo / 4)
    prfaas_retransmit_share: float = 0.02  # a remote node resending more of its TCP segments than this raises t
    prfaas_output_tokens: float = 512  # the mean reply the plan assumes for decode
    prfaas_probe_period: float = 60.0  # s with nothing offloaded nor measured before one long prompt probes the link
    # the long term: the local prefill/decode split solved again, a node converted when it pays
    prfaas_replan_period: float = 600.0  # s between re-plans (0: never convert a node)
    prfaas_convert_gain: float = 0.1  # the predicted throughput gain a conversion must bring
    prfaas_drain_timeout: float = 300.0  # s a node may take to drain before its conversion is given up
    link_gbps: float = 10.0  # Gb/s between two nodes before a transfer between them was measured (0: none)

    @classmethod
    def load(cls, path: str) -> "ConductorConfig":
        with open(path, "rb") as f:
            raw = tomllib.load(f)
        table = dict(raw.get("conductor", {}))
        nodes = raw.get("nodes", [])
        if not nodes:
            raise ValueError(f"{path}: no [[nodes]] (each with name and url)")
        try:
            table["nodes"] = tuple((str(n["name"]), str(n["url"]).rstrip("/")) for n in nodes)
            if any(not isinstance(n.get("remote", False), bool) for n in nodes):
                raise ValueError(f"{path}: a [[nodes]] remote must be true or false")
            table["remote"] = tuple(str(n["name"]) for n in nodes if n.get("remote", False))
        except KeyError as e:
            raise ValueError(f"{path}: every [[nodes]] needs {e.args[0]}") from None
        unknown = set(table) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"{path}: unknown [conductor] keys: {', '.join(sorted(unknown))}")
        config = cls(**table)
        return config

    def __post_init__(self) -> None:
        if self.rejection not in ("off", "current", "predicted"):
            raise ValueError(f"rejection must be off, current or predicted, got {self.rejection!r}")
        unknown = set(self.remote) - {name for name, _ in self.nodes}
        if unknown:
            raise ValueError(f"remote names no node: {', '.join(sorted(unknown))}")
        if not (self.prfaas_threshold >= 0 and self.prfaas_period > 0 and self.prfaas_output_tokens >= 1
                and self.prfaas_probe_period > 0 and 0 < self.prfaas_retransmit_share <= 1):
            raise ValueError("prfaas_threshold must be >= 0, prfaas_period and prfaas_probe_period > 0, "
                             "prfaas_output_tokens >= 1, prfaas_retransmit_share in (0, 1]")
        if not (self.prfaas_replan_period >= 0 and self.prfaas_convert_gain >= 0 and self.prfaas_drain_timeout > 0):
            raise ValueError("prfaas_replan_period and prfaas_convert_gain must be >= 0, prfaas_drain_timeout > 0")
        if not 0 <= self.link_gbps < math.inf:
            raise ValueError(f"link_gbps must be a number of Gb/s, 0 or more, got {self.link_gbps!r}")
