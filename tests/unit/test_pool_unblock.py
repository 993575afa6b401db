"""Pins taken at arrival can leave two engines no room: an engine that runs nothing while requests
wait gives its waiting requests' pins back (pool/engine_hooks.py `_unblock`), and its loop waits
instead of spinning (EngineCore.stalled)."""
from __future__ import annotations

from types import SimpleNamespace

from tokenflowd.engine.core import EngineCore
from tokenflowd.engine.request import Request, SamplingParams
from tokenflowd.engine.scheduler import ScheduledBatch
from tokenflowd.pool.engine_hooks import STUCK_SECONDS, PoolHooks


class FakeScheduler:
    def __init__(self, waiting: list[Request]) -> None:
        self.running, self.loading, self.waiting = [], [], list(waiting)
        self.requests = {r.request_id: r for r in waiting}
        self.taken: list[str] = []

    def take_foreign_prefix(self, req: Request) -> None:
        self.taken.append(req.request_id)
        req.take_foreign_prefix()


def reader(rid: str) -> Request:
    req = Request(rid, list(range(64)), SamplingParams(max_tokens=4))
    req.set_foreign_prefix(32, b"k")
    return req


def hooks(scheduler: FakeScheduler) -> PoolHooks:
    h = PoolHooks.__new__(PoolHooks)
    h.core = SimpleNamespace(scheduler=scheduler, last_batch=ScheduledBatch())
    h.stuck_since, h.unblocked = None, 0
    h.config = SimpleNamespace(page_size=16)
    h.member = SimpleNamespace(count=lambda rid: (2, 0))  # each reader pinned 2 pages on a peer
    h.peer_tokens, h.own_tokens = 2 * 2 * 16, 0  # as counted when the two readers came
    return h


def test_an_engine_running_nothing_while_readers_wait_gives_their_pins_back_after_a_while():
    a, b, own = reader("a"), reader("b"), Request("own", list(range(64)), SamplingParams(max_tokens=4))
    sched = FakeScheduler([a, b, own])
    h = hooks(sched)
    h._unblock(10.0)
    h._unblock(10.0 + STUCK_SECONDS / 2)
    assert sched.taken == [], "a moment with nothing admitted is not a deadlock"
    h._unblock(10.0 + STUCK_SECONDS)
    assert sched.taken == ["a", "b"] and h.unblocked == 2
    assert h.peer_tokens == 0, "the peer tokens counted at their arrival are taken back"
    assert a.num_prompt_tokens == 64 and not a.foreign_token_ids, "it computes its whole prompt here"


def test_an_engine_that_runs_or_admits_keeps_the_pins():
    sched = FakeScheduler([reader("a")])
    h = hooks(sched)
    sched.running.append(object())  # something runs: the pages will come free
    for t in (0.0, 1.0, 2.0):
        h._unblock(t)
    sched.running.clear()
    h.core.last_batch = [("a", 1)]  # a step that ran something
    for t in (3.0, 4.0, 5.0):
        h._unblock(t)
    assert sched.taken == [] and h.stuck_since is None


def test_a_core_whose_last_step_ran_nothing_is_stalled_only_while_requests_wait():
    core = EngineCore.__new__(EngineCore)
    core.last_batch, core._in_flight = ScheduledBatch(), None
    core.scheduler = SimpleNamespace(has_unfinished=lambda: True)
    assert core.stalled()
    core.scheduler = SimpleNamespace(has_unfinished=lambda: False)
    assert not core.stalled()
