"""The load generator against the real daemon on the embedded model: a 20-request burst of readers
completes and the result JSON holds every request with its token times; compare mode runs one
seeded workload twice."""
from __future__ import annotations

import json

import pytest
from daemon import Daemon

from loadgen.cli import main

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def daemon():
    d = Daemon("--dtype", "float32", "--quantization", "none", "--kv-cache-memory", "192MiB")
    yield d
    assert d.stop() == 0


def test_a_burst_of_twenty_readers_completes(daemon, tmp_path):
    out = tmp_path / "burst.json"
    rc = main(["--base-url", daemon.base_url, "--num-prompts", "20", "--lengths", "fixed:16:12",
               "--reading-rate", "15:0.5,30:0.5", "--seed", "3", "--slo-ttft", "60", "--quiet", "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["model"] == MODEL and doc["config"]["workload"]["arrivals"] == "one burst"
    reqs = doc["requests"]
    assert len(reqs) == 20 and len({r["id"] for r in reqs}) == 20
    assert sorted(r["reading_rate"] for r in reqs) == [15.0] * 10 + [30.0] * 10
    for r in reqs:
        assert r["outcome"] == "completed", r
        assert r["prompt_len"] == 16 and r["output_len"] == 12
        assert r["finish_reason"] == "length" and r["usage_tokens"] == 12
        times = r["token_times"]
        assert len(times) == 12 and times == sorted(times)
        assert r["num_events"] == 12  # an event per token, even one whose text is not out yet
        assert r["ttft"] > 0 and times[0] == pytest.approx(r["arrival"] + r["ttft"], abs=2e-6)
        assert r["scheduled"] == 0.0 and r["arrival"] >= 0.0
    s = doc["summary"]
    assert s["requests"] == 20 and s["completed"] == 20 and s["errors"] == 0 and s["aborted"] == 0
    assert s["output_tokens"] == 240
    assert s["throughput"] == pytest.approx(240 / s["span"])
    assert s["slo_attainment"] == 1.0 and s["goodput"] == pytest.approx(20 / s["span"])
    for key in ("throughput", "effective_throughput", "ttft_mean", "ttft_p99", "rebuffer_total", "qos"):
        assert isinstance(s[key], float)
    assert daemon.metric("tokenflowd_requests_running") == 0


def test_compare_against_the_same_daemon_twice(daemon, tmp_path):
    out = tmp_path / "cmp.json"
    rc = main(["compare", "--base-url", daemon.base_url, "--base-url-b", daemon.base_url, "--num-prompts", "6",
               "--lengths", "fixed:8:6", "--abandon-fraction", "0.5", "--seed", "1", "--quiet", "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    a, b = doc["runs"]["A"]["requests"], doc["runs"]["B"]["requests"]
    assert [(r["id"], r["abandon_after"]) for r in a] == [(r["id"], r["abandon_after"]) for r in b]
    for run in (a, b):
        for r in run:
            if r["abandon_after"] is None:
                assert r["outcome"] == "completed" and len(r["token_times"]) == 6
            else:
                assert r["outcome"] == "abandoned" and len(r["token_times"]) == r["abandon_after"] < 6
    assert sum(r["abandon_after"] is not None for r in a) == 3
    assert doc["ratios"]["output_tokens"] == 1.0
