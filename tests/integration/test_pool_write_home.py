"""Write into the home, in a real daemon (`--engines 2 --pool-mode read --pool-placement home`): a
4,096-token prefix is held once while the request that computed it decodes, each segment at its
home but the last, which goes there when the request ends; segment by segment, the prefix reaches
its homes before the prompt ends, and requests that come meanwhile wait for it; a request that read
the writer's copy follows it into its home; SIGKILL of a home as a prefix is written into it
neither hangs nor corrupts a stream, and leaks no page on the survivor. Every reply is a single
engine's greedy tokens."""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import httpx
from daemon import Daemon
from pool_daemon import (MAX_TOKENS, SEGMENT_PAGES, body, copied_pages, greedy, homes, leaks_nothing, placed,
                         pool_pages, post_all, put, reference, source_tokens, stream_text, used, wait_for)

from tokenflowd.engine.offline import Engine
from tokenflowd.engine.request import SamplingParams
from tokenflowd.kv.pages import chain_page_keys
from tokenflowd.pool.homes import segment_homes

__all__ = ["reference"]  # (the module's fixture, from pool_daemon)


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
        # the writer's (with the request's own last pages: its prompt's tail and what it wrote), but
        # the prefix's last segment, the one the request's tail follows: homed on the peer, it stays
        # in the writer's pages until the request ends (pool/hand_off.py tail_end)
        ends = chain_page_keys(prefix, 16, [], LONG_TOKENS)[SEGMENT_PAGES - 1 :: SEGMENT_PAGES]
        last = SEGMENT_PAGES if segment_homes(ends, [0, 1])[-1] == peer else 0
        assert seen["put"][writer] == home[peer] - last and seen["put"][peer] == 0, (seen, home, last)
        assert seen["used"][peer] == home[peer] - last, (seen, home, last)
        assert home[writer] + last <= seen["used"][writer] <= home[writer] + last + 8, (seen, home, last)
        # (the writer's extra keys: the full pages past the prefix, its prompt's tail and 96 tokens)
        wait_for(lambda: placed(d, base, home, 8), 10, f"the prefix never settled at its homes: {pool_pages(d)}")
        # (the home's own figures come with its next heartbeat: the front hears of the move at once)
        wait_for(lambda: d.metric("tokenflowd_pool_stored_pages_total", engine=str(peer)) == home[peer], 10,
                 f"the home stored {d.metric('tokenflowd_pool_stored_pages_total', engine=str(peer))} pages")
        assert put(d)[writer] == home[peer], "the last segment did not go to its home when the request ended"

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
        leaks_nothing(d, survivor, "the survivor")
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
                # (no third: the put came after the first token, which the assertion below names)
                return await task, await second, await third if third is not None else None

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
            leaks_nothing(d, e, f"engine {e}")
    finally:
        assert d.stop() == 0


def test_where_the_request_computing_a_new_prefix_is_cut_off_one_waiting_request_computes_it_for_the_rest(reference):
    """Requests that come while a new 2,048-token prefix is computed wait for it (Reads.pending).
    Where the one computing it is cut off before its first token (its client goes once a segment is
    at its home), the first of them is named to compute the rest and the others wait on for that one
    (Router.done), then read the prefix whole. Before, all were told at once that nothing computed
    it, and each computed it side by side: on 2 cores, six of nine read only its first segment, and
    the last first token came 31.5 s after them against 11.8 s where no client went."""
    prefix, prompts = long_prompts(reference, ARCHIVE, 5, 2048)
    want = greedy(reference, prompts[1:], MAX_TOKENS)
    d = Daemon(*LONG_FLAGS, "--kv-cache-memory", "256MiB")
    try:
        d.wait_all_engines()
        seen: dict = {}

        async def cut_off_writer():
            writer = asyncio.create_task(stream_text(d.base_url, prompts[0], MAX_TOKENS,
                                                     lambda text: _first_token(seen)))
            await asyncio.sleep(0.3)  # they come while it computes the prefix
            waiting = asyncio.create_task(post_all(d.base_url, [body(q) for q in prompts[1:]]))
            for _ in range(6000):  # bounded: 120 s
                if writer.done() or max((await asyncio.to_thread(put, d)).values()):
                    break
                await asyncio.sleep(0.02)
            seen["cut_before_first_token"] = not writer.done() and "first_token" not in seen
            writer.cancel()  # its client goes
            with contextlib.suppress(asyncio.CancelledError):
                await writer
            return await waiting

        responses = asyncio.run(cut_off_writer())
        assert seen["cut_before_first_token"], "the writer had its first token before a segment reached its home"
        assert [r.json()["choices"][0]["text"] for r in responses] == want, [r.text for r in responses]
        cached = [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in responses]
        assert sum(c >= len(prefix) for c in cached) >= len(responses) - 1, ("more than one computed it", cached)
        for e in ("0", "1"):
            leaks_nothing(d, e, f"engine {e}")
    finally:
        assert d.stop() == 0


def test_a_reader_of_the_writers_copy_follows_the_prefix_into_its_home_with_the_greedy_tokens(reference, tmp_path):
    """A request that comes while a new prompt is computed on the other engine, and shares with it
    only part of what is computed so far, pins those pages where they are and computes the rest of its own
    prompt (one that shares more waits for the rest: the test above). Once the first prompt is
    computed and its segments written into their homes (--pool-hand-off prompt), the reader is told
    (protocol.Moved, from the supervisor: the writer names who reads what moved) and reads the
    segments homed on its own engine from its own cache: the writer lets go of its copy
    (pool/member.py follow). Both requests' tokens are one engine's."""
    shared = 2 * 16 * SEGMENT_PAGES  # two segments: homed one on each engine (asserted below)
    prefix, (reader_prompt,) = long_prompts(reference, ARCHIVE, 1)
    tok = reference.tokenizer
    # the writer parts from the reader's prompt after the shared segments, five segments on
    # (the reader computes 14 segments of its own: it still runs when the writer's have moved)
    own = tok.encode(" ".join(f"Note {i}: the harbour master kept a log of every ship." for i in range(120)),
                     add_special_tokens=False)[: 5 * 16 * SEGMENT_PAGES]
    writer_prompt = prefix[:shared] + own + tok.encode("\nQuestion: which ship came first?\nAnswer:",
                                                       add_special_tokens=False)
    want = greedy(reference, [writer_prompt], MAX_TOKENS) + greedy(reference, [reader_prompt], 48)
    home = homes(writer_prompt[: len(writer_prompt) // 256 * 256])
    assert set(segment_homes(chain_page_keys(prefix, 16, [], shared)[SEGMENT_PAGES - 1 :: SEGMENT_PAGES],
                             [0, 1])) == {0, 1}, "the test needs the shared segments homed on both engines"
    # the writer's figures come with its reports, every heartbeat while it computes a prompt: at
    # 0.1 s the reader comes a tenth of a second after three segments are in, however fast the
    # prompt is computed (the prompt's 8 chunks leave 5 after that); the two it shares are in the
    # front's index then, a step's report late or not (had it come before they were, it would wait
    # for them, as a request that comes mid-prompt does, and read nothing of the writer's copy)
    config = tmp_path / "tokenflowd.toml"
    config.write_text("[server]\nheartbeat_interval = 0.1\n")
    d = Daemon(*LONG_FLAGS, "--pool-hand-off", "prompt", "--config", str(config))
    try:
        d.wait_all_engines()

        async def both():
            first = asyncio.create_task(stream_text(d.base_url, writer_prompt, MAX_TOKENS))
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not first.done():  # three segments of it computed
                pages = await asyncio.to_thread(used, d)
                if max(pages.values()) >= 3 * SEGMENT_PAGES:
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
            leaks_nothing(d, e, f"engine {e}")
    finally:
        assert d.stop() == 0


async def _first_token(seen: dict) -> None:
    seen.setdefault("first_token", True)
