"""A queued request pins the prefix it reads once it nears the front of its engine's queue
(pool/ahead.py; pool/engine_hooks.py `take_prefix`, `_pin_due`, `reads`): until then it holds none
of its peers' memory, and then it reads where its front says the pool holds its prefix now."""
from __future__ import annotations

from types import SimpleNamespace

from tokenflowd.buffer import make_policy
from tokenflowd.config import PolicyConfig
from tokenflowd.engine.request import Request, SamplingParams
from tokenflowd.engine.scheduler import Scheduler
from tokenflowd.kv.manager import KVCacheManager
from tokenflowd.kv.pages import PagePool
from tokenflowd.pool.ahead import PIN_AHEAD, due, pins_now
from tokenflowd import protocol as p
from tokenflowd.pool import engine_hooks
from tokenflowd.pool.engine_hooks import PoolHooks

PS = 16


def request(rid: str, tokens: int) -> Request:
    req = Request(rid, list(range(1000, 1000 + tokens)), SamplingParams(max_tokens=4))
    req.max_model_len = 1024
    return req


def test_the_first_pin_ahead_of_the_queue_pin_and_past_them_only_what_fits_the_free_pages():
    assert all(pins_now(i, 10**9, 0) for i in range(PIN_AHEAD))
    assert not pins_now(PIN_AHEAD, 65, 64) and pins_now(PIN_AHEAD, 64, 64)
    queue = [request(f"q{i}", 160) for i in range(PIN_AHEAD + 2)]  # 10 pages each
    reads = {r.request_id for r in queue[1:]}
    assert [r.request_id for r in due(queue, reads, 0, PS)] == [f"q{i}" for i in range(1, PIN_AHEAD)]
    assert [r.request_id for r in due(queue, reads, 10 * (PIN_AHEAD + 1), PS)] == \
        [f"q{i}" for i in range(1, PIN_AHEAD + 1)], "an engine with room pins what it could admit"


class Member:
    """The pool member, recorded: every run is pinned whole on its holder (engine 1)."""

    def __init__(self) -> None:
        self.pinned: dict[str, int] = {}
        self.peers = {1: None}

    def pin(self, rid, runs):
        self.pinned[rid] = sum(len(run.keys) for run in runs)
        return self.pinned[rid]

    def count(self, rid):
        return self.pinned.get(rid, 0), 0

    def release(self, rid):
        self.pinned.pop(rid, None)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


# a queue that puts a reader behind it past the window and past what the free pages hold (64 pages
# free, 25 a queued prompt)
LONG = max(PIN_AHEAD, 3)


def engine(queued: int):
    """An engine's scheduler with 64 pages and `queued` requests of 25 pages each waiting, and its hooks."""
    sched = Scheduler(KVCacheManager(PagePool(64), PS), make_policy("fcfs", PolicyConfig()), 512, 8)
    for i in range(queued):
        sched.add(request(f"q{i}", 400))
    h = PoolHooks.__new__(PoolHooks)
    h.core = SimpleNamespace(scheduler=sched, pool=sched.kv.pool, kv=sched.kv, unlocked=_nothing)
    h.config = SimpleNamespace(page_size=PS)
    h.member, h.deferred, h.peer_tokens, h.own_tokens, h.pinned_queued = Member(), {}, 0, 0, 0
    h.asked, h.asking, h.resolved, h.later, h.again_at, h.computing = {}, [], 0, set(), {}, set()
    return sched, h


def runs(pages: int):
    return [SimpleNamespace(engine=1, keys=[bytes([i]) for i in range(pages)])]


def test_a_reader_near_the_front_pins_as_it_comes():
    sched, h = engine(PIN_AHEAD - 1)
    req = request("r", 64)
    assert h.take_prefix(req, runs(2))
    assert h.member.pinned == {"r": 2} and req.prefix_offset == 2 * PS and not h.deferred


def test_a_reader_behind_a_long_queue_pins_its_reads_only_once_it_nears_the_front():
    sched, h = engine(LONG)
    req = request("r", 64)
    assert not h.take_prefix(req, runs(1)), "prompts of 25 pages ahead of it past the 64 pages free"
    sched.add(req)
    req.max_model_len = 1024
    h._pin_due()
    assert h.member.pinned == {} and req.prefix_offset == 0 and "r" in h.deferred and h.take_asking() == []
    sched.abort("q1")  # one ahead of it leaves: near the front now (the queue up to it fits the free pages)
    h._pin_due()
    assert h.take_asking() == ["r"], "near the front, it asks its front where its reads are now"
    h._pin_due()
    assert h.take_asking() == [] and h.member.pinned == {}, "once, and it waits for the answer"
    h.reads(p.Reads("r", runs(2)))  # the pool holds more of its prefix than when it came
    assert h.member.pinned == {"r": 2} and "r" not in h.deferred and h.pinned_queued == h.resolved == 1
    assert req.prefix_offset == 2 * PS and req.num_prompt_tokens == 64 - 2 * PS
    assert req.max_model_len == 1024 - 2 * PS, "its own tokens' room shrinks by what it reads"
    assert [r.request_id for r in sched.waiting] == [f"q{i}" for i in range(LONG) if i != 1] + ["r"], \
        "it keeps its place"
    assert h.peer_tokens == 2 * PS, "counted as read on a peer when pinned"
    h.reads(p.Reads("r", runs(3)))
    assert h.member.pinned == {"r": 2}, "an answer it no longer waits for changes nothing"


def test_a_reader_that_found_nothing_as_it_came_reads_what_was_computed_while_it_waited():
    """In a burst over one document, the requests after the first came while it was still queued:
    nothing to read then, but by their turn it has been computed."""
    sched, h = engine(1)
    req = request("r", 64)
    assert not h.take_prefix(req, []) and "r" in h.deferred, "nothing held anywhere as it came, one ahead of it"
    sched.add(req)
    sched.held = h.deferred
    h._pin_due()
    assert h.take_asking() == ["r"]
    assert sched.schedule().request_ids == ["q0"], "not admitted before the answer: it would compute what it can read"
    h.reads(p.Reads("r", runs(3)))
    assert h.member.pinned == {"r": 3} and req.prefix_offset == 3 * PS and h.resolved == 1
    assert "r" in sched.schedule().request_ids


def test_a_reader_copies_in_the_hot_segments_its_front_names_with_its_reads_before_it_pins_them():
    """A burst behind one system prompt came before the prompt was computed, so none was told to
    copy it as it came; the front names the copies with the reads (protocol.Reads.copy), and the
    engine copies them in first (PoolMember.copy_in), so its pin reads them here."""
    sched, h = engine(1)
    order: list = []
    h.member.copy_in = lambda copies: order.append(("copy", [len(run.keys) for run in copies]))
    pin = h.member.pin
    h.member.pin = lambda rid, runs: order.append(("pin", rid)) or pin(rid, runs)
    req = request("r", 64)
    assert not h.take_prefix(req, [])
    sched.add(req)
    h._pin_due()
    assert h.take_asking() == ["r"]
    h.reads(p.Reads("r", runs(3), runs(2)))
    assert order == [("copy", [2]), ("pin", "r")] and h.member.pinned == {"r": 3}
    order.clear()
    h.reads(p.Reads("r", runs(3), runs(2)))
    assert order == [("copy", [2])], "an answer it no longer waits for still copies (named once: later readers)"


def queued_reader(sched: Scheduler, h: PoolHooks) -> Request:
    """A reader that found nothing to read as it came, queued behind the scheduler's requests, asking
    its front where its reads are now."""
    req = request("r", 64)
    assert not h.take_prefix(req, []) and "r" in h.deferred
    sched.add(req)
    sched.held = h.deferred
    return req


def test_a_reader_told_nothing_holds_its_prefix_asks_again_when_its_policy_picks_it():
    """pool/ahead.py `asks_again`: near the front is not yet admitted. The first request over a
    document may still be computing it when the next one nears the front; by the time the policy
    picks that one, it may be done."""
    sched, h = engine(1)
    req = queued_reader(sched, h)
    h._pin_due()
    assert h.take_asking() == ["r"]
    h.reads(p.Reads("r", []))
    assert "r" in h.deferred and h.later == {"r"}, "nothing anywhere yet: it waits to ask again"
    h._pin_due()
    assert h.take_asking() == [], "near the front, but asked once: it asks again when the policy picks it (or later)"
    assert sched.schedule().request_ids == ["q0"] and sched.held_back == ("r",)
    h._pin_due()
    assert h.take_asking() == ["r"], "picked: it asks again"
    h.reads(p.Reads("r", runs(3)))
    assert h.member.pinned == {"r": 3} and req.prefix_offset == 3 * PS and not h.later and not h.deferred
    assert "r" in sched.schedule().request_ids


def test_a_reader_told_nothing_holds_its_prefix_once_picked_or_holding_some_computes_it():
    sched, h = engine(1)
    queued_reader(sched, h)
    sched.schedule()
    assert sched.held_back == ("r",)
    h._pin_due()
    assert h.take_asking() == ["r"]
    h.reads(p.Reads("r", []))
    assert not h.deferred and not h.later, "the policy had picked it: it does not wait for a second answer"
    assert "r" in sched.schedule().request_ids

    # not picked, it asks again ASK_EVERY later, and again: a request its policy cannot admit
    # with its whole prompt (it fits only once it reads its prefix) is picked only once it has found
    # the prefix (node simulator, a quarter of the A100's KV, 16 documents of 12K tokens, seed 1:
    # such requests waited 9-11 s, until a request they had not waited for read the document)
    sched, h = engine(1)
    queued_reader(sched, h)
    for _ in range(3):
        h.again_at["r"] = h.again_at.get("r", 0.0) - engine_hooks.ASK_EVERY  # (as if it passed)
        h._pin_due()
        assert h.take_asking() == ["r"]
        sched.held_back = ()  # (an answer that comes after a plan that did not pick it)
        h.reads(p.Reads("r", []))
        assert "r" in h.deferred and h.later == {"r"}
    h.again_at["r"] -= engine_hooks.ASK_EVERY
    h._pin_due()
    h.reads(p.Reads("r", runs(2)))
    assert h.member.pinned == {"r": 2} and not h.deferred and not h.later and not h.again_at

    sched, h = engine(0)
    sched.add(request("first", 64))
    while sched.has_unfinished():  # its pages stay in the prefix cache
        batch = sched.schedule()
        sched.update(batch, {rid: 7 for rid in batch.request_ids})
    sched.add(request("q0", 400))
    queued_reader(sched, h)
    h._pin_due()
    assert h.take_asking() == ["r"]
    h.reads(p.Reads("r", []))
    assert not h.deferred and not h.later, "its own cache holds some of its prefix: it reads that here"


def test_a_reader_that_goes_straight_in_or_has_no_whole_page_asks_nothing():
    sched, h = engine(0)
    assert not h.take_prefix(request("alone", 64), []) and not h.deferred, "an idle engine admits it at once"
    sched, h = engine(1)
    assert not h.take_prefix(request("short", PS), []) and not h.deferred, "no whole page: nothing to read"
    h.member.peers = {}
    assert not h.take_prefix(request("alone", 64), []) and not h.deferred, "no peer: nothing to ask about"


def test_a_reader_whose_prefix_is_being_computed_asks_where_it_is_even_where_it_would_go_straight_in():
    """AddRequest.pending (router.py PENDING_SECONDS): the engine computing its prefix writes it into
    its homes and lets go of its own copy once done; taken at once, the reader computed it all again."""
    sched, h = engine(0)
    assert not h.take_prefix(request("alone", 64), []) and not h.deferred, "(told nothing: it goes straight in)"
    req = request("r", 64)
    assert not h.take_prefix(req, [], pending=True) and "r" in h.deferred
    sched.add(req)
    sched.held = h.deferred
    h._pin_due()
    assert h.take_asking() == ["r"], "at the front: it asks its front where its prefix is now"
    assert sched.schedule().request_ids == [], "not admitted before the answer"
    h.reads(p.Reads("r", runs(3)))
    assert h.member.pinned == {"r": 3} and req.prefix_offset == 3 * PS and "r" in sched.schedule().request_ids
    # come mid-prompt: it reads the part computed so far and waits for the rest, pinning nothing yet
    sched, h = engine(0)
    late = request("late", 64)
    assert not h.take_prefix(late, runs(1), pending=True) and h.deferred == {"late": runs(1)}
    assert not h.member.pinned


def test_a_reader_told_its_prefix_is_still_being_computed_keeps_waiting_and_asks_again_later():
    """Reads.pending: the request computing its prefix has no first token yet. Answered empty
    twice, an idle engine's reader computed the whole prefix again though its peer finished a moment
    later (pool/ahead.py ASK_EVERY)."""
    sched, h = engine(0)
    req = request("r", 64)
    assert not h.take_prefix(req, [], pending=True)
    sched.add(req)
    sched.held = h.deferred
    assert sched.schedule().request_ids == [] and sched.held_back == ("r",), "the policy picks it: it is wanted"
    h._pin_due()
    assert h.take_asking() == ["r"]
    h.reads(p.Reads("r", [], pending=True))
    assert "r" in h.deferred and "r" not in h.later, "it waits, though wanted and answered empty"
    assert sched.schedule().request_ids == []
    h._pin_due()
    assert h.take_asking() == [], "not before ASK_EVERY"
    h.again_at["r"] -= engine_hooks.ASK_EVERY  # (as if it passed)
    h._pin_due()
    assert h.take_asking() == ["r"], "it asks again"
    h.reads(p.Reads("r", runs(3)))
    assert h.member.pinned == {"r": 3} and not h.again_at and "r" in sched.schedule().request_ids


def test_the_engine_names_the_requests_whose_prompts_a_step_begins_once_each():
    """protocol.Computing, sent before the step runs: one told its prefix is being computed waits
    only while the request computing it runs (daemon/router.py `being_computed`)."""
    sched, h = engine(0)
    long, short = request("long", 400), request("short", 40)
    sched.add(long)
    sched.add(short)
    batch = sched.schedule()
    assert sorted(h.began(batch)) == ["long", "short"]
    assert h.began(batch) == [], "each once"
    sched.abort("short")
    assert h.began(sched.schedule()) == [] and h.computing == {"long"}, "a request gone is forgotten"


def test_a_reader_whose_front_does_not_answer_reads_what_it_came_with(monkeypatch):
    sched, h = engine(LONG)
    req = request("r", 64)
    assert not h.take_prefix(req, runs(1))
    sched.add(req)
    sched.abort("q0")
    h._pin_due()
    assert h.take_asking() == ["r"]
    monkeypatch.setattr(engine_hooks, "RESOLVE_SECONDS", -1.0)  # (any wait is past it, even on a clock that did not move)
    h._pin_due()
    assert h.member.pinned == {"r": 1} and "r" not in h.deferred and h.resolved == 0 and h.pinned_queued == 1
    h.reads(p.Reads("r", runs(2)))
    assert h.member.pinned == {"r": 1}, "a late answer changes nothing"


def test_a_reader_that_left_the_queue_before_its_turn_forgets_its_reads():
    sched, h = engine(LONG)
    gone, failed = request("gone", 64), request("failed", 64)
    assert not h.take_prefix(gone, runs(2)) and not h.take_prefix(failed, runs(2))
    sched.add(gone)
    h.release_pins("failed", False)  # its add failed (engine/process/loop.py)
    sched.abort("gone")
    h._pin_due()
    assert h.deferred == {} and h.member.pinned == {}


def test_a_request_whose_reads_are_not_pinned_yet_waits_with_its_room_kept_and_one_behind_it_runs_in_the_rest():
    """Scheduler.held (the hooks' deferred reads): admitted first, it would compute what it could
    have read; it waits a step, and the next step's pins reach it. Its whole prompt's pages are kept
    for it: a request behind it runs in what is left, or waits (it stopped the queue before)."""
    from tokenflowd.buffer.policy import Plan

    sched = Scheduler(KVCacheManager(PagePool(64), PS), make_policy("fcfs", PolicyConfig()), 512, 8)
    r, behind = request("r", 64), request("behind", 64)
    sched.add(r)
    sched.add(behind)
    sched.held = {"r": []}
    assert sched.schedule().request_ids == ["behind"] and [q.request_id for q in sched.waiting] == ["r"]
    assert sched.held_back == ("r",)
    sched.held = {}
    assert "r" in sched.schedule().request_ids

    class Everyone:
        """Admits every waiting request whole, whatever the room (the scheduler checks it)."""

        name = "everyone"

        def plan(self, view):
            return Plan(scheduled=tuple((w.request_id, w.num_tokens - w.num_computed_tokens) for w in view.waiting))

    for pages, runs in ((7, ["behind"]), (6, [])):  # r: 64 tokens, 4 pages kept; behind: 48 tokens, 3 pages
        sched = Scheduler(KVCacheManager(PagePool(pages), PS), Everyone(), 512, 8)
        r, behind = request("r", 64), request("behind", 48)
        sched.add(r)
        sched.add(behind)
        sched.held = {"r": []}
        assert sched.schedule().request_ids == runs, pages


def test_a_request_the_policy_takes_out_of_queue_order_pins_at_the_next_step_whatever_its_place():
    """The buffer-aware policy admits out of queue order. A held request it picks past the window
    (Scheduler.held_back) is due at the next step: it asks its front, pins, and is admitted. Due only
    by its place, it stopped its engine's admissions until the queue ahead of it drained."""
    from tokenflowd.buffer.policy import Plan

    class Newest:
        """Admits the newest waiting request alone."""

        name = "newest"

        def plan(self, view):
            w = view.waiting[-1]
            return Plan(scheduled=((w.request_id, w.num_tokens - w.num_computed_tokens),))

    sched, h = engine(LONG + 2)
    last = f"q{LONG + 1}"
    sched.policy = Newest()
    req = request("r", 64)
    assert not h.take_prefix(req, runs(2))
    sched.add(req)
    sched.held = h.deferred
    h._pin_due()
    assert h.take_asking() == [], "past the window and past what the free pages hold"
    assert len(sched.schedule()) == 0 and sched.held_back == ("r",)
    h._pin_due()
    assert h.take_asking() == ["r"], "the policy wanted it: it asks now"
    h.reads(p.Reads("r", runs(2)))
    assert h.member.pinned == {"r": 2} and sched.schedule().request_ids == ["r"]
    assert sched.held_back == ()
    assert [r.request_id for r in due(sched.waiting, {last: []}, 0, PS, wanted={last})] == [last]
    assert due(sched.waiting, {last: []}, 0, PS) == []
