"""PrfaaS's plan for a live cluster (`tokenflowd federation plan`): the throughput model
(federation/prfaas.py) fed with what the nodes say of themselves in GET /federation/state, never
with nominal figures.

  - T_prefill(l): a node's step-time model, the one the conductor places with: l tokens in steps
    of at most max_num_batched_tokens, each step base + tokens × per token.
  - S_kv(l): l × the KV bytes of a token the node publishes (its cache's shapes).
  - T_decode and BS_max: the largest batch whose step (base + batch × per token) stays within the
    TBT SLO, no larger than max_num_seqs nor than the requests of the workload's mean size its KV
    pages hold. L_out: the workload's mean output.
  - B_out: the sum over the remote prefill nodes of the bandwidth their transfer engines measured
    on their way out, all peers' writes together (over TCP what the kernel delivered while the
    link set the pace, federation/delivery.py; else the writes' own time, transport.py), once
    they have written to a local node. A link not measured yet counts as none.
  - The lengths: each request's uncached prompt, after the longest prefix of its 512-token blocks
    that an earlier request of the trace already had (an unbounded cache: the most a cluster's
    caches could hold back).
"""
from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass
from typing import Iterable

import aiohttp

from tokenflowd.federation.prfaas import Cluster, DecodeProfile, Lengths, Plan, PrefillProfile, search


@dataclass(frozen=True)
class NodeFigures:
    """One node's engine as its /federation/state describes it (the fastest of its engines)."""

    step_base: float  # s per step
    step_per_token: float  # s per token computed in a step
    budget: int  # max_num_batched_tokens
    max_num_seqs: int
    max_model_len: int
    kv_tokens: int  # tokens its KV pages hold
    kv_token_bytes: int  # KV bytes of one token

    @classmethod
    def of(cls, state: dict) -> "NodeFigures":
        # a per-token cost of 0 is a fit too: a decode node that has only run batches of one request
        # sees every step cost the same (its batch size is then bounded by seats and KV alone)
        engines = [e for e in state.get("engines") or []
                   if e["step_per_token"] >= 0 and e["step_base"] >= 0 and e["step_per_token"] + e["step_base"] > 0]
        if not engines:
            raise ValueError("the node reports no engine with a step-time model")
        e = min(engines, key=lambda e: (e["step_per_token"], e["step_base"]))
        kv_bytes = state.get("kv_token_bytes")
        if not kv_bytes:
            raise ValueError("the node does not publish kv_token_bytes (an older tokenflowd?)")
        return cls(float(e["step_base"]), float(e["step_per_token"]), int(e["max_num_batched_tokens"]),
                   int(e["max_num_seqs"]), int(e["max_model_len"]), int(e["kv_pages_total"]) * int(state["page_size"]),
                   int(kv_bytes))

    def prefill_profile(self) -> PrefillProfile:
        """Exact at 1 token and at every multiple of the step budget up to max_model_len."""
        b = max(1, self.budget)
        lengths = [1, *range(b, max(self.max_model_len, b) + 1, b)]
        if lengths[1] == 1:
            lengths = lengths[1:]
        seconds = [n * self.step_per_token + math.ceil(n / b) * self.step_base for n in lengths]
        return PrefillProfile(tuple(map(float, lengths)), tuple(seconds), tuple(n * self.kv_token_bytes for n in lengths))

    def decode_profile(self, tbt_slo: float, mean_tokens: float, output_tokens: float) -> DecodeProfile:
        batch = min(self.max_num_seqs, max(1, int(self.kv_tokens // max(1.0, mean_tokens))))
        while batch > 1 and self.step_base + batch * self.step_per_token > tbt_slo:
            batch -= 1
        return DecodeProfile(self.step_base + batch * self.step_per_token, batch, output_tokens)


def trace_lengths(lines: Iterable[str], block_tokens: int = 512) -> tuple[Lengths, float, float]:
    """(uncached prompt lengths, mean prompt + output, mean output) of a Mooncake-format trace."""
    seen: set[int] = set()
    uncached, totals, outputs = [], [], []
    for line in lines:
        if not line.strip():
            continue
        r = json.loads(line)
        blocks = r.get("hash_ids") or []
        hit = 0
        while hit < len(blocks) and blocks[hit] in seen:
            hit += 1
        seen.update(blocks)
        uncached.append(max(1, r["input_length"] - hit * block_tokens))
        totals.append(r["input_length"] + r["output_length"])
        outputs.append(r["output_length"])
    if not uncached:
        raise ValueError("the trace holds no request")
    return Lengths(uncached), sum(totals) / len(totals), max(1.0, sum(outputs) / len(outputs))


def egress(remote: Iterable[dict], local: Iterable[dict]) -> float:
    """B_out: Σ over the remote nodes of what their transfer engines measured on their way out (to
    every peer together: writes to two decode nodes at once share the link), or, from a node that
    does not publish that, the mean of its figures to the local nodes' endpoints; 0 when a remote
    node has written to no local node yet."""
    endpoints = {e for state in local for e in state.get("kv_endpoints", [])}
    total = 0.0
    for state in remote:
        measured = [bps for peer, bps in state.get("links", {}).items() if peer in endpoints]
        if measured:
            total += state.get("egress") or sum(measured) / len(measured)
    return total


@dataclass(frozen=True)
class LivePlan:
    plan: Plan
    cluster: Cluster
    remote: tuple[str, ...]
    local: tuple[str, ...]


def plan_cluster(states: dict[str, dict], remote: Iterable[str], lengths: Lengths, mean_tokens: float,
                 output_tokens: float, tbt_slo: float, n_prefill: int | None = None) -> LivePlan:
    """The plan for nodes whose /federation/state is `states` (name -> body); `remote` names the
    PrfaaS prefill nodes (role prefill), every other node is the local PD cluster's. `n_prefill`:
    the local split as it stands (the short term's plan: t alone), else searched too."""
    remote = tuple(n for n in states if n in set(remote))
    local = tuple(n for n in states if n not in remote)
    if not local:
        raise ValueError("no local node answered: a plan needs the PD cluster's nodes")
    for name in remote:
        if states[name].get("role") != "prefill":
            raise ValueError(f"remote node {name} is not a prefill node (role {states[name].get('role')})")
    figures = {name: NodeFigures.of(state) for name, state in states.items()}
    b_out = egress((states[n] for n in remote), (states[n] for n in local))
    if remote and b_out <= 0:
        raise ValueError("no transfer from the remote prefill nodes to the local nodes has been measured yet: "
                         "the plan uses measured bandwidth only (serve some traffic through them first)")

    def slowest(names: tuple[str, ...], step) -> NodeFigures:  # a plan the whole group can keep
        return max((figures[n] for n in names), key=step)

    def full_prefill_step(f: NodeFigures) -> float:
        return f.step_base + f.budget * f.step_per_token

    def full_decode_step(f: NodeFigures) -> float:
        return f.step_base + f.max_num_seqs * f.step_per_token

    # each side's figures from the nodes that do that work now: a decode node's step-time model is
    # fitted on decode steps, and says little of how fast it prefills
    prefilling = slowest(tuple(n for n in local if states[n].get("role") == "prefill") or local, full_prefill_step)
    decoding = slowest(tuple(n for n in local if states[n].get("role") == "decode") or local, full_decode_step)
    cluster = Cluster(len(remote), len(local), b_out,
                      (slowest(remote, full_prefill_step) if remote else prefilling).prefill_profile(),
                      prefilling.prefill_profile(), decoding.decode_profile(tbt_slo, mean_tokens, output_tokens))
    return LivePlan(search(cluster, lengths, n_prefill=n_prefill), cluster, remote, local)


async def fetch_states(nodes: Iterable[tuple[str, str]], api_key: str = "", timeout: float = 10.0) -> dict[str, dict]:
    """GET /federation/state of every node that answers (name -> body)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    out: dict[str, dict] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        async def one(name: str, url: str) -> None:
            try:
                async with session.get(f"{url}/federation/state", headers=headers) as r:
                    r.raise_for_status()
                    out[name] = await r.json()
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
                pass

        await asyncio.gather(*(one(name, url) for name, url in nodes))
    return out
