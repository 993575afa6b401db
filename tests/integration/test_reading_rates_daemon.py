"""Rates a client cannot abuse, and rates learned from real clients, through the real daemon on the
embedded model (CPU): priority rights by API key, the clamp of stated rates, the conversation
cadence learned from the openai client's turns, and the read cursor. Timing assertions are
derived from the times the test measures, never from the machine's speed."""
from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import openai
import pytest
from daemon import Daemon

MODEL = "smollm2-135m"
OPS_KEY, USER_KEY = "sk-ops-test", "sk-user-test"
CONFIG = f"""
[server]
max_reading_rate = 50
[auth.keys."{OPS_KEY}"]
role = "operator"
max_priority = 10
"""


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    config = tmp_path_factory.mktemp("cfg") / "tokenflowd.toml"
    config.write_text(CONFIG)
    d = Daemon("--config", str(config), "--dtype", "float32", "--quantization", "none", "--kv-cache-memory", "128MiB",
               env={"TOKENFLOWD_API_KEY": USER_KEY})
    yield d
    assert d.stop() == 0


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def chat(q: str) -> list[dict]:
    return [{"role": "user", "content": q}]


def prompt_tokens(daemon) -> float:
    try:
        return daemon.metric("tokenflowd_prompt_tokens_total")
    except KeyError:  # no request has ended yet: the labelled counter has no sample
        return 0.0


def live_requests(daemon) -> list[dict]:
    return daemon.http.get("/v1/requests", headers=auth(USER_KEY)).json()["data"]


# -- priority rights -------------------------------------------------------------------------------
def test_priority_is_honoured_only_up_to_what_the_key_is_allowed(daemon):
    # The tests run in a random order: one before may have left a stream its client closed, whose
    # abort is still on its way to the engine.
    assert daemon.wait_idle(60) == (0, 0), "the engines still hold requests no client waits for"
    tokens_before = prompt_tokens(daemon)
    user = openai.OpenAI(base_url=daemon.base_url + "/v1", api_key=USER_KEY, max_retries=0, timeout=120)
    with pytest.raises(openai.PermissionDeniedError) as refused:
        user.chat.completions.create(model=MODEL, messages=chat("hi"), max_tokens=2, extra_body={"priority": 5})
    err = refused.value.body
    assert err["code"] == "priority_not_allowed" and err["param"] == "priority" and err["type"] == "permission_error"
    assert err["message"].startswith("priority 5 needs an API key allowed priorities up to at least 5; this key may "
                                     "not set priority above 0")
    body = {"model": MODEL, "messages": chat("hi"), "max_tokens": 2}
    r = daemon.http.post("/v1/completions", headers=auth(OPS_KEY), json={"model": MODEL, "prompt": "hi",
                                                                          "max_tokens": 2, "priority": 11})
    assert r.status_code == 403 and "what this key may set (10)" in r.json()["error"]["message"]
    # Refused before anything was queued: no request, no prompt tokens counted.
    assert live_requests(daemon) == []
    assert prompt_tokens(daemon) == tokens_before
    assert daemon.metric("tokenflowd_requests_waiting") + daemon.metric("tokenflowd_requests_running") == 0

    ok = daemon.http.post("/v1/chat/completions", headers=auth(OPS_KEY), json={**body, "priority": 10})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    # Lowering one's own priority is anyone's right.
    low = user.chat.completions.create(model=MODEL, messages=chat("hi"), max_tokens=2, extra_body={"priority": -3})
    assert low.usage.completion_tokens >= 1
    assert prompt_tokens(daemon) > tokens_before


# -- the clamp -------------------------------------------------------------------------------------
def test_a_stated_rate_above_the_maximum_is_clamped_and_shown(daemon):
    async def run(rate_in_body: float | None, header: str | None) -> tuple[dict, dict]:
        async with httpx.AsyncClient(base_url=daemon.base_url, timeout=60, headers=auth(USER_KEY)) as http:
            body = {"model": MODEL, "messages": chat("Tell me a story."), "max_tokens": 400, "ignore_eos": True,
                    "stream": True}
            if rate_in_body is not None:
                body["reading_rate"] = rate_in_body
            headers = {"X-Reading-Rate": header} if header else {}
            async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
                assert r.status_code == 200
                lines = r.aiter_lines()  # kept referenced: a collected iterator would close the stream
                n = 0
                while n < 3:
                    n += (await anext(lines)).startswith("data: ")
                listing = (await http.get("/v1/requests")).json()["data"]
                return dict(r.headers), next(x for x in listing if x["request_id"] == r.headers["X-Request-Id"])

    headers, info = asyncio.run(run(1e6, None))
    assert headers["x-reading-rate"] == "50" and headers["x-reading-rate-source"] == "stated"
    assert info["reading_rate"] == 50.0 and info["stated_reading_rate"] == 1e6 and info["reading_rate_clamped"]
    assert info["reading_rate_source"] == "stated"
    _, info = asyncio.run(run(None, "500"))
    assert (info["reading_rate"], info["stated_reading_rate"], info["reading_rate_clamped"]) == (50.0, 500.0, True)
    _, info = asyncio.run(run(12.0, None))
    assert (info["reading_rate"], info["stated_reading_rate"], info["reading_rate_clamped"]) == (12.0, 12.0, False)


# -- the conversation's cadence --------------------------------------------------------------------
def test_a_users_reading_rate_is_learned_from_the_cadence_of_its_turns(daemon):
    """Three turns with the official openai client, whose reader reads at 6 tokens/s as each
    answer streams in and sends the next turn once done; the fourth is scheduled at ~6 tokens/s."""
    rate = 6.0
    client = openai.OpenAI(base_url=daemon.base_url + "/v1", api_key=USER_KEY, max_retries=0, timeout=120)
    kw = dict(model=MODEL, temperature=0, user="reader-6", stream=True, stream_options={"include_usage": True})
    messages = chat("Tell me a long story about a dragon.")
    bounds = []  # what the front should measure: L / (next request − first token)
    for _ in range(3):
        t_first, parts, usage = None, [], None
        for chunk in client.chat.completions.create(messages=messages, max_tokens=32, extra_body={"min_tokens": 24},
                                                   **kw):
            if chunk.choices and chunk.choices[0].delta.content:
                t_first = t_first or time.monotonic()
                parts.append(chunk.choices[0].delta.content)
            usage = chunk.usage or usage
        t_end = time.monotonic()
        n = usage.completion_tokens
        assert n >= 24
        time.sleep(max(0.0, n / rate - (t_end - t_first)))  # reading what is left at 6 tokens/s
        bounds.append(n / max(n / rate, t_end - t_first))  # 6, unless the answer streamed slower than that
        messages = messages + [{"role": "assistant", "content": "".join(parts)}, {"role": "user", "content": "And then?"}]

    raw = client.chat.completions.with_raw_response.create(messages=messages, max_tokens=400,
                                                           extra_body={"min_tokens": 400}, **kw)
    try:
        rid = raw.headers["X-Request-Id"]
        info = daemon.http.get(f"/v1/requests/{rid}", headers=auth(USER_KEY)).json()
    finally:
        raw.parse().close()
    expected = sorted(bounds)[-2]  # the estimator's second largest bound
    assert raw.headers["X-Reading-Rate-Source"] == "learned"
    learned = float(raw.headers["X-Reading-Rate"])
    assert abs(learned - expected) <= 0.25 * expected, (learned, bounds)
    assert abs(learned - rate) <= 0.25 * rate or expected < 0.8 * rate  # 6 ± 25% whenever answers outran the reader
    assert info["reading_rate"] == pytest.approx(learned, rel=1e-6) and info["reading_rate_source"] == "learned"
    assert info["stated_reading_rate"] is None and not info["reading_rate_clamped"]
    # A request that states its rate is scheduled by it, not by what was learned.
    stated = client.chat.completions.with_raw_response.create(messages=chat("Hi"), max_tokens=2,
                                                              extra_body={"reading_rate": 15}, **kw)
    stated.parse().close()
    assert stated.headers["X-Reading-Rate"] == "15" and stated.headers["X-Reading-Rate-Source"] == "stated"


# -- the read cursor -------------------------------------------------------------------------------
def test_read_cursors_move_the_engines_buffer_and_set_the_rate(daemon):
    """A chat UI's reader (8 tokens/s, or half the engine's pace here if that is slower) reports its
    cursor every 0.25 s on a request that stated 1 token/s: the engine's buffer follows the cursor
    and its rate becomes the reader's pace."""

    async def run() -> dict:
        async with httpx.AsyncClient(base_url=daemon.base_url, timeout=60, headers=auth(USER_KEY)) as http:
            body = {"model": MODEL, "messages": chat("Tell me a story."), "max_tokens": 1500, "ignore_eos": True,
                    "stream": True, "reading_rate": 1.0}
            async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                rid = r.headers["X-Request-Id"]

                async def delivered() -> int:  # tokens, as the front counts them (an event may carry several)
                    return (await http.get(f"/v1/requests/{rid}")).json()["delivered_tokens"]

                async def drain() -> None:
                    async for _ in r.aiter_lines():
                        pass

                drainer = asyncio.create_task(drain())
                while await delivered() < 1:
                    await asyncio.sleep(0.01)
                t_first = time.monotonic()
                while await delivered() < 21:
                    await asyncio.sleep(0.01)
                out = {"pace": min(8.0, 0.5 * 20 / (time.monotonic() - t_first))}  # never outruns the engine
                pace = out["pace"]
                url = f"/v1/requests/{rid}/read"
                out["too_far"] = await http.post(url, json={"tokens": 10**6})
                out["not_int"] = await http.post(url, json={"tokens": 2.5})
                out["other_key"] = await http.post(url, json={"tokens": 1}, headers=auth(OPS_KEY))
                t0 = time.monotonic()
                n = 0
                while time.monotonic() - t0 < 4.5:
                    await asyncio.sleep(0.25)
                    n = min(int(pace * (time.monotonic() - t0)), await delivered())
                    reply = await http.post(url, json={"tokens": n})
                    assert reply.status_code == 200 and reply.json()["accepted"], reply.text
                out["n"] = n
                out["back"] = (await http.post(url, json={"tokens": n - 5})).json()
                t_before = time.monotonic()
                await http.post(url, json={"tokens": n})
                out["info"] = (await http.get(f"/v1/requests/{rid}")).json()
                out["elapsed"] = time.monotonic() - t_before
                drainer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await drainer
                return out

    out = asyncio.run(run())
    pace = out["pace"]
    if pace < 2.0:
        pytest.skip(f"the engine streams at {2 * pace:.1f} tokens/s here: too slow to tell a reader's pace from 1")
    assert out["too_far"].status_code == 400 and out["too_far"].json()["error"]["param"] == "tokens"
    assert "beyond the" in out["too_far"].json()["error"]["message"]
    assert out["not_int"].status_code == 400
    assert out["other_key"].status_code == 404  # another key's request is not found, let alone moved
    n, info = out["n"], out["info"]
    assert out["back"]["accepted"] is False and out["back"]["read_tokens"] == n  # reading does not go back
    assert info["read_tokens"] == n and info["delivered_tokens"] >= n
    assert info["reading_rate_source"] == "read_cursor"
    assert abs(info["reading_rate"] - pace) <= 0.25 * pace, info
    # The engine's buffer is its tokens less the cursor, less what the reader read since at its rate.
    unread = info["num_output_tokens"] - n
    assert unread - info["reading_rate"] * out["elapsed"] - 1 <= info["buffer_tokens"] <= unread + 1e-6, info
    # At the stated 1 token/s the model would have had far more unread than the cursor says.
    assert n >= 0.75 * pace * 4.5 > 1.0 * 4.5 + 2
