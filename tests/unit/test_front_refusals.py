"""The front against bad bytes and large prompts, in process (a real Front and app over engines
marked ready, none running): bytes that are not UTF-8 get 400 on every JSON endpoint; a prompt
whose length alone proves it cannot fit is refused untokenized; tokenizing never holds the event
loop; every refusal is counted by status and reason and logged once."""
from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from types import SimpleNamespace

import pytest
from aiohttp.test_utils import TestClient, TestServer

from tokenflowd.config import EngineConfig, ServerConfig
from tokenflowd.daemon.api.app import build_app
from tokenflowd.daemon.api.front import Front
from tokenflowd.daemon.supervisor import Supervisor
from tokenflowd.text.source import load_tokenizer

MODEL = "m"
MAX_LEN = 2048


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m")


def make_front(tokenizer, ready: bool = True, **server) -> Front:
    config = ServerConfig(**{"max_body_size": 8 << 20, **server})
    front = Front(Supervisor(config, EngineConfig()), tokenizer, config, MODEL)
    for slot in front.supervisor.slots:
        slot.state = "ready" if ready else "starting"
        slot.info = SimpleNamespace(max_model_len=MAX_LEN, fallback="", attention="torch", cuda_graphs=False, overlap=False,
                                    attention_note="", mps="", pool_segment_pages=0)
    return front


async def with_client(front: Front, run):
    client = TestClient(TestServer(build_app(front)))
    await client.start_server()
    try:
        return await run(client)
    finally:
        await client.close()


def refused(front: Front, status: int, reason: str) -> float:
    return front.metrics.refused.labels(str(status), reason)._value.get()


CHAT_VALUE = b'{"model": "m", "messages": [{"role": "user", "content": "caf\xe9 \xff"}]}'
CHAT_ROLE = b'{"model": "m", "messages": [{"role": "us\xc3", "content": "hi"}]}'
CHAT_KEY = b'{"model": "m", "mess\xffages": [{"role": "user", "content": "hi"}]}'
COMPLETION_VALUE = b'{"model": "m", "prompt": "caf\xe9 \xff"}'
COMPLETION_KEY = b'{"mo\xffdel": "m", "prompt": "hi"}'
COMPLETION_OTHER = b'{"model": "m", "prompt": "hi", "user": "\xc3\x28"}'


def test_bytes_that_are_not_utf8_get_400_with_no_traceback(tokenizer, caplog):
    front = make_front(tokenizer)
    cases = [("/v1/chat/completions", CHAT_VALUE), ("/v1/chat/completions", CHAT_ROLE),
             ("/v1/chat/completions", CHAT_KEY), ("/v1/completions", COMPLETION_VALUE),
             ("/v1/completions", COMPLETION_KEY), ("/v1/completions", COMPLETION_OTHER),
             ("/v1/requests/x/read", b'{"tokens": 3, "\xff": 1}'), ("/federation/abort", b'{"request_id": "\xff"}')]

    async def run(client):
        answers = []
        for path, body in cases:
            r = await client.post(path, data=body, headers={"Content-Type": "application/json"})
            answers.append((r.status, await r.json()))
        return answers

    with caplog.at_level(logging.INFO):
        answers = asyncio.run(with_client(front, run))
    for (path, _), (status, body) in zip(cases, answers):
        assert status == 400, (path, body)
        if path.startswith("/v1/"):
            error = body["error"]
            assert error["code"] == "invalid_utf8" and error["type"] == "invalid_request_error"
            assert "UTF-8" in error["message"] and "0x" in error["message"]
    assert refused(front, 400, "invalid_utf8") == 7
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


class CountingTokenizer:
    """The real tokenizer, counting what it is asked to encode."""

    def __init__(self, inner, block: threading.Event | None = None) -> None:
        self.inner, self.block, self.calls = inner, block, 0
        self.max_token_bytes, self.vocab_size = inner.max_token_bytes, inner.vocab_size

    def min_tokens(self, text: str) -> int:
        return self.inner.min_tokens(text)

    def encode(self, text, add_special_tokens=False):
        self.calls += 1
        if self.block is not None:
            self.block.wait(5)  # a tokenizer that takes 5 s
        return self.inner.encode(text, add_special_tokens)

    def encode_chat(self, messages):
        self.calls += 1
        if self.block is not None:
            self.block.wait(5)
        return self.inner.encode_chat(messages)


def test_a_prompt_whose_bytes_prove_it_too_long_is_never_tokenized(tokenizer):
    counting = CountingTokenizer(tokenizer)
    front = make_front(counting)
    floor_bytes = MAX_LEN * tokenizer.max_token_bytes  # at least MAX_LEN tokens, whatever the text

    async def run(client):
        chat = await client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "x" * floor_bytes}]})
        completion = await client.post("/v1/completions", json={"model": MODEL, "prompt": "y" * floor_bytes})
        return (chat.status, await chat.json()), (completion.status, await completion.json())

    for status, body in asyncio.run(with_client(front, run)):
        assert status == 400 and body["error"]["code"] == "context_length_exceeded"
        assert f"at least {MAX_LEN} tokens" in body["error"]["message"]
    assert counting.calls == 0
    assert refused(front, 400, "context_length_exceeded") == 2


def test_a_tokenizer_that_takes_5_s_holds_neither_health_nor_the_loop(tokenizer):
    release = threading.Event()
    front = make_front(CountingTokenizer(tokenizer, block=release))

    async def run(client):
        post = asyncio.create_task(client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "Hello"}]}))
        ticks = time.monotonic()
        await asyncio.sleep(0.3)  # the request arrives and is tokenizing; the loop keeps its own time
        slept = time.monotonic() - ticks
        in_worker = front.tokenizing.in_flight
        t0 = time.monotonic()
        health = await client.get("/health")
        waited = time.monotonic() - t0
        still_blocked = not release.is_set() and front.tokenizing.in_flight > 0
        release.set()
        await (await post).read()
        return health.status, waited, slept, in_worker, still_blocked

    status, waited, slept, in_worker, still_blocked = asyncio.run(with_client(front, run))
    assert in_worker > 0  # the prompt was in a worker while the loop went on
    assert still_blocked  # /health was answered while the tokenizer still held its prompt: no clock involved
    assert status == 200
    assert waited < 1.0 and slept < 1.0  # not the 5 s the tokenizer takes: it never had the loop


def test_every_refusal_is_counted_and_logged_once(tokenizer, caplog):
    front = make_front(tokenizer, max_body_size=4096, max_waiting_requests=1)
    for slot in front.supervisor.slots:
        slot.num_waiting = 1  # as many as may wait: the next is refused with 429

    async def run(client):
        statuses = []
        for method, path, body in [
            ("POST", "/v1/chat/completions", b"{not json"),  # 400
            ("POST", "/v1/chat/completions", b'{"model": "other", "messages": [{"role": "user", "content": "hi"}]}'),
            ("GET", "/v1/chat/completions", None),  # 405
            ("POST", "/v1/completions", b'{"model": "m", "prompt": "' + b"z" * 8000 + b'"}'),  # 413
            ("POST", "/v1/completions", b'{"model": "m", "prompt": "hi", "priority": 5}'),  # 403
            ("POST", "/v1/completions", b'{"model": "m", "prompt": "hi"}'),  # 429: no room to wait
            ("GET", "/v1/nothing", None),  # 404
        ]:
            r = await client.request(method, path, data=body, headers={"Content-Type": "application/json"})
            statuses.append((r.status, (await r.json())["error"]))
        return statuses

    with caplog.at_level(logging.INFO, logger="tokenflowd.api"):
        answers = asyncio.run(with_client(front, run))
    assert [s for s, _ in answers] == [400, 404, 405, 413, 403, 429, 404]
    for status, error in answers:
        assert error["code"] is None or isinstance(error["code"], str)  # OpenAI's shape: a string or null
    reasons = [(status, error["code"] or {405: "method_not_allowed", 404: "not_found"}[status])
               for status, error in answers]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused ")]
    assert len(lines) == len(answers)
    for (status, reason), line in zip(reasons, lines):
        assert f": {status} {reason}" in line
    total = sum(refused(front, status, reason) for status, reason in set(reasons))
    assert total == len(answers)


def test_a_flood_of_one_refusal_is_logged_once_per_interval(caplog):
    from tokenflowd.daemon.api.refusals import RefusalLog

    now = [0.0]
    say = RefusalLog(every=5.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="tokenflowd.api"):
        for i in range(100):
            now[0] = i * 0.01
            say(400, "invalid_json", "POST", "/v1/completions", "10.0.0.1")
        now[0] = 6.0
        say(400, "invalid_json", "POST", "/v1/completions", "10.0.0.1")
        say(429, "queue_full", "POST", "/v1/completions", "10.0.0.1")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and "and 99 more like it" in lines[1] and "429 queue_full" in lines[2]


def test_the_published_reading_rate_bounds_are_the_enforced_ones(tokenizer):
    """A rate the schema publishes as valid is taken, and the nearest one outside is refused with
    400 naming reading_rate: in the body and in the header."""
    from tokenflowd.openai_api.schema import MAX_READING_RATE, MIN_READING_RATE, openapi

    rate = openapi()["components"]["schemas"]["CompletionRequest"]["properties"]["reading_rate"]
    bounds = next(option for option in rate["anyOf"] if option.get("type") == "number")
    assert (bounds["minimum"], bounds["maximum"]) == (MIN_READING_RATE, MAX_READING_RATE)
    from tokenflowd.openai_api.errors import APIError

    front = make_front(tokenizer)
    taken: list[float] = []

    def start(prep, *args, **kw):  # the request was taken: stop it here, before an engine
        taken.append(prep.rate.reading_rate)
        raise APIError(409, "taken", code="taken")

    front.start = start
    cases = [({"reading_rate": MIN_READING_RATE}, {}, 409), ({"reading_rate": 5e-324}, {}, 400),
             ({"reading_rate": MAX_READING_RATE}, {}, 409), ({"reading_rate": MAX_READING_RATE * 1.01}, {}, 400),
             ({}, {"X-Reading-Rate": "5e-324"}, 400), ({}, {"X-Reading-Rate": str(MIN_READING_RATE)}, 409)]

    async def run(client):
        out = []
        for extra, headers, _ in cases:
            r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", **extra}, headers=headers)
            out.append((r.status, (await r.json())["error"]))
        return out

    for (extra, headers, want), (status, error) in zip(cases, asyncio.run(with_client(front, run))):
        assert status == want, (extra, headers, error)
        if want == 400:
            assert error["param"] in ("reading_rate", "X-Reading-Rate"), error
    assert len(taken) == 3 and min(taken) == MIN_READING_RATE


def test_a_missing_key_and_a_body_that_never_arrives_are_refusals_too(tokenizer, monkeypatch, caplog):
    monkeypatch.setenv("TOKENFLOWD_API_KEY", "secret")
    front = make_front(tokenizer, body_timeout=0.3)

    async def run(client):
        no_key = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
        reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer secret\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\"")  # and no more
        await writer.drain()
        head = await asyncio.wait_for(reader.readline(), 10)
        writer.close()
        return no_key.status, (await no_key.json())["error"]["code"], head

    with caplog.at_level(logging.INFO, logger="tokenflowd.api"):
        status, code, head = asyncio.run(with_client(front, run))
    assert (status, code) == (401, "missing_api_key") and head.startswith(b"HTTP/1.1 408")
    assert refused(front, 401, "missing_api_key") == 1 and refused(front, 408, "body_timeout") == 1
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused ")]
    assert [line.split(": ", 1)[1] for line in lines] == ["401 missing_api_key", "408 body_timeout"]


def test_no_engine_ready_is_a_counted_503(tokenizer):
    front = make_front(tokenizer, ready=False)

    async def run(client):
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
        return r.status, (await r.json())["error"]["code"]

    assert asyncio.run(with_client(front, run)) == (503, "unavailable")
    assert refused(front, 503, "unavailable") == 1


def test_the_body_limit_is_checked_against_what_the_context_could_use():
    import logging

    from tokenflowd.daemon.api.front import body_limit_note

    # a limit that refuses prompts the context holds: a warning
    level, why = body_limit_note(256 << 10, 131072, 32)
    assert level == logging.WARNING and "413" in why and "131072-token" in why
    # a limit far above anything a fitting prompt needs: a note with the limit that would do
    level, why = body_limit_note(4 << 20, 2912, 32)
    assert level == logging.INFO and f"--max-body-size {2912 * 6 * 32 + (64 << 10)}" in why
    # in between: nothing to say
    assert body_limit_note(4 << 20, 131072, 32) is None


def numeric_fields(schema: dict, components: dict) -> dict[str, dict]:
    """name -> the number's JSON Schema, for each numeric property of a request body."""
    out = {}
    for name, prop in schema["properties"].items():
        options = prop.get("anyOf", [prop])
        for option in options:
            if "$ref" in option:
                continue
            if option.get("type") in ("integer", "number"):
                out[name] = option
    return out


def edges(bounds: dict) -> list[tuple[float, bool]]:
    """(value, valid under the schema) at and just past each bound the schema states."""
    integer = bounds["type"] == "integer"
    step = 1 if integer else None
    cases = []
    for key, inside, sign in (("minimum", True, -1), ("maximum", True, 1),
                              ("exclusiveMinimum", False, -1), ("exclusiveMaximum", False, 1)):
        if key not in bounds:
            continue
        b = bounds[key]
        if inside:
            cases.append((b, True))
            cases.append((b + sign * step if integer else math.nextafter(b, sign * math.inf), False))
        else:
            cases.append((b, False))
            cases.append((b - sign * step if integer else math.nextafter(b, -sign * math.inf), True))
    return cases


@pytest.mark.usefixtures("denormals_on")  # the values just past 0 are denormals
def test_every_numeric_field_is_taken_exactly_within_the_bounds_the_schema_publishes(tokenizer):
    """For each numeric field of both request bodies, in the schema the server publishes (narrowed
    to what it serves): a value at each bound it states is taken, one just past it is refused with
    400 naming the field. Schemathesis draws such edges rarely; this walks all of them."""
    from tokenflowd.openai_api.errors import APIError
    from tokenflowd.openai_api.schema import Served, openapi

    served = Served((MODEL,), MAX_LEN, tokenizer.vocab_size)
    doc = openapi(served)["components"]["schemas"]
    front = make_front(tokenizer)

    def start(prep, *args, **kw):  # taken: stop before an engine
        raise APIError(409, "taken", code="taken")

    front.start = start
    bodies = {"/v1/completions": ("CompletionRequest", {"model": MODEL, "prompt": "hi", "max_tokens": 4}),
              "/v1/chat/completions": ("ChatCompletionRequest",
                                       {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                        "max_tokens": 4})}
    cases = []
    for path, (name, base) in bodies.items():
        for field, bounds in numeric_fields(doc[name], doc).items():
            for value, valid in edges(bounds):
                body = {**base, field: value}
                if field == "max_completion_tokens":
                    del body["max_tokens"]  # the one the client sends
                elif field == "min_tokens" and valid:
                    body["max_tokens"] = max(value, 1)  # min_tokens above max_tokens is another refusal
                elif field == "top_logprobs":
                    body["logprobs"] = True  # top_logprobs without logprobs is another refusal
                cases.append((path, field, value, valid, body))
    assert {c[1] for c in cases} >= {"temperature", "top_p", "top_k", "max_tokens", "reading_rate", "priority", "seed"}

    async def run(client):
        out = []
        for path, field, value, valid, body in cases:
            r = await client.post(path, json=body)
            out.append((r.status, (await r.json()).get("error", {})))
        return out

    wrong = []
    for (path, field, value, valid, body), (status, error) in zip(cases, asyncio.run(with_client(front, run))):
        # what the schema cannot say: the prompt's tokens plus max_tokens against the context, and
        # a priority above what the caller's key may set (403, auth.py)
        if valid and status != 409 and error.get("code") not in ("context_length_exceeded", "priority_not_allowed"):
            wrong.append(("refused", path, field, value, status, error.get("message")))
        if not valid and (status != 400 or error.get("param") != field):
            wrong.append(("taken" if status == 409 else "refused oddly", path, field, value, status, error))
    assert not wrong, "\n".join(map(str, wrong))
