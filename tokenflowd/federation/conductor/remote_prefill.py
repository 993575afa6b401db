"""PrfaaS's selective offload (prfaas.txt §3.4.3, short term): the conductor sends a request's
prefill to the remote prefill nodes (`remote = true` in [[nodes]]) if and only if its uncached
prompt, after the longest prefix a local prefill node holds, is longer than the threshold t.

Every `prfaas_period` s the conductor solves t again with the throughput model (prfaas.py) on what
it sees now: the recent requests' uncached lengths, the nodes' step-time models, and B_out, the
bandwidth the remote nodes' links achieved to the local nodes over their last transfers (delivery.py
over TCP, else the writes' own time: transport.py). The local prefill/decode split is taken as it
stands (the long term changes it). A link that slows raises t: fewer, longer prompts cross it. On
top, while the remote prefill queue surges past `prfaas_queue_seconds`, or TCP on a remote node
resends more than `prfaas_retransmit_share` of its segments (congestion.py: the egress nearing its
ceiling), t is raised by a quarter each period; once they ease, the next solve starts from the model
again.

Until a transfer from a remote node to a local one has been measured, t stays at the operator's
`prfaas_threshold`: the model never runs on a nominal bandwidth. A link is measured only by what
crosses it, so when t keeps every prompt local (an operator's t above them all, or a slow link
that raised it), nothing would ever measure the link, or its recovery: after `prfaas_probe_period`
s with no new figure and nothing offloaded, the next prompt at least as long as the recent 90th
percentile is sent remote as a probe, and the solve after it sees the link as it is now.

The long term (`split`): every `prfaas_replan_period` s the split N_p / N_d of the local nodes is
solved too. When the best split predicts a Λ_max at least `prfaas_convert_gain` above the split as
it stands, one node of the surplus role (the least busy) is converted: the conductor stops placing
on it, and asks it to take the other role (POST /federation/role) until it has no work of its old
role left; its streams end as they would have (conductor.py).
"""
from __future__ import annotations

import logging
import math
from collections import deque
from typing import Iterable

from tokenflowd.federation.conductor.nodes import NodeView
from tokenflowd.federation.plan import egress, plan_cluster
from tokenflowd.federation.prfaas import Lengths, evaluate

log = logging.getLogger("tokenflowd.conductor")

MIN_LENGTHS = 20  # requests seen before the model replaces the configured threshold
SURGE = 1.25  # t's rise per period while the remote queue surges or its TCP resends


def state_of(node: NodeView) -> dict:
    """The node as /federation/state described it, for plan.py."""
    return {"role": node.role, "page_size": node.page_size, "engines": node.engines,
            "kv_token_bytes": node.kv_token_bytes, "kv_endpoints": sorted(node.kv_endpoints), "links": node.links,
            "egress": node.egress}


class RemotePrefill:
    def __init__(self, threshold: float, output_tokens: float, tbt_slo: float, queue_seconds: float,
                 probe_seconds: float = 60.0, retransmit_share: float = 0.02, window: int = 2000) -> None:
        self.threshold = threshold  # t, uncached tokens
        self.probe_seconds, self.retransmit_share = probe_seconds, retransmit_share
        self.congested = False  # at the last solve, a remote node's TCP resent more than retransmit_share
        self.probe_floor: float | None = None  # set: the next prompt at least this long goes remote (a probe)
        self.probes = 0
        self._measured = (-1.0, 0.0, 0)  # (B_out, since when it has stood, requests offloaded then)
        self.output_tokens, self.tbt_slo, self.queue_seconds = output_tokens, tbt_slo, queue_seconds
        self.lengths: deque[int] = deque(maxlen=window)  # recent requests' uncached prompt lengths
        self.prompts: deque[int] = deque(maxlen=window)  # ... and whole prompts
        self.offloaded = 0
        self.egress = 0.0  # B_out of the last solve, bytes/s
        self.planned: float | None = None  # Λ_max of the last solve, req/s
        self.bound: str | None = None  # ... and the stage it stops at (prfaas.Plan.bound)

    def route(self, prompt: int, uncached: int, remote_serving: bool = True) -> bool:
        """Whether this request's prefill goes to the remote nodes. Every request is recorded for the
        next solve, remote nodes serving or not: the long term plans a PD cluster without them too."""
        remote = remote_serving and uncached > self.threshold
        if remote_serving and self.probe_floor is not None and not remote and uncached >= self.probe_floor:
            remote, self.probe_floor = True, None
            self.probes += 1
            log.info("offload probe: a %d-token prompt goes remote to measure the link", uncached)
        self.lengths.append(uncached)
        self.prompts.append(prompt)
        self.offloaded += remote
        return remote

    def update(self, remote: Iterable[NodeView], local: Iterable[NodeView], now: float) -> float:
        """Solve t again for the nodes serving now (`now`: monotonic s); -> the new t."""
        remote = [n for n in remote if n.serving]
        local = [n for n in local if n.serving]
        if not remote or not local or len(self.lengths) < MIN_LENGTHS:
            return self.threshold
        states = {n.name: state_of(n) for n in (*remote, *local)}
        b_out = egress((states[n.name] for n in remote), (states[n.name] for n in local))
        self.congested = any((n.retransmits or 0.0) > self.retransmit_share for n in remote)
        self._probe(b_out, now)
        if b_out <= 0:  # nothing measured yet: the operator's t stands
            return self.threshold
        mean = sum(self.prompts) / len(self.prompts) + self.output_tokens
        n_prefill = sum(n.role == "prefill" for n in local)
        try:
            live = plan_cluster(states, [n.name for n in remote], Lengths(self.lengths), mean, self.output_tokens,
                                self.tbt_slo, n_prefill=n_prefill)
        except ValueError as e:  # a node that does not say enough of itself
            log.info("offload threshold kept at %s: %s", self.threshold, e)
            return self.threshold
        t = live.plan.threshold
        if self.congested or max(n.queue_seconds() for n in remote) > self.queue_seconds:
            t = SURGE * min(max(t, self.threshold), max(self.lengths))  # surging: send fewer there
        if t != self.threshold:
            log.info("offload threshold %s -> %s tokens (egress %.3g Gb/s measured, Λ_max %.3g req/s)",
                     _tokens(self.threshold), _tokens(t), b_out * 8 / 1e9, live.plan.throughput)
        self.threshold, self.egress, self.planned, self.bound = t, b_out, live.plan.throughput, live.plan.bound
        return t

    def _probe(self, b_out: float, now: float) -> None:
        """A link is measured only by what crosses it: after probe_seconds with no new figure and
        nothing offloaded, the next prompt at least as long as the recent 90th percentile goes
        remote. At most one probe a probe period, whether or not its transfer measures anything."""
        figure, since, offloaded = self._measured
        if b_out != figure or self.offloaded != offloaded:  # measured anew, or prompts cross the link
            self._measured = (b_out, now, self.offloaded)
        elif now - since >= self.probe_seconds:
            ordered = sorted(self.lengths)
            self.probe_floor = ordered[int(0.9 * (len(ordered) - 1))]
            self._measured = (b_out, now, self.offloaded)

    def split(self, remote: Iterable[NodeView], local: Iterable[NodeView], gain: float) -> tuple[str, str] | None:
        """(node, its new role) when converting one local node improves the predicted Λ_max by `gain`
        (a share) or more; None otherwise, or when the figures are not there yet."""
        remote = [n for n in remote if n.serving]
        local = [n for n in local if n.serving and n.role in ("prefill", "decode")]
        if len(local) < 2 or len(self.lengths) < MIN_LENGTHS:
            return None
        states = {n.name: state_of(n) for n in (*remote, *local)}
        mean = sum(self.prompts) / len(self.prompts) + self.output_tokens
        try:
            live = plan_cluster(states, [n.name for n in remote], Lengths(self.lengths), mean, self.output_tokens,
                                self.tbt_slo)
        except ValueError:
            return None
        now_p = sum(n.role == "prefill" for n in local)
        best = live.plan
        current = evaluate(live.cluster, Lengths(self.lengths), best.threshold, now_p).throughput
        if best.n_prefill == now_p or best.throughput < (1 + gain) * current:
            return None
        old, new = ("decode", "prefill") if best.n_prefill > now_p else ("prefill", "decode")
        candidates = [n for n in local if n.role == old]
        if not candidates:
            return None
        node = min(candidates, key=lambda n: sum(e["running"] + e["waiting"] for e in n.engines))
        log.info("re-plan: %d prefill / %d decode nodes predict %.3g req/s against %.3g now: %s %s -> %s",
                 best.n_prefill, best.n_decode, best.throughput, current, node.name, old, new)
        return node.name, new


def _tokens(t: float) -> str:
    return "none" if math.isinf(t) else f"{t:.0f}"
