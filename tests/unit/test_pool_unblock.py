"""Pins taken by waiting requests can leave two engines no room: an engine that runs nothing while requests
wait gives its waiting requests' pins back (pool/engine_hooks.py `_unblock`), and its loop waits
instead of spinning (EngineCore.stalled)."""
from __future__ import annotations

from types import SimpleNamespace

from tokenflowd.buffer import make_policy
from tokenflowd.config import PolicyConfig
from tokenflowd.engine.core import EngineCore
from tokenflowd.engine.request import Request, SamplingParams
from tokenflowd.engine.scheduler import ScheduledBatch, Scheduler
from tokenflowd.kv.manager import KVCacheManager
from tokenflowd.kv.pages import PagePool
from tokenflowd.pool.engine_hooks import PoolHooks
from tokenflowd.pool.stuck import STUCK_SECONDS, StuckTimer


def scheduler(waiting: list[Request]) -> Scheduler:
    """The engine's scheduler with `waiting` queued and nothing run yet."""
    s = Scheduler(KVCacheManager(PagePool(64), 16), make_policy("fcfs", PolicyConfig()), 512, 8)
    for req in waiting:
        req.max_model_len = 1024
        s.add(req)
    return s


def reader(rid: str) -> Request:
    req = Request(rid, list(range(64)), SamplingParams(max_tokens=4))
    req.set_foreign_prefix(32, b"k")
    return req


def hooks(sched: Scheduler) -> PoolHooks:
    h = PoolHooks.__new__(PoolHooks)
    h.core = SimpleNamespace(scheduler=sched, last_batch=ScheduledBatch())
    h.stuck, h.unblocked = StuckTimer(), 0
    h.config = SimpleNamespace(page_size=16)
    h.member = SimpleNamespace(count=lambda rid: (2, 0))  # each reader pinned 2 pages on a peer
    h.peer_tokens, h.own_tokens = 2 * 2 * 16, 0  # as counted when the two readers came
    return h


def test_an_engine_running_nothing_while_readers_wait_gives_their_pins_back_after_a_while():
    a, b, own = reader("a"), reader("b"), Request("own", list(range(64)), SamplingParams(max_tokens=4))
    sched = scheduler([a, b, own])
    h = hooks(sched)
    h._unblock(10.0)
    h._unblock(10.0 + STUCK_SECONDS / 2)
    assert a.foreign_token_ids and b.foreign_token_ids, "a moment with nothing admitted is not a deadlock"
    h._unblock(10.0 + STUCK_SECONDS)
    assert h.unblocked == 2
    assert h.peer_tokens == 0, "the peer tokens counted when they pinned are taken back"
    for req in (a, b):  # they wait on, the whole prompt theirs to compute here (their pins then swept)
        assert req.num_prompt_tokens == 64 and not req.foreign_token_ids and req in sched.waiting
    assert not own.foreign_token_ids and own in sched.waiting


def test_an_engine_that_runs_or_admits_keeps_the_pins():
    a = reader("a")
    sched = scheduler([a])
    h = hooks(sched)
    sched.running.append(object())  # something runs: the pages will come free
    for t in (0.0, 1.0, 2.0):
        h._unblock(t)
    sched.running.clear()
    h.core.last_batch = [("a", 1)]  # a step that ran something
    for t in (3.0, 4.0, 5.0):
        h._unblock(t)
    assert a.foreign_token_ids and h.unblocked == 0 and h.stuck.since is None


def test_a_core_whose_last_step_ran_nothing_is_stalled_only_while_requests_wait():
    core = EngineCore.__new__(EngineCore)
    core.last_batch, core._in_flight = ScheduledBatch(), None
    core.scheduler = SimpleNamespace(has_unfinished=lambda: True)
    assert core.stalled()
    core.scheduler = SimpleNamespace(has_unfinished=lambda: False)
    assert not core.stalled()
