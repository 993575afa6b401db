"""The load generator's own overhead: how late its clients timestamp tokens.

    python bench/loadgen_overhead.py [--streams 1000] [--period 0.05] [--tokens 100] [--phase spread|aligned]
                                     [--out FILE.json]

A local SSE server (a child process on 127.0.0.1) sends token k of stream i at the scheduled
absolute time  t0 + offset_i + k·period  (time.monotonic(): CLOCK_MONOTONIC, one clock for both
processes). t0 is chosen by the bench --lead s ahead, so every stream is connected by then; each
request's body carries its stream's first send time t0 + offset_i and the period. offset_i is i/N
of a period (--phase spread: tokens evenly over time) or 0 (--phase aligned: every stream's token
at once, as one engine step of a batch delivers them). The server never puts a send time in the
stream: the client's figure is compared with the schedule.

The clients are the load generator's own (loadgen.client.run_blocking: one aiohttp session with
no connection bound, SSE parsing, a timestamp per token). A token's error is the time the client
recorded for it minus its scheduled send time: the server's own lateness, the loopback, and the
client's wake-up and parsing. The server spins on its own CPU (it never sleeps within 2 ms of a
send), so its lateness is small; it is measured and reported beside the error, not subtracted.
The server is pinned to CPU 0 and this process to CPU 1 (--no-pin leaves them to the kernel).

On a shared 2-core machine the tail is set by whatever else runs: a few ms of another process on
either CPU delays every stream at once. The CPU that other processes took during the run is
printed (`foreign_cpu_cores`); trust a p99 only where it is near 0.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import heapq
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from daemon_proc import free_port

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.front_capacity import Probe  # noqa: E402  (the same collector-pass recorder)
from loadgen.client import ClientConfig, run_blocking  # noqa: E402
from loadgen.workload import LoadRequest  # noqa: E402
from tokenflowd.buffer.qos import percentile  # noqa: E402
from tokenflowd.sim.workload import WorkloadRequest  # noqa: E402

EVENT = b'data: {"choices":[{"index":0,"text":" tok","finish_reason":null}]}\n\n'
END = (b'data: {"choices":[{"index":0,"text":"","finish_reason":"length"}]}\n\n'
       b'data: {"choices":[],"usage":{"completion_tokens":%d}}\n\ndata: [DONE]\n\n')


def raise_nofile() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def pin(cpu: int | None) -> None:
    if cpu is not None and hasattr(os, "sched_setaffinity") and cpu < os.cpu_count():
        os.sched_setaffinity(0, {cpu})


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy_seconds() -> float:
    """CPU seconds all CPUs spent not idle since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def gc_summary(events: list[tuple[float, str, float]], start: float, end: float) -> dict:
    """Collector passes (front_capacity.Probe's gc events) that ended within [start, end], while
    tokens were scheduled, by generation."""
    out = {}
    for g in (0, 1, 2):
        d = [dt for t, kind, dt in events if kind == f"gc{g}" and start <= t <= end]
        if d:
            out[f"gen{g}"] = {"passes": len(d), "total_ms": round(1e3 * sum(d), 2), "max_ms": round(1e3 * max(d), 2)}
    return out


# -- the server (a child process) ---------------------------------------------------------------
class Schedule:
    """Every open stream's next send time in one heap; one task sends what is due and spins."""

    SPIN = 0.002  # s before a send from which the task stops sleeping

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, "Stream"]] = []
        self.lateness: list[float] = []
        self.seq = 0

    def add(self, when: float, stream: "Stream") -> None:
        self.seq += 1
        heapq.heappush(self.heap, (when, self.seq, stream))

    async def run(self) -> None:
        while True:
            now = time.monotonic()
            while self.heap and self.heap[0][0] <= now:
                when, _, stream = heapq.heappop(self.heap)
                stream.send(self)
                self.lateness.append(time.monotonic() - when)
            wait = (self.heap[0][0] if self.heap else now + 0.05) - time.monotonic()
            await asyncio.sleep(wait - self.SPIN if wait > self.SPIN else 0)


class Stream:
    def __init__(self, transport: asyncio.Transport, t0: float, period: float, num_tokens: int) -> None:
        self.transport, self.t0, self.period, self.num_tokens = transport, t0, period, num_tokens
        self.k = 0
        self.done = asyncio.get_running_loop().create_future()

    def send(self, schedule: Schedule) -> None:
        if self.transport.is_closing():
            self.done.set_result(None)
            return
        self.transport.write(b"%x\r\n%s\r\n" % (len(EVENT), EVENT))  # one HTTP chunk per event
        self.k += 1
        if self.k < self.num_tokens:
            schedule.add(self.t0 + self.k * self.period, self)
        else:
            end = END % self.num_tokens
            self.transport.write(b"%x\r\n%s\r\n" % (len(end), end))
            self.done.set_result(None)


def serve(a: argparse.Namespace) -> int:
    from aiohttp import web

    raise_nofile()
    pin(None if a.no_pin else 0)
    # The server is the instrument: no collector pauses in its schedule. Its garbage goes by
    # reference counting; the few cycles of a run of seconds can wait.
    gc.disable()
    schedule = Schedule()

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        stream = Stream(request.transport, body["t0"], body["period"], body["max_tokens"])
        schedule.add(stream.t0, stream)
        await stream.done
        await resp.write_eof()
        return resp

    async def stats(request: web.Request) -> web.Response:
        late = schedule.lateness
        return web.json_response({"sends": len(late), **{f"lateness_{q}_ms": 1e3 * percentile(late, q)
                                                         for q in (50, 99)},
                                  "lateness_max_ms": 1e3 * max(late, default=0.0)})

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        app.router.add_get("/stats", stats)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", a.port, backlog=8192).start()
        ticker = asyncio.create_task(schedule.run())
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the bench closes stdin
        ticker.cancel()
        await runner.cleanup()

    _run(main())
    return 0


def _run(coro) -> None:
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
        return
    uvloop.run(coro)


# -- the bench ----------------------------------------------------------------------------------
def bench(a: argparse.Namespace) -> int:
    nofile = raise_nofile()
    if nofile < a.streams + 100:
        print(f"warning: the open-file limit is {nofile}, fewer than {a.streams} streams need", file=sys.stderr)
    port = free_port()
    server = subprocess.Popen([sys.executable, __file__, "--serve", "--port", str(port),
                               *(["--no-pin"] if a.no_pin else [])], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert server.stdout.readline().strip() == b"ready", "the server did not start"
        pin(None if a.no_pin else 1)
        t0 = time.monotonic() + a.lead
        offsets = [(i / a.streams) * a.period if a.phase == "spread" else 0.0 for i in range(a.streams)]
        loads = [LoadRequest(WorkloadRequest(f"s{i}", 0.0, 1, a.tokens, 20.0, (i,)),
                             msgspec.json.encode({"model": "null", "prompt": [1], "max_tokens": a.tokens,
                                                  "stream": True, "t0": t0 + offsets[i], "period": a.period}), None)
                 for i in range(a.streams)]
        cpu0, server0, busy0 = time.process_time(), cpu_seconds(server.pid), machine_busy_seconds()
        with Probe() as probe:
            result = run_blocking(loads, ClientConfig(f"http://127.0.0.1:{port}/v1/completions",
                                                      timeout=a.lead + 30))
        client_cpu, server_cpu = time.process_time() - cpu0, cpu_seconds(server.pid) - server0
        foreign_cpu = machine_busy_seconds() - busy0 - client_cpu - server_cpu
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{port}/stats", timeout=30) as r:
            server_stats = json.load(r)
    finally:
        server.stdin.close()
        server.wait(30)
    errors, incomplete = [], 0
    for i, rec in enumerate(result.records):
        if rec.outcome != "completed" or len(rec.token_times) != a.tokens:
            incomplete += 1
            continue
        start = t0 + offsets[i]
        errors.extend(result.origin + t - (start + k * a.period) for k, t in enumerate(rec.token_times))
    ms = {f"error_p{q}_ms": round(1e3 * percentile(errors, q), 3) for q in (50, 90, 99)}
    out = {
        "streams": a.streams, "period_s": a.period, "tokens_per_stream": a.tokens, "phase": a.phase,
        "tokens_per_s": round(a.streams / a.period), "tokens_measured": len(errors), "incomplete_streams": incomplete,
        **ms, "error_max_ms": round(1e3 * max(errors, default=float("nan")), 3),
        "error_min_ms": round(1e3 * min(errors, default=float("nan")), 3),
        "server": {k: round(v, 3) if isinstance(v, float) else v for k, v in server_stats.items()},
        "client_gc_while_measured": gc_summary(probe.events, t0, t0 + max(offsets) + a.tokens * a.period),
        "client_cpu_s": round(client_cpu, 2), "run_s": round(result.duration, 2),
        "client_cpu_share": round(client_cpu / result.duration, 3),
        "server_cpu_share": round(server_cpu / result.duration, 3),
        # CPU other processes took meanwhile, in cores: above ~0.1 they competed with the bench
        "foreign_cpu_cores": round(max(0.0, foreign_cpu) / result.duration, 3),
        "pinned": not a.no_pin, "cpus": os.cpu_count(), "python": platform.python_version(),
        "machine": platform.machine(),
    }
    print(f"{a.streams} streams x {a.tokens} tokens every {a.period * 1e3:g} ms ({a.phase}), "
          f"{out['tokens_per_s']} tokens/s: {len(errors)} tokens measured, {incomplete} streams incomplete")
    print(f"token timestamp error  p50 {ms['error_p50_ms']:.3f} ms  p90 {ms['error_p90_ms']:.3f} ms  "
          f"p99 {ms['error_p99_ms']:.3f} ms  max {out['error_max_ms']:.3f} ms  (target: p99 < 2 ms)")
    print(f"server lateness (included above)  p50 {out['server']['lateness_50_ms']:.3f} ms  "
          f"p99 {out['server']['lateness_99_ms']:.3f} ms;  CPU: client {out['client_cpu_share']:.0%}, server "
          f"{out['server_cpu_share']:.0%} of a core, other processes {out['foreign_cpu_cores']:.2f} cores")
    print(f"client GC passes while tokens flowed: {out['client_gc_while_measured']}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    return 0 if not incomplete else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=1000, help="concurrent streams (default 1000)")
    p.add_argument("--period", type=float, default=0.05, help="s between a stream's tokens (default 0.05)")
    p.add_argument("--tokens", type=int, default=100, help="tokens per stream (default 100)")
    p.add_argument("--phase", choices=("spread", "aligned"), default="spread",
                   help="streams' tokens spread evenly over a period (default) or all at once")
    p.add_argument("--lead", type=float, default=3.0, help="s from the start to the first scheduled token (default 3)")
    p.add_argument("--no-pin", action="store_true", help="do not pin the server to CPU 0 and the client to CPU 1")
    p.add_argument("--out", help="write the figures as JSON here")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    return serve(a) if a.serve else bench(a)


if __name__ == "__main__":
    sys.exit(main())
