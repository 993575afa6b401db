"""What the pool's daemon tests share (tests/integration/test_pool_daemon.py,
test_pool_write_home.py): the daemon's flags, a reference engine configured as its engines are,
and the figures the tests read from its metrics."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from daemon import Daemon

from tokenflowd.config import EngineConfig
from tokenflowd.engine.offline import Engine
from tokenflowd.engine.request import SamplingParams
from tokenflowd.kv.pages import chain_page_keys
from tokenflowd.pool.homes import segment_homes

MODEL = "smollm2-135m"
SEGMENT_PAGES = 16
FLAGS = ("--engines", "2", "--dtype", "float32", "--quantization", "none", "--kv-cache-memory", "128MiB",
         "--pool-segment-tokens", str(16 * SEGMENT_PAGES), "--pool-placement", "home")
SYSTEM_TOKENS = 1024
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def reference():
    """A single engine, in this process, as the daemon's engines are configured (with room for the
    long prompts' 4,096-token prefix: the size of its cache does not change its greedy tokens)."""
    return Engine(EngineConfig.resolve(model=MODEL, dtype="float32", quantization="none",
                                       kv_cache_memory="512MiB"))

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


def homes(system: list[int]) -> dict[int, int]:
    """Pages of the system prompt whose segments' home is each engine."""
    keys = chain_page_keys(system, 16, [], len(system))
    out = {0: 0, 1: 0}
    for home in segment_homes(keys[SEGMENT_PAGES - 1 :: SEGMENT_PAGES], [0, 1]):
        out[home] += SEGMENT_PAGES
    assert out[0] and out[1], "the test needs a system prompt with segments homed on both engines"
    return out


def pool_pages(d: Daemon) -> dict[int, float]:
    return {e: d.metric("tokenflowd_pool_pages", engine=str(e)) for e in (0, 1)}


def copied_pages(d: Daemon) -> dict[int, float]:
    return {e: d.metric("tokenflowd_pool_copied_pages_total", engine=str(e)) for e in (0, 1)}


def used(d: Daemon) -> dict[int, float]:
    return {e: d.metric("tokenflowd_kv_pages_used", engine=str(e)) for e in (0, 1)}


def put(d: Daemon) -> dict[int, float]:
    return {e: d.metric("tokenflowd_pool_put_pages_total", engine=str(e)) for e in (0, 1)}


def leaks_nothing(d: Daemon, engine: str, who: str) -> None:
    """`engine` holds no page for a request and pins none on its peer once its requests ended."""
    wait_for(lambda: d.metric("tokenflowd_kv_pages_used", engine=engine) == 0, 10, f"{who} leaked pages")
    assert d.metric("tokenflowd_pool_pinned_pages", engine=engine) == 0, f"{who} left pages pinned"


def placed(d: Daemon, base: dict[int, float], home: dict[int, int], extra: int) -> bool:
    """Each engine holds the system prompt's segments homed on it and no others (plus up to `extra`
    pages of the first request's own): the engine that computed them has dropped the others."""
    now = pool_pages(d)
    return all(base[e] + home[e] <= now[e] <= base[e] + home[e] + extra for e in (0, 1))


def wait_for(condition, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)

async def stream_text(base_url: str, prompt: list[int], max_tokens: int, on_token=None) -> tuple[str, str | None]:
    text, error = "", None
    async with (httpx.AsyncClient(base_url=base_url, timeout=300) as http,
                http.stream("POST", "/v1/completions", json=body(prompt, max_tokens, stream=True)) as r):
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return text, event["error"]["message"]
            text += event["choices"][0]["text"]
            if on_token is not None:
                await on_token(text)
    return text, error
