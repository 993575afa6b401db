"""PrfaaS's case study (prfaas.txt §4, Tables 5 and 6) through the throughput model
(federation/prfaas.py): PrfaaS-PD against homogeneous PD and naive heterogeneous PD.

The setup, as the paper gives it:
  - a 1T hybrid model (Kimi Linear's layout) at 8 GPUs an instance;
  - Table 5: its prefill on 8×H200 at 1K/8K/32K/128K tokens, 0.44/0.72/1.84/7.40 s, with KV of
    190.8/308.9/701.3/2316.3 MiB;
  - prompts: log-normal (μ 9.90, σ 1.00) truncated to [128, 128K] (mean ~27K); outputs 1024 tokens;
    a decode SLO of 40 tokens/s;
  - PrfaaS-PD: 4 H200 instances remote, 8 H20 instances local (96 GPUs in all), a 100 Gbps egress;
  - homogeneous PD: 12 H20 instances (96 H20 GPUs); naive heterogeneous: 4 H200 prefill, 8 H20 decode.

What the paper does not give, derived from Table 6 and labelled so:
  - an H20 instance's prefill time. A line through Table 6's two Θ_pd-p values: homogeneous, 9
    instances → 2.11 req/s at the mean prompt; PrfaaS-PD, 3 → 1.64 at E[L | L ≤ 19.4K]. So the
    Θ_pd-p values of the two PD columns are inputs here, not results.
  - an H20 decode instance's throughput. Θ_pd-d / N_d is 0.78 req/s in all three columns of Table 6:
    BS_max 20 at T_decode = 1/40 s (the SLO) with L_out = 1024.

What the search finds on its own: t, the splits N_p / N_d, the share offloaded, l_long, the egress,
and the naive column (H200 profile and decode only).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from tokenflowd.federation.prfaas import Cluster, DecodeProfile, Lengths, Plan, PrefillProfile, naive, search
from tokenflowd.sim.prfaas_cluster import Deployment

MiB = 1 << 20
H200_1T = PrefillProfile((1024, 8192, 32768, 131072), (0.44, 0.72, 1.84, 7.40),
                         (190.8 * MiB, 308.9 * MiB, 701.3 * MiB, 2316.3 * MiB))
H20_1T = PrefillProfile.linear(seconds_per_token=1.408e-4, base_seconds=0.39, kv_bytes_per_token=0.0)  # derived
H20_DECODE = DecodeProfile(step_seconds=1 / 40, max_batch=20, output_tokens=1024)  # derived
EGRESS = 100e9 / 8  # bytes/s

# Table 6: Λ_max (req/s), and PrfaaS-PD's operating point
PAPER = {"prfaas": 3.24, "homogeneous": 2.11, "naive": 2.45, "threshold": 19_400, "offloaded": 0.496,
         "egress_gbps": 13.0, "split": {"prfaas": (3, 5), "homogeneous": (9, 3), "naive": (0, 8)},
         "ttft": {"prfaas": (2.22, 3.51), "homogeneous": (4.44, 9.73), "naive": (1.74, 3.51)}}  # mean, P90 s


def lognormal_lengths(n: int = 200_000, mu: float = 9.90, sigma: float = 1.00, low: int = 128,
                      high: int = 131_072, seed: int = 0) -> Lengths:
    rng = random.Random(seed)
    out: list[float] = []
    while len(out) < n:
        x = rng.lognormvariate(mu, sigma)
        if low <= x <= high:
            out.append(x)
    return Lengths(out)


@dataclass(frozen=True)
class CaseStudy:
    prfaas: Plan
    homogeneous: Plan
    naive: Plan
    hetero: Cluster  # PrfaaS-PD's and naive's
    homogeneous_cluster: Cluster

    def deployments(self) -> list[Deployment]:
        """The three columns as deployments for the simulator (sim/prfaas_cluster.py)."""
        return [Deployment.of("prfaas", self.hetero, self.prfaas),
                Deployment.of("homogeneous", self.homogeneous_cluster, self.homogeneous),
                Deployment.of("naive", self.hetero, self.naive)]

    def to_dict(self) -> dict:
        return {"prfaas": self.prfaas.to_dict(), "homogeneous": self.homogeneous.to_dict(),
                "naive": self.naive.to_dict(), "paper": PAPER}


def case_study(lengths: Lengths | None = None, egress: float = EGRESS) -> CaseStudy:
    lengths = lengths or lognormal_lengths()
    hetero = Cluster(remote=4, local=8, egress=egress, remote_prefill=H200_1T, local_prefill=H20_1T,
                     decode=H20_DECODE)
    homogeneous = Cluster(remote=0, local=12, egress=0.0, remote_prefill=H200_1T, local_prefill=H20_1T,
                          decode=H20_DECODE)
    return CaseStudy(search(hetero, lengths), search(homogeneous, lengths), naive(hetero, lengths), hetero,
                     homogeneous)
