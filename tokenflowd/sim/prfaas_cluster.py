"""PrfaaS deployments on a virtual clock (prfaas.txt §4): what the throughput model
(federation/prfaas.py) predicts as Λ_max, measured by replaying requests through the stages it
models, and the TTFT the model does not give.

    arrival ─► longer than t? ─ yes ─► remote prefill nodes ─► egress link (B_out) ─┐
                              └ no ──► local prefill nodes ─────────────────────────┤
                                                                                    ▼
                                         decode seats: N_d × BS_max, each held T_decode × L_out

- Arrivals are Poisson at the offered rate, prompt lengths drawn from the deployment's sample
  (continuous times: no two arrive at once, so no tie order decides anything).
- A prefill node serves one request at a time, T_prefill(l) of its profile; each pool is one FIFO
  queue in front of its nodes (a request takes the node free soonest).
- The egress link carries KV bytes first come, first served at B_out. A transfer streams while
  its prefill runs (layer-wise): it may start when its prefill starts, it holds the link for
  S_kv(l) / B_out, and the KV is whole no sooner than the prefill's end. KV inside the PD cluster
  (RDMA) takes no time, as in the model.
- Decode: N_d × BS_max seats, first come first served, each held for L_out steps of T_decode.
- TTFT: arrival to the KV at a decode seat, where the first token streams from: the prefill queue,
  the prefill, the transfer and the wait for a seat.

`sustainable` finds by bisection the largest offered rate at which the requests keep reaching
decode as they arrive: the simulated Λ_max.

NOTE: equation (3) takes T_prefill at the mean length of the prompts a pool serves. A pool serves
at N / E[T_prefill(L)], which is less wherever the profile is convex: on the case study's H200
profile, naive heterogeneous PD sustains 4 / 1.69 s = 2.37 req/s where the model says 2.50.
"""
from __future__ import annotations

import heapq
import math
import random
import statistics
from dataclasses import dataclass

from tokenflowd.federation.prfaas import Cluster, Lengths, Plan


@dataclass(frozen=True)
class Deployment:
    """One column of Table 6: a cluster, its threshold t and its local split."""

    name: str
    cluster: Cluster
    threshold: float  # prompts longer go remote (math.inf: none; 0: all)
    n_prefill: int
    n_decode: int

    @classmethod
    def of(cls, name: str, cluster: Cluster, plan: Plan) -> "Deployment":
        return cls(name, cluster, plan.threshold, plan.n_prefill, plan.n_decode)


@dataclass(frozen=True)
class Run:
    rate: float  # offered, req/s
    throughput: float  # finished req/s while arrivals went on (the first 20% of them left out)
    kept_up: float  # the share of the requests that arrived in that time that had reached decode by its end
    ttft_mean: float  # over every request, the first 20% too
    ttft_p90: float
    offloaded: float  # share of requests prefilled remotely

    def to_dict(self) -> dict:
        return {"rate": self.rate, "throughput": self.throughput, "kept_up": self.kept_up, "ttft_mean": self.ttft_mean,
                "ttft_p90": self.ttft_p90, "offloaded": self.offloaded}


def simulate(d: Deployment, lengths: Lengths, rate: float, requests: int = 20_000, seed: int = 0) -> Run:
    rng = random.Random(seed)
    sample = lengths.sorted
    c = d.cluster
    remote_free = [0.0] * c.remote  # heaps: when each node is next free
    local_free = [0.0] * d.n_prefill
    link_free = 0.0
    ready: list[tuple[float, float]] = []  # (KV at decode, arrival)
    now = offloaded = 0
    for _ in range(requests):
        now += rng.expovariate(rate)
        length = sample[rng.randrange(len(sample))]
        remote = length > d.threshold or not local_free
        if remote and not remote_free:
            raise ValueError(f"{d.name}: a prompt of {length:.0f} tokens has no prefill node to go to")
        nodes, profile = (remote_free, c.remote_prefill) if remote else (local_free, c.local_prefill)
        start = max(now, heapq.heappop(nodes))
        end = start + profile.prefill_seconds(length)
        heapq.heappush(nodes, end)
        if remote:
            offloaded += 1
            link_free = max(link_free, start) + profile.kv_size(length) / c.egress
            end = max(end, link_free)
        ready.append((end, now))
    ready.sort()
    hold = c.decode.step_seconds * c.decode.output_tokens
    seats = [0.0] * (d.n_decode * c.decode.max_batch)
    seated = []  # (arrival, when it took a decode seat)
    for at, arrived in ready:
        seat = max(at, heapq.heappop(seats))
        heapq.heappush(seats, seat + hold)
        seated.append((arrived, seat))
    arrivals = sorted(a for a, _ in seated)
    lo, hi = arrivals[len(arrivals) // 5], arrivals[-1]
    done = sum(lo <= s + hold <= hi for _, s in seated)
    window = [s for a, s in seated if a >= lo]
    ttfts = sorted(s - a for a, s in seated)
    return Run(rate, done / (hi - lo) if hi > lo else math.nan, sum(s <= hi for s in window) / len(window),
               statistics.fmean(ttfts), ttfts[int(0.9 * (len(ttfts) - 1))], offloaded / requests)


def sustainable(d: Deployment, lengths: Lengths, high: float, requests: int = 20_000, tolerance: float = 0.01,
                seed: int = 0, steps: int = 12) -> float:
    """The largest offered rate in (0, high] at which all but `tolerance` of the requests reach
    decode by the last arrival (those within a TTFT of it cannot: ~0.1% at the case study's rates;
    a stage over its capacity by x on a share s of the requests leaves about s·x behind)."""
    lo, hi = 0.0, high
    for _ in range(steps):
        mid = (lo + hi) / 2
        if simulate(d, lengths, mid, requests, seed).kept_up >= 1 - tolerance:
            lo = mid
        else:
            hi = mid
    return lo
