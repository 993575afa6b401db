"""The node's prefix-cache pool in a real daemon (`--engines 2 --pool-mode query|read`): requests on
one engine read a prompt prefix that the other engine holds, where it is, and their greedy tokens
equal a single engine's; a shared 1,024-token system prompt is held once, each segment at its
home (pool/homes.py segment_homes; written into its home once the prompt is computed); SIGKILL of a
holder mid-stream neither hangs nor corrupts a stream and leaks no page on the survivor; an idle
engine takes requests queued on a busy one. (Writing a new long prefix into its homes:
test_pool_write_home.py.)"""
from __future__ import annotations

import asyncio
import os
import signal
import tempfile

import httpx
import pytest
from daemon import Daemon
from pool_daemon import (FLAGS, MAX_TOKENS, SEGMENT_PAGES, SYSTEM_TOKENS, body, copied_pages, greedy, homes,
                         leaks_nothing, placed, pool_pages, post_all, put, reference, source_tokens, stream_text,
                         wait_for)

from tokenflowd.kv.pages import chain_page_keys
from tokenflowd.pool.homes import segment_homes

__all__ = ["reference"]  # (the module's fixture, from pool_daemon)


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
        # (the last segment went as the request ended, pool/hand_off.py tail_end: the home's own
        # figures come with its next heartbeat)
        wait_for(lambda: d.metric("tokenflowd_pool_stored_pages_total", engine="1") == home[1], 10,
                 f"engine 1 stored {d.metric('tokenflowd_pool_stored_pages_total', engine='1')} pages, not {home[1]}")
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
        leaks_nothing(d, survivor, "the survivor")
        d.wait_all_engines()  # the holder comes back
    finally:
        assert d.stop() == 0


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
            leaks_nothing(d, e, f"engine {e}")
    finally:
        assert d.stop() == 0
