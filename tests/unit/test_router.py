"""Engine choice: longest cached prefix, unless that engine is clearly busier."""
from dataclasses import dataclass

from tokenflowd.kv.pages import chain_page_keys
from tokenflowd.daemon.prefix_index import PrefixIndex
from tokenflowd.daemon.router import Arrival, Router, TrafficCost
from tokenflowd.pool.homes import rendezvous_home, segment_homes

PS = 4


@dataclass
class FakeEngine:
    engine_id: int
    load: int = 0


def keys_of(tokens):
    return chain_page_keys(tokens, PS, [])


def router_with(held: dict[int, list[bytes]]) -> Router:
    index = PrefixIndex()
    for engine_id, keys in held.items():
        index.update(engine_id, keys, [])
    return Router(PS, index)


def test_the_index_counts_the_leading_run_only_and_follows_key_events():
    k = keys_of(list(range(16)))
    index = PrefixIndex()
    index.update(0, [k[0], k[1], k[3]], [])
    assert index.cached_pages(0, k) == 2 and index.cached_pages(1, k) == 0
    index.update(0, [k[2]], [k[1]])  # an eviction and a publication in one step message
    assert index.cached_pages(0, k) == 1
    index.update(0, [k[1]], [k[1]])  # evicted, then published again: held
    assert index.cached_pages(0, k) == 4
    index.forget(0)  # the engine went away: its successor starts cold
    assert index.cached_pages(0, k) == 0 and index.num_keys(0) == 0
    index.update(1, [k[3]], [])
    index.replace(1, [k[0], k[1]])  # a snapshot (a front that restarted): all the engine holds
    assert index.cached_pages(1, k) == 2 and index.num_keys(1) == 2


def test_prefers_the_engine_holding_the_prefix():
    prompt = list(range(40))
    choice = router_with({1: keys_of(prompt[:32])}).pick([FakeEngine(0), FakeEngine(1), FakeEngine(2)], prompt)
    assert (choice.engine_id, choice.cached_pages) == (1, 8)


def test_the_last_prompt_token_is_never_a_hit():
    prompt = list(range(16))  # 4 full pages; the last page holds the last token, so 3 can hit
    assert router_with({1: keys_of(prompt)}).pick([FakeEngine(0), FakeEngine(1)], prompt).cached_pages == 3


def test_load_outweighs_a_small_match():
    prompt = list(range(40))
    router = router_with({0: keys_of(prompt[:8])})
    warm = FakeEngine(0, load=10)  # 2 pages cached, 10 requests ahead
    idle = FakeEngine(1)
    assert router.pick([warm, idle], prompt).engine_id == 1
    warm.load = 1
    assert router.pick([warm, idle], prompt).engine_id == 0


def test_no_match_goes_to_the_least_loaded_then_lowest_id():
    prompt = list(range(10))
    engines = [FakeEngine(0, load=3), FakeEngine(1, load=1), FakeEngine(2, load=1)]
    assert router_with({}).pick(engines, prompt).engine_id == 1


def test_with_a_tie_breaker_ties_go_to_any_of_the_best_and_never_to_a_worse_engine():
    import random

    prompt = list(range(10))
    engines = [FakeEngine(0, load=3), FakeEngine(1, load=1), FakeEngine(2, load=1), FakeEngine(3, load=1)]
    router = Router(PS, PrefixIndex(), ties=random.Random(0))
    picked = {router.pick(engines, prompt).engine_id for _ in range(200)}
    assert picked == {1, 2, 3}
    held = Router(PS, router_with({2: keys_of(prompt[:8])}).index, ties=random.Random(0))
    assert {held.pick(engines, prompt).engine_id for _ in range(50)} == {2}  # (no tie: the prefix wins)


# -- the pool (--pool-mode query|read) ---------------------------------------------------------
def test_a_pooled_pick_whose_first_unread_page_an_earlier_request_is_computing_is_told_it_is_pending():
    from tokenflowd.daemon import router as router_module

    now = [0.0]
    index = PrefixIndex()
    r = Router(PS, index, clock=lambda: now[0])
    engines = [FakeEngine(0), FakeEngine(1)]
    system = list(range(32))  # 8 pages every prompt starts with
    first = r.pick_pooled(engines, system + [100, 101], segment_pages=2, request_id="a")
    assert not first.pending, "the first one computes it"
    now[0] = 0.5
    assert r.pick_pooled(engines, system + [200, 201], segment_pages=2, request_id="b").pending, "being computed"
    assert not r.being_computed("b"), "a waits in its queue yet: b does not wait for it as it asks"
    r.computing("a")  # (protocol.Computing: a step begins a's prompt)
    assert r.being_computed("b") and not r.being_computed("a"), "a waits for nothing"
    # the first one moves (an idle engine takes it): the record is its own, and it computes it there;
    # the second moves too: still behind the first
    assert not r.pick_pooled(engines, system + [100, 101], segment_pages=2, target=1, count=False,
                             request_id="a").pending
    assert r.pick_pooled(engines, system + [200, 201], segment_pages=2, target=1, count=False,
                         request_id="b").pending
    assert r.being_computed("b")
    assert not r.pick_pooled(engines, [7] * 40, segment_pages=2).pending, "another prefix: nothing computes it"
    assert not r.pick_pooled(engines, system + [250, 251], segment_pages=2, place=False).pending, \
        "kept where computed: one behind it reads it at its admission"
    index.update(0, keys_of(system), [])  # computed, held on engine 0
    read = r.pick_pooled(engines, system + [300] * 8 + [301], segment_pages=2)
    assert not read.pending and read.cached_pages + sum(len(k) for _, k in read.runs) >= 8, read
    now[0] += router_module.PENDING_SECONDS
    assert not r.pick_pooled(engines, [7] * 40 + [1], segment_pages=2).pending, "named too long ago"
    assert r.being_computed("b"), "a still computes it: a running request's record stays until it is done"
    r.done("a")
    assert not r.being_computed("b")


def test_a_request_told_pending_waits_until_the_one_computing_its_prefix_has_its_first_token_or_ends():
    """Router.being_computed (protocol.Reads.pending): true while the request named to compute the
    page it waits for has not finished its prompt (Router.done: the front's Supervisor.on_started,
    and the request's end); a request that ends forgets what it waited for."""
    r = Router(PS, PrefixIndex(), clock=lambda: 0.0)
    engines = [FakeEngine(0), FakeEngine(1)]
    doc = list(range(32))
    assert not r.pick_pooled(engines, doc + [1, 2], segment_pages=2, request_id="a").pending
    assert r.pick_pooled(engines, doc + [3, 4], segment_pages=2, request_id="b").pending
    assert r.pick_pooled(engines, doc + [5, 6], segment_pages=2, request_id="c").pending
    r.computing("b")  # (not named to compute anything: no matter)
    r.computing("a")
    assert r.done("c") == [], "c was named to compute nothing"
    assert r.being_computed("b") and not r.being_computed("c")
    assert r.done("a") == ["b"], "its first token: b hears where the document is, unasked"
    assert not r.being_computed("b")
    assert not r.pick_pooled(engines, doc + [7, 8], segment_pages=2, request_id="d").pending, \
        "nothing computes it now: d is named to"
    r.computing("d")
    assert r.pick_pooled(engines, doc + [9, 9], segment_pages=2, request_id="e").pending and r.being_computed("e")
    assert r.done("d", computed=False) == ["e"], "cut off before its first token: e, its one waiter, computes it"
    assert not r.being_computed("e")


def computing_a_document() -> tuple[PrefixIndex, Router, list, list[int]]:
    """A router on two engines where request "a" computes a new 16-page document (begun: Computing)."""
    index = PrefixIndex()
    r = Router(PS, index, clock=lambda: 0.0)
    engines = [FakeEngine(0), FakeEngine(1)]
    doc = list(range(64))  # 16 pages
    assert not r.pick_pooled(engines, doc + [1, 2], segment_pages=2, request_id="a").pending
    r.computing("a")
    return index, r, engines, doc


def test_where_the_request_computing_a_prefix_is_cut_off_the_first_waiting_computes_it_and_the_rest_wait():
    """Router.done(computed=False): the request named to compute a document ended before its first
    token (its client went): the first request that waited for it is named to compute it instead,
    and the others wait for that one; told all at once, each computed the document side by side."""
    index, r, engines, doc = computing_a_document()
    for rid, tail in (("b", [3, 4]), ("c", [5, 6]), ("d", [7, 8])):
        assert r.pick_pooled(engines, doc + tail, segment_pages=2, request_id=rid).pending
    assert r.done("c", computed=False) == [], "a waiter cut off: it waited, it computed nothing"
    index.update(1, keys_of(doc)[:4], [])  # a wrote its first segments into a home before it went
    assert r.done("a", computed=False) == ["b"], "b, the first to wait, hears it computes the rest"
    assert not r.being_computed("b") and r.being_computed("d"), "d waits for b"
    late = r.pick_pooled(engines, doc + [9, 9], segment_pages=2, request_id="e")
    assert late.pending and r.being_computed("e"), "b computes what a would have"
    assert r.done("b") == ["d", "e"], "its first token: those waiting for it hear where the document is"
    assert not r.being_computed("d") and not r.being_computed("e")
    # where it had its first token, its end tells nobody again
    assert not r.pick_pooled(engines, list(range(100, 164)) + [1], segment_pages=2, request_id="f").pending
    assert r.pick_pooled(engines, list(range(100, 164)) + [2], segment_pages=2, request_id="g").pending
    r.computing("f")
    assert r.done("f") == ["g"] and r.done("f", computed=False) == []


def test_a_request_that_comes_mid_prompt_reads_what_is_computed_and_waits_for_the_rest():
    """Every page a request is named to compute is on record, not only its first: one that comes
    once part of the document is computed (and published) reads that part and is told the rest is
    being computed, and waits for it; one that parts from the document within the computed part
    computes its own pages."""
    index, r, engines, doc = computing_a_document()
    index.update(0, keys_of(doc)[:6], [])  # its first 6 pages computed, on engine 0
    late = r.pick_pooled(engines, doc + [3, 4], segment_pages=2, request_id="b")
    assert late.pending and r.being_computed("b"), "the rest of the document is being computed"
    assert late.cached_pages + sum(len(k) for _, k in late.runs) == 6, late
    own = r.pick_pooled(engines, doc[:24] + [9] * 10, segment_pages=2, request_id="c")
    assert not own.pending and not r.being_computed("c"), "its own pages: nothing computes them"
    assert r.done("a") == ["b"]
    assert not r.being_computed("b")
    assert r.done("c") == []


def test_pooled_pick_runs_on_the_least_loaded_engine_and_names_where_each_segment_is_read():
    tokens = list(range(33))  # 8 full pages before the last token
    k = keys_of(tokens)
    r = router_with({0: k[:8], 1: k[:2]})
    engines = [FakeEngine(0, load=5), FakeEngine(1, load=1), FakeEngine(2, load=2)]
    c = r.pick_pooled(engines, tokens, segment_pages=2)
    # Engine 1 is the least loaded. It reads its own first segment, and the other three where they
    # are: on engine 0 (busier, but the only holder).
    assert c.engine_id == 1 and c.cached_pages == 2
    assert c.runs == [(1, k[:2]), (0, k[2:8])]


def test_a_pooled_pick_with_homes_breaks_ties_towards_the_engine_holding_least_of_the_prompt_then_in_turn():
    """With placement at homes, among the engines of the least work and requests, the one holding
    the fewest of the prompt's segments runs it (its own reads fall where the prompt's are fewest),
    not the one holding its leading pages (its first segment's home); ties left go round the
    engines, not to the lowest id (at a light load engine 0 ran most of what came). Kept where
    computed (place=False), the engine holding most of the prefix still wins."""
    tokens = list(range(33))  # 4 segments of 2 pages
    k = keys_of(tokens)
    r = router_with({0: k[:2] + k[4:6], 1: k[:2], 3: k[6:8]})
    engines = [FakeEngine(e, load=1) for e in range(4)]
    assert r.pick_pooled(engines, tokens, segment_pages=2).engine_id == 2, "holds none of it"
    assert r.pick_pooled(engines, tokens, segment_pages=2, place=False).engine_id == 0, "holds most of it"
    engines[2].load = 2
    # 1 and 3 hold one segment each: they take turns
    picks = [r.pick_pooled(engines, tokens, segment_pages=2).engine_id for _ in range(4)]
    assert sorted(picks) == [1, 1, 3, 3], picks
    fresh = router_with({})
    picks = [fresh.pick_pooled([FakeEngine(e) for e in range(4)], tokens, segment_pages=2).engine_id
             for _ in range(8)]
    assert sorted(picks) == [0, 0, 1, 1, 2, 2, 3, 3], picks


def test_pooled_pick_sends_no_runs_when_the_engine_holds_all_of_the_prefix_itself():
    tokens = list(range(33))
    k = keys_of(tokens)
    r = router_with({0: k[:8], 1: k[:8]})
    c = r.pick_pooled([FakeEngine(0, load=2), FakeEngine(1)], tokens, segment_pages=4)
    assert (c.engine_id, c.cached_pages, c.runs) == (1, 8, [])  # its own prefix cache serves it


def test_pooled_pick_reads_a_segment_from_one_holder_and_stops_where_none_holds_it_whole():
    tokens = list(range(33))
    k = keys_of(tokens)
    # Segment 0 (pages 0-3) is whole on engine 0 only; of segment 1, engine 1 holds pages 4-5 only
    # (its own leading run of that segment) and engine 0 pages 4-6: the longer part is read.
    r = router_with({0: k[:7], 1: k[4:6]})
    c = r.pick_pooled([FakeEngine(0, load=3), FakeEngine(1), FakeEngine(2, load=1)], tokens, segment_pages=4)
    assert c.engine_id == 1
    assert c.runs == [(0, k[:7])]


def test_a_segment_no_engine_holds_whole_is_read_in_parts_and_the_read_goes_on_past_it():
    """A request read a segment's leading pages on engine 0 and computed the rest on engine 1, and
    its next segments went to their homes (engine 2): no engine holds that segment whole, but its
    parts are held, so a request over the same prompt reads them where they are and everything
    after them (it read up to engine 0's part and computed the rest before)."""
    tokens = list(range(33))  # 8 full pages before the last token: 2 segments of 4
    k = keys_of(tokens)
    r = router_with({0: k[:2], 1: k[2:4], 2: k[4:8]})
    engines = [FakeEngine(0, load=3), FakeEngine(1, load=3), FakeEngine(2, load=3), FakeEngine(3)]
    c = r.pick_pooled(engines, tokens, segment_pages=4)
    assert c.engine_id == 3 and c.runs == [(0, k[:2]), (1, k[2:4]), (2, k[4:8])]
    assert r.reads(engines, tokens, 4, target=3)[0] == c.runs, "named again at the front, the same"
    gap = router_with({0: k[:2], 1: k[3:4], 2: k[4:8]})  # page 2 is nowhere: nothing past it is read
    assert gap.pick_pooled(engines, tokens, segment_pages=4).runs == [(0, k[:2])]
    # a burst's dispatch weighs the same reads: every part's holder but the engine's own is sent rows
    cost = TrafficCost(query_row_bytes=1, kv_token_bytes=0)
    rows = len(tokens) - 8 * PS + 2
    assert r._traffic(k, Arrival(tokens, 2), [0, 1, 2, 3], 4, cost, place=False) == [2 * rows, 2 * rows,
                                                                                       2 * rows, 3 * rows]


def test_pooled_pick_takes_the_less_loaded_of_two_replicas():
    tokens = list(range(17))
    k = keys_of(tokens)
    engines = [FakeEngine(0, load=9), FakeEngine(1, load=9), FakeEngine(2, load=2), FakeEngine(3, load=0)]
    import random

    # a fresh router each time: read this often, the segment would be hot, and replicated instead
    picks = {router_with({0: k[:4], 1: k[:4], 2: k[:4]}).pick_pooled(engines, tokens, 4, random.Random(s)).runs[0][0]
             for s in range(40)}
    assert 3 not in picks and picks <= {0, 1, 2}
    assert 2 in picks, "engine 2, the least loaded holder, wins whenever it is one of the two drawn"
    # engines 0 and 1 are picked only when they are the two drawn (then the lower id of equal loads)
    assert picks - {2} <= {0}


def test_a_segment_several_hold_is_read_at_one_the_request_asks_anyway_the_less_loaded_of_those():
    """A request asks each engine it reads from (a round trip per layer, its rows shipped): a
    segment several engines hold is read at one of those it asks anyway (the only holders of its
    other segments, and those picked before), the less loaded of two of them; else at the less
    loaded of two of all its holders. A hot document's replicated segments were read where the
    first of them was, all from one engine, though the request asked every engine anyway."""
    tokens = list(range(65))  # 16 pages before the last token: 4 segments of 4
    k = keys_of(tokens)
    engines = [FakeEngine(0), FakeEngine(1, load=1), FakeEngine(2, load=5), FakeEngine(3, load=5)]
    for read in ("pick", "reads"):
        def runs_of(r):
            return r.pick_pooled(engines, tokens, 4, target=0).runs if read == "pick" else \
                r.reads(engines, tokens, 4, target=0)[0]

        # segments 0-1 on engines 1 and 2, 2 on engine 2 alone, 3 on engine 3 alone: engine 1, though
        # less loaded, would be one holder more to ask
        r = router_with({1: k[:8], 2: k[:12], 3: k[12:16]})
        assert runs_of(r) == [(2, k[:12]), (3, k[12:16])], read
        # segment 0 on engine 2 alone, 1 on engines 1 and 2, 2 on engine 1 alone: both are asked
        # anyway, and segment 1 is read at the less loaded, not where segment 0 is
        r = router_with({2: k[:8], 1: k[4:12]})
        assert runs_of(r) == [(2, k[:4]), (1, k[4:12])], read


def test_a_hot_segment_read_elsewhere_is_copied_in_once_a_cold_one_is_read_where_it_is():
    """TokenLake's heavy hitters (§4.3): a segment read this often is named for copying into the
    engine that reads it elsewhere (AddRequest.copy), once while the copy is made; the request reads
    it where it is meanwhile. A cold one is only read where it is."""
    tokens = list(range(33))
    k = keys_of(tokens)
    now = [0.0]
    r = router_with({0: k[:8]})
    r.clock = lambda: now[0]
    engines = [FakeEngine(0, load=6), FakeEngine(1, load=1)]
    c = r.pick_pooled(engines, tokens, segment_pages=4)
    assert (c.engine_id, c.runs, c.copies) == (1, [(0, k[:8])], []), "cold (its first read): read, not copied"
    for _ in range(2):  # engine 0 reads it in place: its own reads make it hot but copy nothing
        assert r.pick_pooled([FakeEngine(0), FakeEngine(1, load=9)], tokens, segment_pages=4).copies == []
    c = r.pick_pooled(engines, tokens, segment_pages=4)
    assert c.copies == [(0, k[:8])] and c.runs == [(0, k[:8])], "hot: copied into engine 1, read at 0 meanwhile"
    assert r.pick_pooled(engines, tokens, segment_pages=4).copies == [], "once: the copy is under way"
    assert r.reads(engines, tokens, 4, target=1) == ([(0, k[:8])], []), "once: named again at the front neither"
    r.index.update(1, k[:8], [])  # the copy is there: read at home, nothing to copy
    c = r.pick_pooled([FakeEngine(0, load=5), FakeEngine(1, load=6)], tokens, segment_pages=4)
    assert c.engine_id == 0 and c.runs == [] and c.copies == []
    r.index.update(1, [], k[:8])  # evicted there later: copied again, after the first copy's while
    now[0] += 10
    assert r.pick_pooled(engines, tokens, segment_pages=4).copies == [(0, k[:8])]
    now[0] += 3600  # an hour later the segment is cold again (and forgotten)
    r.heat.hit(b"other", now[0])
    assert r.pick_pooled(engines, tokens, segment_pages=4).copies == []

def test_a_queued_request_that_came_before_its_hot_prefix_was_computed_names_its_copy_when_it_asks_again():
    """A burst behind one system prompt: its requests come while the first computes it, so none has
    a copy named as it comes (nothing holds the prompt yet), though their arrivals make it hot.
    Near the front of its queue, a request's reads are named again (Router.reads, pool/ahead.py),
    and a hot segment it reads on another engine is named for copying in then, once an engine;
    those reads do not count towards the segment's heat again."""
    tokens = list(range(33))
    k = keys_of(tokens)
    r = router_with({})
    engines = [FakeEngine(0), FakeEngine(1), FakeEngine(2)]
    for _ in range(8):  # the burst comes: the prompt is nowhere yet, so nothing to read or copy
        c = r.pick_pooled(engines, tokens, segment_pages=4)
        assert (c.runs, c.copies) == ([], [])
    r.index.update(0, k[:8], [])  # the first request computed it on engine 0
    heat = dict(r.heat._scores)
    assert r.reads(engines, tokens, 4, target=1) == ([(0, k[:8])], [(0, k[:8])]), "hot: copied in at the front"
    assert r.reads(engines, tokens, 4, target=1) == ([(0, k[:8])], []), "once while the copy is made"
    assert r.reads(engines, tokens, 4, target=2)[1] == [(0, k[:8])], "once per engine"
    assert r.reads(engines, tokens, 4, target=0) == ([], []), "all of it where it runs"
    assert r.heat._scores == heat, "its use was counted when it came"
    cold = router_with({0: k[:8]})
    assert cold.reads(engines, tokens, 4, target=1) == ([(0, k[:8])], []), "a cold segment is read where it is"


def test_pooled_pick_places_each_new_segment_at_its_home_dealt_round_the_engines():
    tokens = list(range(33))  # 8 full pages before the last token: 4 segments of 2
    k = keys_of(tokens)
    r = router_with({0: k[:2]})
    engines = [FakeEngine(0, load=3), FakeEngine(1), FakeEngine(2, load=1)]
    c = r.pick_pooled(engines, tokens, segment_pages=2)
    assert c.engine_id == 1 and c.runs == [(0, k[:2])]
    # The three segments nobody holds go to their homes; the one engine 1 computes for itself
    # (its home is engine 1) stays there; the segment read on engine 0 is not placed anywhere.
    home = segment_homes(k[1::2], [0, 1, 2])
    want: list[tuple[int, list[bytes]]] = []
    for s in (2, 4, 6):
        if home[s // 2] != 1:
            if want and want[-1][0] == home[s // 2]:
                want[-1][1].extend(k[s : s + 2])
            else:
                want.append((home[s // 2], k[s : s + 2]))
    assert c.places == want
    assert sorted(home[:3]) == [0, 1, 2], "the first three segments go one to each engine"


def test_a_prompts_segments_are_dealt_evenly_round_the_engines_in_an_order_its_keys_hash_to():
    """pool/homes.py segment_homes: each group of as many segments as engines puts one on each, so a
    document's reads ask every engine alike; the order differs from group to group and document to
    document, and a segment's home depends only on the keys up to it. An engine that is gone (or
    not serving yet) moves only the segments dealt to it, each where its key hashes over the rest."""
    from collections import Counter

    engines = list(range(8))
    docs = [keys_of([d] * PS + list(range(PS * 8 * 19))) for d in range(40)]  # 19 segments of 8 pages and more
    homes = [segment_homes(k[7::8], engines) for k in docs]
    for h in homes:
        assert max(Counter(h).values()) - min(Counter(h).get(e, 0) for e in engines) <= 1, h
        assert sorted(h[:8]) == sorted(h[8:16]) == engines
    assert len({tuple(h[:8]) for h in homes}) > 30, "each document's order is its own"
    assert len({h[0] for h in homes}) == 8 and len({h[16] for h in homes}) == 8, "so is each group's"
    assert all(segment_homes(k[7::8][:n], engines) == h[:n] for k, h in zip(docs, homes) for n in (1, 9, 17))
    live = [0, 1, 2, 4, 5, 6, 7]  # engine 3 gone
    for k, h in zip(docs, homes):
        left = segment_homes(k[7::8], engines, live)
        assert [a for a, b in zip(left, h) if b != 3] == [b for b in h if b != 3], "the others' stay"
        assert all(a == rendezvous_home(key, live) for a, b, key in zip(left, h, k[7::8]) if b == 3)


def test_the_router_deals_new_segments_round_every_engine_that_has_served_while_one_is_away():
    """Router.places: the engines that have served make the deal; one away (restarting) has its
    segments homed on the others meanwhile, the others' homes unchanged."""
    tokens = list(range(4 * 2 * 8 + 1))  # 8 segments of 2 pages
    k = keys_of(tokens)
    r = router_with({})
    all_up = r.pick_pooled([FakeEngine(e) for e in range(4)], tokens, segment_pages=2, target=0)
    assert [home for home, keys in all_up.places for _ in range(len(keys) // 2)] == \
        [h for h in segment_homes(k[1::2], range(4)) if h != 0]
    away = r.pick_pooled([FakeEngine(e) for e in (0, 1, 3)], tokens, segment_pages=2, target=0)
    assert [home for home, keys in away.places for _ in range(len(keys) // 2)] == \
        [h for h in segment_homes(k[1::2], range(4), [0, 1, 3]) if h != 0]


def test_pooled_pick_places_what_it_reads_at_its_home_there_and_nothing_held_elsewhere():
    """A segment read at its home is named there too: where the request's pin of it comes up
    short (the home evicted it after the index named it: the index hears of a step's evictions at
    its end), the request computes it and writes it back into its home instead of keeping a copy
    every later reader reads where it ran. One held by an engine that is not its home stays there."""
    tokens = list(range(33))
    k = keys_of(tokens)
    r = router_with({0: k[:8]})
    c = r.pick_pooled([FakeEngine(0, load=6), FakeEngine(1, load=1)], tokens, segment_pages=4)
    home = segment_homes([k[3], k[7]], [0, 1])
    assert (c.engine_id, c.runs) == (1, [(0, k[:8])])
    assert c.places == [(0, k[s : s + 4]) for s, h in zip((0, 4), home) if h == 0], (home, c.places)
    assert r.pick_pooled([FakeEngine(0)], tokens, segment_pages=4).places == []
    # a trailing part of a segment (pages 4-6 of a 4-page segment) is no segment: kept where computed
    home = segment_homes(k[3:4], [0, 1])[0]
    c = router_with({}).pick_pooled([FakeEngine(0), FakeEngine(1)], tokens[:28], segment_pages=4)
    assert c.engine_id == 0 and c.places == ([] if home == 0 else [(1, k[:4])])


def test_a_segment_its_home_still_holds_past_a_cut_is_put_back_there_and_one_held_elsewhere_is_not():
    """The chain was cut before segment 2 (segment 1 evicted): the request computes segments 1-3.
    Segment 2, still at its home, is put there (only the pages the home lacks cross), so the chain is
    whole at the homes again and no second copy stays where the request ran; segment 3, held by an
    engine that is not its home (a replica), stays where it is computed."""
    tokens = list(range(33))  # 8 pages before the last token: 4 segments of 2
    k = keys_of(tokens)
    engines = [0, 1, 2]
    home = dict(zip((0, 2, 4, 6), segment_homes(k[1::2], engines)))
    elsewhere = next(e for e in engines if e != home[6])
    r = router_with({home[4]: k[4:6], elsewhere: k[6:8]})
    c = r.pick_pooled([FakeEngine(e, load=0 if e == 0 else 5) for e in engines], tokens, segment_pages=2)
    assert c.engine_id == 0 and c.runs == []
    placed = {tuple(run[i : i + 2]) : e for e, run in c.places for i in range(0, len(run), 2)}
    want = {tuple(k[s : s + 2]): home[s] for s in (0, 2, 4) if home[s] != 0}
    assert placed == want
    # with its home's copy gone too, a segment another engine holds is never put
    held: dict[int, list[bytes]] = {}
    held.setdefault(next(e for e in engines if e != home[4]), []).extend(k[4:6])
    held.setdefault(elsewhere, []).extend(k[6:8])
    r = router_with(held)
    c = r.pick_pooled([FakeEngine(e, load=0 if e == 0 else 5) for e in engines], tokens, segment_pages=2)
    placed = {tuple(run[i : i + 2]) for _, run in c.places for i in range(0, len(run), 2)}
    assert placed == {tuple(k[s : s + 2]) for s in (0, 2) if home[s] != 0}


def test_a_hot_segment_goes_to_no_home_the_engine_that_computes_it_keeps_it():
    """A burst behind one system prompt: every engine's first requests compute it together, and
    by the time they are picked its segments are hot. A hot segment stays where it is computed, as
    a copy there would (Choice.copies): moved to its home, the requests that computed it read it
    there at every step of their decodes, and so does every engine's every request until its copy
    lands. A cold one goes to its home; with --no-pool-copy, a hot one too."""
    tokens = list(range(33))  # 8 full pages before the last token: 4 segments of 2
    k = keys_of(tokens)
    engines = [FakeEngine(e) for e in range(3)]
    home = segment_homes(k[1::2], [0, 1, 2])
    away = [i for i in range(4) if home[i] != 0]
    for copy_hot in (True, False):
        r = router_with({})
        r.clock = lambda: 0.0
        r.copy_hot = copy_hot
        first = r.pick_pooled(engines, tokens, segment_pages=2, target=0)
        assert [key for _, run in first.places for key in run] == [key for i in away for key in k[2 * i : 2 * i + 2]]
        for _ in range(6):  # the burst comes while the first computes it: hot (2 x 3 engines' reads)
            later = r.pick_pooled(engines, tokens, segment_pages=2, target=0)
        assert r.heat.is_heavy(k[1], 3, 0.0)
        assert later.places == (first.places if not copy_hot else []), copy_hot
        # a cold prompt past the hot one still goes to its homes
        longer = tokens[:-1] + list(range(100, 117))
        kl = keys_of(longer)
        c = r.pick_pooled(engines, longer, segment_pages=2, target=0)
        homes_after = segment_homes(kl[1::2], [0, 1, 2])
        cold_away = [i for i in range(4, 6) if homes_after[i] != 0]
        assert cold_away, "a cold segment homed elsewhere (else this part proves nothing)"
        placed = [key for _, run in c.places for key in run]
        assert placed[len(placed) - 2 * len(cold_away):] == [key for i in cold_away for key in kl[2 * i : 2 * i + 2]]
        assert not copy_hot or len(placed) == 2 * len(cold_away), "the hot head stays where it is computed"


def test_dispatch_of_arrivals_balances_load_then_moves_the_fewest_bytes():
    import itertools
    import random

    from tokenflowd.pool.dispatch import balanced_slots
    from tokenflowd.daemon.router import Arrival, TrafficCost

    cost = TrafficCost(query_row_bytes=100, kv_token_bytes=30)
    rng = random.Random(3)
    for trial in range(30):
        prompts = [[rng.randrange(3)] * 4 + [rng.randrange(1000) for _ in range(rng.choice([4, 12, 20]))]
                   for _ in range(4)]
        held = {e: [] for e in range(3)}
        for prompt in prompts:
            k = keys_of(prompt[:-1])
            held[rng.randrange(3)].extend(k[: rng.choice([0, 2, 4])])
        r = router_with(held)
        engines = [FakeEngine(e, load=rng.randrange(3)) for e in range(3)]
        arrivals = [Arrival(p, max_tokens=rng.randrange(1, 50)) for p in prompts]
        choices = r.dispatch(engines, arrivals, 2, cost)
        ids = [e.engine_id for e in engines]
        load = {e.engine_id: e.load for e in engines}

        def traffic(targets):
            return sum(r._traffic(r.prompt_keys(a.prompt_token_ids), a, ids, 2, cost, True)[t]
                       for a, t in zip(arrivals, targets))

        def peak(targets):
            return max(load[e] + list(targets).count(e) for e in ids)

        got = [c.engine_id for c in choices]
        options = list(itertools.product(ids, repeat=len(arrivals)))
        best_peak = min(peak(t) for t in options)
        assert peak(got) == best_peak, (trial, got)  # no engine ends busier than it must
        slots = balanced_slots(load, len(arrivals))
        within = [t for t in options if all(t.count(e) <= slots[e] for e in ids)]
        assert traffic(got) == min(traffic(t) for t in within), (trial, got)


def test_dispatch_runs_each_arrival_beside_the_segments_it_reads():
    from tokenflowd.daemon.router import Arrival, TrafficCost

    a, b = list(range(100, 117)), list(range(200, 217))  # 4 full pages each before the last token
    r = router_with({0: keys_of(a[:-1]), 1: keys_of(b[:-1])})
    engines = [FakeEngine(0), FakeEngine(1)]
    choices = r.dispatch(engines, [Arrival(b, 8), Arrival(a, 8)], 2, TrafficCost(100, 30))
    assert [(c.engine_id, c.cached_pages, c.runs) for c in choices] == [(1, 4, []), (0, 4, [])]
    # Engine 0 busier by two: the even level takes both arrivals to engine 1, which reads a's
    # pages where they are.
    busy = [FakeEngine(0, load=2), FakeEngine(1)]
    choices = r.dispatch(busy, [Arrival(b, 8), Arrival(a, 8)], 2, TrafficCost(100, 30))
    assert [c.engine_id for c in choices] == [1, 1] and choices[1].runs == [(0, keys_of(a[:-1]))]


def test_the_node_wide_index_agrees_with_per_engine_key_sets_under_random_events():
    import random

    rng = random.Random(7)
    keys = [bytes([i]) for i in range(12)]
    index, sets = PrefixIndex(), {e: set() for e in range(3)}
    for _ in range(400):
        e = rng.randrange(3)
        op = rng.random()
        if op < 0.05:
            index.forget(e)
            sets[e] = set()
        elif op < 0.1:
            snap = set(rng.sample(keys, rng.randrange(6)))
            index.replace(e, snap)
            sets[e] = snap
        else:
            removed, added = rng.sample(keys, rng.randrange(3)), rng.sample(keys, rng.randrange(3))
            index.update(e, added, removed)
            sets[e] = (sets[e] - set(removed)) | set(added)
        for key in keys:
            assert index.holders(key) == sorted(x for x in sets if key in sets[x])
        assert [index.num_keys(x) for x in sets] == [len(sets[x]) for x in sets]
        assert index.num_replicated() == sum(sum(key in s for s in sets.values()) > 1 for key in keys)
        for x in sets:
            lead = next((i for i, key in enumerate(keys) if key not in sets[x]), len(keys))
            assert index.cached_pages(x, keys) == lead


def test_the_traffic_dispatch_weighs_is_query_rows_to_other_holders_and_new_segments_to_other_homes():
    from tokenflowd.daemon.router import Arrival, TrafficCost

    cost = TrafficCost(query_row_bytes=100, kv_token_bytes=30)
    a = list(range(100, 117))  # 4 full pages before the last token: 2 segments of 2 pages
    k = keys_of(a[:-1])
    r = router_with({0: k, 2: k[:2]})
    # Read where held: on 0 nothing moves; elsewhere its 1 prompt token left + 8 output tokens are
    # query rows, shipped to one holder (engine 2 holds segment 0 itself, then reads segment 1 on 0).
    assert r._traffic(k, Arrival(a, 8), [0, 1, 2], 2, cost, True) == [0, 9 * 100, 9 * 100]
    # Held nowhere: computed wherever it runs; each segment's 8 tokens of KV go to its home elsewhere.
    fresh = router_with({})
    homes = segment_homes([k[1], k[3]], [0, 1, 2])
    want = [sum(8 * 30 for h in homes if h != e) for e in (0, 1, 2)]
    assert fresh._traffic(k, Arrival(a, 8), [0, 1, 2], 2, cost, True) == want
    assert fresh._traffic(k, Arrival(a, 8), [0, 1, 2], 2, cost, False) == [0, 0, 0]


@dataclass
class WorkEngine:
    engine_id: int
    load: int = 0
    work: int = 0  # prompt tokens of the requests it holds


def test_pooled_pick_weighs_prompt_tokens_before_the_request_count():
    """Two 32K prompts fill an engine's KV as forty short chats do not: the pool sends the next
    request to the engine with fewer prompt tokens, then fewer requests."""
    tokens = list(range(33))
    r = router_with({})
    engines = [WorkEngine(0, load=2, work=64_000), WorkEngine(1, load=40, work=8_000), WorkEngine(2, load=3, work=8_000)]
    assert r.pick_pooled(engines, tokens, segment_pages=4).engine_id == 2
    engines[2].work = 8_001
    assert r.pick_pooled(engines, tokens, segment_pages=4).engine_id == 1


def test_pooled_pick_keeps_a_request_where_its_prefix_is_while_that_engine_is_not_much_busier():
    """Where segments stay where they are computed (place=False), the engine holding the prefix
    reads it for nothing: it gets the request while its work is within AFFINITY_SLACK prompts of
    the least loaded engine's. With placement at homes, the least work wins (among equals, the one
    holding less of the prompt)."""
    from tokenflowd.daemon.router import AFFINITY_SLACK

    tokens = list(range(33))  # a 33-token prompt, its 8 leading pages held by engine 1
    k = keys_of(tokens)
    r = router_with({1: k[:8], 2: k[:4]})
    near = 1000 + int(AFFINITY_SLACK * len(tokens))
    engines = [WorkEngine(0, load=1, work=1000), WorkEngine(1, load=9, work=near), WorkEngine(2, load=1, work=1000)]
    c = r.pick_pooled(engines, tokens, segment_pages=4, place=False)
    assert (c.engine_id, c.runs) == (1, [])
    assert r.pick_pooled(engines, tokens, segment_pages=4).engine_id == 0, "the least work, holding less of it"
    engines[1].work = near + 1  # too busy now: the least loaded of the others, holding more, reads it there
    c = r.pick_pooled(engines, tokens, segment_pages=4, place=False)
    assert (c.engine_id, c.runs) == (2, [(2, k[:4]), (1, k[4:8])])


def test_an_engine_handles_work_is_the_prompt_tokens_of_its_streams():
    from tokenflowd.config import EngineConfig
    from tokenflowd.daemon.engine_handle import EngineHandle, Stream

    h = EngineHandle(0, EngineConfig(), {})
    h.streams = {"a": Stream("a", h, 30_000, print), "b": Stream("b", h, 12, print)}
    assert (h.load, h.work) == (2, 30_012)


def test_an_idle_engine_takes_a_request_from_a_holder_of_its_prefix_that_holds_idle_spill_requests():
    """A long shared prefix (a system prompt: 16 pages here) outweighs 16 requests of load, so by
    the score alone its holder took every request until it held 16 more than an idle engine. An
    engine holding none takes the request once the holder holds IDLE_SPILL; after that both hold
    the prefix and share its requests by load. A busy engine does not take it."""
    from tokenflowd.daemon.router import IDLE_SPILL

    system = list(range(64))  # 16 pages of 4 tokens
    chat = system + [1000 + i for i in range(8)]
    r = router_with({0: keys_of(system)})
    holder, other = FakeEngine(0, load=IDLE_SPILL - 1), FakeEngine(1)
    assert r.pick([holder, other], chat).engine_id == 0
    holder.load = IDLE_SPILL
    c = r.pick([holder, other], chat)
    assert (c.engine_id, c.cached_pages) == (1, 0)
    holder.load, other.load = 12, 1  # not idle: the prefix outweighs 11 requests
    assert r.pick([holder, other], chat).engine_id == 0
    idle = [FakeEngine(2), FakeEngine(3)]  # of two idle engines, the one holding more of the prompt
    r.index.update(3, keys_of(system[:8]), [])
    assert r.pick([holder, other, *idle], chat).engine_id == 3
    r.index.update(1, keys_of(system), [])  # engine 1 computed it: both hold it, the lighter wins
    assert r.pick([holder, other], chat).engine_id == 1


def test_a_prefix_under_one_engines_share_of_the_requests_stays_with_its_holder_while_another_is_idle():
    """One document among four, a quarter of the requests each, on two engines: an idle engine would
    compute it again and evict what it holds, so the holder keeps its questions. Once the document
    is more than half of the requests, the idle engine takes one."""
    from tokenflowd.daemon.router import IDLE_SPILL

    docs = [[d * 1000 + i for i in range(64)] for d in range(4)]
    questions = [doc + [9000 + q for q in range(8)] for doc in docs]
    now = [0.0]
    r = Router(PS, PrefixIndex(), clock=lambda: now[0])
    r.index.update(0, keys_of(docs[0]), [])
    holder, idle = FakeEngine(0, load=IDLE_SPILL), FakeEngine(1)
    for q in questions * 3:
        now[0] += 0.1
        r.pick([FakeEngine(0, load=IDLE_SPILL), FakeEngine(1, load=IDLE_SPILL)], q)
    assert r.pick([holder, idle], questions[0]).engine_id == 0
    for _ in range(12):  # now document 0's questions come alone
        now[0] += 0.1
        r.pick([FakeEngine(0, load=IDLE_SPILL), FakeEngine(1, load=IDLE_SPILL)], questions[0])
    assert r.pick([holder, idle], questions[0]).engine_id == 1
