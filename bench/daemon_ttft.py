"""TTFT of one short request against the idle daemon on the embedded model, next to the same
request run in-process on `Engine` (no HTTP, no processes) in the same run.

    .venv/bin/python bench/daemon_ttft.py [--runs 20] [--dtype auto]

Each run sends a different short question (so the prefix cache only holds the chat template's
system part, as for a new conversation; both sides get the same questions after the same warm-up) with stream=true and measures the time from sending the
request to the first content event. The ratio daemon/in-process is the cost of the daemon's path
(HTTP, validation, tokenization, zmq to the engine process and back, SSE).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from daemon import Daemon  # noqa: E402

WARM_UP = 150  # the questions from here on warm up each side
QUESTIONS = [f"In one word, what is the colour of object number {i}?" for i in range(200)]


def daemon_ttfts(d: Daemon, runs: int, offset: int) -> list[float]:
    out = []
    with httpx.Client(base_url=d.base_url, timeout=60) as http:
        for i in range(runs):
            body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": QUESTIONS[offset + i]}],
                    "max_tokens": 4, "temperature": 0, "stream": True}
            t0 = time.perf_counter()
            with http.stream("POST", "/v1/chat/completions", json=body) as r:
                first = None
                for line in r.iter_lines():  # read to the end, so the connection is reused
                    if first is None and '"content":"' in line and '"content":""' not in line:
                        first = time.perf_counter() - t0
                out.append(first)
    return out


def inprocess_ttfts(dtype: str, runs: int, offset: int) -> list[float]:
    from tokenflowd.config import EngineConfig
    from tokenflowd.engine.offline import Engine
    from tokenflowd.engine.request import SamplingParams

    engine = Engine(EngineConfig.resolve(dtype=dtype, kv_cache_memory="256MiB"))
    out = []
    for i in [WARM_UP, WARM_UP + 1, *range(offset, offset + runs)]:
        t0 = time.perf_counter()
        for piece in engine.stream(f"r{i}", messages=[{"role": "user", "content": QUESTIONS[i]}],
                                   sampling_params=SamplingParams(temperature=0, max_tokens=4)):
            if piece.text:
                if i < WARM_UP:
                    out.append(time.perf_counter() - t0)
                break
        engine.abort(f"r{i}")
    return out


def summary(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median_ms": 1e3 * statistics.median(xs), "p90_ms": 1e3 * xs[int(0.9 * (len(xs) - 1))],
            "min_ms": 1e3 * xs[0], "n": len(xs)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--dtype", default="auto")
    a = ap.parse_args()
    d = Daemon("--dtype", a.dtype, "--kv-cache-memory", "256MiB", "--log-level", "WARNING")
    try:
        daemon_ttfts(d, 2, WARM_UP)
        served = summary(daemon_ttfts(d, a.runs, 0))
    finally:
        d.stop()
    local = summary(inprocess_ttfts(a.dtype, a.runs, 0))  # the same questions
    result = {"daemon": served, "in_process": local, "ratio_median": served["median_ms"] / local["median_ms"],
              "dtype": a.dtype}
    print(f"TTFT, short chat request, idle, {a.runs} runs ({a.dtype}):")
    for k in ("daemon", "in_process"):
        r = result[k]
        print(f"  {k:10s}  median {r['median_ms']:7.1f} ms   p90 {r['p90_ms']:7.1f} ms   min {r['min_ms']:7.1f} ms")
    print(f"  daemon / in-process (median): {result['ratio_median']:.2f}")
    out = Path(__file__).parent / "results" / "daemon_ttft.json"
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
