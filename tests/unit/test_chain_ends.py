"""Where the pool's chains end (daemon/prefix_index.py link / drain_marks, kv/pages.py set_inner):
a prompt's pages spread over engines are evicted from the chain's end, node-wide."""
from __future__ import annotations

from tokenflowd.daemon.prefix_index import PrefixIndex
from tokenflowd.kv.pages import PagePool


def chain(n: int) -> list[bytes]:
    return [b"k%d" % i for i in range(n)]


def test_a_page_is_inner_while_a_page_after_it_is_held_anywhere():
    idx, k = PrefixIndex(), chain(4)
    idx.link(k)
    idx.update(0, k[:2], [])  # engine 0 holds k0 k1, engine 1 k2 k3
    assert idx.drain_marks() == {0: ([b"k0"], [])}
    idx.update(1, k[2:], [])
    assert idx.drain_marks() == {0: ([b"k1"], []), 1: ([b"k2"], [])}
    idx.update(1, [], [b"k3"])  # the end evicted: k2 is the end now
    assert idx.drain_marks() == {1: ([], [b"k2"])}
    idx.update(1, [], [b"k2"])
    assert idx.drain_marks() == {0: ([], [b"k1"])}


def test_a_page_cut_from_the_middle_orphans_what_follows_and_a_refill_brings_it_back():
    idx, k = PrefixIndex(), chain(5)
    idx.link(k)
    idx.update(0, [k[0], k[2]], [])
    idx.update(1, [k[1], k[3], k[4]], [])
    idx.update(2, [k[3]], [])  # a replica is as inner as the others
    assert idx.drain_marks() == {0: ([b"k0", b"k2"], []), 1: ([b"k1", b"k3"], []), 2: ([b"k3"], [])}
    idx.update(1, [], [b"k1"])  # k2.. are out of every match's reach: evicted first wherever they are
    marks = idx.drain_marks()
    assert marks[0] == ([], [b"k0", b"k2"]) and sorted(marks[1][1]) == [b"k3", b"k4"] and marks[2] == ([], [b"k3"])
    idx.update(3, [b"k1"], [])  # a reader computed k1 again: the chain is whole
    marks = idx.drain_marks()
    assert marks[0][0] == [b"k0", b"k2"] and marks[3] == ([b"k1"], []) and marks[1] == ([b"k3"], [])


def test_a_page_lost_and_held_again_between_two_drains_is_inner_by_its_last_mark():
    """Marks are drained once per step message, and an engine applies a drain's inner marks before
    its ends. A key marked an end and then inner again before one drain (its follower evicted and
    computed again in one step, here or on a peer) was applied as an end: a cached inner page left
    first in line for eviction, where taking it cut every chain through it. Now each key's last mark
    stands (the node simulator, quarter KV, 16 overload runs: 7 moved, 0.96x-1.12x each; pool-local
    1.33x routing's throughput before, 1.36x after, bench/results/node_contexts_small_cache_marks.json)."""
    idx, k = PrefixIndex(), chain(3)
    idx.link(k)
    idx.update(0, k, [])
    idx.drain_marks()
    idx.update(0, [], [k[2]])  # the follower goes: k1 is the chain's end ...
    idx.update(1, [k[2]], [])  # ... and is held again (on a peer) before the marks are drained
    marks = idx.drain_marks()
    assert b"k1" in marks[0][0] and b"k1" not in marks[0][1], marks
    idx.update(1, [], [k[2]])
    idx.update(0, [k[2]], [])
    idx.update(0, [], [k[2]])  # and the other way round: an end by its last mark
    marks = idx.drain_marks()
    assert b"k1" in marks[0][1] and b"k1" not in marks[0][0], marks


def test_an_engine_gone_orphans_what_followed_its_pages():
    idx, k = PrefixIndex(), chain(3)
    idx.link(k)
    idx.update(0, k[:1], [])
    idx.update(1, k[1:], [])
    idx.drain_marks()
    idx.forget(0)
    assert idx.drain_marks() == {1: ([], [b"k1", b"k2"])}


def test_links_are_pruned_but_a_later_reader_links_again(monkeypatch):
    import tokenflowd.daemon.prefix_index as m
    monkeypatch.setattr(m, "MIN_LINKS", 4)
    idx = PrefixIndex()
    for i in range(10):  # prompts never computed
        idx.link([b"p%d" % i, b"q%d" % i, b"r%d" % i])
    assert len(idx._parent) <= 5
    idx.update(0, [b"a", b"b"], [])
    idx.link([b"a", b"b"])  # both held when linked
    assert idx.drain_marks() == {0: ([b"a"], [])}


def test_engines_apply_the_marks_so_an_engine_evicts_a_chains_end_not_its_middle():
    """Two engines, a 4-page chain alternating between them, each with one more page of its own
    (a question's, used later). Engine 0 must evict: without the marks its LRU takes k0 (the oldest),
    which cuts the whole chain for every reader; with them it takes its own leaf."""
    for marks in (False, True):
        idx, k = PrefixIndex(), chain(4)
        pools = [PagePool(3), PagePool(2)]
        idx.link(k)
        placed = {0: [k[0], k[2]], 1: [k[1], k[3]]}
        for e, keys in placed.items():
            for key in keys:
                page = pools[e].allocate()
                pools[e].register(page, key)
                pools[e].decref(page)
            idx.update(e, keys, [])
        own = pools[0].allocate()
        pools[0].register(own, b"q")
        pools[0].decref(own)
        if marks:
            for e, (inner, ends) in idx.drain_marks().items():
                pools[e].set_inner(inner, True)
                pools[e].set_inner(ends, False)
        pools[0].allocate()
        assert pools[0].holds(b"k0") is marks and pools[0].holds(b"q") is not marks


def test_the_supervisor_sends_each_holder_its_marks_after_a_step_and_the_engine_applies_them():
    from types import SimpleNamespace

    from tokenflowd import protocol as p
    from tokenflowd.config import EngineConfig, ServerConfig
    from tokenflowd.daemon.supervisor import Supervisor
    from tokenflowd.engine.process.loop import EngineProcess

    sup = Supervisor(ServerConfig(engines=2), EngineConfig())
    sent = []
    for slot in sup.slots:
        slot.state, slot.inbox = "ready", object()
    sup.send = lambda slot, msg: sent.append((slot.engine_id, msg)) or True
    k = chain(3)
    sup.index.link(k)  # as the pool's pick does
    stats = p.EngineStats(0, 0, 0, 0, 0, 0, 0, 0.0)
    sup._on_step(sup.slots[0], p.StepOutputs(0, 0, 0.0, [], stats, keys_added=k[:2]))
    sup._on_step(sup.slots[1], p.StepOutputs(1, 0, 0.0, [], stats, keys_added=k[2:]))
    assert sent == [(0, p.ChainEnds([b"k0"], [])), (0, p.ChainEnds([b"k1"], []))]
    sup._on_step(sup.slots[0], p.StepOutputs(0, 0, 0.0, [], stats, keys_removed=[b"k0"]))
    assert sent[2:] == [(0, p.ChainEnds([], [b"k1"])), (1, p.ChainEnds([], [b"k2"]))]  # orphans

    pool = PagePool(2)
    for key in (b"k1", b"x"):
        page = pool.allocate()
        pool.register(page, key)
        pool.decref(page)
    engine = SimpleNamespace(core=SimpleNamespace(pool=pool))
    EngineProcess.chain_ends(engine, p.ChainEnds([b"k1"], []))
    assert pool.allocate() == 1  # x goes first: k1 is inner


def test_the_marks_of_branches_come_in_the_same_order_whatever_the_hash_seed():
    """A page's followers are kept in the order they were linked, not in a set's: the marks' order
    is the order set_inner moves pages in, and so the order they are evicted in. In a set, one
    light-load simulator run (node_contexts, seed 3) served 256.0 or 254.8 tok/s by PYTHONHASHSEED."""
    import os
    import subprocess
    import sys

    script = ("from tokenflowd.daemon.prefix_index import PrefixIndex\n"
              "idx = PrefixIndex()\n"
              "for i in range(32):\n"
              "    idx.link([b'root', b'branch%d' % i])\n"
              "idx.update(0, [b'root'] + [b'branch%d' % i for i in range(32)], [])\n"
              "idx.drain_marks()\n"
              "idx.update(0, [], [b'root'])\n"
              "print(idx.drain_marks()[0][1])\n")
    orders = {subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout for seed in (1, 2, 3)}
    assert len(orders) == 1 and orders.pop().count("branch") == 32, orders


def test_segments_written_into_their_homes_are_held_there_before_the_senders_copies_go(monkeypatch):
    """A step message's keys_moved (pool/engine_hooks.py `_hand_off`): the front holds the keys at
    their homes before it applies the sender's removals, so no chain is cut in between and no new
    reader is named the sender's copy; a move to an engine that is not serving is not believed. The
    home's own reports have the last word: a key it has not reported within two heartbeats (it
    evicted the page before the sender's word came, or restarted) leaves the index again."""
    from tokenflowd import protocol as p
    from tokenflowd.config import EngineConfig, ServerConfig
    from tokenflowd.daemon import supervisor

    now = [0.0]
    monkeypatch.setattr(supervisor.time, "monotonic", lambda: now[0])
    sup = supervisor.Supervisor(ServerConfig(engines=3, heartbeat_interval=0.5), EngineConfig())
    sent = []
    for slot in sup.slots[:2]:
        slot.state, slot.inbox = "ready", object()
    sup.send = lambda slot, msg: sent.append((slot.engine_id, msg)) or True
    k = chain(4)
    sup.index.link(k)
    stats = p.EngineStats(0, 0, 0, 0, 0, 0, 0, 0.0)

    def step(engine: int, added=(), removed=(), moved=()) -> None:
        sup._on_step(sup.slots[engine], p.StepOutputs(engine, 0, now[0], [], stats, keys_added=list(added),
                                                      keys_removed=list(removed), keys_moved=list(moved)))

    step(0, added=k)
    sent.clear()
    step(0, removed=k[1:], moved=[p.PrefixRun(1, k[1:])])
    assert [sup.index.holders(key) for key in k] == [[0], [1], [1], [1]]
    assert all(not msg.ends for _, msg in sent), f"a chain was cut: {sent}"
    now[0] = 0.5
    step(1, added=k[1:3])  # the home's own report: k1 k2 (k3 it evicted before the sender's word came)
    now[0] = 1.1  # two heartbeats on
    step(1)
    assert [sup.index.holders(key) for key in k] == [[0], [1], [1], []], "k3 was not the home's to hold"
    step(1, moved=[p.PrefixRun(2, k[3:])])
    assert sup.index.holders(k[3]) == [], "engine 2 is not serving"
    step(0, moved=[p.PrefixRun(1, k[3:])])  # moved again; then the home says all it holds, k3 with it
    sup._on_message(p.KeySnapshot(1, sup.slots[1].incarnation, k[1:]))
    now[0] = 2.5
    step(1)
    assert sup.index.holders(k[3]) == [1], "its snapshot is its own word"


def test_the_supervisor_tells_the_readers_the_sender_names_where_the_segments_went():
    """StepOutputs.moved_readers: the engines whose requests read the sender's pages of what it wrote
    into their homes get protocol.Moved (they read the homes from then on: PoolMember.follow); no
    other engine, none that is not serving, and no API server process (the supervisor tells them)."""
    from tokenflowd import protocol as p
    from tokenflowd.config import EngineConfig, ServerConfig
    from tokenflowd.daemon import supervisor
    from tokenflowd.daemon.api_server import ApiServerSupervisor

    sup = supervisor.Supervisor(ServerConfig(engines=4), EngineConfig())
    sent = []
    for slot in sup.slots[:3]:
        slot.state, slot.inbox = "ready", object()
    sup.send = lambda slot, msg: sent.append((slot.engine_id, msg)) or True
    k = chain(4)
    stats = p.EngineStats(0, 0, 0, 0, 0, 0, 0, 0.0)
    moved = [p.PrefixRun(1, k[:2]), p.PrefixRun(2, k[2:])]
    msg = p.StepOutputs(0, 0, 0.0, [], stats, keys_removed=k, keys_moved=moved, moved_readers=[2, 3])
    sup._on_step(sup.slots[0], msg)
    assert [(e, m) for e, m in sent if isinstance(m, p.Moved)] == [(2, p.Moved(0, moved))], "engine 3 is not serving"
    sent.clear()
    sup._on_step(sup.slots[0], p.StepOutputs(0, 0, 0.0, [], stats, keys_moved=moved))
    assert not [m for _, m in sent if isinstance(m, p.Moved)], "no one reads them there"
    assert supervisor.Supervisor.tells_readers and not ApiServerSupervisor.tells_readers
