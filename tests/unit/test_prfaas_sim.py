"""PrfaaS deployments on a virtual clock (sim/prfaas_cluster.py): TTFT on hand-computed cases, the
rate a deployment sustains against the throughput model's Λ_max, and the paper's case study:
Table 6's TTFT at a light load, which the model does not give, and where the model's Λ_max is
optimistic."""
from __future__ import annotations

import math

import pytest

from tokenflowd.federation.prfaas import Cluster, DecodeProfile, Lengths, PrefillProfile, evaluate, search
from tokenflowd.sim.prfaas_case import H200_1T, PAPER, case_study, lognormal_lengths
from tokenflowd.sim.prfaas_cluster import Deployment, simulate, sustainable

FLAT = PrefillProfile.linear(seconds_per_token=1e-3, base_seconds=0.0, kv_bytes_per_token=1.0)  # l / 1000 s, l bytes
ONE_PER_S = DecodeProfile(step_seconds=0.1, max_batch=10, output_tokens=100)  # a seat held 10 s


def test_a_lone_request_s_ttft_is_its_prefill_or_its_transfer_whichever_ends_later():
    lengths = Lengths([2000])
    fast_link = Deployment("d", Cluster(1, 2, 1e6, FLAT, FLAT, ONE_PER_S), threshold=1000, n_prefill=1, n_decode=1)
    run = simulate(fast_link, lengths, rate=1e-3, requests=50)
    assert run.offloaded == 1.0 and run.ttft_mean == pytest.approx(2.0)  # 2 s of prefill, the 2 KB cross in 2 ms
    slow_link = Deployment("d", Cluster(1, 2, 500.0, FLAT, FLAT, ONE_PER_S), threshold=1000, n_prefill=1, n_decode=1)
    assert simulate(slow_link, lengths, rate=1e-3, requests=50).ttft_mean == pytest.approx(4.0)  # 2 KB at 500 B/s
    local = Deployment("d", Cluster(1, 2, 500.0, FLAT, FLAT, ONE_PER_S), threshold=math.inf, n_prefill=1, n_decode=1)
    run = simulate(local, lengths, rate=1e-3, requests=50)
    assert run.offloaded == 0.0 and run.ttft_mean == pytest.approx(2.0)


def test_the_rate_a_deployment_sustains_is_the_model_s_lambda_max():
    lengths = Lengths([1000] * 50 + [9000] * 50)
    fast = PrefillProfile.linear(seconds_per_token=2.5e-4, base_seconds=0.0, kv_bytes_per_token=1.0)
    cluster = Cluster(remote=2, local=3, egress=1e9, remote_prefill=fast, local_prefill=FLAT, decode=ONE_PER_S)
    for plan in (search(cluster, lengths), evaluate(cluster, lengths, math.inf, 2), evaluate(cluster, lengths, 0, 1)):
        d = Deployment("d", cluster, plan.threshold, plan.n_prefill, plan.n_decode)
        assert sustainable(d, lengths, 2 * plan.throughput, requests=5_000) == pytest.approx(plan.throughput, rel=0.05)


def test_the_paper_s_case_study_at_a_light_load_gives_table_6_s_ttft():
    lengths = lognormal_lengths(n=50_000)
    study = case_study(lengths)
    for d in study.deployments():
        run = simulate(d, lengths, rate=0.2, requests=5_000)
        mean, p90 = PAPER["ttft"][d.name]
        assert run.ttft_mean == pytest.approx(mean, rel=0.1), d.name
        assert run.ttft_p90 == pytest.approx(p90, rel=0.1), d.name
    # PrfaaS-PD and homogeneous PD sustain what the model predicts
    deployments = {d.name: d for d in study.deployments()}
    for name in ("prfaas", "homogeneous"):
        plan = getattr(study, name)
        assert sustainable(deployments[name], lengths, 2 * plan.throughput, requests=5_000) == pytest.approx(
            plan.throughput, rel=0.05), name
    # naive, less: equation (3) takes T_prefill at the mean length, and H200's profile is convex, so
    # the mean prefill time is longer than the prefill time of the mean (1.69 s against 1.60 s)
    naive = sustainable(deployments["naive"], lengths, 2 * study.naive.throughput, requests=5_000)
    mean_prefill = sum(map(H200_1T.prefill_seconds, lengths.sorted)) / len(lengths)
    assert naive == pytest.approx(4 / mean_prefill, rel=0.03) and naive < 0.96 * study.naive.throughput
