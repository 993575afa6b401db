"""Capacity of the HTTP front: how many concurrent SSE streams one `tokenflowd serve` process
(aiohttp + supervisor on uvloop) holds while adding at most 5 ms (p99) to each token's latency.

    python bench/front_capacity.py [--streams 250,500,1000,2000,3000,4000] [--rate 20] [--tokens 100]

The model is replaced by bench/null_engine.py (same zmq/msgspec protocol as the real engine
process, no model): every request gets one token per 1/rate s from its arrival at the engine, up to
max_tokens, and the engine logs the time it sent each token. The front is built by
tokenflowd.serve.run_server itself, with a Supervisor whose engine_command starts the null engine.

Three processes per N, on a 2-core machine pinned as: the front alone on one CPU; the load client
and the null engine share the other (--no-pin leaves placement to the kernel).

Load. One client process (uvloop, a raw HTTP/1.1 protocol: see _SSEClient) runs N workers. Worker
i starts at i / ramp-rate s (a ramp, so the listen queue never overflows; the front's backlog is 4096),
and each worker runs streams back to back: POST /v1/completions {stream, max_tokens, ignore_eos},
read the SSE lines, record time.monotonic() at the read that delivered each content event; when a
stream ends the worker opens the next one. So N streams are open at all times (less the moment
between two streams of a worker), and new requests keep arriving at N * rate / tokens per second:
the request set-up cost is part of the load, as it is for a server holding N streams of that length.

Steady state. The ramp has ended when every worker has received a token. After `--settle` more
seconds the window opens for `--duration` s; at its end workers open no new streams and finish
theirs. Only tokens the engine sent inside the window are measured.

Latency. time.monotonic() is CLOCK_MONOTONIC, the same clock in every process on the host, so each
token's added latency is measured directly: arrival at the client (the read that delivered it)
minus the engine's send time of that token (token k of a stream ↔ its k-th content event; the
stream is matched to the engine's log by the X-Request-Id header). That is everything between
the engine's socket and the client's parser: zmq, the supervisor, the handler (detokenizer, metrics,
JSON), aiohttp's write, loopback TCP, and the client's own wake-up. The engine's own lateness
against its schedule is excluded (reported separately). Also reported: the added inter-token gap,
(gap between two arrivals) − (gap between the two sends), whose p99 is what a reader would feel.

Per N: streams completed and failed, tokens measured, p50/p99/max added latency, p99 added gap,
CPU of the front / engine / client over the window (a client near 100% inflates the figures: its
wake-ups are in them). Results go to bench/results/front_capacity.json; the verdict is the largest
N whose p99 added latency is <= --threshold-ms with every stream complete.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import msgspec

HERE = Path(__file__).resolve().parent
NULL_ENGINE = HERE / "null_engine.py"
MODEL = "smollm2-135m"
PROMPT = "Tell me a story about a lighthouse keeper."


# -- shared helpers ------------------------------------------------------------------------------
def raise_nofile() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def pin(cpus: str | None) -> None:
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


# -- the front ----------------------------------------------------------------------------------
def front_main(a: argparse.Namespace) -> int:
    import uvloop

    from tokenflowd import protocol as p
    from tokenflowd.config import EngineConfig, ServerConfig
    from tokenflowd.serve import run_server
    from tokenflowd.supervisor import Supervisor

    class NullSupervisor(Supervisor):
        def engine_command(self, spec: p.EngineSpec) -> list[str]:
            return [sys.executable, str(NULL_ENGINE), msgspec.json.encode(spec).decode()]

    raise_nofile()
    pin(a.cpus)
    os.environ.update(NULL_ENGINE_RATE=str(a.rate), NULL_ENGINE_TOKEN_ID=str(a.token_id),
                      NULL_ENGINE_LOG=a.engine_log, NULL_ENGINE_CPUS=a.engine_cpus or "")
    server = ServerConfig(port=a.port, default_reading_rate=a.rate, max_waiting_requests=1_000_000)
    engine = EngineConfig(model=MODEL, device="cpu")
    probe = Probe()

    async def serve() -> None:
        watcher = asyncio.create_task(probe.watch_loop())
        await run_server(server, engine, supervisor_factory=NullSupervisor, backlog=a.backlog)
        watcher.cancel()

    with probe:
        uvloop.run(serve())
    Path(a.probe_log).write_bytes(msgspec.msgpack.encode(probe.events))
    return 0


class Probe:
    """What stalls a process's event loop: each garbage-collector pass (gc0, gc1, gc2) and each time
    a 5 ms timer fires more than 2 ms late (lag). Events are (end time, kind, seconds)."""

    def __init__(self) -> None:
        self.events: list[tuple[float, str, float]] = []
        self._t = 0.0

    def __enter__(self) -> Probe:
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.events.append((time.monotonic(), f"gc{info['generation']}", time.perf_counter() - self._t))

    async def watch_loop(self, interval: float = 0.005, slack: float = 0.002) -> None:
        while True:
            t = time.monotonic()
            await asyncio.sleep(interval)
            now = time.monotonic()
            if now - t - interval > slack:
                self.events.append((now, "lag", now - t - interval))

    @staticmethod
    def summary(events: list[tuple[float, str, float]], window: tuple[float, float]) -> dict:
        ws, we = window
        out = {}
        for kind in ("gc0", "gc1", "gc2", "lag"):
            d = [dt for t, k, dt in events if k == kind and ws <= t < we]
            out[kind] = {"per_s": round(len(d) / (we - ws), 2), "total_ms": round(1e3 * sum(d), 1),
                         "max_ms": round(1e3 * max(d), 2) if d else None}
        return out


# -- the load client ----------------------------------------------------------------------------
class StreamRecord(msgspec.Struct, array_like=True):
    request_id: str | None
    worker: int
    start: float
    arrivals: list[float]  # time.monotonic() of the read that delivered each content event
    finish_reason: str | None
    done: bool  # data: [DONE] seen
    error: str | None


class ClientResult(msgspec.Struct):
    n: int
    ramp_end: float | None
    window: tuple[float, float]
    cpu: dict[str, tuple[float, float]]  # process -> (user, system) CPU seconds inside the window
    streams: list[StreamRecord]
    probe: list[tuple[float, str, float]]  # the client's own loop stalls (see Probe)


class _SSEClient(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection that runs streaming requests one after another.

    Deliberately lean (a raw protocol, no HTTP client library): on a 2-core machine the load
    client shares the CPUs, and its own per-token cost would count against the front. It relies
    on what the front sends: one SSE event per HTTP chunk, content events carrying a non-empty
    "text", the stream ending with `data: [DONE]` and the last chunk."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.rec: StreamRecord | None = None
        self.finished: asyncio.Future[None] | None = None
        self._head = b""
        self._pending = b""
        self._in_body = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def start(self, request: bytes, rec: StreamRecord) -> asyncio.Future[None]:
        self.rec, self._head, self._pending, self._in_body = rec, b"", b"", False
        self.finished = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self.finished

    def data_received(self, data: bytes) -> None:
        t = time.monotonic()
        rec = self.rec
        if rec is None:
            return
        if not self._in_body:
            self._head += data
            end = self._head.find(b"\r\n\r\n")
            if end < 0:
                return
            head, data = self._head[:end], self._head[end + 4:]
            self._in_body = True
            lines = head.split(b"\r\n")
            status = int(lines[0].split(b" ", 2)[1])
            for line in lines[1:]:
                if line[:13].lower() == b"x-request-id:":
                    rec.request_id = line[13:].strip().decode()
            if status != 200:
                rec.error = f"HTTP {status}"
                self._finish(close=True)
                return
        events = (self._pending + data).split(b"\n\n")
        self._pending = events.pop()
        for event in events:
            i = event.find(b"data: ")
            if i < 0:
                continue
            payload = event[i + 6:]
            if payload == b"[DONE]":
                rec.done = True
            elif payload.startswith(b'{"error"'):
                rec.error = payload.decode(errors="replace")[:200]
            else:
                if b'"text":""' not in payload:
                    rec.arrivals.append(t)
                j = payload.find(b'"finish_reason":"')
                if j >= 0:
                    rec.finish_reason = payload[j + 17:payload.index(b'"', j + 17)].decode()
        if rec.done and self._pending.endswith(b"\r\n0\r\n\r\n"):
            self._finish(close=False)

    def _finish(self, close: bool) -> None:
        self.rec = None
        if close and self.transport is not None:
            self.transport.close()
        if self.finished is not None and not self.finished.done():
            self.finished.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.rec is not None and self.rec.error is None:
            self.rec.error = f"connection lost: {exc}"
        self.transport = None
        self._finish(close=False)


async def run_client(a: argparse.Namespace, probe: Probe) -> ClientResult:
    n = a.n
    loop = asyncio.get_running_loop()
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": a.tokens, "stream": True,
                       "ignore_eos": True, "temperature": 0}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    records: list[StreamRecord] = []
    started = 0
    ramp_done = asyncio.Event()
    ramp_end: float | None = None
    stop = asyncio.Event()

    async def worker(i: int, t0: float) -> None:
        nonlocal started, ramp_end
        await asyncio.sleep(max(0.0, t0 + i / a.ramp_rate - time.monotonic()))
        conn: _SSEClient | None = None
        counted = False
        while not stop.is_set():
            rec = StreamRecord(None, i, time.monotonic(), [], None, False, None)
            records.append(rec)
            try:
                if conn is None or conn.transport is None or conn.transport.is_closing():
                    _, conn = await loop.create_connection(_SSEClient, "127.0.0.1", a.port)
                await asyncio.wait_for(conn.start(request, rec), 60)
            except (OSError, asyncio.TimeoutError) as e:
                rec.error = rec.error or f"{type(e).__name__}: {e}"
                if conn is not None and conn.transport is not None:
                    conn.transport.close()
                conn = None
            if not counted and rec.arrivals:
                counted = True
                started += 1
                if started == n:
                    ramp_end = time.monotonic()
                    ramp_done.set()
            if rec.error is not None:
                await asyncio.sleep(0.1)
        if conn is not None and conn.transport is not None:
            conn.transport.close()

    pids = {"front": a.front_pid, "engine": a.engine_pid, "client": os.getpid()}
    watcher = asyncio.create_task(probe.watch_loop())
    t0 = time.monotonic() + 0.1
    tasks = [asyncio.create_task(worker(i, t0)) for i in range(n)]
    try:
        await asyncio.wait_for(ramp_done.wait(), n / a.ramp_rate + a.ramp_timeout)
    except asyncio.TimeoutError:
        print(f"client: only {started}/{n} streams got a token within the ramp; measuring anyway",
              file=sys.stderr)
    await asyncio.sleep(a.settle)
    ws = time.monotonic()
    cpu0 = {k: cpu_seconds(pid) for k, pid in pids.items()}
    await asyncio.sleep(a.duration)
    cpu1 = {k: cpu_seconds(pid) for k, pid in pids.items()}
    we = time.monotonic()
    stop.set()
    await asyncio.gather(*tasks)
    watcher.cancel()
    return ClientResult(n, ramp_end, (ws, we), {k: (cpu1[k][0] - cpu0[k][0], cpu1[k][1] - cpu0[k][1]) for k in pids}, records, probe.events)


def client_main(a: argparse.Namespace) -> int:
    import uvloop

    raise_nofile()
    pin(a.cpus)
    gc.freeze()
    gc.disable()  # the client's own collector pauses would count against the front (a run leaks little)
    with Probe() as probe:
        result = uvloop.run(run_client(a, probe))
    Path(a.out).write_bytes(msgspec.msgpack.encode(result))
    return 0


# -- analysis -----------------------------------------------------------------------------------
def analyse(client: ClientResult, sent: dict[str, list[float]], front_probe: list[tuple[float, str, float]],
            a: argparse.Namespace) -> dict:
    import numpy as np

    ws, we = client.window
    period = 1.0 / a.rate
    delays, gaps, slips = [], [], []
    completed = failed = mismatched = lost = 0
    streams_in_window = 0
    for rec in client.streams:
        if rec.error is not None or not rec.done or rec.finish_reason is None:
            failed += 1
        else:
            completed += 1
        em = sent.get(rec.request_id or "")
        if not em:
            continue
        e = np.asarray(em)
        arr = np.asarray(rec.arrivals)
        if rec.done and len(arr) != len(e):
            mismatched += 1
        inside = (e >= ws) & (e < we)
        if not inside.any():
            continue
        streams_in_window += 1
        k = min(len(arr), len(e))
        lost += int(inside[k:].sum())  # sent in the window, never seen by the client
        d = arr[:k] - e[:k]
        delays.append(d[inside[:k]])
        if k > 1:
            g = np.diff(d)  # (arrival gap) - (send gap)
            gaps.append(g[inside[1:k]])
        slips.append((e - (e[0] + period * np.arange(len(e))))[inside])  # engine lateness vs its schedule
    d = np.concatenate(delays) if delays else np.zeros(0)
    g = np.concatenate(gaps) if gaps else np.zeros(0)
    s = np.concatenate(slips) if slips else np.zeros(0)
    span = we - ws

    def ms(x: np.ndarray, q: float) -> float | None:
        return round(float(np.quantile(x, q)) * 1e3, 3) if len(x) else None

    return {
        "streams": client.n,
        "ramp_s": round(client.ramp_end - client.streams[0].start, 2) if client.ramp_end and client.streams else None,
        "all_started": client.ramp_end is not None,
        "streams_completed": completed,
        "streams_failed": failed,
        "streams_token_count_mismatch": mismatched,
        "streams_in_window": streams_in_window,
        "window_s": round(span, 2),
        "tokens_measured": int(len(d)),
        "tokens_lost": lost,
        "tokens_per_s": round(len(d) / span, 1),
        "requests_per_s": round(sum(1 for r in client.streams if ws <= r.start < we) / span, 1),
        "added_latency_ms": {"p50": ms(d, 0.5), "p90": ms(d, 0.9), "p99": ms(d, 0.99), "p999": ms(d, 0.999),
                             "max": ms(d, 1.0)},
        "added_gap_ms": {"p50": ms(g, 0.5), "p99": ms(g, 0.99), "max": ms(g, 1.0)},
        "engine_lateness_ms": {"p50": ms(s, 0.5), "p99": ms(s, 0.99)},
        "cpu_cores": {k: round((u + st) / span, 3) for k, (u, st) in client.cpu.items()},
        "front_cpu_us_per_token": {"user": round(client.cpu["front"][0] / max(len(d), 1) * 1e6, 1),
                                   "system": round(client.cpu["front"][1] / max(len(d), 1) * 1e6, 1)},
        "front_stalls": Probe.summary(front_probe, client.window),
        "client_stalls": Probe.summary(client.probe, client.window),
    }


# -- one N, then the sweep ------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the front exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                return json.loads(r.read())
        except OSError:
            time.sleep(0.2)
    raise TimeoutError("the front did not become healthy")


def ramp_rate(n: int, a: argparse.Namespace) -> float:
    """New streams/s during the ramp: by default the starts spread over one stream's duration, so the
    closed loop afterwards keeps a uniform N * rate / tokens new requests per second, not waves."""
    return a.ramp_rate or n * a.rate / a.tokens


def run_one(n: int, a: argparse.Namespace, cpus: tuple[str | None, str | None], tmp: Path) -> dict:
    front_cpus, other_cpus = cpus
    port = free_port()
    engine_log, client_out, probe_log = (tmp / f"{what}-{n}.msgpack" for what in ("engine", "client", "probe"))
    me = [sys.executable, str(Path(__file__).resolve())]
    common = ["--port", str(port), "--rate", str(a.rate)]
    front = subprocess.Popen([*me, "--role", "front", *common, "--engine-log", str(engine_log), "--probe-log", str(probe_log),
                              "--token-id", str(a.token_id), "--backlog", str(a.backlog),
                              *(["--cpus", front_cpus] if front_cpus else []),
                              *(["--engine-cpus", other_cpus] if other_cpus else [])])
    try:
        health = wait_healthy(port, front)
        engine_pid = health["engines"][0]["pid"]
        client = subprocess.run([*me, "--role", "client", *common, "--n", str(n), "--tokens", str(a.tokens),
                                 "--ramp-rate", str(ramp_rate(n, a)), "--ramp-timeout", str(a.ramp_timeout),
                                 "--settle", str(a.settle), "--duration", str(a.duration), "--out", str(client_out),
                                 "--front-pid", str(front.pid), "--engine-pid", str(engine_pid),
                                 *(["--cpus", other_cpus] if other_cpus else [])],
                                timeout=n / ramp_rate(n, a) + a.ramp_timeout + a.settle + a.duration + 120)
        if client.returncode != 0:
            raise RuntimeError(f"the load client exited with {client.returncode}")
    finally:
        front.send_signal(signal.SIGTERM)  # drains (nothing is open by now), then shuts the engine down
        try:
            front.wait(60)
        except subprocess.TimeoutExpired:
            front.kill()
            front.wait()
    result = msgspec.msgpack.decode(client_out.read_bytes(), type=ClientResult)
    sent = msgspec.msgpack.decode(engine_log.read_bytes(), type=dict[str, list[float]])
    front_probe = msgspec.msgpack.decode(probe_log.read_bytes(), type=list[tuple[float, str, float]])
    for f in (engine_log, client_out, probe_log):
        if a.keep_raw:
            Path(a.keep_raw).mkdir(parents=True, exist_ok=True)
            f.replace(Path(a.keep_raw) / f.name)
        else:
            f.unlink()
    return analyse(result, sent, front_probe, a)


def fmt(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def table(rows: list[dict], threshold_ms: float) -> str:
    head = (f"{'streams':>7} {'done':>6} {'fail':>4} {'tok/s':>7} {'req/s':>6} {'p50 ms':>7} {'p99 ms':>7} "
            f"{'max ms':>7} {'gap p99':>7} {'eng p99':>7} {'front':>6} {'client':>6} {'engine':>6} {'stall':>6} {'c.stall':>7}  ok")
    lines = [head, "-" * len(head)]
    for r in rows:
        lat, cpu = r["added_latency_ms"], r["cpu_cores"]
        lines.append(f"{r['streams']:>7} {r['streams_completed']:>6} {r['streams_failed']:>4} {r['tokens_per_s']:>7.0f} "
                     f"{r['requests_per_s']:>6.0f} {fmt(lat['p50']):>7} {fmt(lat['p99']):>7} {fmt(lat['max'], 1):>7} "
                     f"{fmt(r['added_gap_ms']['p99']):>7} {fmt(r['engine_lateness_ms']['p99']):>7} "
                     f"{cpu['front']:>6.2f} {cpu['client']:>6.2f} {cpu['engine']:>6.2f} "
                     f"{fmt(r['front_stalls']['lag']['max_ms'], 0):>6} {fmt(r['client_stalls']['lag']['max_ms'], 0):>7}  "
                     f"{'yes' if passes(r, threshold_ms) else 'no'}")
    return "\n".join(lines)


def passes(r: dict, threshold_ms: float) -> bool:
    p99 = r["added_latency_ms"]["p99"]
    return (p99 is not None and p99 <= threshold_ms and r["all_started"] and r["streams_failed"] == 0
            and r["tokens_lost"] == 0)


def sweep(a: argparse.Namespace) -> int:
    raise_nofile()
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    cpus: tuple[str | None, str | None] = (None, None)
    if a.pin and len(allowed) >= 2:
        cpus = (str(allowed[0]), ",".join(map(str, allowed[1:])))
        pin(cpus[1])  # this process mostly sleeps; keep it off the front's CPU
    token_text = None
    try:
        from tokenflowd.text.source import load_tokenizer

        token_text = load_tokenizer(MODEL).decode([a.token_id])
    except Exception as e:  # noqa: BLE001 - only for the report
        print(f"(could not decode token {a.token_id}: {e})", file=sys.stderr)
    rows = []
    with tempfile.TemporaryDirectory(prefix="front-capacity-") as tmp:
        for n in [int(x) for x in a.streams.split(",")]:
            t = time.monotonic()
            r = run_one(n, a, cpus, Path(tmp))
            rows.append(r)
            print(f"N={n}: p99 added latency {r['added_latency_ms']['p99']} ms, {r['streams_completed']} streams "
                  f"completed, {r['streams_failed']} failed, front {r['cpu_cores']['front']:.2f} cores "
                  f"({time.monotonic() - t:.0f} s)", flush=True)
    ok = [r["streams"] for r in rows if passes(r, a.threshold_ms)]
    best = max(ok) if ok else None
    print()
    print(f"front capacity: rate {a.rate} tokens/s per stream, {a.tokens} tokens per stream, "
          f"window {a.duration} s, pinned front={cpus[0]} client+engine={cpus[1]}")
    print(table(rows, a.threshold_ms))
    print("(latencies: client arrival - engine send, per token, in ms; CPU in cores over the window;\n"
          " gap p99: added inter-token gap; eng p99: null engine lateness vs its schedule;\n"
          " stall / c.stall: longest event-loop stall of the front / the client in the window, ms)")
    print(f"largest N with p99 added latency <= {a.threshold_ms} ms: {best}")
    out = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "method": "per-token client arrival minus null-engine send time (CLOCK_MONOTONIC); closed-loop streams",
        "params": {"rate": a.rate, "tokens": a.tokens, "token_id": a.token_id, "token_text": token_text,
                   "ramp_rate": a.ramp_rate or "N * rate / tokens", "settle_s": a.settle, "duration_s": a.duration,
                   "threshold_ms": a.threshold_ms, "pinned": {"front": cpus[0], "client_and_engine": cpus[1]},
                   "backlog": a.backlog},
        "results": rows,
        "max_streams_within_threshold": best,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {a.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="250,500,1000,2000,3000,4000", help="comma-separated N to sweep")
    ap.add_argument("--rate", type=float, default=20.0, help="tokens/s per stream")
    ap.add_argument("--tokens", type=int, default=100, help="max_tokens of each stream")
    ap.add_argument("--duration", type=float, default=8.0, help="seconds measured in steady state")
    ap.add_argument("--settle", type=float, default=2.0, help="seconds between the end of the ramp and the window")
    ap.add_argument("--ramp-rate", type=float, default=0.0,
                    help="new streams per second during the ramp (default: N * rate / tokens, i.e. the starts "
                         "spread over one stream's duration)")
    ap.add_argument("--ramp-timeout", type=float, default=30.0, help="extra seconds allowed for the ramp")
    ap.add_argument("--threshold-ms", type=float, default=5.0)
    ap.add_argument("--token-id", type=int, default=260, help="the token the null engine emits (260: ' the')")
    ap.add_argument("--backlog", type=int, default=4096, help="the front's listen backlog")
    ap.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin the processes to CPUs")
    ap.add_argument("--out", default=str(HERE / "results" / "front_capacity.json"))
    ap.add_argument("--keep-raw", metavar="DIR", help="keep the raw logs (engine send times, client arrivals, "
                                                      "front stalls) as msgpack files in DIR")
    # internal: the subprocesses
    ap.add_argument("--role", choices=["sweep", "front", "client"], default="sweep", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--cpus", help=argparse.SUPPRESS)
    ap.add_argument("--engine-cpus", help=argparse.SUPPRESS)
    ap.add_argument("--engine-log", help=argparse.SUPPRESS)
    ap.add_argument("--probe-log", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--front-pid", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--engine-pid", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.role == "front":
        return front_main(a)
    if a.role == "client":
        return client_main(a)
    return sweep(a)


if __name__ == "__main__":
    sys.exit(main())
