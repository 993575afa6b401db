"""A CI-sized soak of the daemon on the embedded model, driven by the bundled load generator:
90 s (SOAK_SECONDS; 300 or more for a release) of repeated bursts of readers, a tenth of them abandoning mid-stream. No 5xx, every
KV page back to idle afterwards, and the daemon's memory (supervisor and engine RSS) flat.

The load is a share of what this machine serves, measured first through the daemon (a closed
loop at the seat count), never an assumed speed: a slow 2-core box and a fast one both run at
LOAD of their capacity, under the default policy."""
from __future__ import annotations

import os

import pytest
from daemon import Daemon

from loadgen.client import ClientConfig, run_blocking
from loadgen.report import SLO, summary
from loadgen.workload import BodyFormat, LoadWorkload, load_requests
from tokenflowd.sim.workload import parse_lengths

MODEL = "smollm2-135m"
SOAK_SECONDS = float(os.environ.get("SOAK_SECONDS", 90))  # the suite's 20 min on 2 cores
SEATS = 8
PROMPT_LEN, OUTPUT_LEN = 40, 48
BURST = 10  # readers at once: more than the 8 seats hold
LOAD = 0.6  # of the measured capacity, in generated tokens/s
READING_RATES = ((4.0, 0.5), (6.0, 0.5))


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def daemon_rss(d: Daemon) -> int:
    return rss_bytes(d.proc.pid) + sum(rss_bytes(e["pid"]) for e in d.health()["engines"])


def capacity(d: Daemon) -> tuple[float, float]:
    """(generated tokens/s, s a request takes) of a closed loop at the seat count: SEATS clients,
    each sending its next request as its last one ends, two rounds. One request first takes the
    engine's one-time set-up out of the measurement."""
    lengths = parse_lengths(f"fixed:{PROMPT_LEN}:{OUTPUT_LEN}")
    url = d.base_url + "/v1/completions"
    for n, seed in ((1, 200), (2 * SEATS, 201)):
        w = LoadWorkload(num_prompts=n, lengths=lengths, reading_rates=READING_RATES, seed=seed)
        result = run_blocking(load_requests(w, BodyFormat(model=MODEL)),
                              ClientConfig(url=url, timeout=120, max_concurrency=SEATS))
        assert all(r.outcome == "completed" for r in result.records), [r.error for r in result.records]
    recs = result.records
    tokens = sum(len(r.token_times) for r in recs)
    span = max(r.token_times[-1] for r in recs) - min(r.arrival for r in recs)
    return tokens / span, sum(r.token_times[-1] - r.arrival for r in recs) / len(recs)


def bursts(d: Daemon, seconds: float, period: float, seed: int):
    n = max(1, int(seconds / period)) * BURST
    w = LoadWorkload(num_prompts=n, burst_size=BURST, burst_period=period,
                     lengths=parse_lengths(f"fixed:{PROMPT_LEN}:{OUTPUT_LEN}"), reading_rates=READING_RATES,
                     abandon_fraction=0.1, seed=seed)
    reqs = load_requests(w, BodyFormat(model=MODEL))
    result = run_blocking(reqs, ClientConfig(url=d.base_url + "/v1/completions", timeout=60))
    return reqs, result


@pytest.mark.slow
def test_soak_repeated_bursts_with_abandoning_readers():
    d = Daemon("--max-num-seqs", str(SEATS), "--kv-cache-memory", "48MiB", "--log-level", "WARNING")  # default policy
    try:
        tokens_per_s, service = capacity(d)
        period = BURST * OUTPUT_LEN / (LOAD * tokens_per_s)  # a burst every `period` s: LOAD of the capacity
        print(f"\nsoak: measured {tokens_per_s:.1f} tokens/s at {SEATS} seats ({service:.1f} s a request); "
              f"offering {LOAD:.0%} of it: bursts of {BURST} x {OUTPUT_LEN} tokens every {period:.1f} s "
              f"({BURST * OUTPUT_LEN / period:.1f} tokens/s, policy {d.health()['engines'][0]['policy']})")
        bursts(d, 30, period, seed=100)  # warm-up: allocator pools, kernel caches, the step-time model, prefix cache
        assert d.wait_idle(10.0) == (0, 0)
        rss_before = daemon_rss(d)
        reqs, result = bursts(d, SOAK_SECONDS, period, seed=1)
        s = summary(result.records, SLO(), result.duration)
        assert d.wait_idle(10.0) == (0, 0)  # every page of finished and abandoned requests is back
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
