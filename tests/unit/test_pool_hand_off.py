"""Write into the home, the engine's side (pool/engine_hooks.py `_hand_off`): once its prompt is
computed, a request reads its new segments homed on peers, and the pages before them, where the
pool holds them; its own pages of them go, its remaining pages keep the whole prompt's keys, and its
usage still counts those tokens as computed, not cached."""
from __future__ import annotations

import contextlib
import threading
from types import SimpleNamespace

import pytest

from tokenflowd import protocol as p
from tokenflowd.engine.request import Request, RequestStatus, SamplingParams
from tokenflowd.kv.manager import KVCacheManager
from tokenflowd.kv.pages import PagePool, chain_page_keys
from tokenflowd.pool.engine_hooks import PoolHooks
from tokenflowd.pool.hand_off import by_segment

PS, SEG = 16, 2  # tokens a page, pages a segment
OWN = 2 * PS + 5  # the request's tokens past segment 2: segment 3 and 5


class Member:
    """The pool member's side, recorded: every run handed is taken whole."""

    segment_pages = SEG

    def __init__(self, takes: int | None = None) -> None:
        self.runs, self.takes = [], takes
        self.replicas: set[bytes] = set()  # hot segments the front named this engine to copy in
        self.read_here: dict[int, int] = {}  # page -> the peer that pins it for a request of its own
        self.foreign: dict = {}  # this engine's requests' foreign prefixes (only their number matters here)
        self.followed: list = []
        self.released: list = []  # requests whose pins were let go of

    def readers(self, pages):
        # the query service's lock is taken before the engine's by its thread: asked under the
        # engine's, the two threads could each hold one and wait for the other
        assert not self.engine_lock.locked(), "asked with the engine's lock held"
        return sorted({self.read_here[page] for page in pages if page in self.read_here})

    def follow(self, holder, runs):
        self.followed.append((holder, runs))
        return 0

    def release(self, rid):
        self.released.append(rid)

    def hand_off(self, rid, runs):
        self.runs.append(runs)
        n = sum(len(keys) for _, keys, _ in runs)
        return n if self.takes is None else min(n, self.takes)


def setup(takes: int | None = None, hand_off: str = "prompt", num_pages: int = 64, pages: int = 8):
    """A request of `pages` whole pages and 5 tokens: segment 0 (pages 0-1) homed here, segments 1 and 2
    (pages 2-5) on engine 1, and with 8 pages, segment 3 (pages 6-7), the last whole one, homed here."""
    pool = PagePool(num_pages)
    kv = KVCacheManager(pool, PS)
    req = Request("r", list(range(100, 100 + pages * PS + 5)), SamplingParams(max_tokens=4))
    req.max_model_len = 1024
    kv.track(req)
    assert kv.admit(req, kv.match(req), req.num_prompt_tokens)
    req.status = RequestStatus.RUNNING
    h = PoolHooks.__new__(PoolHooks)
    h.spec = SimpleNamespace(engine_id=0)
    h.config = SimpleNamespace(page_size=PS, pool_hand_off=hand_off)
    lock = threading.Lock()

    @contextlib.contextmanager
    def unlocked():  # as EngineCore.unlocked: the loop holds the lock but where it lets go
        lock.release()
        try:
            yield
        finally:
            lock.acquire()

    lock.acquire()  # (held by the engine's loop, as in EngineProcess.run)
    h.core = SimpleNamespace(scheduler=SimpleNamespace(requests={"r": req}), kv=kv, pool=pool, unlocked=unlocked)
    h.member = Member(takes)
    h.member.engine_lock = lock
    h.homes, h.ends, h.kept, h.moved, h.readers, h.followed = {}, {}, {}, [], set(), 0
    keys = chain_page_keys(req.prompt_token_ids, PS, [], pages * PS)
    h.added(SimpleNamespace(request_id="r", place=[SimpleNamespace(engine=1, keys=keys[2:6])]), False)
    return h, req, kv, pool, keys


def test_the_segments_move_once_the_prompt_is_computed_with_the_pages_before_them():
    h, req, kv, pool, keys = setup()
    before = list(kv.block_table(req))
    h.member.read_here = {before[0]: 3, before[3]: 2}  # peers read page 0 (stays: its home is here) and page 3
    req.num_computed_tokens = 5 * PS  # segments 0 and 1 whole, the prompt not yet computed
    kv.commit(req)
    h._hand_off()
    assert h.member.runs == [] and req.prefix_offset == 0, "nothing moves while the prompt is computed"
    req.num_computed_tokens = req.num_prompt_tokens  # segment 2 too: all of it goes, 0 pinned where it is
    kv.commit(req)
    h._hand_off()
    (runs,) = h.member.runs
    assert [(e, k, p) for e, k, p in runs] == [(0, keys[0:2], before[0:2]), (1, keys[2:6], before[2:6])]
    assert req.prefix_offset == 6 * PS and req.num_computed_tokens == OWN and req.num_prompt_tokens == OWN
    assert kv.block_table(req) == before[6:]
    assert h.take_moved() == ([p.PrefixRun(1, keys[2:6])], [2]), "the step's message says where, and who reads it"
    assert h.take_moved() == ([], []), "once"
    assert h.member.followed == [], "no other request here reads a foreign prefix"
    assert len(pool.lookup(keys)) == 2, "what went to the peer stops being cached here at once, its own pages stay"
    assert all(pool.holds(k) for k in keys[6:8]) and h.kept == {}, "the last segment is homed here: nothing waits"
    for page in before[2:6]:  # its own reference is gone (the member's pins on pages 0-1 are the member's)
        assert pool.ref_count(page) == 0
    assert req.prompt_cached_tokens == 0, "handed tokens were computed here, not read"
    assert "r" not in h.homes
    # it decodes on: its next page is keyed as the whole prompt's
    req.token_ids.extend(range(11))
    req.num_computed_tokens = PS
    kv.grow(req, 0)
    kv.commit(req)
    whole = chain_page_keys([*req.foreign_token_ids, *req.token_ids], PS, [], 7 * PS)
    assert kv.state(req).page_hashes[0] == whole[6]


def test_what_the_home_does_not_take_stays_here_and_is_not_tried_again():
    h, req, kv, pool, keys = setup(takes=3)  # the peer took one page of segment 1, then was full
    h.member.read_here = {kv.block_table(req)[3]: 2}  # a peer reads a page that stays
    req.num_computed_tokens = req.num_prompt_tokens
    kv.commit(req)
    h._hand_off()
    assert req.prefix_offset == 3 * PS and len(kv.block_table(req)) == 6
    assert h.take_moved() == ([p.PrefixRun(1, keys[2:3])], []), "no peer reads what moved"
    assert not pool.holds(keys[2]) and all(pool.holds(k) for k in keys[3:6]), "the rest is still its own, here"
    h._hand_off()
    assert len(h.member.runs) == 1 and "r" not in h.homes and h.take_moved() == ([], [])


def test_a_hot_segment_the_front_named_to_copy_in_stays_cached_here_as_a_replica():
    h, req, kv, pool, keys = setup()
    h.member.replicas.update(keys[2:4])  # segment 1 is hot: the front named this engine to copy it in
    req.num_computed_tokens = req.num_prompt_tokens
    kv.commit(req)
    h._hand_off()
    assert h.take_moved()[0] == [p.PrefixRun(1, keys[2:6])], "the home holds all of it"
    assert [pool.holds(k) for k in keys] == [True] * 4 + [False] * 2 + [True] * 2


def test_segment_by_segment_each_segment_moves_once_it_is_computed():
    """--pool-hand-off segment: the engine needs room for a segment of a long prompt, not all of it."""
    h, req, kv, pool, keys = setup(hand_off="segment")
    before = list(kv.block_table(req))
    req.num_computed_tokens = 3 * PS  # segment 0 (this engine's own) whole, segment 1 not yet
    kv.commit(req)
    h._hand_off()
    assert h.member.runs == [], "nothing homed on a peer is whole yet"
    req.num_computed_tokens = 4 * PS  # segment 1 whole: it goes, with segment 0 pinned where it is
    kv.commit(req)
    h._hand_off()
    (runs,) = h.member.runs
    assert [(e, k) for e, k, _ in runs] == [(0, keys[0:2]), (1, keys[2:4])]
    assert req.prefix_offset == 4 * PS and kv.block_table(req) == before[4:]
    for page in before[2:4]:
        assert pool.ref_count(page) == 0, "its own copy of what went to the peer is gone"
    assert h.take_moved()[0] == [p.PrefixRun(1, keys[2:4])] and "r" in h.homes, "segment 2 is still to come"
    req.num_computed_tokens = req.num_prompt_tokens  # the rest of the prompt (what is left of it here)
    kv.commit(req)
    h._hand_off()
    assert [(e, k) for e, k, _ in h.member.runs[-1]] == [(1, keys[4:6])]
    assert req.prefix_offset == 6 * PS and req.num_prompt_tokens == OWN and "r" not in h.homes
    assert kv.block_table(req) == before[6:]


def test_by_default_a_prompt_goes_segment_by_segment_only_where_it_would_take_over_a_quarter_of_the_kv():
    """pool/hand_off.py `auto`: the request's 6 pages and 5 tokens on a pool of 64 pages wait for
    the prompt's end (the rest of the prompt attends to its own pages); on a pool of 24 (over a
    quarter of it) each segment moves as soon as it is computed."""
    for pages, moved in ((64, []), (24, [[(0, 2), (1, 2)]])):
        h, req, kv, pool, keys = setup(hand_off="auto", num_pages=pages)
        req.num_computed_tokens = 4 * PS  # segments 0 and 1 whole, the prompt not yet computed
        kv.commit(req)
        h._hand_off()
        assert [[(e, len(k)) for e, k, _ in runs] for runs in h.member.runs] == moved, pages
    assert not by_segment("prompt", 1 << 20, 1) and by_segment("segment", 1, 1 << 20)
    from tokenflowd.sim.cost import cost_model
    from tokenflowd.sim.node import NodeConfig, NodeSimulator
    with pytest.raises(ValueError, match="hand_off must be one of"):  # (checked once with the config)
        NodeSimulator(cost_model("a100-llama2-7b"), [], "pool-write", NodeConfig(hand_off="layer"))


def test_the_engine_says_at_once_where_the_segments_went_with_the_keys_its_cache_let_go():
    """The engine loop after a step (EngineProcess.report_step): the step's own message, then the
    pool's work between steps (PoolHooks._hand_off here); segments the homes took go out in a
    second message at once, with the removals of this cache's copies, not at the next step or
    heartbeat."""
    from tokenflowd.engine.process.loop import EngineProcess

    h, req, kv, pool, keys = setup()
    pool.drain_key_events()  # (an engine records them from its start)
    sent = []
    engine = SimpleNamespace(core=h.core, _stats=lambda: None,
                             pool=SimpleNamespace(after_step=lambda now: h._hand_off(), take_moved=h.take_moved,
                                                  evicted=h.evicted),
                             must_report=lambda deltas, now, last: bool(deltas) or now - last >= 0.5,
                             send_step=lambda now, deltas, stats, added, removed, moved=None, readers=None:
                             sent.append((deltas, added, removed, moved, readers)))
    engine.report = lambda *a: EngineProcess.report(engine, *a)
    h.member.replicas = set()
    h.member.read_here = {kv.block_table(req)[5]: 1}  # engine 1 reads a page of segment 2 here
    req.num_computed_tokens = 5 * PS  # segments 0 and 1 whole, the prompt not yet computed
    kv.commit(req)
    assert EngineProcess.report_step(engine, 1.0, [], False, 0.9) == 0.9 and sent == [], "nothing to say yet"
    req.num_computed_tokens = req.num_prompt_tokens  # computed: segments 1 and 2 go to engine 1
    kv.commit(req)
    delta = p.Delta("r", [5])
    assert EngineProcess.report_step(engine, 1.1, [delta], False, 0.9) == 1.1
    assert sent == [([delta], keys[:8], [], None, None), ([], [], keys[2:6], [p.PrefixRun(1, keys[2:6])], [1])]
    assert EngineProcess.report_step(engine, 1.2, [], False, 1.1) == 1.1 and len(sent) == 2, "moved once"


def test_the_segment_the_requests_tail_follows_stays_here_while_it_runs_and_goes_home_when_it_ends():
    """pool/hand_off.py `tail_end`: the prompt's last whole segment, new and homed on a peer, is read
    at every step of the request (where it is the request's own, by it alone): it stays here until
    the request ends, then goes to its home, and the peers that read it here are told."""
    for takes in (None, 0):
        h, req, kv, pool, keys = setup(pages=6)  # segment 2 (pages 4-5), homed on engine 1, is the last whole one
        before = list(kv.block_table(req))
        req.num_computed_tokens = req.num_prompt_tokens
        kv.commit(req)
        h._hand_off()
        (runs,) = h.member.runs
        assert [(e, k) for e, k, _ in runs] == [(0, keys[0:2]), (1, keys[2:4])]
        assert req.prefix_offset == 4 * PS and kv.block_table(req) == before[4:]
        assert h.kept == {"r": (1, keys[4:6])} and all(pool.holds(k) for k in keys[4:6])
        assert h.take_moved()[0] == [p.PrefixRun(1, keys[2:4])] and "r" not in h.homes
        h._hand_off()
        assert len(h.member.runs) == 1, "not while it runs"
        # it ends: its pages stay cached here unreferenced, and segment 2 goes to its home
        h.member.read_here, h.member.takes = {before[5]: 3}, takes  # a peer reads page 5 here
        kv.free(req)
        del h.core.scheduler.requests["r"]
        h._hand_off()
        assert h.member.runs[-1] == [(1, keys[4:6], before[4:6])] and h.kept == {}
        assert h.member.released == ["r"], "pinned at the home only while it is written"
        if takes == 0:  # the home took nothing: it stays cached here
            assert all(pool.holds(k) for k in keys[4:6]) and h.take_moved() == ([], [])
            continue
        assert h.take_moved() == ([p.PrefixRun(1, keys[4:6])], [3]), "the step's message says where, and who reads it"
        assert not any(pool.holds(k) for k in keys[4:6])
        assert all(pool.ref_count(page) == 0 for page in before), "no page is kept referenced"
        h._hand_off()
        assert len(h.member.runs) == 2, "once"
