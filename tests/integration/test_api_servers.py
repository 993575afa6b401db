"""`--api-servers 2`: two API server processes share the port, each over every engine (api_servers.py)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import psutil
import pytest
from daemon import Daemon

MODEL = "smollm2-135m"


def fronts(d: Daemon) -> list[psutil.Process]:
    return [c for c in psutil.Process(d.proc.pid).children()
            if "tokenflowd.daemon.api_server" in " ".join(c.cmdline())]


def idle_pages(d: Daemon, timeout: float = 60) -> float:
    """KV pages in use once no request runs or waits (another test's aborted streams may still be ending)."""
    deadline = time.monotonic() + timeout
    while (d.metric("tokenflowd_requests_running") + d.metric("tokenflowd_requests_waiting")
           and time.monotonic() < deadline):
        time.sleep(0.1)
    return d.metric("tokenflowd_kv_pages_used")


def listening(proc: psutil.Process, port: int) -> bool:
    try:
        return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in proc.net_connections("tcp"))
    except psutil.NoSuchProcess:
        return False


def wait_for_fronts(d: Daemon, n: int, timeout: float = 120) -> list[psutil.Process]:
    """The n API server processes, once each listens on the port and the engines serve."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        procs = fronts(d)
        if len(procs) == n and all(listening(f, d.port) for f in procs) and d.health()["status"] == "ok":
            return procs
        time.sleep(0.2)
    raise TimeoutError("the API server processes did not come up")


async def stream(client: httpx.AsyncClient, body: dict, drop_after: int | None = None) -> tuple[int, str, int]:
    """(status, text, [DONE] count); leaves after `drop_after` content events when set."""
    text, done, events = "", 0, 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done += 1
            elif line.startswith("data: {"):
                event = json.loads(line[6:])
                if event["choices"]:
                    text += event["choices"][0]["text"]
                    events += 1
                    if drop_after is not None and events >= drop_after:
                        break
    return r.status_code, text, done


def test_fifty_streams_through_two_fronts_finish_once_and_in_order():
    d = Daemon("--api-servers", "2", null_engine=True, env={"NULL_ENGINE_RATE": "50"})
    try:
        wait_for_fronts(d, 2)

        async def run():
            limits = httpx.Limits(max_connections=100, max_keepalive_connections=0)  # a connection each
            async with httpx.AsyncClient(base_url=d.base_url, timeout=60, limits=limits) as client:
                body = {"model": MODEL, "prompt": "hi", "max_tokens": 40, "stream": True}
                return await asyncio.gather(*(stream(client, body) for _ in range(50)))

        results = asyncio.run(run())
        assert results == [(200, " the" * 40, 1)] * 50
        assert d.metric("tokenflowd_requests_total", outcome="length") == 50  # summed over both fronts
    finally:
        code = d.stop()
    assert code == 0


def test_a_keys_bound_and_max_streams_hold_across_the_fronts(tmp_path):
    """Counted by both fronts together (daemon/api/open_counts.py): the kernel spreads a key's connections over
    the fronts, and a bound split or repeated per front would let it open more, or refuse it too soon."""
    config = tmp_path / "tokenflowd.toml"
    config.write_text('[auth]\n[auth.keys."k-three"]\nmax_concurrent = 3\n[auth.keys."k-free"]\n')
    d = Daemon("--api-servers", "2", "--max-streams", "5", "--config", str(config), null_engine=True,
               env={"NULL_ENGINE_RATE": "10"})
    try:
        wait_for_fronts(d, 2)

        async def open_stream(key: str, started: asyncio.Event) -> int:
            async with httpx.AsyncClient(base_url=d.base_url, timeout=60, headers={"Authorization": f"Bearer {key}"}) as c:
                # 15 s at 10 tokens/s: the checks below run while all of them are open, however slow the box
                body = {"model": MODEL, "prompt": "hi", "max_tokens": 150, "stream": True, "ignore_eos": True}
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            started.set()
                    return r.status_code

        async def one_more(key: str) -> tuple[int, str]:
            async with httpx.AsyncClient(base_url=d.base_url, timeout=60, headers={"Authorization": f"Bearer {key}"}) as c:
                r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
                return r.status_code, r.json().get("error", {}).get("code", "") if r.status_code != 200 else ""

        async def run():
            started = [asyncio.Event() for _ in range(5)]
            keys = ["k-three"] * 3 + ["k-free"] * 2
            streams = [asyncio.create_task(open_stream(k, e)) for k, e in zip(keys[:3], started)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started[:3])), 60)
            three_more = await asyncio.gather(*(one_more("k-three") for _ in range(6)))  # fresh connections each
            streams += [asyncio.create_task(open_stream(k, e)) for k, e in zip(keys[3:], started[3:])]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started[3:])), 60)
            sixth = await asyncio.gather(*(one_more("k-free") for _ in range(4)))
            ends = await asyncio.gather(*streams)
            after = await one_more("k-three")
            return three_more, sixth, ends, after

        three_more, sixth, ends, after = asyncio.run(run())
        assert three_more == [(429, "too_many_requests_for_key")] * 6
        assert sixth == [(429, "too_many_streams")] * 4
        assert ends == [200] * 5
        assert after == (200, "")  # the places came back
    finally:
        d.stop()


@pytest.fixture(scope="module")
def daemon():
    d = Daemon("--api-servers", "2", "--dtype", "float32", "--quantization", "none", "--kv-cache-memory", "256MiB")
    wait_for_fronts(d, 2)
    yield d
    assert d.stop() == 0


def test_greedy_text_through_either_front_is_the_engines(daemon):
    prompts = [f"Question {i}: what is {i} plus {i}?" for i in range(8)]
    whole = [daemon.http.post("/v1/completions", json={"model": MODEL, "prompt": q, "max_tokens": 12,
                                                       "temperature": 0}).json()["choices"][0]["text"] for q in prompts]

    async def run():
        limits = httpx.Limits(max_connections=20, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=daemon.base_url, timeout=120, limits=limits) as client:
            return await asyncio.gather(*(stream(client, {"model": MODEL, "prompt": q, "max_tokens": 12,
                                                          "temperature": 0, "stream": True}) for q in prompts))

    assert [text for _, text, _ in asyncio.run(run())] == whole


def test_disconnects_through_either_front_abort_their_requests_and_free_their_pages(daemon):
    """As test_daemon.py's, through two fronts: the abort crosses from a front's process to the
    engine's (the wait is no speed bound; the abort count says why the pages came back)."""
    idle = idle_pages(daemon)
    aborted = daemon.count("tokenflowd_requests_total", outcome="abort")

    async def run():
        limits = httpx.Limits(max_connections=20, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=daemon.base_url, timeout=120, limits=limits) as client:
            body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 2000, "ignore_eos": True,
                    "stream": True}
            await asyncio.gather(*(stream(client, body, drop_after=3) for _ in range(16)))

    asyncio.run(run())
    dropped = time.monotonic()
    while daemon.metric("tokenflowd_kv_pages_used") != idle and time.monotonic() - dropped < 10.0:
        time.sleep(0.05)
    assert daemon.metric("tokenflowd_kv_pages_used") == idle
    assert daemon.metric("tokenflowd_requests_total", outcome="abort") - aborted == 16


def test_sigkill_of_one_front_leaves_the_other_serving_and_its_requests_are_aborted(daemon):
    idle = idle_pages(daemon)
    victim, survivor = wait_for_fronts(daemon, 2)
    # pages published long before the kill (a 290-token prompt: 18 full pages), which a restarted front
    # can learn only from a snapshot of the engine's keys
    long_prompt = " ".join(f"w{i}" for i in range(100))
    assert daemon.http.post("/v1/completions", json={"model": MODEL, "prompt": long_prompt,
                                                     "max_tokens": 1}).status_code == 200

    async def run():
        limits = httpx.Limits(max_connections=20, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=daemon.base_url, timeout=120, limits=limits) as client:
            body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 2000, "ignore_eos": True,
                    "stream": True}
            streams = [asyncio.create_task(stream(client, body)) for _ in range(12)]
            deadline = time.monotonic() + 120
            while daemon.metric("tokenflowd_kv_pages_used") <= idle and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.5)
            served_by = {r["front"] for r in (await client.get("/v1/requests")).json()["data"]}
            os.kill(victim.pid, signal.SIGKILL)
            # Until the supervisor reaps it: a zombie leader's other threads may still hold the listening
            # socket, and a connection the kernel queues there is reset when they exit (unless
            # net.ipv4.tcp_migrate_req=1 moves it to the live front).
            while victim.is_running():
                await asyncio.sleep(0.05)
            async with httpx.AsyncClient(base_url=daemon.base_url, timeout=120, limits=limits) as fresh:
                # New connections (a client of their own: the pool above holds the broken streams' ones):
                # the kernel sends them to the live front.
                answers = [await fresh.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
                           for _ in range(10)]
            for s in streams:
                s.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
            return answers, served_by

    answers, served_by = asyncio.run(run())
    assert served_by == {1, 2}  # both fronts held streams when one was killed
    assert [a.status_code for a in answers] == [200] * 10
    deadline = time.monotonic() + 10  # the killed front's requests are aborted by the supervisor
    while daemon.metric("tokenflowd_kv_pages_used") != idle and time.monotonic() < deadline:
        time.sleep(0.1)
    assert daemon.metric("tokenflowd_kv_pages_used") == idle
    assert survivor.is_running()
    new = wait_for_fronts(daemon, 2)  # the supervisor started it again
    assert victim.pid not in [f.pid for f in new]
    # The new front asked the engine for its prefix-cache keys (the step messages it missed carried them):
    # it knows what the survivor knows. Each front also serves on its own unix socket.
    def known(front: psutil.Process) -> list[int]:
        path = next(c.laddr for c in front.net_connections("unix") if c.laddr.endswith(".sock"))
        with httpx.Client(transport=httpx.HTTPTransport(uds=path), base_url="http://front") as client:
            return [e["prefix_pages_known"] for e in client.get("/health").json()["engines"]]

    restarted = next(f for f in new if f.pid != survivor.pid)
    assert known(survivor)[0] >= 18
    deadline = time.monotonic() + 10
    while known(restarted) != known(survivor) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert known(restarted) == known(survivor)


def test_a_read_cursor_and_the_request_listing_work_through_either_front(daemon):
    """New connections land on either front; the cursor reaches the one streaming the request."""
    async def run():
        limits = httpx.Limits(max_connections=20, max_keepalive_connections=0)  # every call a new connection
        async with httpx.AsyncClient(base_url=daemon.base_url, timeout=120, limits=limits) as client:
            body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True,
                    "stream": True, "reading_rate": 5}
            async with client.stream("POST", "/v1/completions", json=body) as r:
                rid = r.headers["X-Request-Id"]
                lines, delivered = r.aiter_lines(), 0
                while delivered < 3:  # a few tokens delivered (sampled text: no word is sure to come)
                    delivered += (await anext(lines)).startswith("data: {")
                listed = [[x["request_id"] for x in (await client.get("/v1/requests")).json()["data"]]
                          for _ in range(6)]
                cursors = [await client.post(f"/v1/requests/{rid}/read", json={"tokens": 1}) for _ in range(8)]
                other = await client.post("/v1/requests/no-such-request/read", json={"tokens": 1})
            return rid, listed, cursors, other

    rid, listed, cursors, other = asyncio.run(run())
    assert all(rid in ids for ids in listed)
    assert [c.status_code for c in cursors] == [200] * 8 and all(c.json()["id"] == rid for c in cursors)
    assert other.status_code == 404
