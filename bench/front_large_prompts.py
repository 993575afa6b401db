"""What large prompts do to the API server's event loop: one open stream and a /health probe,
while N large prompts arrive at once.

    python bench/front_large_prompts.py [--prompts 6] [--megabytes 3.9] [--checkout DIR] [--out FILE]

Starts `tokenflowd serve` on the embedded model (from --checkout, default this one), opens a
streaming chat that reads at 10 tokens/s, then posts --prompts completions of --megabytes of
text each at once. Reports the longest gap between the open stream's events and the slowest
/health answer (polled every 0.1 s) from the posts until all are answered, and their statuses.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from daemon_proc import free_port, wait_healthy

ROOT = Path(__file__).resolve().parent.parent


async def probe(base: str, prompts: int, megabytes: float) -> dict:
    text = ("the quick brown fox jumps over the lazy dog " * int(megabytes * 1e6 / 44 + 1))[: int(megabytes * 1e6)]
    events: list[float] = []
    health: list[float] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        async def stream() -> None:
            body = {"model": "smollm2-135m", "stream": True, "max_tokens": 300, "reading_rate": 10,
                    "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}]}
            async with http.post(f"{base}/v1/chat/completions", json=body) as r:
                async for _ in r.content:
                    events.append(time.monotonic())

        reader = asyncio.create_task(stream())
        while len(events) < 3:
            await asyncio.sleep(0.05)
        start = time.monotonic()

        async def post() -> int:
            async with http.post(f"{base}/v1/completions", json={"model": "smollm2-135m", "prompt": text,
                                                                   "max_tokens": 1}) as r:
                await r.read()
                return r.status

        posts = asyncio.gather(*(post() for _ in range(prompts)))

        async def poll() -> None:
            while not posts.done():
                t0 = time.monotonic()
                async with http.get(f"{base}/health") as r:
                    await r.read()
                health.append(time.monotonic() - t0)
                await asyncio.sleep(0.1)

        poller = asyncio.create_task(poll())
        statuses = await posts
        end = time.monotonic()
        await poller
        reader.cancel()
    window = [t for t in events if start <= t <= end]
    gaps = [b - a for a, b in zip(window, window[1:])] + ([window[0] - start] if window else [end - start])
    return {"prompts": prompts, "megabytes": megabytes, "statuses": sorted(statuses), "answered_s": end - start,
            "longest_stream_gap_s": max(gaps), "slowest_health_s": max(health, default=None)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--megabytes", type=float, default=3.9)
    ap.add_argument("--checkout", default=str(ROOT))
    ap.add_argument("--out")
    a = ap.parse_args()
    port = free_port()
    env = {**os.environ, "PYTHONPATH": a.checkout}
    daemon = subprocess.Popen([sys.executable, "-m", "tokenflowd.cli", "serve", "--port", str(port)], cwd=a.checkout,
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(port, daemon)
        result = asyncio.run(probe(base, a.prompts, a.megabytes))
    finally:
        daemon.terminate()
        daemon.wait(30)
    result["checkout"] = a.checkout
    print(json.dumps(result))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
