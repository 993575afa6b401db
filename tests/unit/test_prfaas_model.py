"""PrfaaS's throughput model (federation/prfaas.py) on hand-computed cases, its grid search on a
toy cluster whose optimum is known, and the paper's case study (sim/prfaas_case.py)."""
from __future__ import annotations

import json
import math

import pytest

from tokenflowd.federation.prfaas import Cluster, DecodeProfile, Lengths, PrefillProfile, evaluate, naive, search
from tokenflowd.sim.prfaas_case import PAPER, case_study, lognormal_lengths

# T_prefill(l) = l / 1000 s on both sides, S_kv(l) = l bytes; a decode node serves 1 req/s.
FLAT = PrefillProfile.linear(seconds_per_token=1e-3, base_seconds=0.0, kv_bytes_per_token=1.0)
ONE_PER_S = DecodeProfile(step_seconds=0.1, max_batch=10, output_tokens=100)


def test_profiles_interpolate_between_measured_lengths_and_extend_the_last_slope():
    p = PrefillProfile((1000, 2000, 4000), (1.0, 3.0, 4.0), (10.0, 20.0, 40.0))
    assert p.prefill_seconds(1500) == pytest.approx(2.0) and p.kv_size(3000) == pytest.approx(30.0)
    assert p.prefill_seconds(6000) == pytest.approx(5.0)  # the last segment's slope, 0.5 s per 1000
    assert 0 < p.prefill_seconds(500) < 1e-6  # the first segment's slope reaches 0 there: kept above it
    with pytest.raises(ValueError):
        PrefillProfile((2000, 1000), (1.0, 2.0), (1.0, 2.0))


def test_lengths_split_into_the_share_above_t_and_the_two_means():
    lengths = Lengths([1000, 2000, 3000, 10000])
    assert lengths.split(2500) == (0.5, 6500.0, 1500.0)
    assert lengths.split(math.inf) == (0.0, 0.0, 4000.0)
    assert lengths.split(0) == (1.0, 4000.0, 0.0)


def test_equations_3_to_6_by_hand():
    lengths = Lengths([1000, 2000, 3000, 10000])
    cluster = Cluster(remote=2, local=4, egress=5000.0, remote_prefill=FLAT, local_prefill=FLAT, decode=ONE_PER_S)
    plan = evaluate(cluster, lengths, 2500, n_prefill=1)
    # p = 0.5, l_long = 6500, l_short = 1500
    assert plan.theta_prfaas == pytest.approx(min(2 / 6.5, 5000 / 6500))  # compute-bound: 0.3077
    assert plan.theta_pd_p == pytest.approx(1 / 1.5)
    assert plan.theta_pd_d == pytest.approx(3.0)
    assert plan.throughput == pytest.approx(min(0.3077 / 0.5, (1 / 1.5) / 0.5, 3.0), rel=1e-3)
    assert plan.egress == pytest.approx(plan.throughput * 0.5 * 6500)
    assert plan.bound == "remote prefill"
    # A narrow egress binds: 1000 bytes/s over 6500-byte KV
    narrow = evaluate(Cluster(2, 4, 1000.0, FLAT, FLAT, ONE_PER_S), lengths, 2500, 1)
    assert narrow.theta_prfaas == pytest.approx(1000 / 6500) and narrow.bound == "link"
    # Nothing offloaded: the PrfaaS term drops out; everything: the PD-P one does
    local = evaluate(cluster, lengths, math.inf, 2)
    assert local.offloaded == 0 and local.throughput == pytest.approx(min(2 / 4.0, 2.0)) and local.bound == "local prefill"
    remote = naive(cluster, lengths)
    assert remote.n_decode == 4 and remote.throughput == pytest.approx(min(2 / 4.0, 5000 / 4000, 4.0))


def test_the_grid_search_finds_the_known_optimum_of_a_toy_cluster():
    """Two lengths, 1000 (half) and 9000 (half); remote prefill 3x as fast as local. Every split is
    tried; by hand: offloading the long half (t between them) with N_p = 1 of 3 local nodes gives
    Λ = min((2 / 3.0) / 0.5, (1 / 1.0) / 0.5, 2 × 1) = 1.333; nothing beats it."""
    lengths = Lengths([1000] * 50 + [9000] * 50)
    fast = PrefillProfile.linear(seconds_per_token=1e-3 / 3, base_seconds=0.0, kv_bytes_per_token=1.0)
    cluster = Cluster(remote=2, local=3, egress=1e9, remote_prefill=fast, local_prefill=FLAT, decode=ONE_PER_S)
    best = search(cluster, lengths)
    assert (best.n_prefill, best.n_decode) == (1, 2)
    assert 1000 <= best.threshold < 9000 and best.offloaded == 0.5
    assert best.throughput == pytest.approx(4 / 3)
    brute = max(evaluate(cluster, lengths, t, n).throughput for t in (0, 1000, 5000, 9000, math.inf)
                for n in range(4))
    assert best.throughput == pytest.approx(brute)
    # Without remote nodes the search keeps everything local (homogeneous PD)
    alone = search(Cluster(0, 3, 0.0, fast, FLAT, ONE_PER_S), lengths)
    assert alone.threshold == math.inf and alone.offloaded == 0


def test_the_paper_s_case_study_lands_on_its_operating_point():
    study = case_study(lognormal_lengths(n=50_000))
    pr, homo, nv = study.prfaas, study.homogeneous, study.naive
    assert (pr.n_prefill, pr.n_decode) == PAPER["split"]["prfaas"]
    assert (homo.n_prefill, homo.n_decode) == PAPER["split"]["homogeneous"]
    assert pr.threshold == pytest.approx(PAPER["threshold"], rel=0.05)
    assert pr.offloaded == pytest.approx(PAPER["offloaded"], abs=0.02)
    assert pr.egress * 8 / 1e9 == pytest.approx(PAPER["egress_gbps"], rel=0.15)
    for name, plan in (("prfaas", pr), ("homogeneous", homo), ("naive", nv)):
        assert plan.throughput == pytest.approx(PAPER[name], rel=0.03), name
    assert pr.throughput / homo.throughput == pytest.approx(1.54, rel=0.03)


def test_sim_prfaas_prints_the_three_deployments_and_a_narrower_link_raises_t(tmp_path, capsys):
    from tokenflowd.cli import main

    out = tmp_path / "case.json"
    assert main(["sim-prfaas", "--samples", "20000", "--requests", "2000", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert all(name in text for name in ("prfaas", "homogeneous", "naive")) and "3.24" in text
    assert "sustained" in text and "2.22 / 3.51" in text  # the simulated runs, against the paper's TTFT
    doc = json.loads(out.read_text())
    wide = doc["prfaas"]
    assert set(doc["simulated"]) == {"prfaas", "homogeneous", "naive"}
    assert main(["sim-prfaas", "--samples", "20000", "--egress-gbps", "10", "--requests", "0", "--out", str(out)]) == 0
    narrow = json.loads(out.read_text())["prfaas"]
    assert narrow["threshold"] > wide["threshold"] and narrow["egress"] <= 10e9 / 8 * 1.001
