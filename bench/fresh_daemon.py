"""A fresh daemon as an operator meets it: `tokenflowd serve` to /health 200, the TTFT of its first
and tenth requests, and the API server process's own footprint (RSS, whether it imported torch).

    .venv/bin/python bench/fresh_daemon.py [--runs 3] [--out bench/results/fresh_daemon.json]

Each run starts a new daemon on the embedded model (one engine). The ten requests are distinct
short chat questions sent one after another (stream, greedy, 4 tokens), so the prefix cache holds
only the chat template's system part. The front's RSS is read after the tenth request.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from daemon import Daemon  # noqa: E402


def ttft(http: httpx.Client, question: str) -> float:
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": question}],
            "max_tokens": 4, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    first = None
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if first is None and '"content":"' in line and '"content":""' not in line:
                first = time.perf_counter() - t0
    assert first is not None, "no content event"
    return first


def one_run(i: int) -> dict:
    t0 = time.perf_counter()
    d = Daemon("--log-level", "WARNING", "--kv-cache-memory", "256MiB", start_timeout=300)
    start = time.perf_counter() - t0
    try:
        ttfts = [ttft(d.http, f"In one word, what colour is object {i}-{k}?") for k in range(10)]
        front = psutil.Process(d.proc.pid)
        with open(f"/proc/{d.proc.pid}/maps") as f:
            torch_mapped = "libtorch" in f.read()
        return {"start_to_health_s": start, "ttft_first_s": ttfts[0], "ttft_tenth_s": ttfts[9],
                "front_rss_mib": front.memory_info().rss / 2**20, "front_has_torch": torch_mapped}
    finally:
        d.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "fresh_daemon.json")
    a = ap.parse_args()
    runs = [one_run(i) for i in range(a.runs)]
    summary = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "front_has_torch"}
    summary["front_has_torch"] = any(r["front_has_torch"] for r in runs)
    result = {"runs": runs, "median": summary}
    for k, v in summary.items():
        print(f"  {k:20s} {v:.3f}" if isinstance(v, float) else f"  {k:20s} {v}")
    a.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
