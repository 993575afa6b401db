"""An idle engine takes a queued request from the engine with the longest queue (pool/steal.py): the
engine gives back the last of its queue that has started nothing (pool/engine_hooks.py
`withdrawable`), and the front sends it to the idle engine with its reads named for where it runs now
(daemon/api/front.py `_steal`, `_withdrawn`; Supervisor.move)."""
from __future__ import annotations

from types import SimpleNamespace

import msgspec

from tokenflowd import protocol as p
from tokenflowd.buffer import make_policy
from tokenflowd.config import EngineConfig, PolicyConfig, ServerConfig
from tokenflowd.daemon.api.front import Front
from tokenflowd.daemon.router import Arrival, Router
from tokenflowd.daemon.supervisor import Supervisor
from tokenflowd.engine.process.loop import EngineProcess
from tokenflowd.engine.request import Request, SamplingParams
from tokenflowd.engine.scheduler import Scheduler
from tokenflowd.kv.manager import KVCacheManager
from tokenflowd.kv.pages import PagePool, chain_page_keys
from tokenflowd.pool.engine_hooks import PoolHooks
from tokenflowd.pool.steal import IDLE_FREE, MIN_QUEUE, idle, stays, victim, withdrawable

PS = 16


def request(rid: str, tokens: int = 64) -> Request:
    req = Request(rid, list(range(1000, 1000 + tokens)), SamplingParams(max_tokens=4))
    req.max_model_len = 1024
    return req


def test_an_engine_is_idle_with_nothing_queued_a_seat_and_room_free():
    assert idle(0, 3, 8, 25, 100)
    assert not idle(1, 0, 8, 100, 100), "something queued"
    assert not idle(0, 8, 8, 100, 100), "every seat taken"
    assert not idle(0, 0, 8, int(IDLE_FREE * 100) - 1, 100), "no room for a prompt"


def test_the_longest_queue_of_at_least_two_gives_the_lowest_id_among_equals():
    assert victim({0: 0, 1: 3, 2: 5, 3: 5}, 0) == 2
    assert victim({0: 9, 1: 3}, 0) == 1, "never the idle engine itself"
    assert victim({0: 0, 1: MIN_QUEUE - 1}, 0) is None, "one queued runs next where it is anyway"
    assert victim({0: 0}, 0) is None


def test_the_last_request_that_has_started_nothing_goes():
    a, b, c, d = (request(x) for x in "abcd")
    b.num_preemptions = 1
    d.set_foreign_prefix(PS, b"k")  # it pinned its reads
    assert withdrawable([a, b, c, d]) is c
    assert withdrawable([a, b, c, d], keep={"c"}) is a
    assert withdrawable([b, d]) is None


class Member:
    peers = {1: None}

    def __init__(self) -> None:
        self.released: list[str] = []

    def release(self, rid):
        self.released.append(rid)


def engine(queued: int):
    sched = Scheduler(KVCacheManager(PagePool(64), PS), make_policy("fcfs", PolicyConfig()), 512, 8)
    for i in range(queued):
        sched.add(request(f"q{i}"))
    h = PoolHooks.__new__(PoolHooks)
    h.core = SimpleNamespace(scheduler=sched, pool=sched.kv.pool, leaders={}.keys(), unlocked=lambda: None)
    h.config = SimpleNamespace(page_size=PS)
    h.member, h.deferred, h.asked, h.homes, h.ends, h.kept, h.later, h.again_at = Member(), {}, {}, {}, {}, {}, set(), {}
    return sched, h


def test_an_engine_gives_back_the_last_of_its_queue_and_forgets_its_reads_and_homes():
    sched, h = engine(4)
    h.deferred["q3"] = []
    h.homes["q3"], h.ends["q3"] = {b"k": 1}, {b"k"}
    assert h.withdrawable(lambda rid: True).request_id == "q3"
    h.asked["q3"] = 0.0  # asking its front where its reads are: near the front, it stays
    assert h.withdrawable(lambda rid: True).request_id == "q2"
    h.core.leaders = {"q2": []}.keys()  # another choice of its prompt waits for its first token here
    assert h.withdrawable(lambda rid: True).request_id == "q1"
    assert h.withdrawable(lambda rid: rid == "q0").request_id == "q0", "only the asking front's requests"
    h.withdrawn("q3")
    assert h.deferred == h.asked == h.homes == h.ends == {}
    sched, h = engine(MIN_QUEUE - 1)
    assert h.withdrawable(lambda rid: True) is None


class Inbox:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, raw, flags=0):
        self.sent.append(raw)


def front(num_engines: int = 3, placement: str = "local") -> tuple[Front, Supervisor]:
    """A front over `num_engines` ready engines with the pool on (new segments kept where computed,
    or with `placement` "home" written into their homes), each with a recording inbox."""
    sup = Supervisor(ServerConfig(), EngineConfig(pool_mode="query", pool_placement=placement),
                     placement=[(EngineConfig(pool_mode="query", max_num_seqs=8), {}) for _ in range(num_engines)])
    for slot in sup.slots:
        slot.state, slot.inbox = "ready", Inbox()
        slot.info = SimpleNamespace(pool_segment_pages=1)
        slot.stats = p.EngineStats(0, 0, 0, 0, 100, 0, 0, 0.0)
    f = Front.__new__(Front)
    f.supervisor, f.router, f._withdrawing, f._refused = sup, Router(PS, sup.index), {}, {}
    f.metrics = SimpleNamespace(moved=SimpleNamespace(labels=lambda e: SimpleNamespace(inc=lambda: None)))
    return f, sup


def sent(slot) -> list:
    out = [msgspec.msgpack.decode(raw, type=p.ToEngine) for raw in slot.inbox.sent]
    slot.inbox.sent.clear()
    return out


def test_an_idle_engine_asks_the_longest_queue_once_and_takes_what_it_gives_back_with_reads_named_for_it():
    f, sup = front()
    idle_slot, busy, other = sup.slots
    busy.stats = p.EngineStats(1, 5, 90, 0, 100, 0, 0, 0.0)
    other.stats = p.EngineStats(1, 3, 90, 0, 100, 0, 0, 0.0)
    f._steal(idle_slot)
    assert sent(busy) == [p.Withdraw(0)] and sent(other) == [] and sent(idle_slot) == []
    f._steal(busy)
    assert sent(busy) == [], "one Withdraw in flight"
    prompt = list(range(1000, 1064))
    sup.index.update(2, chain_page_keys(prompt, PS, [], 64)[:2], [])  # the third engine holds its first two pages
    got: list = []
    stream = sup.submit(busy, p.AddRequest("r", prompt, p.Sampling(max_tokens=4), 10.0), got.append)
    sent(busy)
    f._withdrawn(busy, p.Withdrawn(1, 0, ["r"]))
    [add] = sent(idle_slot)
    assert add.request_id == "r" and [run.engine for run in add.prefix] == [2] and len(add.prefix[0].keys) == 2
    assert stream.engine is idle_slot and "r" in idle_slot.streams and "r" not in busy.streams
    assert (idle_slot.num_waiting, busy.num_waiting) == (1, 0)
    assert f._withdrawing == {}
    idle_slot.deliver(p.Delta("r", [7], "length"))
    assert got[-1].token_ids == [7], "its deltas come from the engine it runs on now"


def two_over_one_prefix(f: Front, sup: Supervisor, slot) -> None:
    """Requests "a" and "b" over one new prefix, queued on `slot`: a is named to compute it, b is
    told it is being computed (AddRequest.pending)."""
    prompt = list(range(1000, 1064))
    first = f.router.pick_pooled(sup.slots, prompt, target=slot.engine_id, request_id="a")
    second = f.router.pick_pooled(sup.slots, prompt + [5], target=slot.engine_id, request_id="b")
    assert not first.pending and second.pending
    for rid, choice in (("a", first), ("b", second)):
        sup.submit(slot, p.AddRequest(rid, prompt, p.Sampling(max_tokens=4), 10.0, pending=choice.pending),
                   lambda delta: None)
    sent(slot)


def test_a_request_that_moves_is_not_told_that_it_is_computing_its_own_prefix():
    """The router records the pages a pooled pick names its request to compute (Router
    `_pending`): a request that moves before it ran is named again, and its own record is no
    earlier request's (an idle engine that took it waited for itself, asking again where its prefix
    was). One told that an earlier request computes it is still told so."""
    f, sup = front(placement="home")
    idle_slot, busy, _ = sup.slots
    busy.stats = p.EngineStats(1, 5, 90, 0, 100, 0, 0, 0.0)
    two_over_one_prefix(f, sup, busy)
    f._steal(idle_slot)
    assert sent(busy) == [p.Withdraw(0)]
    f._withdrawn(busy, p.Withdrawn(1, 0, ["a"]))
    [add] = sent(idle_slot)
    assert add.request_id == "a" and not add.pending
    # nothing queued on the idle engine: a begins at its next step, computing before its Computing
    # comes (as Front._place counts one placed there), so b, asking, waits for it
    assert f.router.being_computed("b")
    f._withdrawn(busy, p.Withdrawn(1, 0, ["b"]))  # (no steal in flight: back to the end of its queue)
    [add] = sent(busy)
    assert add.request_id == "b" and add.pending


def test_a_queued_request_hears_its_prefix_is_pending_until_the_request_computing_it_has_its_first_token():
    """Reads.pending (Router.being_computed): the front answers a queued request's ResolveReads that
    the request named to compute its prefix is computing it (protocol.Computing) and has not
    finished its prompt, until that request's first token comes (Supervisor.on_started: Front.done,
    which tells the waiting request so without its asking, once the engine's next message says
    where the prompt's last segments went)."""
    f, sup = front(placement="home")
    sup.on_started, sup.on_computing = f.done, f.router.computing  # (as Front.__init__ sets them)
    _, busy, _ = sup.slots
    two_over_one_prefix(f, sup, busy)
    f._resolve(busy, busy.streams["b"])
    assert sent(busy) == [p.Reads("b", [], [], pending=False)], "a waits in the queue: b does not wait for it"
    sup._on_message(p.Computing(1, 0, ["a"]))  # a step begins a's prompt
    f._resolve(busy, busy.streams["b"])
    assert sent(busy) == [p.Reads("b", [], [], pending=True)]
    stats = p.EngineStats(1, 1, 90, 0, 100, 0, 0, 0.0)
    sup._on_step(busy, p.StepOutputs(1, 0, 0.0, [p.Delta("a", [7])], stats))
    assert sent(busy) == [], "its first token: not yet (the engine writes its last segments into their homes next)"
    sup._on_step(busy, p.StepOutputs(1, 0, 0.0, [], stats))  # (EngineProcess.report_step: where they went)
    assert sent(busy) == [p.Reads("b", [], [], pending=False)], "with the engine's next message b hears unasked"


def test_a_request_placed_on_an_engine_with_nothing_queued_is_computing_at_once():
    """Front._place: such an engine begins it at its next step, and its Computing may reach the
    front after a peer's request asks whether it is (that one computed the prefix too); one placed
    behind a queue is computing only once its engine says so."""
    for queued in (0, 3):
        f, sup = front(2, placement="home")
        for slot in sup.slots:
            slot.info = SimpleNamespace(pool_segment_pages=1, pool_query_row_bytes=1, pool_kv_token_bytes=1)
            slot.stats = p.EngineStats(1, queued, 90, 0, 100, 0, 0, 0.0)
        prompt = list(range(1000, 1064))
        [a] = f._place([Arrival(prompt, 4, "a")])
        [b] = f._place([Arrival(prompt + [5], 4, "b")])
        assert not a.pending and b.pending
        assert f.router.being_computed("b") == (not queued), queued


def test_a_request_whose_client_left_meanwhile_goes_nowhere_and_one_whose_thief_left_goes_back():
    f, sup = front(2)
    thief, busy = sup.slots
    busy.stats = p.EngineStats(1, 4, 90, 0, 100, 0, 0, 0.0)
    f._steal(thief)
    gone = sup.submit(busy, p.AddRequest("gone", list(range(40)), p.Sampling(max_tokens=4), 1.0), lambda d: None)
    sup.abort(gone)
    sent(busy)
    f._withdrawn(busy, p.Withdrawn(1, 0, ["gone"]))
    assert sent(thief) == [] and sent(busy) == [] and not thief.streams
    f._steal(thief)
    sup.submit(busy, p.AddRequest("back", list(range(40)), p.Sampling(max_tokens=4), 1.0), lambda d: None)
    sent(busy)
    thief.state = "backoff"  # it went away before the answer came
    f._withdrawn(busy, p.Withdrawn(1, 0, ["back"]))
    assert [m.request_id for m in sent(busy)] == ["back"] and "back" in busy.streams and busy.num_waiting == 1


def test_an_engine_that_gave_nothing_back_is_not_asked_again_before_its_queue_grows():
    """Its queue holds only requests that have started (preempted ones): an idle engine that reports
    each step would otherwise ask it at every step."""
    f, sup = front(2)
    thief, busy = sup.slots
    busy.stats = p.EngineStats(1, 3, 90, 0, 100, 0, 0, 0.0)
    f._steal(thief)
    assert sent(busy) == [p.Withdraw(0)]
    f._withdrawn(busy, p.Withdrawn(1, 0, []))
    f._steal(thief)
    assert sent(busy) == []
    busy.stats = p.EngineStats(1, 4, 90, 0, 100, 0, 0, 0.0)  # a request joined its queue
    f._steal(thief)
    assert sent(busy) == [p.Withdraw(0)]


def test_a_request_stays_where_most_of_its_prompt_is_held_that_the_idle_engine_does_not_hold():
    assert stays(3, 0, 64, PS) and stays(4, 2, 64, PS), "half its prompt or more would be read here all the same"
    assert not stays(4, 4, 64, PS), "the idle engine holds it too (a system prompt every engine holds)"
    assert not stays(1, 0, 64, PS)


def test_the_front_names_the_queued_requests_that_stay_where_their_prefix_is():
    """Front._staying: by the router's index, the busy engine holds the document "doc" reads; the idle
    one holds the system prompt "common" reads, as the busy one does; nothing holds "new"'s. Only
    "doc" stays (pool/steal.py `stays`); the engine gives back the last of the others."""
    f, sup = front()
    idle_slot, busy, other = sup.slots
    busy.stats = p.EngineStats(1, 5, 90, 0, 100, 0, 0, 0.0)
    doc, common, new = list(range(1000, 1072)), list(range(2000, 2072)), list(range(3000, 3072))
    sup.index.update(1, chain_page_keys(doc, PS, [], 64)[:4] + chain_page_keys(common, PS, [], 64)[:4], [])
    sup.index.update(0, chain_page_keys(common, PS, [], 64)[:4], [])
    for rid, prompt in (("common", common), ("doc", doc), ("new", new)):
        sup.submit(busy, p.AddRequest(rid, prompt, p.Sampling(max_tokens=4), 10.0), lambda d: None)
    sent(busy)
    f._steal(idle_slot)
    assert sent(busy) == [p.Withdraw(0, keep=["doc"])]
    # the engine (EngineProcess.withdraw) gives back the last of its queue that does not stay
    sched, h = engine(0)
    for rid, prompt in (("common", common), ("doc", doc), ("new", new)):
        sched.add(Request(rid, prompt, SamplingParams(max_tokens=4)))
    h.core.abort = sched.abort
    proc = EngineProcess.__new__(EngineProcess)
    proc.pool, proc.federation, proc.core, proc.prompt_tokens = h, None, h.core, 216
    proc.request_front = {"common": 0, "doc": 0, "new": 0}
    assert proc.withdraw(0, {"doc"}) == ["new"]
    assert proc.withdraw(0, {"doc"}) == ["common"]
    assert [r.request_id for r in sched.waiting] == ["doc"] and proc.prompt_tokens == 72


def test_a_queued_request_asking_where_its_reads_are_is_told_the_hot_segments_to_copy_in_too():
    """Front._resolve (protocol.ResolveReads): the runs where the pool holds the prefix now, and the
    hot segments among them the engine copies in first (protocol.Reads.copy), once an engine."""
    import time

    f, sup = front()
    asker, holder, _ = sup.slots
    prompt = list(range(1000, 1064))
    keys = chain_page_keys(prompt, PS, [], 63)[:3]
    sup.index.update(holder.engine_id, keys, [])
    for _ in range(7):  # read this often (over 2 per engine), its pages are heavy hitters
        for key in keys:
            f.router.heat.hit(key, time.monotonic())
    streams = [sup.submit(asker, p.AddRequest(rid, prompt, p.Sampling(max_tokens=4), 10.0), lambda d: None)
               for rid in ("r", "s")]
    sent(asker)
    f._resolve(asker, streams[0])
    [reads] = sent(asker)
    assert reads.request_id == "r" and [(run.engine, run.keys) for run in reads.prefix] == [(1, keys)]
    assert [(run.engine, run.keys) for run in reads.copy] == [(1, keys)]
    f._resolve(asker, streams[1])
    [reads] = sent(asker)
    assert [run.keys for run in reads.prefix] == [keys] and reads.copy == [], "named once while it is copied"
