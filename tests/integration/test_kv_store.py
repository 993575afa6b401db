"""Whole pages into another engine's prefix cache (federation/store.py), in process over a memmove
transport: the keeper publishes what arrived intact, so a request there hits the pages and decodes
with one engine's tokens; a checksum that does not match publishes nothing and frees the pages."""
from __future__ import annotations

import os
import sys

import pytest

from tokenflowd.config import EngineConfig
from tokenflowd.engine.core import EngineCore
from tokenflowd.engine.request import Request, SamplingParams
from tokenflowd.federation.store import VERIFY_SECONDS, Giver, Keeper
from tokenflowd.federation.transport import KVLayout
from tokenflowd.kv.pages import chain_page_keys

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from local_transport import LocalTransport  # noqa: E402

PROMPT = list(range(5, 47))  # 42 tokens
PAGE = 4


def core(tiny) -> EngineCore:
    cfg = EngineConfig.resolve(model="tiny", device="cpu", dtype="float32", page_size=PAGE, num_pages=64,
                               max_num_batched_tokens=64, max_num_seqs=4, policy="fcfs", offload="none")
    return EngineCore.from_config(cfg, tiny)


def run(c: EngineCore, rid: str, prompt: list[int], max_tokens: int = 8) -> tuple[list[int], int]:
    """(tokens, cached prompt tokens) of a greedy request."""
    c.add_request(Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)))
    out, cached = [], 0
    while c.has_unfinished():
        for o in c.step():
            if o.request_id == rid:
                out += o.new_token_ids
                cached = o.num_cached_tokens
    return out, cached


def store(giver_core: EngineCore, keeper_core: EngineCore, keys: list[bytes], corrupt: bool = False) -> int:
    transport = LocalTransport()
    keeper = Keeper(keeper_core.pool, keeper_core.runner.kv_layers, keeper_core.runner.attn.page_axis)
    giver = Giver(transport, giver_core.pool, giver_core.runner.kv_layers, giver_core.runner.attn.page_axis)
    held, pages = keeper.reserve("s", keys)
    dst = KVLayout.of(keeper_core.runner.kv_layers, keeper_core.runner.attn.page_axis)
    sent = giver.give("s", keys[held:], "local", dst, pages)
    assert 0 < sent <= len(pages)
    assert giver_core.pool.num_used == sent, "the giver pins what it sends until it settles"
    (sid, ok, crc, n), = giver.poll()
    assert giver_core.pool.num_used == 0
    published = keeper.done(sid, ok, crc ^ 1 if corrupt else crc, n, now=0.0)
    if corrupt:  # tried again while bytes may land, then held until the horizon: no write can land after it
        assert keeper.poll(VERIFY_SECONDS + 1) == 0 and keeper.kept
        keeper.poll(float("inf"))
        assert not keeper.kept
    return published


def test_pages_given_are_published_and_a_request_over_them_decodes_as_one_engine(tiny):
    a = core(tiny)
    want, _ = run(a, "a", PROMPT)
    conversation = PROMPT + want  # the whole exchange is in a's prefix cache (full pages)
    keys = chain_page_keys(conversation, PAGE, [])
    b = core(tiny)
    run(b, "warm", PROMPT[:12], 1)  # b holds the first 3 pages itself: only the rest travels
    assert store(a, b, keys) == len(keys) - 3
    assert b.pool.num_used == 0 and len(b.pool.lookup(keys)) == len(keys)
    follow_up = conversation + [7, 8, 9]
    ref, _ = run(core(tiny), "ref", follow_up)
    got, cached = run(b, "next", follow_up)
    assert got == ref and cached == len(keys) * PAGE


def test_a_store_whose_checksum_does_not_match_publishes_nothing_and_frees_its_pages(tiny):
    a = core(tiny)
    want, _ = run(a, "a", PROMPT)
    keys = chain_page_keys(PROMPT + want, PAGE, [])
    b = core(tiny)
    free = b.pool.num_free
    assert store(a, b, keys, corrupt=True) == 0
    assert b.pool.lookup(keys) == [] and b.pool.num_free == free and b.pool.num_used == 0


def test_a_giver_holding_fewer_pages_than_reserved_writes_those_and_the_keeper_publishes_them(tiny):
    a = core(tiny)
    want, _ = run(a, "a", PROMPT)
    held_by_a = chain_page_keys(PROMPT + want, PAGE, [])
    keys = chain_page_keys(PROMPT + want + list(range(100, 100 + 2 * PAGE)), PAGE, [])  # two pages a lacks
    b = core(tiny)
    assert store(a, b, keys) == len(held_by_a)
    assert len(b.pool.lookup(keys)) == len(held_by_a) and b.pool.num_used == 0


def test_a_target_of_another_shape_or_outside_the_cache_is_refused_and_pins_nothing(tiny):
    a = core(tiny)
    want, _ = run(a, "a", PROMPT)
    keys = chain_page_keys(PROMPT + want, PAGE, [])
    giver = Giver(LocalTransport(), a.pool, a.runner.kv_layers, a.runner.attn.page_axis)
    layout = KVLayout.of(a.runner.kv_layers, a.runner.attn.page_axis)
    other = KVLayout(layout.bases, layout.shape[:-1] + (layout.shape[-1] * 2,), layout.itemsize, layout.page_axis)
    for dst, pages in ((other, list(range(4))), (layout, [10_000, 1, 2]), (layout, [1, 1, 2])):
        with pytest.raises(ValueError):
            giver.give("s", keys, "local", dst, pages)
        assert a.pool.num_used == 0 and not giver.given


def test_a_reservation_takes_at_most_a_quarter_of_the_cache(tiny):
    b = core(tiny)
    keeper = Keeper(b.pool, b.runner.kv_layers, b.runner.attn.page_axis)
    keys = chain_page_keys(list(range(1, 1 + 60 * PAGE)), PAGE, [])
    held, pages = keeper.reserve("s", keys)
    assert held == 0 and len(pages) == b.pool.num_pages // 4
    keeper.poll(float("inf"))  # never reported: freed at the horizon
    assert b.pool.num_used == 0


def test_a_store_the_giver_refused_before_writing_frees_its_pages_at_once_and_one_that_failed_does_not(tiny):
    b = core(tiny)
    keys = chain_page_keys(PROMPT, PAGE, [])
    keeper = Keeper(b.pool, b.runner.kv_layers, b.runner.attn.page_axis)
    free = b.pool.num_free
    _, pages = keeper.reserve("refused", keys, until=100.0)
    assert pages and b.pool.num_free == free - len(pages)
    keeper.done("refused", False, now=0.0, unwritten=True)  # e.g. the giver no longer held the pages
    assert not keeper.kept and b.pool.num_free == free
    _, pages = keeper.reserve("failed", keys, until=100.0)
    keeper.done("failed", False, now=0.0)  # a write that failed may still land: held to the horizon
    assert keeper.poll(50.0) == 0 and b.pool.num_free == free - len(pages)
    keeper.poll(100.0)
    assert not keeper.kept and b.pool.num_free == free
