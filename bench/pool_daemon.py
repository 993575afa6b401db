"""The node's prefix-cache pool on the real daemon (CPU, the embedded model): today's cache-aware
routing (`--pool-mode off`) against `--pool-mode query` and `--pool-mode read` (new segments placed
at their homes; `query-local`, `read-local`: kept where computed), on the Mooncake conversation
trace replayed by the load generator, or on a synthetic workload of shared long contexts
(`--contexts documents:scale=0.05`, TokenLake's kind: sim/workload.py CONTEXT_SHAPES) at Poisson arrivals.

    .venv/bin/python bench/pool_daemon.py [--engines 2] [--num-prompts 300] [--rounds 1]
        [--out bench/results/pool_daemon.json]

Each daemon: `tokenflowd serve --engines N --dtype float32 --quantization none --kv-cache-memory M`
with a small KV budget (M, default 64MiB: 91 pages of 16 tokens per engine, 1,456 tokens), started fresh for
each run and stopped with SIGTERM. The workload is the trace's first `--num-prompts` records with
each 512-token block of the trace cut to `--block-tokens` tokens (prompts scaled down by that
share; which prefixes requests share is kept, token for token), prompts cut to `--max-prompt-len`,
outputs × `--output-scale`, arrivals × a time scale set so that the offered prompt tokens per second
are `--load` times what the engines prefill (measured first, on the `off` daemon, with a burst);
with --contexts, the Poisson rate that offers that many prompt tokens.

Per run: the loadgen's summary (throughput, effective throughput, TTFT p99) and, from /metrics
before and after, where the prompt tokens came from (local prefix cache, a peer of the pool,
computed), the pool's query counters and the mean load CV sampled each second. The modes run in
the order off, query, read, and with --rounds 2 again in the reverse order, so a machine that
drifts shows as a spread between rounds rather than as a difference between modes.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
from daemon import Daemon  # noqa: E402
from machine import cpu_info  # noqa: E402

from loadgen import report  # noqa: E402
from loadgen.client import ClientConfig, run_blocking  # noqa: E402
from loadgen.workload import BodyFormat, LoadWorkload, build_requests, load_requests  # noqa: E402
from tokenflowd.sim.result import json_safe  # noqa: E402
from tokenflowd.sim.workload import parse_context_shape, parse_lengths  # noqa: E402

MODEL = "smollm2-135m"
SOURCES = ("local", "peer", "miss")


def flags(engines: int, kv: str, mode: str, segment_tokens: int = 0) -> list[str]:
    """`mode`: off, query or read (the default placement: new segments stay where they are
    computed), query-home, read-home (written into their homes: --pool-hand-off's default, auto,
    pool/hand_off.py), query-local, read-local (local, named), or query-segment, read-segment,
    query-prompt, read-prompt (placement by home, each segment written into its home as it is
    computed, or all once the prompt is: --pool-hand-off segment, prompt); any with -nosteal: no idle
    engine takes queued requests (--no-pool-steal, pool/steal.py). `segment_tokens`: the
    pool's segment (0: the break-even length the engines measure at start-up)."""
    mode, steal = mode.removesuffix("-nosteal"), [] if not mode.endswith("-nosteal") else ["--no-pool-steal"]
    pool, _, placement = mode.partition("-")
    segment = ["--pool-segment-tokens", str(segment_tokens)] if segment_tokens and pool != "off" else []
    where = ["--pool-placement", "home", "--pool-hand-off", placement] if placement in ("segment", "prompt") else \
        ["--pool-placement", placement] if placement else []
    return ["--engines", str(engines), "--dtype", "float32", "--quantization", "none", "--kv-cache-memory", kv,
            "--pool-mode", pool, *where, *segment, *(steal if pool != "off" else [])]


def counters(d: Daemon) -> dict[str, float]:
    out = {}
    for s in SOURCES:
        out[s] = d.metric("tokenflowd_prompt_token_sources_total", source=s)
    for name in ("queries", "query_bytes", "query_seconds", "put_pages", "unblocked_requests", "pinned_queued_requests",
                 "resolved_requests", "moved_requests", "copied_pages"):
        try:
            out[name] = d.metric(f"tokenflowd_pool_{name}_total")
        except KeyError:  # pool off: no such metric
            out[name] = 0.0
    return out


class LoadSampler(threading.Thread):
    """Requests in flight per engine, once a second (the CV of the load across engines)."""

    def __init__(self, d: Daemon) -> None:
        super().__init__(daemon=True)
        self.d, self.stop_flag, self.cvs = d, threading.Event(), []

    def run(self) -> None:
        while not self.stop_flag.wait(1.0):
            try:
                loads = [e["requests"] for e in self.d.health()["engines"]]
            except Exception:
                continue
            mean = sum(loads) / len(loads)
            if mean > 0:
                self.cvs.append(statistics.pstdev(loads) / mean)


def prefill_rate(d: Daemon) -> float:
    """Prompt tokens/s the daemon's engines compute together: a burst of fresh 512-token prompts."""
    w = LoadWorkload(num_prompts=8, lengths=parse_lengths("fixed:512:1"), seed=9, request_rate=float("inf"))
    loads = load_requests(w, BodyFormat("/v1/completions", MODEL))
    t0 = time.monotonic()
    result = run_blocking(loads, ClientConfig(d.base_url + "/v1/completions", timeout=600.0))
    took = time.monotonic() - t0
    assert all(r.outcome == "completed" for r in result.records), [r.error for r in result.records]
    return 8 * 512 / took


def run_mode(mode: str, a, workload: LoadWorkload, log_dir: Path) -> dict:
    d = Daemon(*flags(a.engines, a.kv_cache_memory, mode, a.segment_tokens), log_path=str(log_dir / f"{mode}.log"))
    try:
        d.wait_all_engines()
        before = counters(d)
        sampler = LoadSampler(d)
        sampler.start()
        loads = load_requests(workload, BodyFormat("/v1/completions", MODEL))
        result = run_blocking(loads, ClientConfig(d.base_url + "/v1/completions", timeout=a.timeout))
        sampler.stop_flag.set()
        time.sleep(1.5)  # the engines' last step messages
        after = counters(d)
    finally:
        d.stop()
    delta = {k: after[k] - before[k] for k in before}
    prompt = sum(delta[s] for s in SOURCES)
    summary = report.summary(result.records, report.SLO(), result.duration)
    out = {
        "mode": mode,
        "hit_rate": (delta["local"] + delta["peer"]) / prompt if prompt else 0.0,
        "sources": {s: delta[s] for s in SOURCES},
        "throughput": summary["throughput"],
        "effective_throughput": summary["effective_throughput"],
        "ttft_p99": summary["ttft_p99"],
        "ttft_mean": summary["ttft_mean"],
        "completed": summary["completed"],
        "errors": summary["errors"],
        "load_cv_mean": statistics.fmean(sampler.cvs) if sampler.cvs else None,
        "pool_queries": delta["queries"],
        "pool_query_mb": delta["query_bytes"] / 1e6,
        "pool_query_ms_mean": 1000 * delta["query_seconds"] / delta["queries"] if delta["queries"] else None,
        "pool_put_pages": delta["put_pages"],
        "pool_unblocked": delta["unblocked_requests"],  # waiting requests that gave their pins back
        "pool_pinned_queued": delta["pinned_queued_requests"],  # requests that pinned their reads near the front
        "pool_resolved": delta["resolved_requests"],  # ... named again then by their front (ResolveReads)
        "pool_moved": delta["moved_requests"],  # queued requests an idle engine took (pool/steal.py)
        "pool_copied_pages": delta["copied_pages"],  # hot segments' pages copied into engines that read them elsewhere
    }
    print(f"[bench] {mode}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                          for k, v in out.items() if k not in ("mode", "sources")), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=300)
    p.add_argument("--block-tokens", type=int, default=64,
                   help="tokens per trace block (512 in the trace): prompts scaled down, their sharing kept")
    p.add_argument("--max-prompt-len", type=int, default=1024)
    p.add_argument("--output-scale", type=float, default=0.1)
    p.add_argument("--kv-cache-memory", default="64MiB")
    p.add_argument("--load", type=float, default=0.6, help="offered prompt tokens/s over measured prefill rate")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--modes", default="off,query,read")
    p.add_argument("--segment-tokens", type=int, default=0,
                   help="the pool's segment for every pool mode (default 0: measured at start-up; on a 2-core CPU "
                        "the break-even is about 400-1,200 tokens, longer than most trace prompts)")
    p.add_argument("--prefill-rate", type=float, help="tokens/s the engines prefill, as measured before (default: "
                                                      "measured now; a run to compare with another uses the same)")
    p.add_argument("--contexts", help="a synthetic shared-context workload instead of the trace: documents, "
                                      "sessions or system-prompt with :KEY=VALUE overrides (documents:scale=0.05)")
    p.add_argument("--out", default=str(ROOT / "bench/results/pool_daemon.json"))
    a = p.parse_args()
    log_dir = Path("/tmp/pool_daemon_logs")
    log_dir.mkdir(exist_ok=True)
    modes = a.modes.split(",")
    if a.contexts:
        base = LoadWorkload(dataset="synthetic", contexts=parse_context_shape(a.contexts), num_prompts=a.num_prompts,
                            request_rate=1.0, output_scale=a.output_scale, block_tokens=a.block_tokens, seed=0,
                            reading_rates=((20.0, 1.0),))
    else:
        base = LoadWorkload(dataset="mooncake", num_prompts=a.num_prompts, max_prompt_len=a.max_prompt_len,
                            output_scale=a.output_scale, block_tokens=a.block_tokens, seed=0,
                            reading_rates=((20.0, 1.0),))
    reqs = build_requests(base)
    span = reqs[-1].arrival_time - reqs[0].arrival_time
    tokens = sum(r.prompt_len for r in reqs)
    if a.prefill_rate:
        rate = a.prefill_rate
    else:
        d = Daemon(*flags(a.engines, a.kv_cache_memory, "off"), log_path=str(log_dir / "measure.log"))
        try:
            d.wait_all_engines()
            rate = prefill_rate(d)
        finally:
            d.stop()
    time_scale = tokens / (a.load * rate) / span  # the trace's span stretched to offer `load` of the rate
    if a.contexts:  # the same offer from the Poisson rate (its arrivals scale with 1 / rate)
        workload = LoadWorkload(**{**base.__dict__, "request_rate": 1.0 / time_scale})
    else:
        workload = LoadWorkload(**{**base.__dict__, "time_scale": time_scale})
    print(f"[bench] prefill rate {rate:.0f} tokens/s; {len(reqs)} requests, {tokens} prompt tokens over "
          f"{span * time_scale:.0f} s (time scale {time_scale:.4f})", flush=True)
    runs = []
    for r in range(a.rounds):
        for mode in (modes if r % 2 == 0 else modes[::-1]):
            runs.append({"round": r, **run_mode(mode, a, workload, log_dir)})
    doc = {"machine": cpu_info(), "args": vars(a), "prefill_rate": rate, "time_scale": time_scale,
           "requests": len(reqs), "prompt_tokens": tokens, "runs": runs}
    Path(a.out).write_text(json.dumps(json_safe(doc), indent=1))
    print(f"[bench] wrote {a.out}")


if __name__ == "__main__":
    main()
