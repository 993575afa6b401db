"""The node's prefix-cache pool in a real daemon (`--engines 2 --pool-mode query|read`): requests on
one engine read a prompt prefix that the other engine holds, where it is, and their greedy tokens
equal a single engine's; a shared 1,024-token system prompt is held once; SIGKILL of the holder
neither hangs nor corrupts a stream that reads its pages, and leaks no page on the survivor."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest
from daemon import Daemon

from tokenflowd.config import EngineConfig
from tokenflowd.engine.engine import Engine
from tokenflowd.engine.request import SamplingParams

MODEL = "smollm2-135m"
FLAGS = ("--engines", "2", "--dtype", "float32", "--quantization", "none", "--kv-cache-memory", "128MiB")
SYSTEM_TOKENS = 1024
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def reference():
    """A single engine, in this process, as the daemon's engines are configured."""
    return Engine(EngineConfig.resolve(model=MODEL, dtype="float32", quantization="none",
                                       kv_cache_memory="128MiB"))


@pytest.fixture(scope="module")
def prompts(reference):
    tok = reference.tokenizer
    text = " ".join(f"Rule {i}: answer briefly, politely and in plain words." for i in range(200))
    system = tok.encode(text, add_special_tokens=True)[:SYSTEM_TOKENS]
    assert len(system) == SYSTEM_TOKENS
    topics = ["a color", "a fruit", "a city", "a river", "a tree", "a bird", "a metal", "a planet", "a flower",
              "a sport", "a fish", "a tool", "a song", "a game", "a dance", "a cheese", "a bread", "a stone",
              "a cloud", "a boat"]
    return system, [system + tok.encode(f"\nQuestion: name {t}.\nAnswer:", add_special_tokens=False) for t in topics]


def greedy(reference: Engine, prompts: list[list[int]], max_tokens: int) -> list[str]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    out = reference.generate({f"r{i}": {"prompt": p, "sampling_params": params} for i, p in enumerate(prompts)})
    return [out[f"r{i}"].text for i in range(len(prompts))]


def body(prompt: list[int], max_tokens: int = MAX_TOKENS, **kw) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **kw}


async def post_all(base_url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as http:
        return await asyncio.gather(*[http.post("/v1/completions", json=b) for b in bodies])


def source_tokens(d: Daemon, source: str) -> float:
    return sum(d.metric("tokenflowd_prompt_token_sources_total", engine=str(e), source=source) for e in (0, 1))


def wait_for(condition, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.parametrize("mode", ["query", "read"])
def test_requests_read_the_peers_prefix_in_place_with_a_single_engines_greedy_tokens_held_once(
        mode, reference, prompts):
    system, asked = prompts
    want = greedy(reference, asked, MAX_TOKENS)
    d = Daemon(*FLAGS, "--pool-mode", mode)
    try:
        d.wait_all_engines()
        replicated_before = d.metric("tokenflowd_pool_replicated_pages")  # the warm-up's chat-template head
        # The first request computes the system prompt on one engine (both idle: engine 0).
        first = d.http.post("/v1/completions", json=body(asked[0]))
        assert first.status_code == 200, first.text
        assert first.json()["choices"][0]["text"] == want[0]
        wait_for(lambda: d.metric("tokenflowd_pool_pages", engine="0") >= SYSTEM_TOKENS // 16, 10,
                 "the front never learned engine 0's pages")
        # A burst of 20: both engines take requests; engine 1's read the prompt's pages on engine 0.
        responses = asyncio.run(post_all(d.base_url, [body(p) for p in asked]))
        assert [r.status_code for r in responses] == [200] * len(asked), [r.text for r in responses]
        got = [r.json()["choices"][0]["text"] for r in responses]
        assert got == want
        for r in responses:
            usage = r.json()["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] >= SYSTEM_TOKENS, usage
        assert source_tokens(d, "peer") >= SYSTEM_TOKENS, "no request read its prefix on the other engine"
        # Deduplication: the system prompt's 64 pages are held by one engine, not both.
        assert d.metric("tokenflowd_pool_replicated_pages") == replicated_before
        assert d.metric("tokenflowd_pool_pages", engine="1") < SYSTEM_TOKENS // 16
        wait_for(lambda: d.metric("tokenflowd_pool_pinned_pages", engine="0") == 0, 10,
                 "pins outlived their requests")
        for e in ("0", "1"):
            wait_for(lambda e=e: d.metric("tokenflowd_kv_pages_used", engine=e) == 0, 10, f"engine {e} leaked pages")
    finally:
        assert d.stop() == 0
    assert not [f for f in os.listdir("/dev/shm") if "-kv-" in f and f.startswith("tokenflowd-")], \
        "a shared KV cache outlived the daemon"


def test_sigkill_of_the_holder_mid_stream_recomputes_the_prefix_and_keeps_the_greedy_tokens(reference, prompts):
    system, asked = prompts
    victim_prompt, reader_prompt = asked[0], asked[1]
    n = 160
    want = greedy(reference, [reader_prompt], n)[0]
    d = Daemon(*FLAGS, "--pool-mode", "query")
    try:
        d.wait_all_engines()
        assert d.http.post("/v1/completions", json=body(victim_prompt, 2)).status_code == 200  # engine 0 caches it
        wait_for(lambda: d.metric("tokenflowd_pool_pages", engine="0") >= SYSTEM_TOKENS // 16, 10,
                 "the front never learned engine 0's pages")

        async def stream(prompt: list[int], max_tokens: int, started: asyncio.Event) -> tuple[str, str | None]:
            text, error = "", None
            async with httpx.AsyncClient(base_url=d.base_url, timeout=120) as http:
                async with http.stream("POST", "/v1/completions",
                                       json=body(prompt, max_tokens, stream=True)) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        event = json.loads(line[6:])
                        if "error" in event:
                            error = event["error"]["message"]
                            break
                        text += event["choices"][0]["text"]
                        if text:
                            started.set()
            return text, error

        async def run():
            a_started, b_started = asyncio.Event(), asyncio.Event()
            a = asyncio.create_task(stream(victim_prompt, 1800, a_started))  # engine 0, holder of the prefix
            await asyncio.wait_for(a_started.wait(), 60)
            b = asyncio.create_task(stream(reader_prompt, n, b_started))  # engine 1, reads engine 0's pages
            await asyncio.wait_for(b_started.wait(), 60)
            peer = await asyncio.to_thread(source_tokens, d, "peer")
            assert peer >= SYSTEM_TOKENS, "the second stream does not read the holder's pages"
            engines = (await asyncio.to_thread(d.health))["engines"]
            assert not b.done(), "the reader must still depend on the holder when it dies"
            os.kill(engines[0]["pid"], signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(a, b), 120)  # neither hangs

        (a_text, a_error), (b_text, b_error) = asyncio.run(run())
        assert a_error is not None, "the killed engine's own stream ends with an error event"
        assert b_error is None and b_text == want, (b_error, b_text, want)
        wait_for(lambda: d.metric("tokenflowd_kv_pages_used", engine="1") == 0, 10, "the survivor leaked pages")
        assert d.metric("tokenflowd_pool_pinned_pages", engine="1") == 0
        d.wait_all_engines()  # the holder comes back
    finally:
        assert d.stop() == 0
