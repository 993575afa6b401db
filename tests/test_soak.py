"""A CI-sized soak of the daemon on the embedded model, driven by the bundled load generator:
five minutes of repeated bursts of readers, a tenth of them abandoning mid-stream. No 5xx, every
KV page back to idle afterwards, and the daemon's memory (supervisor and engine RSS) flat."""
from __future__ import annotations

import os
import time

import pytest
from daemon import Daemon

from loadgen.client import ClientConfig, run_blocking
from loadgen.report import SLO, summary
from loadgen.workload import BodyFormat, LoadWorkload, load_requests
from tokenflowd.sim.workload import parse_lengths

MODEL = "smollm2-135m"
SOAK_SECONDS = float(os.environ.get("SOAK_SECONDS", 300))
BURST, PERIOD = 10, 8.0  # a burst of 10 readers every 8 s: more than the 8 slots hold at once


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def daemon_rss(d: Daemon) -> int:
    return rss_bytes(d.proc.pid) + sum(rss_bytes(e["pid"]) for e in d.health()["engines"])


def bursts(d: Daemon, seconds: float, seed: int):
    n = max(1, int(seconds / PERIOD)) * BURST
    w = LoadWorkload(num_prompts=n, burst_size=BURST, burst_period=PERIOD, lengths=parse_lengths("fixed:40:48"),
                     reading_rates=((4.0, 0.5), (6.0, 0.5)), abandon_fraction=0.1, seed=seed)
    reqs = load_requests(w, BodyFormat(model=MODEL))
    result = run_blocking(reqs, ClientConfig(url=d.base_url + "/v1/completions", timeout=60))
    return reqs, result


def wait_idle(d: Daemon, timeout: float = 10.0) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        used = d.metric("tokenflowd_kv_pages_used")
        if used == 0:
            return used
        time.sleep(0.1)
    return d.metric("tokenflowd_kv_pages_used")


@pytest.mark.slow
def test_soak_repeated_bursts_with_abandoning_readers():
    d = Daemon("--policy", "tokenflow", "--max-num-seqs", "8", "--kv-cache-memory", "48MiB", "--log-level", "WARNING")
    try:
        bursts(d, 60, seed=100)  # warm-up: allocator pools, kernel caches, the step-time model, prefix cache
        assert wait_idle(d) == 0
        rss_before = daemon_rss(d)
        reqs, result = bursts(d, SOAK_SECONDS, seed=1)
        s = summary(result.records, SLO(), result.duration)
        assert wait_idle(d) == 0  # every page of finished and abandoned requests is back
        rss_after = daemon_rss(d)
        errors = [r.error for r in result.records if r.outcome in ("error", "timeout")]
        assert not errors, errors[:5]  # no 5xx, no dropped stream, no stream left hanging
        planned = sum(lr.abandon_after is not None for lr in reqs)
        assert s["abandoned"] == planned > 0 and s["completed"] == len(reqs) - planned
        for lr, rec in zip(reqs, result.records):
            expected = lr.request.output_len if lr.abandon_after is None else lr.abandon_after
            assert len(rec.token_times) == expected, rec
        assert d.metric("tokenflowd_requests_total", outcome="abort") >= planned
        drift = (rss_after - rss_before) / rss_before
        print(f"soak: {len(reqs)} requests in {result.duration:.0f} s ({planned} abandoned), "
              f"{s['throughput']:.1f} tokens/s, TTFT p99 {s['ttft_p99']:.2f} s, "
              f"preemptions {d.metric('tokenflowd_preemptions_total'):.0f}; "
              f"RSS {rss_before / 2**20:.1f} -> {rss_after / 2**20:.1f} MiB ({100 * drift:+.2f}%)")
        assert abs(drift) < 0.05
    finally:
        assert d.stop() == 0
