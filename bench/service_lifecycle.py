"""How the daemon behaves as a service, timed on this machine with the embedded model:

    start      `tokenflowd serve` → /health 200 (an engine serves; READY=1 under systemd)
    restart    SIGKILL of the engine → /health 200 again (the supervisor's backoff + a fresh engine)
    drain      SIGTERM with N open streams → the process exits 0 (every stream ends first)

    python bench/service_lifecycle.py [--streams 10] [--tokens 40] [--out bench/results/service_lifecycle.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx

from daemon_proc import free_port

MODEL = "smollm2-135m"


def wait_health(http: httpx.Client, proc: subprocess.Popen, ok, timeout: float = 180) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tokenflowd exited with {proc.returncode}")
        try:
            h = http.get("/health").json()
            if ok(h):
                return h
        except httpx.TransportError:
            pass
        time.sleep(0.02)
    raise TimeoutError("health condition not reached")


async def open_streams(base_url: str, n: int, tokens: int, started: asyncio.Event) -> list[str | None]:
    count = [0]

    async def one() -> str | None:
        body = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": tokens, "ignore_eos": True,
                "stream": True, "reading_rate": 10.0}
        finish = None
        async with httpx.AsyncClient(base_url=base_url, timeout=300) as c:
            async with c.stream("POST", "/v1/completions", json=body) as r:
                first = True
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    if first:
                        first = False
                        count[0] += 1
                        if count[0] == n:
                            started.set()
                    finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
        return finish

    return await asyncio.gather(*[one() for _ in range(n)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "tokenflowd.cli", "serve", "--port", str(port), "--dtype", "float32",
           "--kv-cache-memory", "64MiB", "--log-level", "WARNING"]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd)
    http = httpx.Client(base_url=base_url, timeout=30)
    h = wait_health(http, proc, lambda h: h["status"] == "ok")
    start = time.monotonic() - t0

    os.kill(h["engines"][0]["pid"], signal.SIGKILL)
    t0 = time.monotonic()
    wait_health(http, proc, lambda h: h["status"] == "ok" and h["engines"][0]["restarts"] == 1)
    restart = time.monotonic() - t0

    async def drain() -> tuple[float, list]:
        started = asyncio.Event()
        streams = asyncio.create_task(open_streams(base_url, a.streams, a.tokens, started))
        await asyncio.wait_for(started.wait(), 120)
        proc.send_signal(signal.SIGTERM)
        t = time.monotonic()
        finishes = await streams
        code = await asyncio.to_thread(proc.wait, 120)
        assert code == 0, code
        return time.monotonic() - t, finishes

    drain_s, finishes = asyncio.run(drain())
    complete = sum(f == "length" for f in finishes)
    result = {"start_s": start, "restart_after_sigkill_s": restart, "drain_s": drain_s, "streams": a.streams,
              "tokens_per_stream": a.tokens, "streams_complete": complete, "machine": os.uname().machine,
              "threads": os.cpu_count()}
    print(f"start {start:.2f} s | restart after SIGKILL {restart:.2f} s | drain of {a.streams} streams "
          f"({a.tokens} tokens at 10 tokens/s readers) {drain_s:.2f} s, {complete}/{a.streams} complete, exit 0")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
