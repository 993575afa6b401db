"""The node's prefix-cache pool in a real daemon (`--engines 2 --pool-mode query|read`): requests on
one engine read a prompt prefix that the other engine holds, where it is, and their greedy tokens
equal a single engine's; a shared 1,024-token system prompt is held once, each segment at its
home (pool/homes.py segment_homes; written into its home once the prompt is computed); a 4,096-token prefix
is held once while the request that computed it decodes; SIGKILL of a holder, or of a home as a
prefix is written into it, neither hangs nor corrupts a stream, and leaks no page on the survivor."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import tempfile
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


@pytest.fixture(scope="module")
def prompts(reference):
    tok = reference.tokenizer
    text = " ".join(f"Rule {i}: answer briefly, politely and in plain words." for i in range(200))
    system = tok.encode(text, add_special_tokens=True)[:SYSTEM_TOKENS]
    assert len(system) == SYSTEM_TOKENS
    topics = ["a lake", "a color", "a fruit", "a city", "a river", "a tree", "a bird", "a metal", "a planet", "a flower",
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


@pytest.mark.parametrize("mode,seats", [("query", None), ("read", None), ("query", 2)])
def test_requests_read_the_peers_prefix_in_place_with_a_single_engines_greedy_tokens_held_once(
        mode, seats, reference, prompts):
    """`seats` (--max-num-seqs, and --no-pool-copy): with 2, most of the burst waits in the engines' queues; each prompt has
    ~200 tokens of its own (less than a segment: nothing new to place), so the prompts queued on an
    engine outgrow its free pages, and those far back pin their reads only as they near the front
    (pool/ahead.py, Scheduler.held), where their front names them again (protocol.ResolveReads)."""
    system, prompts = prompts
    if seats:
        tok = reference.tokenizer
        notes = [tok.encode(" ".join(f"note {i}-{j}." for j in range(30)), add_special_tokens=False)
                 for i in range(len(prompts))]
        prompts = [p[:SYSTEM_TOKENS] + n + p[SYSTEM_TOKENS:] for p, n in zip(prompts, notes)]
    own = (max(map(len, prompts)) - SYSTEM_TOKENS + MAX_TOKENS) // 16  # full pages a request adds where it runs
    assert all(len(p) + MAX_TOKENS < SYSTEM_TOKENS + 16 * SEGMENT_PAGES for p in prompts), "no new whole segment"
    want = greedy(reference, prompts, MAX_TOKENS)
    # The first request is not one of the burst's: a prompt computed twice would hold its last page,
    # prompt and output, twice, and that page is no segment of the shared prefix.
    asked, want_first, want = prompts[1:], want[0], want[1:]
    runtime = tempfile.mkdtemp(prefix="tf")  # short: its sockets' paths must fit a sun_path
    # (with seats, hot segments are not copied: each request pins its reads on the other engine)
    # (read mode: --pool-read-rows above any step's rows, which on a CPU still reads every row in place)
    d = Daemon(*FLAGS, "--pool-mode", mode, *(("--max-num-seqs", str(seats), "--no-pool-copy") if seats else ()),
               *(("--pool-read-rows", "100000") if mode == "read" else ()),
               "--runtime-dir", runtime)  # its own: other daemons' caches may be in /dev/shm meanwhile
    try:
        d.wait_all_engines()
        (private,) = os.listdir(runtime)  # the daemon's runtime directory, which names its caches
        replicated_before = d.metric("tokenflowd_pool_replicated_pages")  # the warm-up's chat-template head
        base, home = pool_pages(d), homes(system)
        # The first request computes the system prompt on one engine (both idle: engine 0), which
        # puts the segments whose home is engine 1 there and keeps only its own.
        first = d.http.post("/v1/completions", json=body(prompts[0]))
        assert first.status_code == 200, first.text
        assert first.json()["choices"][0]["text"] == want_first
        wait_for(lambda: placed(d, base, home, own), 10,
                 f"the system prompt's segments never settled at their homes: {pool_pages(d)}, want {base} + {home}")
        assert d.metric("tokenflowd_pool_put_pages_total", engine="0") == home[1]
        assert d.metric("tokenflowd_pool_stored_pages_total", engine="1") == home[1]
        # A burst of 20: both engines take requests; each reads the segments the other holds.
        responses = asyncio.run(post_all(d.base_url, [body(p) for p in asked]))
        assert [r.status_code for r in responses] == [200] * len(asked), [r.text for r in responses]
        got = [r.json()["choices"][0]["text"] for r in responses]
        assert got == want
        for r in responses:
            usage = r.json()["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] >= SYSTEM_TOKENS, usage
        assert source_tokens(d, "peer") >= SYSTEM_TOKENS, "no request read its prefix on the other engine"
        path = "shared memory" if mode == "read" else "host staging (query mode)"  # (no GPU: no peer access)
        assert [e["pool"] for e in d.health()["engines"]] == [{"path": path, "staged": {}, "peer_access": {}}] * 2
        # read mode attends the peer's pages in place (a CPU's peer is in the same memory: every row,
        # --pool-read-rows or not) and asks the peer nothing; query mode sends every row
        reads, queries = (sum(d.metric(f"tokenflowd_pool_{what}_total", engine=str(e)) for e in (0, 1))
                          for what in ("reads", "queries"))
        assert (reads > 0 and queries == 0) if mode == "read" else (queries > 0 and reads == 0), (reads, queries)
        queued = sum(d.metric("tokenflowd_pool_pinned_queued_requests_total", engine=str(e)) for e in (0, 1))
        resolved = sum(d.metric("tokenflowd_pool_resolved_requests_total", engine=str(e)) for e in (0, 1))
        if seats:
            assert queued > 0, "no request waited to pin its reads"
            # near the front, they asked their front where their reads were then (ResolveReads) and
            # pinned what it named (one whose answer took over RESOLVE_SECONDS pins what it came with)
            assert 0 < resolved <= queued, (resolved, queued)
        # Deduplication: the system prompt's 64 pages are held once, each at its home (each request
        # adds its own pages, prompt and output, to where it ran), plus replicas of its hot segments:
        # read by every request, they turn hot after 4 reads and are copied, once, into the engine
        # that reads them on the other, never computed there again.
        after, copied = pool_pages(d), copied_pages(d)
        assert (0 < sum(copied.values()) or seats) and all(copied[e] <= home[1 - e] for e in (0, 1)), (copied, home)
        assert not seats or sum(copied.values()) == 0, "--no-pool-copy copied"
        replicated = d.metric("tokenflowd_pool_replicated_pages") - replicated_before
        assert replicated == sum(copied.values()), (replicated, copied, after, base, home)
        assert all(after[e] <= base[e] + home[e] + copied[e] + own * len(prompts) for e in (0, 1)), \
            (after, base, home, copied)
        assert d.metric("tokenflowd_pool_put_pages_total", engine="1") == 0, "nothing new to place"
        wait_for(lambda: d.metric("tokenflowd_pool_pinned_pages", engine="0") == 0, 10,
                 "pins outlived their requests")
        for e in ("0", "1"):
            wait_for(lambda e=e: d.metric("tokenflowd_kv_pages_used", engine=e) == 0, 10, f"engine {e} leaked pages")
    finally:
        assert d.stop() == 0
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"{private}-kv-")], \
        "a shared KV cache outlived the daemon"
    os.rmdir(runtime)  # and the daemon removed its own directory in it


def test_by_default_a_prefix_stays_where_computed_and_its_hot_segments_are_copied_to_the_other_engine(
        reference, prompts):
    """The default placement (local): the first request computes the system prompt on one engine,
    which keeps it (nothing is put anywhere). A burst of 20 is spread over both engines: read by
    every request, the prompt's segments are hot by the time the other engine takes one of them, so
    that engine copies them in once (their KV, not their computation) and its requests read its copy.
    Every reply is a single engine's, and no page outlives its request."""
    system, prompts = prompts
    want = greedy(reference, prompts, MAX_TOKENS)
    d = Daemon(*FLAGS[:-2], "--pool-mode", "query")  # (FLAGS without its --pool-placement home)
    try:
        d.wait_all_engines()
        replicated_before = d.metric("tokenflowd_pool_replicated_pages")
        first = d.http.post("/v1/completions", json=body(prompts[0]))
        assert first.status_code == 200 and first.json()["choices"][0]["text"] == want[0], first.text
        responses = asyncio.run(post_all(d.base_url, [body(p) for p in prompts[1:]]))
        assert [r.status_code for r in responses] == [200] * (len(prompts) - 1), [r.text for r in responses]
        assert [r.json()["choices"][0]["text"] for r in responses] == want[1:]
        assert sum(put(d).values()) == 0, "kept where computed: nothing put at a home"
        copied = copied_pages(d)
        # copied once, into the engine that did not compute it: at most the system prompt's pages
        assert 0 < sum(copied.values()) <= SYSTEM_TOKENS // 16 and min(copied.values()) == 0, copied
        # (a request on the other engine before the copy reads it there: a peer hit, not a miss)
        hits = source_tokens(d, "local") + source_tokens(d, "peer")
        assert hits >= 20 * SYSTEM_TOKENS, (hits, "a request computed the prompt again")
        assert d.metric("tokenflowd_pool_replicated_pages") - replicated_before == sum(copied.values())
        for e in ("0", "1"):
            wait_for(lambda e=e: d.metric("tokenflowd_kv_pages_used", engine=e) == 0, 10, f"engine {e} leaked pages")
    finally:
        assert d.stop() == 0


def test_sigkill_of_the_holder_mid_stream_recomputes_the_prefix_and_keeps_the_greedy_tokens(reference, prompts):
    system, asked = prompts
    victim_prompt, reader_prompt = asked[1], asked[2]
    n = 160
    want = greedy(reference, [reader_prompt], n)[0]
    d = Daemon(*FLAGS, "--pool-mode", "query")
    try:
        d.wait_all_engines()
        base, home = pool_pages(d), homes(system)
        victim = segment_homes(chain_page_keys(system, 16, [], SEGMENT_PAGES * 16)[-1:], [0, 1])[0]
        # Engine 0 computes the system prompt; the segments whose home is engine 1 go there.
        assert d.http.post("/v1/completions", json=body(victim_prompt, 2)).status_code == 200
        wait_for(lambda: placed(d, base, home, 0), 10, "the system prompt's segments never settled at their homes")

        async def stream(prompt: list[int], max_tokens: int, started: asyncio.Event) -> tuple[str, str | None]:
            async def on_token(text: str) -> None:
                if text:
                    started.set()
            return await stream_text(d.base_url, prompt, max_tokens, on_token)

        async def run():
            a_started, b_started = asyncio.Event(), asyncio.Event()
            # The victim's engine is the one holding the prompt's first segment (the longer match
            # of two idle engines); the reader runs on the other and reads the victim's segments.
            a = asyncio.create_task(stream(victim_prompt, 1800, a_started))
            await asyncio.wait_for(a_started.wait(), 60)
            b = asyncio.create_task(stream(reader_prompt, n, b_started))
            await asyncio.wait_for(b_started.wait(), 60)
            peer = await asyncio.to_thread(source_tokens, d, "peer")
            assert peer >= SYSTEM_TOKENS, "the second stream does not read the holder's pages"
            engines = (await asyncio.to_thread(d.health))["engines"]
            assert not b.done(), "the reader must still depend on the holder when it dies"
            os.kill(engines[victim]["pid"], signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(a, b), 120)  # neither hangs

        (a_text, a_error), (b_text, b_error) = asyncio.run(run())
        assert a_error is not None, "the killed engine's own stream ends with an error event"
        assert b_error is None and b_text == want, (b_error, b_text, want)
        survivor = str(1 - victim)
        wait_for(lambda: d.metric("tokenflowd_kv_pages_used", engine=survivor) == 0, 10, "the survivor leaked pages")
        assert d.metric("tokenflowd_pool_pinned_pages", engine=survivor) == 0
        d.wait_all_engines()  # the holder comes back
    finally:
        assert d.stop() == 0


LONG_TOKENS = 4096
LONG_FLAGS = ("--engines", "2", "--dtype", "float32", "--quantization", "none", "--kv-cache-memory", "512MiB",
              "--pool-segment-tokens", str(16 * SEGMENT_PAGES), "--max-num-batched-tokens", "256",
              "--pool-mode", "read", "--pool-placement", "home")


ARCHIVE = "Letter"  # the long tests' prefix: the reference computes it once (its prefix cache keeps it between tests)


def long_prompts(reference: Engine, what: str, n: int, tokens: int = LONG_TOKENS) -> tuple[list[int], list[list[int]]]:
    """The first `tokens` of a text on `what` and n questions after it. The tests that need a long
    prefix new to their daemon share ARCHIVE's (each daemon starts empty), so the module's reference
    engine computes it once, not once a test: on 2 cores that is a minute a test."""
    tok = reference.tokenizer
    text = " ".join(f"{what} {i}: the archive holds letters, maps and ledgers from the old port." for i in range(600))
    prefix = tok.encode(text, add_special_tokens=True)[:tokens]
    assert len(prefix) == tokens
    return prefix, [prefix + tok.encode(f"\nQuestion {i}: which ledger came first?\nAnswer:", add_special_tokens=False)
                    for i in range(n)]


def used(d: Daemon) -> dict[int, float]:
    return {e: d.metric("tokenflowd_kv_pages_used", engine=str(e)) for e in (0, 1)}


def put(d: Daemon) -> dict[int, float]:
    return {e: d.metric("tokenflowd_pool_put_pages_total", engine=str(e)) for e in (0, 1)}


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


def test_write_into_home_holds_a_4096_token_prefix_once_and_survives_its_home_killed(reference):
    """Write into the home (read mode): the engine computing a new 4,096-token prefix writes each
    segment homed on its peer into the peer's cache once the prompt is computed, and keeps no copy
    of it while the request runs on. (--pool-hand-off prompt: by default, auto, a prompt over a
    quarter of the engine's KV, as this one is, goes segment by segment: the test below.)"""
    prefix, prompts = long_prompts(reference, ARCHIVE, 20)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    want = [reference.generate({"first": {"prompt": prompts[0], "sampling_params": params}})["first"].text]
    out = reference.generate({f"r{i}": {"prompt": q, "sampling_params": params} for i, q in enumerate(prompts[1:])})
    want += [out[f"r{i}"].text for i in range(len(prompts) - 1)]
    home = homes(prefix)
    prefix_pages = LONG_TOKENS // 16
    d = Daemon(*LONG_FLAGS, "--pool-hand-off", "prompt")
    try:
        d.wait_all_engines()
        replicated_before = d.metric("tokenflowd_pool_replicated_pages")
        base = pool_pages(d)
        seen: dict = {}

        async def first():
            async def look(text: str) -> None:
                # its prompt computed, it decodes: once it has written into the home, where is the
                # prefix? (each engine's figures come with its own next report: an idle one's with
                # its heartbeat, so the home's are waited for a few heartbeats)
                if "used" in seen:
                    return
                if "put" not in seen:
                    if max((now := await asyncio.to_thread(put, d)).values()):
                        seen.update(writer=max((0, 1), key=now.__getitem__), put=now, since=time.monotonic())
                    return
                pages = await asyncio.to_thread(used, d)
                # (the home's figure can come mid-write, with part of the segments in: wait for all)
                if pages[1 - seen["writer"]] >= home[1 - seen["writer"]] or time.monotonic() - seen["since"] > 3:
                    seen.update(used=pages, at=len(text))
            return await stream_text(d.base_url, prompts[0], 96, look)

        text, error = asyncio.run(first())
        assert error is None and text.startswith(want[0]), (error, text, want[0])
        assert "used" in seen, "the writer never wrote into the home while its request ran"
        writer, peer = seen["writer"], 1 - seen["writer"]
        # while it ran, the segments homed on the peer were in the peer's pages only, the others in
        # the writer's (with the request's own last pages: its prompt's tail and what it wrote)
        assert seen["put"][writer] == home[peer] and seen["put"][peer] == 0, (seen, home)
        assert seen["used"][peer] == home[peer], (seen, home)
        assert home[writer] <= seen["used"][writer] <= home[writer] + 8, (seen, home)
        # (the writer's extra keys: the full pages past the prefix, its prompt's tail and 96 tokens)
        wait_for(lambda: placed(d, base, home, 8), 10, f"the prefix never settled at its homes: {pool_pages(d)}")
        assert d.metric("tokenflowd_pool_stored_pages_total", engine=str(peer)) == home[peer]

        responses = asyncio.run(post_all(d.base_url, [body(q) for q in prompts[1:]]))
        assert [r.status_code for r in responses] == [200] * (len(prompts) - 1), [r.text for r in responses]
        assert [r.json()["choices"][0]["text"] for r in responses] == want[1:]
        for r in responses:
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= LONG_TOKENS, r.json()["usage"]
        after, copied = pool_pages(d), copied_pages(d)
        # each segment once, at its home, plus copies of the hot ones only (at most the 4 heavy
        # hitters of 2 engines, once each), and each engine's keys no more than its home segments,
        # its copies, and each request's own last pages
        assert all(copied[e] <= min(home[1 - e], 4 * 16) for e in (0, 1)), (copied, home)
        replicated = d.metric("tokenflowd_pool_replicated_pages") - replicated_before
        assert replicated == sum(copied.values()), (replicated, copied, after, base, home)
        assert sum(after.values()) <= sum(base.values()) + prefix_pages + sum(copied.values()) + 2 * len(prompts), \
            (after, base, home, copied)
        assert all(after[e] <= base[e] + home[e] + copied[e] + 2 * len(prompts) for e in (0, 1)), \
            (after, base, home, copied)
        for e in ("0", "1"):
            wait_for(lambda e=e: d.metric("tokenflowd_kv_pages_used", engine=e) == 0, 10, f"engine {e} leaked pages")

        # SIGKILL of the home as a new prefix is written into it (its write seen in the metrics, the
        # request reading it there): the stream neither hangs nor changes (the writer recomputes
        # what the home held), and the survivor leaks no page
        # (a new prefix of 1,024 tokens, four segments homed on both engines: the write is the same
        # as a longer one's, and each of the reference and the writer computes it in a quarter of the time)
        victim_prefix, (victim_prompt,) = long_prompts(reference, "Ledger", 1, 1024)
        homes(victim_prefix)
        want_victim = greedy(reference, [victim_prompt], MAX_TOKENS)[0]
        killed: dict = {}

        async def kill_mid_write():
            before = await asyncio.to_thread(put, d)
            # long enough that its home's write is seen before it ends, on a machine of any speed
            task = asyncio.create_task(stream_text(d.base_url, victim_prompt, 160))
            deadline = time.monotonic() + 120
            while not task.done() and time.monotonic() < deadline:
                now = await asyncio.to_thread(put, d)
                wrote = [e for e in (0, 1) if now[e] > before[e]]
                if wrote:
                    engines = (await asyncio.to_thread(d.health))["engines"]
                    killed.update(writer=wrote[0], home=1 - wrote[0], done=task.done())
                    os.kill(engines[1 - wrote[0]]["pid"], signal.SIGKILL)
                    break
                await asyncio.sleep(0.02)
            return await asyncio.wait_for(task, 180)

        text, error = asyncio.run(kill_mid_write())
        assert killed, "the writer never wrote into the home"
        assert error is None and text.startswith(want_victim), (killed, error, text, want_victim)
        survivor = str(killed["writer"])
        wait_for(lambda: d.metric("tokenflowd_kv_pages_used", engine=survivor) == 0, 10, "the survivor leaked pages")
        assert d.metric("tokenflowd_pool_pinned_pages", engine=survivor) == 0
        d.wait_all_engines()  # the home comes back
    finally:
        assert d.stop() == 0


def test_segment_by_segment_the_prefix_reaches_its_homes_before_the_prompt_ends_with_the_greedy_tokens(reference):
    """By default (--pool-hand-off auto, pool/hand_off.py) a prompt over a quarter of the engine's KV
    goes segment by segment (256 MiB: ~5.8K tokens of SmolLM2's KV in float32): the engine computing
    a new 2,048-token prefix writes each segment homed on its peer into it as soon as it is computed,
    256-token chunks apart, so the peer holds pages of it before the request's first token; the rest
    of the prompt reads them there, and the tokens are one engine's.
    A second request over the prefix comes with the first and goes to the other engine, told the
    prefix is being computed (AddRequest.pending). Its engine is idle, but it does not compute the
    prefix too: each time it asks where it is, its front answers that the first is computing it
    (Reads.pending, once that engine's Computing came or at once: nothing was queued there), and
    once the first has its first token it is told where the prefix is and reads it whole (before,
    it asked twice at once, found nothing and computed it all). A third comes mid-prompt, once a
    segment is at its home: it waits for the rest the same way (before, it read what was computed
    and computed the rest)."""
    prefix, prompts = long_prompts(reference, ARCHIVE, 5, 2048)
    want = greedy(reference, prompts[:1], MAX_TOKENS) + greedy(reference, prompts[1:], MAX_TOKENS)
    home = homes(prefix)
    keys = chain_page_keys(prefix, 16, [], len(prefix))
    first_half = len(range(0, len(keys) // 2, SEGMENT_PAGES))
    early = set(segment_homes(keys[SEGMENT_PAGES - 1 :: SEGMENT_PAGES], [0, 1])[:first_half])
    # whichever engine writes, a segment homed on its peer is whole half a prompt before the first
    # token (not in the last chunk, whose step also samples it): the order seen does not race
    assert early == {0, 1}, "the test needs segments homed on both engines in the prefix's first half"
    d = Daemon(*LONG_FLAGS, "--kv-cache-memory", "256MiB")
    try:
        d.wait_all_engines()
        seen: dict = {}

        async def first_three():
            async with httpx.AsyncClient(base_url=d.base_url, timeout=300) as http:
                task = asyncio.create_task(stream_text(d.base_url, prompts[0], MAX_TOKENS,
                                                       lambda text: _first_token(seen)))
                second = asyncio.create_task(http.post("/v1/completions", json=body(prompts[1])))
                third = None
                while not task.done():
                    if "first_token" not in seen and max((await asyncio.to_thread(put, d)).values()):
                        seen["put_before_first_token"] = True
                        if third is None:  # mid-prompt: part of the prefix is at its homes
                            third = asyncio.create_task(http.post("/v1/completions", json=body(prompts[2])))
                    await asyncio.sleep(0.02)
                return await task, await second, await third

        (text, error), second, third = asyncio.run(first_three())
        assert error is None and text == want[0], (error, text, want[0])
        assert second.status_code == 200 and second.json()["choices"][0]["text"] == want[1], second.text
        assert seen.get("put_before_first_token"), "nothing reached the home before the prompt was computed"
        # the third came mid-prompt: it read the part computed and waited for the rest (computing the
        # rest itself, it read 256-1,280 tokens)
        assert third.status_code == 200 and third.json()["choices"][0]["text"] == want[2], third.text
        assert third.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(prefix), third.json()["usage"]
        took = {e: sum(d.metric("tokenflowd_prompt_token_sources_total", engine=str(e), source=s)
                       for s in ("local", "peer", "miss")) for e in (0, 1)}
        assert min(took.values()) > 0, ("the two ran on one engine", took)
        # the prefix computed once: the three questions' tokens besides (a request that read part of
        # it and computed the rest, or all of it, misses 700-2,100 more)
        assert source_tokens(d, "miss") < len(prefix) + 128, source_tokens(d, "miss")
        now = put(d)
        writer = max((0, 1), key=now.__getitem__)
        assert now[writer] == home[1 - writer] and now[1 - writer] == 0, (now, home)
        responses = asyncio.run(post_all(d.base_url, [body(q) for q in prompts[3:]]))
        assert [r.json()["choices"][0]["text"] for r in responses] == want[3:], [r.text for r in responses]
        for e in ("0", "1"):
            wait_for(lambda e=e: d.metric("tokenflowd_kv_pages_used", engine=e) == 0, 10, f"engine {e} leaked pages")
            assert d.metric("tokenflowd_pool_pinned_pages", engine=e) == 0
    finally:
        assert d.stop() == 0


def test_a_reader_of_the_writers_copy_follows_the_prefix_into_its_home_with_the_greedy_tokens(reference, tmp_path):
    """A request that comes while a new prompt is computed on the other engine, and shares with it
    only the part computed so far, pins those pages where they are and computes the rest of its own
    prompt (one that shares more waits for the rest: the test above). Once the first prompt is
    computed and its segments written into their homes (--pool-hand-off prompt), the reader is told
    (protocol.Moved, from the supervisor: the writer names who reads what moved) and reads the
    segments homed on its own engine from its own cache: the writer lets go of its copy
    (pool/member.py follow). Both requests' tokens are one engine's."""
    shared = 2 * 16 * SEGMENT_PAGES  # two segments: homed one on each engine (asserted below)
    prefix, (reader_prompt,) = long_prompts(reference, ARCHIVE, 1)
    tok = reference.tokenizer
    # the writer parts from the reader's prompt after the shared segments, three segments on
    # (the reader computes 14 segments of its own: it still runs when the writer's have moved)
    own = tok.encode(" ".join(f"Note {i}: the harbour master kept a log of every ship." for i in range(120)),
                     add_special_tokens=False)[: 3 * 16 * SEGMENT_PAGES]
    writer_prompt = prefix[:shared] + own + tok.encode("\nQuestion: which ship came first?\nAnswer:",
                                                       add_special_tokens=False)
    want = greedy(reference, [writer_prompt], MAX_TOKENS) + greedy(reference, [reader_prompt], 48)
    home = homes(writer_prompt[: len(writer_prompt) // 256 * 256])
    assert set(segment_homes(chain_page_keys(prefix, 16, [], shared)[SEGMENT_PAGES - 1 :: SEGMENT_PAGES],
                             [0, 1])) == {0, 1}, "the test needs the shared segments homed on both engines"
    # the writer's figures come with its reports, every heartbeat while it computes a prompt: at
    # 0.1 s the reader comes a tenth of a second after two segments are in, however fast the prompt
    # is computed (the prompt's 6 chunks leave 4 after that)
    config = tmp_path / "tokenflowd.toml"
    config.write_text("[server]\nheartbeat_interval = 0.1\n")
    d = Daemon(*LONG_FLAGS, "--pool-hand-off", "prompt", "--config", str(config))
    try:
        d.wait_all_engines()

        async def both():
            first = asyncio.create_task(stream_text(d.base_url, writer_prompt, MAX_TOKENS))
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not first.done():  # two segments of it computed
                pages = await asyncio.to_thread(used, d)
                if max(pages.values()) >= 2 * SEGMENT_PAGES:
                    break
                await asyncio.sleep(0.02)
            assert not first.done(), "the first prompt was computed before the reader came"
            second = asyncio.create_task(stream_text(d.base_url, reader_prompt, 48))
            return await first, await second, max((0, 1), key=pages.__getitem__)

        (text, error), (text2, error2), writer = asyncio.run(both())
        assert error is None and text == want[0], (error, text, want[0])
        assert error2 is None and text2 == want[1], (error2, text2, want[1])
        reader = str(1 - writer)
        # (the reader's figure comes with its next report)
        wait_for(lambda: d.metric("tokenflowd_pool_followed_pages_total", engine=reader) > 0, 30,
                 "the reader never followed the segments written into its engine")
        assert d.metric("tokenflowd_pool_followed_pages_total", engine=reader) <= home[1 - writer]
        assert d.metric("tokenflowd_pool_followed_pages_total", engine=str(writer)) == 0
        for e in ("0", "1"):
            wait_for(lambda e=e: d.metric("tokenflowd_kv_pages_used", engine=e) == 0, 10, f"engine {e} leaked pages")
            assert d.metric("tokenflowd_pool_pinned_pages", engine=e) == 0
    finally:
        assert d.stop() == 0


async def _first_token(seen: dict) -> None:
    seen.setdefault("first_token", True)


def test_an_idle_engine_takes_requests_queued_on_the_busy_one_with_a_single_engines_greedy_tokens(reference):
    """One seat an engine (--max-num-seqs 1). A long prompt goes first, to one engine; twelve short
    ones then come one at a time, and each goes where the work is least: the other engine, where
    they queue. Once the long one ends, its engine is idle and takes the last of the other's queue,
    again and again (pool/steal.py; protocol.Withdraw). Every reply is a single engine's."""
    tok = reference.tokenizer
    long = tok.encode(" ".join(f"Fact {i}: rivers run to the sea." for i in range(120)), add_special_tokens=True)[:600]
    topics = ["a lake", "a color", "a fruit", "a city", "a river", "a tree", "a bird", "a metal", "a planet",
              "a flower", "a sport", "a fish"]
    shorts = [tok.encode(f"Question: name {t}.\nAnswer:", add_special_tokens=True) for t in topics]
    want_long, want = greedy(reference, [long], 48)[0], greedy(reference, shorts, 32)
    d = Daemon(*FLAGS, "--pool-mode", "query", "--max-num-seqs", "1")
    try:
        d.wait_all_engines()

        async def run():
            async with httpx.AsyncClient(base_url=d.base_url, timeout=300) as http:
                first = asyncio.ensure_future(http.post("/v1/completions", json=body(long, 48)))
                await asyncio.sleep(0.3)  # (sent: the front counts its prompt as its engine's work)
                rest = []
                for prompt in shorts:  # one at a time: each placed alone, where the work is least
                    rest.append(asyncio.ensure_future(http.post("/v1/completions", json=body(prompt, 32))))
                    await asyncio.sleep(0.05)
                return await first, await asyncio.gather(*rest)

        first, rest = asyncio.run(run())
        assert first.status_code == 200 and first.json()["choices"][0]["text"] == want_long, first.text
        assert [r.json()["choices"][0]["text"] for r in rest] == want, [r.text for r in rest]
        moved = sum(d.metric("tokenflowd_pool_moved_requests_total", engine=str(e)) for e in (0, 1))
        assert moved >= 1, "the idle engine took nothing from the busy one's queue"
        took = {e: sum(d.metric("tokenflowd_prompt_token_sources_total", engine=str(e), source=s)
                       for s in ("local", "peer", "miss")) for e in (0, 1)}
        ran_long = max(took, key=took.__getitem__)
        assert took[ran_long] > len(long), ("the engine that ran the long prompt ran no short one", took)
        for e in ("0", "1"):
            wait_for(lambda e=e: d.metric("tokenflowd_kv_pages_used", engine=e) == 0, 10, f"engine {e} leaked pages")
            assert d.metric("tokenflowd_pool_pinned_pages", engine=e) == 0
    finally:
        assert d.stop() == 0
