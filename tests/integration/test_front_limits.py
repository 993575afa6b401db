"""The front's limits, against a real front over a model-free engine (tests/null_daemon.py): open
streams, connections, slow request heads and bodies, per-key concurrency, and readers that stop
reading. Nothing here assumes a speed: every wait is for a state, with a generous deadline."""
from __future__ import annotations

import asyncio
import json
import resource
import socket
import time

import httpx
import pytest

from daemon import Daemon

from tokenflowd.daemon.procstats import process_figures

MODEL = "smollm2-135m"


@pytest.fixture(autouse=True, scope="module")
def _enough_descriptors():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def body(max_tokens: int, **extra) -> dict:
    return {"model": MODEL, "prompt": "hi", "max_tokens": max_tokens, "stream": True, **extra}


def request_bytes(payload: dict, headers: dict[str, str] | None = None) -> bytes:
    data = json.dumps(payload).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    return (f"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n{head}"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


async def stream_tokens(client: httpx.AsyncClient, payload: dict, opened: asyncio.Event | None = None,
                        headers: dict[str, str] | None = None) -> tuple[int, int]:
    """(status, tokens) of one streamed completion; sets `opened` once the response head arrived."""
    async with client.stream("POST", "/v1/completions", json=payload, headers=headers) as r:
        if opened is not None:
            opened.set()
        if r.status_code != 200:
            await r.aread()
            return r.status_code, 0
        tokens = 0
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if event["choices"] and event["choices"][0]["text"]:
                    tokens += event["choices"][0]["text"].count(" the")
    return r.status_code, tokens


def test_max_streams_refuses_the_101st_and_lets_the_first_100_complete():
    # 20 s streams: all 100 are still open when the 101st comes, even on a box many times slower at opening them
    d = Daemon("--max-streams", "100", null_engine=True, env={"NULL_ENGINE_RATE": "5"})
    try:
        async def run():
            limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
            async with httpx.AsyncClient(base_url=d.base_url, timeout=120, limits=limits) as client:
                opened = [asyncio.Event() for _ in range(100)]
                streams = [asyncio.create_task(stream_tokens(client, body(100), o)) for o in opened]
                await asyncio.wait_for(asyncio.gather(*(o.wait() for o in opened)), 60)
                refused = await client.post("/v1/completions", json=body(60))
                results = await asyncio.gather(*streams)
            return refused, results

        refused, results = asyncio.run(run())
        assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
        assert refused.json()["error"]["code"] == "too_many_streams"
        assert results == [(200, 100)] * 100
        assert d.metric("tokenflowd_requests_rejected_total", status="429") == 1
    finally:
        d.stop()


def test_max_connections_answers_503_with_retry_after_beyond_the_bound():
    d = Daemon("--max-connections", "20", null_engine=True)
    socks = []
    try:
        for _ in range(20):
            s = socket.create_connection(("127.0.0.1", d.port))
            socks.append(s)
        deadline = time.monotonic() + 30
        while True:  # the server counts a connection once its loop accepted it
            extra = socket.create_connection(("127.0.0.1", d.port))
            extra.settimeout(10)
            extra.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
            reply = extra.recv(4096)
            extra.close()
            if reply.startswith(b"HTTP/1.1 503") or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert reply.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in reply and b"too_many_connections" in reply
        for s in socks[:5]:
            s.close()
        deadline = time.monotonic() + 30
        while True:  # room again once the server saw them close
            with socket.create_connection(("127.0.0.1", d.port)) as s:
                s.settimeout(10)
                s.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
                reply = s.recv(4096)
            if reply.startswith(b"HTTP/1.1 200") or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert reply.startswith(b"HTTP/1.1 200")
        assert d.metric("tokenflowd_connections_refused_total", reason="limit") >= 1
    finally:
        for s in socks:
            s.close()
        d.stop()


def test_slow_loris_heads_are_closed_and_do_not_stop_a_normal_client():
    d = Daemon("--header-timeout", "2", null_engine=True)
    try:
        async def loris(closed_after: list[float]) -> None:
            reader, writer = await asyncio.open_connection("127.0.0.1", d.port)
            t0 = time.monotonic()
            head = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nX-Slow: " + b"a" * 100
            try:
                for byte in head:  # a byte a second: never a whole head
                    writer.write(bytes([byte]))
                    await writer.drain()
                    if await _closed(reader, 1.0):
                        break
            except ConnectionError:
                pass
            closed_after.append(time.monotonic() - t0)
            writer.close()

        async def run():
            closed_after: list[float] = []
            attackers = [asyncio.create_task(loris(closed_after)) for _ in range(200)]
            await asyncio.sleep(0.5)
            async with httpx.AsyncClient(base_url=d.base_url, timeout=60) as client:
                answer = await stream_tokens(client, body(5))
            await asyncio.wait_for(asyncio.gather(*attackers), 60)
            return answer, closed_after

        answer, closed_after = asyncio.run(run())
        assert answer == (200, 5)
        assert len(closed_after) == 200 and max(closed_after) < 30  # closed by the timeout, not the 100 bytes
        assert d.metric("tokenflowd_connections_refused_total", reason="header_timeout") >= 200
    finally:
        d.stop()


async def _closed(reader: asyncio.StreamReader, wait: float) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1), wait) == b""
    except asyncio.TimeoutError:
        return False
    except ConnectionError:
        return True


def test_a_body_that_does_not_arrive_gets_408_and_a_whole_one_is_served():
    d = Daemon("--body-timeout", "1", null_engine=True)
    try:
        with socket.create_connection(("127.0.0.1", d.port)) as s:
            s.settimeout(30)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"model\":")
            reply = s.recv(4096)
        assert reply.startswith(b"HTTP/1.1 408") and b"body_timeout" in reply
        r = d.http.post("/v1/completions", json={**body(3), "stream": False})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        d.stop()


def test_a_key_may_hold_only_its_own_number_of_open_requests(tmp_path):
    config = tmp_path / "tokenflowd.toml"
    config.write_text('[auth]\ndefault_max_concurrent = 2\n[auth.keys."k-small"]\nmax_concurrent = 1\n'
                      '[auth.keys."k-other"]\n')
    d = Daemon("--config", str(config), null_engine=True, env={"NULL_ENGINE_RATE": "10"})
    try:
        async def run():
            async with httpx.AsyncClient(base_url=d.base_url, timeout=60) as client:
                small = {"Authorization": "Bearer k-small"}
                other = {"Authorization": "Bearer k-other"}
                opened = asyncio.Event()
                first = asyncio.create_task(stream_tokens(client, body(30), opened, small))
                await asyncio.wait_for(opened.wait(), 30)
                second = await client.post("/v1/completions", json=body(30), headers=small)
                others = await asyncio.gather(*(stream_tokens(client, body(3), None, other) for _ in range(2)))
                return await first, second, others

        first, second, others = asyncio.run(run())
        assert first == (200, 30)
        assert second.status_code == 429 and second.json()["error"]["code"] == "too_many_requests_for_key"
        assert others == [(200, 3), (200, 3)]  # another key's bound is its own
    finally:
        d.stop()


def _cpu_seconds(pid: int) -> float:
    return process_figures(pid).cpu_seconds


def _switches(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:  # the main thread: the front's event loop
        return sum(int(line.split()[1]) for line in f if "ctxt_switches" in line)


@pytest.mark.slow
def test_a_thousand_readers_that_stop_reading_cost_no_wakeups_and_are_cut_off(capsys):
    """1,000 streams whose clients read the response head and then nothing. Once the engine is
    done with them, the front has nothing to do until the stall timeout: a poll per blocked
    stream would cost it a core (1,000 x 100 wake-ups a second). Then each is cut off."""
    n, stall = 1000, 30.0  # far beyond the window, on a box several times slower
    d = Daemon("--write-stall-timeout", str(stall), null_engine=True, env={"NULL_ENGINE_RATE": "20"})
    try:
        async def client(ready: list[int]) -> str:
            loop = asyncio.get_running_loop()
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # a small window: the front's writes block soon
            s.setblocking(False)
            try:
                await loop.sock_connect(s, ("127.0.0.1", d.port))
                await loop.sock_sendall(s, request_bytes(body(200, stream_options={"coalesce": False})))
                await loop.sock_recv(s, 100)  # the head has come: stop reading
                ready.append(1)
                while not done.is_set():
                    await asyncio.sleep(0.2)
                tail = b""
                while True:  # now read what is there: the stream's end, or the server's close
                    try:
                        data = await asyncio.wait_for(loop.sock_recv(s, 1 << 16), 3.0)
                    except ConnectionResetError:
                        return "reset"
                    except asyncio.TimeoutError:  # the front wrote it all; the kernel sends the rest to a
                        return "trickle"  # window this small only at its zero-window probes
                    if not data:
                        return "closed"
                    tail = (tail + data)[-5:]
                    if tail == b"0\r\n\r\n":
                        return "complete"
            finally:
                s.close()

        async def run():
            nonlocal done
            done = asyncio.Event()
            ready: list[int] = []
            clients = [asyncio.create_task(client(ready)) for _ in range(n)]
            while len(ready) < n:
                await asyncio.sleep(0.2)
            async with httpx.AsyncClient(base_url=d.base_url, timeout=60) as http:
                while (await http.get("/v1/requests")).json()["data"]:  # the engine is done with every one
                    await asyncio.sleep(0.2)
                await asyncio.sleep(1.0)  # and the front with its last messages
                t0, cpu0, sw0 = time.monotonic(), _cpu_seconds(d.proc.pid), _switches(d.proc.pid)
                await asyncio.sleep(2.0)
                window = time.monotonic() - t0
                cpu, switches = _cpu_seconds(d.proc.pid) - cpu0, _switches(d.proc.pid) - sw0
                await asyncio.sleep(stall + 2)  # past every stalled stream's timeout
            done.set()
            outcomes = await asyncio.gather(*clients)
            return window, cpu, switches, outcomes

        done = None
        window, cpu, switches, outcomes = asyncio.run(run())
        cut = outcomes.count("reset")
        with capsys.disabled():
            print(f"\n{n} stalled readers: front CPU {cpu / window:.3f} s/s and {switches / window:.0f} context "
                  f"switches/s while they waited; {cut} cut off with a reset")
        assert cpu / window < 0.25  # polling would keep a core busy
        # Each stream the front could not finish writing was cut off at the timeout, its client reset;
        # the others fit whole into the sockets' buffers (a window this small takes them in slowly).
        assert d.metric("tokenflowd_requests_total", outcome="write_stall") == cut >= n // 2
    finally:
        d.stop()


async def _timed_stream(client: httpx.AsyncClient, payload: dict) -> tuple[list[tuple[float, int]], dict]:
    """[(arrival, tokens)] per event that carries tokens, and the usage. With continuous usage, each
    event's usage must count the tokens delivered so far."""
    events, usage, so_far = [], None, 0
    async with client.stream("POST", "/v1/completions", json=payload) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if event["choices"] and event["choices"][0]["text"]:
                    n = event["choices"][0]["text"].count(" the")
                    events.append((time.monotonic(), n))
                    so_far += n
                    if payload["stream_options"].get("continuous_usage_stats"):
                        assert event["usage"]["completion_tokens"] == so_far
                usage = event.get("usage") or usage
    return events, usage


def _late(events: list[tuple[float, int]], rate: float) -> float:
    """How late the latest token came for a reader at `rate` tokens/s from the first token: > 0 means
    the reader's buffer ran dry."""
    t0, k, worst = events[0][0], 0, 0.0
    for arrival, n in events:
        worst = max(worst, arrival - (t0 + k / rate))  # the first token of this event was due then
        k += n
    return worst


def test_coalescing_gathers_a_slow_readers_tokens_and_sends_a_fast_reader_each_one():
    """Tokens come at 20/s. A reader at 5 tokens/s is soon 2 s ahead: its tokens then come one event
    per 250 ms. A reader at 100 tokens/s never holds 2 s: one event per token."""
    d = Daemon(null_engine=True, env={"NULL_ENGINE_RATE": "20"})
    try:
        async def run():
            async with httpx.AsyncClient(base_url=d.base_url, timeout=60) as client:
                opts = {"include_usage": True}
                return await asyncio.gather(
                    _timed_stream(client, body(200, reading_rate=5,
                                               stream_options={**opts, "continuous_usage_stats": True})),
                    _timed_stream(client, body(100, reading_rate=100, stream_options=opts)),
                    _timed_stream(client, body(100, reading_rate=5, stream_options={**opts, "coalesce": False})))

        (slow, slow_usage), (fast, fast_usage), (asked, _) = asyncio.run(run())
        assert sum(n for _, n in slow) == slow_usage["completion_tokens"] == 200
        assert len(slow) * 3 <= 200
        assert _late(slow, 5) <= 0.05  # the buffer never ran dry
        assert [n for _, n in fast] == [1] * 100 and fast_usage["completion_tokens"] == 100
        assert [n for _, n in asked] == [1] * 100  # stream_options.coalesce false: one event per token
        assert d.metric("tokenflowd_sse_events_total") == len(slow) + len(fast) + len(asked)
        assert d.metric("tokenflowd_inter_token_latency_seconds_count") == 400 - 3  # per token, not per event
    finally:
        d.stop()


def test_malformed_requests_log_one_line_and_integral_floats_are_integers(tmp_path):
    log = tmp_path / "daemon.log"
    d = Daemon(null_engine=True, log_path=str(log))
    try:
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", d.port)) as s:
                s.settimeout(10)
                s.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nX-Probe: a\x00b\r\n\r\n")
                assert s.recv(4096).split(b"\r\n")[0].endswith(b" 400 Bad Request")
        # 3.0 is an integer to JSON Schema: taken where an integer goes, range-checked as one
        r = d.http.post("/v1/completions", json={"model": MODEL, "prompt": [260.0, 260], "max_tokens": 2.0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        r = d.http.post("/v1/completions", json={"model": MODEL, "prompt": [465478690029.0]})
        assert r.status_code == 400 and "prompt" in r.json()["error"]["message"]  # beyond the schema's maximum
        r = d.http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2.5})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        schema = d.http.get("/openapi.json").json()["components"]["schemas"]
        assert schema["CompletionRequest"]["properties"]["model"]["enum"] == [MODEL]
    finally:
        d.stop()
    text = log.read_text()
    assert "Traceback" not in text and "ERROR" not in text
    assert text.count("malformed request refused (400)") == 1  # one line, then at most one per 10 s
