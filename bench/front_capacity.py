"""Capacity of the HTTP front: how many concurrent SSE streams one `tokenflowd serve` process
(aiohttp + supervisor on uvloop) holds with no reader stalled and every token on time, with the
front's rate-aware SSE coalescing on or off.

    python bench/front_capacity.py [--streams 250,500,1000,2000,3000,4000] [--rate 20] [--tokens 100]
                                   [--reading-rate R] [--coalesce on|off]

The model is replaced by bench/null_engine.py (same zmq/msgspec protocol as the real engine
process, no model): every request gets one token per 1/rate s from its arrival at the engine, up to
max_tokens, and the engine logs the time it sent each token. The front is built by
tokenflowd.daemon.serve.run_server itself, with a Supervisor whose engine_command starts the null engine.

Three processes per N, on a 2-core machine pinned as: the front alone on one CPU; the load client
and the null engine share the other (--no-pin leaves placement to the kernel).

Load. One client process (uvloop, a raw HTTP/1.1 protocol: see _SSEClient) runs N workers. Worker
i starts at i / ramp-rate s (a ramp, so the listen queue never overflows; the front's backlog is 4096),
and each worker runs streams back to back: POST /v1/completions {stream, max_tokens, ignore_eos,
reading_rate}, read the SSE lines, record time.monotonic() at the read that delivered each content
event and the number of tokens it carries; when a stream ends the worker opens the next one. So N
streams are open at all times (less the moment between two streams of a worker), and new requests
keep arriving at N * rate / tokens per second: the request set-up cost is part of the load, as it is
for a server holding N streams of that length.

Reading rate and coalescing. Each request states `"reading_rate": R` (--reading-rate, default
--rate). The front models each client's buffer (tokens delivered minus what a reader at R has
read); while it holds at least --coalesce-buffer s of reading (the front's default, 2 s) the front
holds the stream's tokens and sends them as one SSE event per --coalesce-interval (default
0.25 s), else one event per token. With R = --rate the buffer never fills, so every token is its
own event whatever --coalesce says; with R < --rate it fills and coalescing takes over.
--coalesce off sends `"stream_options": {"coalesce": false}`: one event per token throughout.
The null engine emits one token (260: " the"), so the client counts a content event's tokens as
the occurrences of that text between `"text":"` and the closing quote (no JSON parsing: the client
shares the CPUs).

Steady state. The ramp has ended when every worker has received a token. After `--settle` more
seconds the window opens for `--duration` s; at its end workers open no new streams and finish
theirs. Only tokens the engine sent inside the window are measured.

Latency. time.monotonic() is CLOCK_MONOTONIC, the same clock in every process on the host, so each
token's latency is measured directly. Token k of a stream (k from 0; the stream is matched to the
engine's log by the X-Request-Id header) arrives with the event that carries it:
  * added = arrival − the engine's send time of token k: everything between the engine's socket and
    the client's parser (zmq, the supervisor, the handler: detokenizer, metrics, JSON, coalescing's
    hold; aiohttp's write, loopback TCP, the client's own wake-up). The engine's own lateness
    against its schedule is excluded (reported separately).
  * late = arrival − due, due = (arrival of the stream's first token) + k / R: when a reader at
    the stated rate reads token k. late > 0 means that reader waited for it (a stall); late >
    --threshold-ms counts as a reader stall.
Also reported: the added inter-token gap, (gap between two arrivals) − (gap between the two sends),
which says little with coalescing on (a held token's gap is the hold).

Per N: streams completed and failed, tokens measured, p50/p99/max added latency, p99/max late,
the fraction of tokens later than --threshold-ms (stalls), SSE events per token (events that carry
tokens / tokens they carry, both arriving inside the window), front CPU µs (user + system) per token
delivered inside the window, CPU of the front / engine / client over the window (a client near 100%
inflates the figures: its wake-ups are in them). Results go to bench/results/front_capacity.json.

Verdict: N passes when every stream started, completed with max_tokens tokens and none failed,
no token was lost, p99 late <= --threshold-ms (no reader stall), and the front keeps up: p99 added
<= --threshold-ms with coalescing off, or <= the front's coalesce interval + --threshold-ms with it
on (a token may be held one interval by design). The result is the largest N that passes.
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
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec

from daemon_proc import free_port, wait_healthy

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


def front_cpu_seconds(pid: int, engine_pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of the front: its process and, with --api-servers N > 1, its front
    processes (every child but the engine)."""
    import psutil

    pids = [pid] + [c.pid for c in psutil.Process(pid).children() if c.pid != engine_pid]
    times = [cpu_seconds(p) for p in pids]
    return sum(u for u, _ in times), sum(s for _, s in times)


# -- the front ----------------------------------------------------------------------------------
def front_main(a: argparse.Namespace) -> int:
    import uvloop

    from tokenflowd import protocol as p
    from tokenflowd.config import EngineConfig, ServerConfig
    from tokenflowd.daemon.api_servers import run_api_servers
    from tokenflowd.daemon.serve import run_server
    from tokenflowd.daemon.supervisor import Supervisor

    class NullSupervisor(Supervisor):
        def engine_command(self, spec: p.EngineSpec) -> list[str]:
            return [sys.executable, str(NULL_ENGINE), msgspec.json.encode(spec).decode()]

    raise_nofile()
    pin(a.cpus)
    os.environ.update(NULL_ENGINE_RATE=str(a.rate), NULL_ENGINE_TOKEN_ID=str(a.token_id),
                      NULL_ENGINE_LOG=a.engine_log, NULL_ENGINE_CPUS=a.engine_cpus or "")
    server = ServerConfig(port=a.port, default_reading_rate=a.rate, max_waiting_requests=1_000_000,
                          api_servers=a.api_servers)
    engine = EngineConfig(model=MODEL, device="cpu")
    probe = Probe()

    async def serve() -> None:
        watcher = asyncio.create_task(probe.watch_loop())
        if a.api_servers > 1:
            await run_api_servers(server, engine, a.api_servers, supervisor_factory=NullSupervisor)
        else:
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
    num_tokens: list[int]  # the tokens each of those events carries (1 each without coalescing)
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
    "text" made of `token_text` once per token (the null engine's one token; the text holds no
    escaped quote), the stream ending with `data: [DONE]` and the last chunk."""

    def __init__(self, token_text: bytes) -> None:
        self.token_text = token_text  # the emitted token's text as it appears in the JSON
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
                j = payload.find(b'"text":"')
                if j >= 0:
                    num_tokens = payload.count(self.token_text, j + 8, payload.index(b'"', j + 8))
                    if num_tokens:
                        rec.arrivals.append(t)
                        rec.num_tokens.append(num_tokens)
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
                       "ignore_eos": True, "temperature": 0, "reading_rate": a.reading_rate,
                       **({} if a.coalesce == "on" else {"stream_options": {"coalesce": False}})}).encode()
    token_text = msgspec.json.encode(a.token_text)[1:-1]  # as the front's JSON writes it
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
            rec = StreamRecord(None, i, time.monotonic(), [], [], None, False, None)
            records.append(rec)
            try:
                if conn is None or conn.transport is None or conn.transport.is_closing():
                    _, conn = await loop.create_connection(lambda: _SSEClient(token_text), "127.0.0.1", a.port)
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

    def cpu_seconds_of(what: str, pid: int) -> tuple[float, float]:
        return front_cpu_seconds(pid, a.engine_pid) if what == "front" else cpu_seconds(pid)

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
    cpu0 = {k: cpu_seconds_of(k, pid) for k, pid in pids.items()}
    await asyncio.sleep(a.duration)
    cpu1 = {k: cpu_seconds_of(k, pid) for k, pid in pids.items()}
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
    delays, lates, gaps, slips = [], [], [], []
    completed = failed = mismatched = lost = 0
    streams_in_window = events_delivered = tokens_delivered = 0
    for rec in client.streams:
        if rec.error is not None or not rec.done or rec.finish_reason is None:
            failed += 1
        else:
            completed += 1
        arr = np.asarray(rec.arrivals)  # per event
        counts = np.asarray(rec.num_tokens, dtype=np.int64)
        delivered = (arr >= ws) & (arr < we)
        events_delivered += int(delivered.sum())
        tokens_delivered += int(counts[delivered].sum())
        em = sent.get(rec.request_id or "")
        if not em:
            continue
        e = np.asarray(em)  # per token: the engine's send time of token k
        arr = np.repeat(arr, counts)  # per token: the arrival of the event that carried token k
        if rec.done and not len(arr) == len(e) == a.tokens:
            mismatched += 1
        inside = (e >= ws) & (e < we)
        if not inside.any():
            continue
        streams_in_window += 1
        k = min(len(arr), len(e))
        lost += int(inside[k:].sum())  # sent in the window, never seen by the client
        d = arr[:k] - e[:k]
        delays.append(d[inside[:k]])
        if k:
            due = arr[0] + np.arange(k) / a.reading_rate  # when a reader at the stated rate reads token k
            lates.append((arr[:k] - due)[inside[:k]])
        if k > 1:
            g = np.diff(d)  # (arrival gap) - (send gap)
            gaps.append(g[inside[1:k]])
        slips.append((e - (e[0] + period * np.arange(len(e))))[inside])  # engine lateness vs its schedule
    d = np.concatenate(delays) if delays else np.zeros(0)
    late = np.concatenate(lates) if lates else np.zeros(0)
    g = np.concatenate(gaps) if gaps else np.zeros(0)
    s = np.concatenate(slips) if slips else np.zeros(0)
    span = we - ws
    front_user, front_sys = client.cpu["front"]

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
        "late_ms": {"p50": ms(late, 0.5), "p99": ms(late, 0.99), "max": ms(late, 1.0)},
        "stalled_token_fraction": round(float((late > a.threshold_ms / 1e3).mean()), 5) if len(late) else None,
        "events_delivered": events_delivered,
        "tokens_delivered": tokens_delivered,
        "events_per_token": round(events_delivered / tokens_delivered, 4) if tokens_delivered else None,
        "added_gap_ms": {"p50": ms(g, 0.5), "p99": ms(g, 0.99), "max": ms(g, 1.0)},
        "engine_lateness_ms": {"p50": ms(s, 0.5), "p99": ms(s, 0.99)},
        "cpu_cores": {k: round((u + st) / span, 3) for k, (u, st) in client.cpu.items()},
        # per token delivered (arrived at the client) inside the window
        "front_cpu_us_per_token": {"total": round((front_user + front_sys) / max(tokens_delivered, 1) * 1e6, 1),
                                   "user": round(front_user / max(tokens_delivered, 1) * 1e6, 1),
                                   "system": round(front_sys / max(tokens_delivered, 1) * 1e6, 1)},
        "front_stalls": Probe.summary(front_probe, client.window),
        "client_stalls": Probe.summary(client.probe, client.window),
    }


# -- one N, then the sweep ------------------------------------------------------------------------
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
                              "--api-servers", str(a.api_servers),
                              *(["--cpus", front_cpus] if front_cpus else []),
                              *(["--engine-cpus", other_cpus] if other_cpus else [])])
    try:
        health = wait_healthy(port, front)
        engine_pid = health["engines"][0]["pid"]
        client = subprocess.run([*me, "--role", "client", *common, "--n", str(n), "--tokens", str(a.tokens),
                                 "--ramp-rate", str(ramp_rate(n, a)), "--ramp-timeout", str(a.ramp_timeout),
                                 "--settle", str(a.settle), "--duration", str(a.duration), "--out", str(client_out),
                                 "--front-pid", str(front.pid), "--engine-pid", str(engine_pid),
                                 "--reading-rate", str(a.reading_rate), "--coalesce", a.coalesce,
                                 f"--token-text={a.token_text}", *(["--cpus", other_cpus] if other_cpus else [])],
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


def table(rows: list[dict], threshold_ms: float, hold_s: float) -> str:
    head = (f"{'streams':>7} {'done':>6} {'fail':>4} {'tok/s':>7} {'req/s':>6} {'p50 ms':>7} {'p99 ms':>7} "
            f"{'max ms':>7} {'late99':>7} {'latemax':>7} {'stall%':>6} {'ev/tok':>6} {'us/tok':>6} {'eng p99':>7} "
            f"{'front':>6} {'client':>6} {'engine':>6} {'stall':>6} {'c.stall':>7}  ok")
    lines = [head, "-" * len(head)]
    for r in rows:
        lat, late, cpu = r["added_latency_ms"], r["late_ms"], r["cpu_cores"]
        stalled = None if r["stalled_token_fraction"] is None else 100 * r["stalled_token_fraction"]
        lines.append(f"{r['streams']:>7} {r['streams_completed']:>6} {r['streams_failed']:>4} {r['tokens_per_s']:>7.0f} "
                     f"{r['requests_per_s']:>6.0f} {fmt(lat['p50']):>7} {fmt(lat['p99']):>7} {fmt(lat['max'], 1):>7} "
                     f"{fmt(late['p99']):>7} {fmt(late['max'], 1):>7} {fmt(stalled, 3):>6} "
                     f"{fmt(r['events_per_token'], 3):>6} {r['front_cpu_us_per_token']['total']:>6.1f} "
                     f"{fmt(r['engine_lateness_ms']['p99']):>7} {cpu['front']:>6.2f} {cpu['client']:>6.2f} "
                     f"{cpu['engine']:>6.2f} {fmt(r['front_stalls']['lag']['max_ms'], 0):>6} "
                     f"{fmt(r['client_stalls']['lag']['max_ms'], 0):>7}  "
                     f"{'yes' if passes(r, threshold_ms, hold_s) else 'no'}")
    return "\n".join(lines)


def passes(r: dict, threshold_ms: float, hold_s: float) -> bool:
    """Every stream whole, no reader stalled (p99 late), and the front keeping up (p99 added): `hold_s`
    is the coalesce interval when coalescing is on (a token may be held that long by design), else 0."""
    added, late = r["added_latency_ms"]["p99"], r["late_ms"]["p99"]
    return (r["all_started"] and r["streams_failed"] == 0 and r["streams_token_count_mismatch"] == 0
            and r["tokens_lost"] == 0 and late is not None and late <= threshold_ms
            and added is not None and added <= hold_s * 1e3 + threshold_ms)


def sweep(a: argparse.Namespace) -> int:
    from tokenflowd.config import ServerConfig

    if a.reading_rate > ServerConfig.max_reading_rate:
        sys.exit(f"--reading-rate {a.reading_rate:g} is above the front's max_reading_rate "
                 f"({ServerConfig.max_reading_rate:g}), which it would be clamped to")
    # the front runs with ServerConfig's coalescing defaults (front_main)
    coalesce_buffer, coalesce_interval = ServerConfig.coalesce_buffer, ServerConfig.coalesce_interval
    hold = coalesce_interval if a.coalesce == "on" else 0.0
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
    if token_text is None and a.token_id == 260:
        token_text = " the"
    if not token_text:
        sys.exit(f"the client counts tokens by their text, and token {a.token_id} has none known")
    a.token_text = token_text
    rows = []
    with tempfile.TemporaryDirectory(prefix="front-capacity-") as tmp:
        for n in [int(x) for x in a.streams.split(",")]:
            t = time.monotonic()
            r = run_one(n, a, cpus, Path(tmp))
            rows.append(r)
            print(f"N={n}: p99 added latency {r['added_latency_ms']['p99']} ms, p99 late {r['late_ms']['p99']} ms, "
                  f"{r['events_per_token']} events/token, {r['streams_completed']} streams completed, "
                  f"{r['streams_failed']} failed, front {r['cpu_cores']['front']:.2f} cores "
                  f"({time.monotonic() - t:.0f} s)", flush=True)
    ok = [r["streams"] for r in rows if passes(r, a.threshold_ms, hold)]
    best = max(ok) if ok else None
    print()
    print(f"front capacity: rate {a.rate} tokens/s per stream, reading rate {a.reading_rate}, coalescing {a.coalesce} "
          f"(buffer {coalesce_buffer} s, interval {coalesce_interval} s), {a.tokens} tokens per stream, "
          f"window {a.duration} s, pinned front={cpus[0]} client+engine={cpus[1]}")
    print(table(rows, a.threshold_ms, hold))
    print("(p50/p99/max: added latency, client arrival - engine send, per token, in ms;\n"
          " late99 / latemax: client arrival - when a reader at the reading rate reads the token, ms;\n"
          f" stall%: tokens later than {a.threshold_ms} ms; ev/tok: SSE events per token delivered in the window;\n"
          " us/tok: front CPU (user + system) per token delivered; CPU in cores over the window;\n"
          " eng p99: null engine lateness vs its schedule;\n"
          " stall / c.stall: longest event-loop stall of the front / the client in the window, ms)")
    print(f"largest N with every stream whole, p99 late <= {a.threshold_ms} ms and p99 added <= "
          f"{hold * 1e3 + a.threshold_ms:g} ms: {best}")
    out = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "method": "per-token client arrival minus null-engine send time (added) and minus when a reader at the "
                  "reading rate reads it (late), CLOCK_MONOTONIC; closed-loop streams",
        "params": {"rate": a.rate, "reading_rate": a.reading_rate, "coalesce": a.coalesce,
                   "coalesce_buffer_s": coalesce_buffer, "coalesce_interval_s": coalesce_interval,
                   "tokens": a.tokens, "token_id": a.token_id, "token_text": token_text,
                   "ramp_rate": a.ramp_rate or "N * rate / tokens", "settle_s": a.settle, "duration_s": a.duration,
                   "threshold_ms": a.threshold_ms, "pinned": {"front": cpus[0], "client_and_engine": cpus[1]},
                   "api_servers": a.api_servers,
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
    ap.add_argument("--reading-rate", type=float, help="tokens/s each client states as its reading_rate "
                                                         "(default: --rate, so coalescing never starts)")
    ap.add_argument("--coalesce", choices=["on", "off"], default="on",
                    help="off: each request sends stream_options.coalesce = false (one SSE event per token)")
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
    ap.add_argument("--api-servers", type=int, default=1,
                    help="API server processes (tokenflowd serve --api-servers): with more than 1, pin nothing (--no-pin), "
                         "and the front's loop-stall probe sees only the supervisor")
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
    ap.add_argument("--token-text", help=argparse.SUPPRESS)  # the emitted token's text, which the client counts
    a = ap.parse_args(argv)
    if a.reading_rate is None:
        a.reading_rate = a.rate
    if a.reading_rate <= 0:
        ap.error("--reading-rate must be above 0")
    if a.role == "front":
        return front_main(a)
    if a.role == "client":
        return client_main(a)
    return sweep(a)


if __name__ == "__main__":
    sys.exit(main())
