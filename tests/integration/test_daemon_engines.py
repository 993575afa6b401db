"""Two engine processes behind one daemon: prefix-aware routing, the waiting-queue bound, and an
engine killed mid-stream."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import openai
import pytest
from daemon import Daemon, exited

MODEL = "smollm2-135m"
LONG = ("You are a careful assistant. Answer in one short sentence, and never use lists. " * 3).strip()


@pytest.fixture(scope="module")
def daemon():
    d = Daemon("--engines", "2", "--dtype", "float32", "--quantization", "none", "--kv-cache-memory", "64MiB", "--max-waiting-requests", "3")
    d.wait_all_engines()
    yield d
    assert d.stop() == 0


def chat_body(question: str, **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "system", "content": LONG}, {"role": "user", "content": question}],
            "temperature": 0, **kw}


async def _post_all(base_url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
        return await asyncio.gather(*[http.post("/v1/chat/completions", json=b) for b in bodies])


def test_router_sends_a_prompt_back_to_the_engine_that_cached_it(daemon):
    # Two requests at once spread over both engines (by load); each engine caches its prompt.
    a, b = chat_body("Name a color.", max_tokens=2), chat_body("Name a fruit.", max_tokens=2)
    for r in asyncio.run(_post_all(daemon.base_url, [a, b])):
        assert r.status_code == 200
    # (a page the write-through is still copying to the host is pinned, not cached, for a moment)
    deadline = time.monotonic() + 2.0
    while not all(daemon.metric("tokenflowd_kv_pages_cached", engine=str(i)) > 0 for i in (0, 1)):
        assert time.monotonic() < deadline, "an engine cached no page"
        time.sleep(0.02)
    # Alone, with both engines idle, each prompt goes where its pages are: its whole prefix is cached.
    for body in (b, a, b):
        r = daemon.http.post("/v1/chat/completions", json=body)
        usage = r.json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 16, usage


def test_over_the_waiting_bound_gets_429_with_retry_after(daemon):
    bodies = [chat_body(f"Count to {i}.", max_tokens=4) for i in range(12)]
    codes = [r.status_code for r in asyncio.run(_post_all(daemon.base_url, bodies))]
    assert codes.count(200) >= 3 and codes.count(429) >= 1, codes
    assert set(codes) <= {200, 429}
    r = asyncio.run(_post_all(daemon.base_url, bodies[:12]))
    limited = [x for x in r if x.status_code == 429]
    if limited:
        assert limited[0].headers["Retry-After"] == "1"
        assert limited[0].json()["error"]["type"] == "rate_limit_error"


def test_sigkill_of_an_engine_ends_its_streams_and_it_comes_back(daemon):
    async def stream_until_error(i: int) -> str:
        c = openai.AsyncOpenAI(base_url=daemon.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        async with c:
            s = await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Story {i}"}],
                                                max_tokens=1000, stream=True, extra_body={"ignore_eos": True})
            try:
                async for _ in s:
                    pass
            except openai.APIError as e:
                return str(e)
        return "finished"

    async def run() -> list[str]:
        tasks = [asyncio.create_task(stream_until_error(i)) for i in range(3)]
        await asyncio.sleep(0)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # every stream placed and streaming
            engines = (await asyncio.to_thread(daemon.health))["engines"]
            if sum(e["requests"] for e in engines) == 3:
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)
        victims = [e for e in engines if e["requests"] > 0]
        for e in victims:
            os.kill(e["pid"], signal.SIGKILL)
        return await asyncio.wait_for(asyncio.gather(*tasks), 30)  # none hangs

    results = asyncio.run(run())
    assert all("exited" in r and "retry" in r for r in results), results
    h = daemon.wait_all_engines()
    assert sum(e["restarts"] for e in h["engines"]) >= 1
    for body in (chat_body("Name a color.", max_tokens=3), chat_body("Name a fruit.", max_tokens=3)):
        assert daemon.http.post("/v1/chat/completions", json=body).status_code == 200
    assert daemon.metric("tokenflowd_engine_restarts_total") >= 1


def test_engines_exit_within_5_s_of_a_sigkilled_supervisor():
    # Engines busy (a busy engine once checked for its parent only when idle, and went on stepping
    # and pushing into a socket nobody read).
    d = Daemon("--engines", "2", "--dtype", "float32", "--quantization", "none", "--kv-cache-memory", "64MiB")
    clients = []
    try:
        d.wait_all_engines()
        for i in range(4):
            c = httpx.Client(base_url=d.base_url, timeout=60)
            clients.append(c)
            r = c.send(c.build_request("POST", "/v1/chat/completions", json=chat_body(
                f"Story {i}", max_tokens=400, stream=True, ignore_eos=True)), stream=True)
            assert r.status_code == 200, r.read()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and sum(e["requests"] for e in d.health()["engines"]) < 4:
            time.sleep(0.1)
        engines = d.health()["engines"]
        assert sum(e["requests"] for e in engines) == 4, engines
        pids = [e["pid"] for e in engines]
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait()
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and not all(map(exited, pids)):
            time.sleep(0.05)
        assert all(map(exited, pids)), [p for p in pids if not exited(p)]
    finally:
        for c in clients:
            c.close()
        if d.proc.poll() is None:
            d.proc.kill()


FAULT_SITE = '''
import os, sys
if "tokenflowd.engine.process" in sys.orig_argv:  # engine processes only
    from tokenflowd.offload import copier

    _run = copier.ThreadCopier._run

    def _dying_run(self, job):
        if os.path.exists({armed!r}):
            os.unlink({armed!r})
            raise SystemExit  # not an Exception: the lane's worker thread itself ends
        _run(self, job)

    copier.ThreadCopier._run = _dying_run
'''


def test_a_dead_copier_lane_ends_the_engine_and_the_supervisor_restarts_it(tmp_path):
    """The engine's KV write lane dies mid-stream (a sitecustomize in the engines arms it through
    a file): the engine exits non-zero instead of hanging on a copy that will never end, the
    stream ends with an error, and the supervisor brings a fresh engine up that serves."""
    armed = tmp_path / "armed"
    (tmp_path / "sitecustomize.py").write_text(FAULT_SITE.format(armed=str(armed)))
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    d = Daemon("--dtype", "float32", "--quantization", "none", "--kv-cache-memory", "64MiB", "--offload", "write-through", env=env)
    try:
        armed.touch()  # after the warm-up: the next copy, a write-through of this request's prompt
        r = d.http.post("/v1/chat/completions", json=chat_body("Tell me a long story.", max_tokens=200,
                                                                ignore_eos=True, stream=True))
        assert "error" in r.text and "exited with code 4" in r.text, r.text[-500:]
        assert not armed.exists()
        h = d.wait_all_engines()
        assert h["engines"][0]["restarts"] == 1
        ok = d.http.post("/v1/chat/completions", json=chat_body("Name a color.", max_tokens=3))
        assert ok.status_code == 200, ok.text
    finally:
        d.stop()
