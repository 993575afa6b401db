"""PrfaaS's throughput model (prfaas.txt §3.4, Table 4) and its grid search: which requests a
cluster sends to the remote prefill cluster, and how it splits its own nodes between prefill and
decode.

A request whose uncached prompt is longer than the threshold t is prefilled on one of N_prfaas
remote prefill nodes and its KV crosses the egress link (B_out bytes/s); the others are prefilled
on one of the local cluster's N_p prefill nodes; all decode on its N_d decode nodes. With
p = P(L > t), l_long = E[L | L > t], l_short = E[L | L ≤ t]:

    Θ_prfaas = min(N_prfaas / T_prefill(l_long), B_out / S_kv(l_long))        (3)
    Θ_pd-p   = N_p / T_prefill(l_short)                                        (4)
    Θ_pd-d   = N_d · BS_max / (T_decode · L_out)                               (5)
    Λ_max    = min(Θ_prfaas / p, Θ_pd-p / (1 − p), Θ_pd-d)                     (6)

`search` tries every t on a grid of the length sample's quantiles (and "offload nothing", "offload
everything") against every split N_p + N_d of the local nodes, and keeps the largest Λ_max; ties
go to the larger t (less egress) and then to more decode nodes. Homogeneous PD is the search on a
cluster with no remote node; naive heterogeneous PD (all prefill remote, every local node
decodes) is `naive`, the plan at t = 0 with N_p = 0.

The profiles are the nodes' own: `PrefillProfile` interpolates T_prefill and S_kv linearly
between measured lengths (and extends the last segment's slope beyond them), so a profile can be
a paper's table or points taken from a node's live step-time model.
"""
from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Iterable, Sequence


@dataclass(frozen=True)
class PrefillProfile:
    """A prefill node's time and its KV's size at some prompt lengths (ascending)."""

    lengths: tuple[float, ...]
    seconds: tuple[float, ...]  # T_prefill
    kv_bytes: tuple[float, ...]  # S_kv

    def __post_init__(self) -> None:
        if not len(self.lengths) == len(self.seconds) == len(self.kv_bytes) >= 1:
            raise ValueError("a prefill profile needs as many times and KV sizes as lengths, at least one")
        if any(b <= a for a, b in zip(self.lengths, self.lengths[1:])):
            raise ValueError("a prefill profile's lengths must ascend")
        if any(x <= 0 for x in (*self.lengths, *self.seconds)) or any(x < 0 for x in self.kv_bytes):
            raise ValueError("a prefill profile's lengths and times must be above 0, its KV sizes at least 0")

    @classmethod
    def linear(cls, seconds_per_token: float, base_seconds: float, kv_bytes_per_token: float) -> "PrefillProfile":
        """T_prefill(l) = base + l × per token, S_kv(l) = l × bytes per token (a dense model's KV)."""
        return cls((1.0, 2.0), (base_seconds + seconds_per_token, base_seconds + 2 * seconds_per_token),
                   (kv_bytes_per_token, 2 * kv_bytes_per_token))

    def prefill_seconds(self, length: float) -> float:
        return max(1e-9, _interpolate(self.lengths, self.seconds, length))

    def kv_size(self, length: float) -> float:
        return max(0.0, _interpolate(self.lengths, self.kv_bytes, length))


def _interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    if len(xs) == 1:
        return ys[0] * x / xs[0]  # one point: proportional
    i = min(max(bisect.bisect_right(xs, x), 1), len(xs) - 1)  # the segment [i-1, i], or the nearest end's
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class DecodeProfile:
    step_seconds: float  # T_decode: one step at the batch the TBT SLO allows
    max_batch: int  # BS_max
    output_tokens: float  # L_out: mean output length

    @property
    def requests_per_second(self) -> float:
        """One decode node's throughput: Θ_pd-d / N_d."""
        return self.max_batch / (self.step_seconds * self.output_tokens)


@dataclass(frozen=True)
class Cluster:
    remote: int  # N_prfaas
    local: int  # N_p + N_d
    egress: float  # B_out: the remote cluster's egress, bytes/s (measured)
    remote_prefill: PrefillProfile
    local_prefill: PrefillProfile
    decode: DecodeProfile


class Lengths:
    """A sample of uncached prompt lengths, sorted, with prefix sums: P(L > t) and the two
    conditional means in O(log n)."""

    def __init__(self, lengths: Iterable[float]) -> None:
        self.sorted = sorted(float(x) for x in lengths)
        if not self.sorted:
            raise ValueError("no prompt lengths")
        self.sums = [0.0, *itertools.accumulate(self.sorted)]

    def __len__(self) -> int:
        return len(self.sorted)

    def split(self, t: float) -> tuple[float, float, float]:
        """(p, l_long, l_short) at threshold t: the share longer than t and the two means (0 when empty)."""
        n = len(self.sorted)
        k = bisect.bisect_right(self.sorted, t)  # lengths <= t
        short = self.sums[k] / k if k else 0.0
        long = (self.sums[n] - self.sums[k]) / (n - k) if k < n else 0.0
        return (n - k) / n, long, short

    def quantiles(self, n: int) -> list[float]:
        return sorted({self.sorted[min(len(self.sorted) - 1, int(q * len(self.sorted) / n))] for q in range(n)})


@dataclass(frozen=True)
class Plan:
    threshold: float  # t: prompts longer go remote (math.inf: none do)
    n_prefill: int  # N_p
    n_decode: int  # N_d
    offloaded: float  # p
    l_long: float
    l_short: float
    theta_prfaas: float  # req/s
    theta_pd_p: float
    theta_pd_d: float
    throughput: float  # Λ_max, req/s
    egress: float  # bytes/s the remote cluster sends at Λ_max: Λ · p · S_kv(l_long)
    bound: str = ""  # the stage Λ_max stops at: "remote prefill", "link", "local prefill" or "decode"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _ratio(theta: float, share: float) -> float:
    """Θ / share: the arrival rate a stage sustains when `share` of requests reach it (∞ if none do)."""
    return math.inf if share <= 0 else theta / share


def evaluate(cluster: Cluster, lengths: Lengths, threshold: float, n_prefill: int) -> Plan:
    """Equations (3)–(6) at one threshold and one split of the local nodes."""
    if not 0 <= n_prefill <= cluster.local:
        raise ValueError(f"n_prefill must be in [0, {cluster.local}], got {n_prefill}")
    p, l_long, l_short = lengths.split(threshold)
    if p > 0 and cluster.remote == 0:
        raise ValueError("a threshold below the longest prompt needs remote prefill nodes")
    n_decode = cluster.local - n_prefill
    remote_compute = link = 0.0
    if p > 0:
        remote_compute = cluster.remote / cluster.remote_prefill.prefill_seconds(l_long)
        link = _ratio(cluster.egress, cluster.remote_prefill.kv_size(l_long))
    theta_prfaas = min(remote_compute, link)
    theta_pd_p = n_prefill / cluster.local_prefill.prefill_seconds(l_short) if p < 1 else 0.0
    theta_pd_d = n_decode * cluster.decode.requests_per_second
    stages = {"remote prefill": _ratio(remote_compute, p), "link": _ratio(link, p),
              "local prefill": _ratio(theta_pd_p, 1 - p), "decode": theta_pd_d}
    bound = min(stages, key=stages.__getitem__)  # the first of equals, in the order a request meets them
    lam = stages[bound]
    egress = lam * p * cluster.remote_prefill.kv_size(l_long) if p > 0 else 0.0
    return Plan(threshold, n_prefill, n_decode, p, l_long, l_short, theta_prfaas, theta_pd_p, theta_pd_d, lam, egress,
                bound)


def thresholds(lengths: Lengths, grid: int = 2000) -> list[float]:
    """Where t is tried: 0 (everything remote), the sample's quantiles, and math.inf (nothing)."""
    return [0.0, *lengths.quantiles(grid), math.inf]


def search(cluster: Cluster, lengths: Lengths, grid: int = 2000, threshold: float | None = None,
           n_prefill: int | None = None) -> Plan:
    """The plan of largest Λ_max over t (or the one given) and N_p (or the one given)."""
    ts = [threshold] if threshold is not None else (thresholds(lengths, grid) if cluster.remote else [math.inf])
    splits = [n_prefill] if n_prefill is not None else range(cluster.local + 1)
    best: Plan | None = None
    for t in ts:
        for n_p in splits:
            plan = evaluate(cluster, lengths, t, n_p)
            if best is None or (plan.throughput, plan.threshold, plan.n_decode) > (
                    best.throughput, best.threshold, best.n_decode):
                best = plan
    assert best is not None
    return best


def naive(cluster: Cluster, lengths: Lengths) -> Plan:
    """Every prompt prefilled remotely, every local node decoding: no threshold, no balancing."""
    return evaluate(cluster, lengths, 0.0, 0)
