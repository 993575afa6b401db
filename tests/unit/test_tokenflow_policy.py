"""The buffer-aware policy on hand-built views: admission threshold, utility order, local search,
the schedulability fallback, and the seam's invariants over random views."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenflowd.buffer.estimates import StepCost
from tokenflowd.buffer.fcfs import FCFSPolicy
from tokenflowd.buffer.policy import RequestView, SchedulerView, cdiv
from tokenflowd.buffer.tokenflow import TokenFlowPolicy
from tokenflowd.buffer.working_set import buffer_utility, build_working_set
from tokenflowd.config import PolicyConfig

from policy_checks import assert_plan_keeps_the_seam

pytestmark = pytest.mark.usefixtures("denormals_on")  # hypothesis draws floats

PS = 4
# Every running request generates 40 tokens/s whatever the batch (as in Fig. 6); recomputing a
# token costs 0.1 ms.
COST = StepCost(base=0.025, per_token=1e-4, per_context=0.0)
PARAMS = PolicyConfig(schedule_interval=1.0, buffer_conservativeness=2.0)


def running(rid, t, buffer, rate, n=20, out=5):
    return RequestView(rid, t, num_tokens=n, num_computed_tokens=n - 1, pages_held=cdiv(n - 1, PS),
                       reading_rate=rate, buffer=buffer, num_output_tokens=out, max_output_tokens=400)


def preempted(rid, t, buffer, rate, n=20, io_time=None):
    return RequestView(rid, t, num_tokens=n, num_computed_tokens=0, pages_held=0, reading_rate=rate,
                       buffer=buffer, num_output_tokens=5, max_output_tokens=400, io_time=io_time)


def new(rid, t, rate=20.0, n=16):
    return RequestView(rid, t, num_tokens=n, num_computed_tokens=0, pages_held=0, reading_rate=rate,
                       max_output_tokens=400)


def view(running=(), waiting=(), free=100, max_num_seqs=2, now=0.0, budget=64, total=200, cost=COST):
    return SchedulerView(now=now, running=tuple(running), waiting=tuple(waiting), free_pages=free,
                         total_pages=total, page_size=PS, token_budget=budget, max_num_seqs=max_num_seqs, cost=cost)


def test_not_stressed_is_prefill_first_fcfs():
    v = view(running=[running("a", 0, 5, 20), running("b", 1, 50, 20)], max_num_seqs=4)
    assert TokenFlowPolicy(PARAMS).plan(v) == FCFSPolicy().plan(v)


def test_admission_waits_until_a_victim_buffer_covers_mu_times_its_swap():
    # R1 reads 20 tok/s: away for recompute (20 tokens · 0.1 ms) + one 1 s interval, μ = 2 →
    # its buffer must hold 2 · 20 · 1.002 = 40.08 tokens before R3 may displace it.
    r2 = running("R2", 0.0, buffer=20, rate=30)
    r3 = new("R3", 2.0, rate=25)
    early = TokenFlowPolicy(PARAMS).plan(view([running("R1", 0.0, 40.0, 20), r2], [r3], now=2.0))
    assert early.preempted == () and "R3" not in dict(early.scheduled)
    later = TokenFlowPolicy(PARAMS).plan(view([running("R1", 0.0, 40.2, 20), r2], [r3], now=3.0))
    assert later.preempted == ("R1",)
    assert dict(later.scheduled) == {"R2": 1, "R3": 16}


def test_a_conservative_mu_keeps_the_victim():
    params = PolicyConfig(schedule_interval=1.0, buffer_conservativeness=20.0)
    plan = TokenFlowPolicy(params).plan(view([running("R1", 0.0, 60.0, 20), running("R2", 0, 30, 30)],
                                             [new("R3", 2.0)], now=3.0))
    assert plan.preempted == ()


def test_utility_brings_back_the_emptiest_buffer_and_preempts_the_fullest():
    # Fig. 6 at t = 5: R1 (out, 1 s of buffer left) returns; R2 (1.67 s) makes way; R3 (1.2 s) stays.
    v = view([running("R2", 0.0, 50.0, 30), running("R3", 2.0, 30.0, 25)], [preempted("R1", 0.0, 20.0, 20)], now=5.0)
    plan = TokenFlowPolicy(PARAMS).plan(v)
    assert plan.preempted == ("R2",)
    assert set(dict(plan.scheduled)) == {"R3", "R1"}


def test_utility_order_by_seconds_of_buffer_and_token_value():
    def u(buffer, rate, max_out=400):
        r = RequestView("x", 0, 20, 19, 5, reading_rate=rate, buffer=buffer, num_output_tokens=5,
                        max_output_tokens=max_out)
        ws = build_working_set(view([r]), [], PARAMS.expected_output_len)
        return float(buffer_utility(ws, 40.0, PARAMS.schedule_interval, PARAMS.stall_penalty)[0])

    assert u(0, 20) > u(10, 20) > u(30, 20) > u(60, 20)
    assert u(20, 20) == u(40, 40)  # one second of reading either way
    # beyond 20% of the output buffered a token is worth nothing: only the stall term is left
    assert u(100, 20) == PARAMS.stall_penalty * math.exp(-5)
    assert u(100, 20, max_out=10_000) > u(100, 20)


def test_fallback_an_overdue_stream_does_not_displace_one_whose_long_way_back_its_buffer_would_not_last():
    # Σ r > Γ, two seats. "c" has been silent 25 s (over 2×max_stall): it displaces a running
    # request, the one with the most buffer first: "b", a token ahead. But where "b" has just come
    # back from a recompute of 20,000 tokens (2 s at 0.1 ms a token, over the 1 s pass), displaced
    # it would go as silent as "c" was and pay those 2 s again to return (streams that each needed
    # a long recompute took a small device from each other a token at a time): "a", whose way back
    # is short, makes way instead.
    def v(n):
        return view([running("a", 0.0, 0.0, 35), running("b", 1.0, 1.0, 35, n=n)],
                    [preempted("c", 0.5, 0.0, 35).replace(dry_for=25.0), new("n", 3.0)],
                    free=20_000, total=30_000, max_num_seqs=2, now=40.0)

    short, long = TokenFlowPolicy(PARAMS).balance(v(20)), TokenFlowPolicy(PARAMS).balance(v(20_000))
    assert short.fallback and long.fallback
    assert short.run == ("c", "a")
    assert long.run == ("b", "c")


def test_fallback_serves_running_requests_that_count_then_new_then_the_rest():
    # Three slots at ~40 tokens/s: Γ ≈ 119 < Σ min(r, g) ≈ 30 + 40 + 40 + 25. "rich" holds 100
    # tokens (a fifth of its expected 400: its next tokens are worth nothing, §7.1.3) and 2.2 s of
    # reading, more than μ× its time away: it makes way. The new request's first token comes before
    # the preempted member, which waits for a seat (its reader has not been silent for max_stall).
    # Running requests that count come least buffered first.
    v = view([running("late", 2.0, 0.0, 30), running("early", 0.0, 50.0, 45), running("rich", 1.0, 100.0, 45)],
             [preempted("mid", 1.0, 0.0, 25), new("n", 3.0)], now=4.0, max_num_seqs=3)
    pol = TokenFlowPolicy(PARAMS)
    d = pol.balance(v)
    assert d.fallback
    assert d.run == ("late", "early", "n")
    plan = pol.plan(v)
    assert plan.preempted == ("rich",) and "n" in dict(plan.scheduled)


def test_fallback_brings_silent_streams_back_before_new_requests_and_overdue_ones_by_displacement():
    # Σ r > Γ as above. A member silent for max_stall (10 s) takes the free seat before the new
    # request; one silent for 2×max_stall takes the seat of the running request with the most
    # buffer, whatever the new requests.
    def v(dry, slots):
        return view([running("a", 0.0, 0.0, 35), running("b", 1.0, 30.0, 35)],
                    [preempted("c", 0.5, 0.0, 35).replace(dry_for=dry), preempted("d", 0.6, 0.0, 35), new("n", 3.0)],
                    free=100, max_num_seqs=slots, now=40.0)

    assert TokenFlowPolicy(PARAMS).balance(v(5.0, 3)).run == ("a", "b", "n")
    assert TokenFlowPolicy(PARAMS).balance(v(12.0, 3)).run == ("a", "b", "c")
    assert TokenFlowPolicy(PARAMS).balance(v(12.0, 2)).run == ("a", "b")
    assert TokenFlowPolicy(PARAMS).balance(v(25.0, 2)).run == ("c", "a")
    plan = TokenFlowPolicy(PARAMS).plan(v(25.0, 2))
    assert plan.preempted == ("b",)
    # ... but not the place of a running request of higher priority
    v2 = replace(v(25.0, 2), running=(running("a", 0.0, 0.0, 35), running("b", 1.0, 30.0, 35).replace(priority=1)))
    assert TokenFlowPolicy(PARAMS).balance(v2).run == ("b", "c")


def test_fallback_never_displaces_a_recompute_in_progress_for_another_silent_stream():
    """Two streams silent for 2×max_stall, each recomputing a long context, one seat: the one whose
    recompute is under way keeps the seat until it is done. Displaced mid-recompute, its work was
    thrown away, it was the longest silent at the next pass and displaced the other in turn: in the
    node simulator (A100, full KV, pool-write, sessions in overload, seed 3) two requests on one
    engine took the seat from each other for 500 s, one recomputed chunk a pass, while the engine's
    other seats and room stayed empty, and the run's span grew 3.5x."""
    half = running("a", 0.0, 0.0, 35, n=400, out=5).replace(num_computed_tokens=200, pages_held=50)
    v = view([running("r", 0.0, 0.0, 35), half],
             [preempted("b", 0.5, 0.0, 35, n=400).replace(dry_for=40.0)], free=100, max_num_seqs=2, now=60.0)
    d = TokenFlowPolicy(PARAMS).balance(v)
    assert d.fallback and "a" in d.run and "b" not in d.run, d
    done = replace(v, running=(running("r", 0.0, 0.0, 35), running("a", 0.0, 0.0, 35, n=400)))
    assert "b" in TokenFlowPolicy(PARAMS).balance(done).run, "recomputed, it is a running request like any"


def test_a_silent_stream_too_big_for_the_room_does_not_leave_the_device_idle_with_smaller_ones_waiting():
    """Nothing runs, 50 pages are free: the longest silent stream needs 100 to recompute, another
    needs 10. Its pages capped at the room, the big one looked as if it fitted, took the whole
    room in the plan, could not be admitted, and the device stayed idle pass after pass (node
    simulator, A100, sessions in overload, pool-write seed 0: one engine, its memory pinned by
    peers' readers, ran nothing while 13 streams waited, then recomputed their prefixes). The
    small one runs; the big one comes back once the room is there."""
    big = preempted("big", 0.5, 0.0, 35, n=400).replace(dry_for=40.0)
    small = preempted("small", 0.6, 0.0, 35, n=40).replace(dry_for=30.0)
    v = view([], [big, small], free=50, max_num_seqs=4, now=60.0)
    policy = TokenFlowPolicy(PARAMS)
    d = policy.balance(v)
    assert d.fallback and d.run == ("small",), d
    assert [rid for rid, _ in policy.plan(v).scheduled] == ["small"]
    roomy = replace(v, free_pages=200)
    assert "big" in TokenFlowPolicy(PARAMS).balance(roomy).run, "with the room there, it comes back"


def test_fallback_keeps_running_requests_that_count_and_admits_into_room_left_over():
    # Five readers at 35 tokens/s and at most four slots of ~40: Σ r = 175 > Γ. With four slots the
    # new request and the first preempted member both fit; with three the new one takes the last
    # slot; with two, no one is displaced for it.
    def v(slots):
        return view([running("a", 0.0, 0.0, 35), running("b", 1.0, 0.0, 35)],
                    [preempted("c", 0.5, 0.0, 35), preempted("d", 0.6, 0.0, 35), preempted("e", 0.7, 0.0, 35),
                     new("n", 3.0)], free=100, max_num_seqs=slots, now=4.0)

    d = TokenFlowPolicy(PARAMS).balance(v(4))
    assert d.fallback
    assert d.run == ("a", "b", "c", "n")
    assert TokenFlowPolicy(PARAMS).balance(v(3)).run == ("a", "b", "n")
    assert TokenFlowPolicy(PARAMS).balance(v(2)).run == ("a", "b")


def test_one_client_stating_an_absurd_rate_does_not_switch_the_policy_to_fallback():
    # A request is never fed faster than one decode stream (g ≈ 40 tokens/s here), so a stated
    # 1e6 tokens/s counts as g in the schedulability test.
    honest = [running(f"h{i}", float(i), 30.0, 10) for i in range(3)]
    v = view([*honest, running("greedy", 3.0, 0.0, 1e6)], [new("n", 5.0)], max_num_seqs=4, now=6.0)
    assert not TokenFlowPolicy(PARAMS).balance(v).fallback


def test_a_new_request_too_big_for_the_room_its_victims_would_free_displaces_no_one():
    # R1 and R2 have buffer to spare (2.25 s each: both may make way), but the 400-token prompt
    # needs ~110 pages of the 50 there are even with both gone. The pass displaced both and ran
    # nothing; they came back at the next pass, to be displaced again (the node simulator, the
    # A100's trace in overload: 2,353 preemptions on one engine, each a recompute).
    v = view([running("R1", 0.0, 45.0, 20), running("R2", 0.5, 45.0, 20)], [new("big", 2.0, n=400)],
             free=40, total=50, max_num_seqs=4, now=3.0)
    d = TokenFlowPolicy(PARAMS).balance(v)
    assert d.run == ("R1", "R2")
    assert TokenFlowPolicy(PARAMS).plan(v).preempted == ()


def test_a_head_whose_prompt_does_not_fit_does_not_start_a_pass_each_time_the_running_set_changes():
    # The head's first chunk (64 tokens, 16 pages) fits the free room, its whole prompt does not: a
    # pass would admit it only by displacing running requests, the interval's pass's to do, so a
    # request leaving is no reason to run one before the interval.
    pol = TokenFlowPolicy(PARAMS)
    big = new("big", 1.0, n=400)
    r1, r2 = running("R1", 0.0, 2.0, 20), running("R2", 0.5, 2.0, 20)
    pol.plan(view([r1, r2], [big], free=30, total=40, max_num_seqs=4, now=2.0))
    pol.plan(view([r1], [big], free=35, total=40, max_num_seqs=4, now=2.1))
    assert pol.num_passes == 1
    small = new("small", 1.0, n=40)  # a head that fits: a pass admits it at once
    pol.plan(view([r1], [small], free=35, total=40, max_num_seqs=4, now=2.2))
    assert pol.num_passes == 2


def test_a_new_request_takes_free_room_whatever_the_working_set_bound():
    # Σ r = 35 of Γ ≈ 119 and three free slots: the new requests go in at once, and no one is
    # displaced (every running buffer is low).
    v = view([running("a", 0.0, 2.0, 20), running("b", 1.0, 2.0, 15)], [new("n1", 2.0), new("n2", 2.5)],
             max_num_seqs=4, now=3.0)
    d = TokenFlowPolicy(PARAMS).balance(v)
    assert not d.fallback
    assert d.run == ("a", "b", "n1", "n2")


def test_a_new_request_counts_only_the_pages_it_adds_to_those_a_running_request_shares_with_it():
    # "a" runs over 40 tokens (10 pages); "n" asks 44 tokens whose first 40 are a's pages. Over the
    # interval (~41 tokens each) a holds 21 pages and n 22, 10 of them a's: 33 of the 38 pages there
    # are (28 free + a's 10). Counting n's shared pages again (43 > 38) kept it waiting behind room
    # it did not need. Pages of its prefix that are cached but unreferenced are counted: they are
    # among the free ones, and taking them uses them up.
    def ask(reclaimed: int):
        n = new("n", 1.0, n=44).replace(num_computed_tokens=40, pages_held=10, pages_reclaimed=reclaimed)
        return TokenFlowPolicy(PARAMS).balance(view([running("a", 0.0, 2.0, 20, n=41)], [n], free=28, max_num_seqs=4,
                                                    now=2.0))

    shared = ask(reclaimed=0)
    assert not shared.fallback and shared.run == ("a", "n")
    assert ask(reclaimed=10).run == ("a",)


def test_an_idle_device_admits_a_prompt_that_fits_even_if_its_growth_over_the_interval_would_not():
    # 12 free pages of 4 tokens: the 33-token prompt needs 9, its next interval's ~40 tokens would
    # need 19. Nobody runs, so nobody's room is at stake: it is admitted (it once waited forever).
    v = view([], [new("a", 0.0, n=33)], free=12, total=12, max_num_seqs=4)
    assert TokenFlowPolicy(PARAMS).balance(v).run == ("a",)
    assert dict(TokenFlowPolicy(PARAMS).plan(v).scheduled) == {"a": 33}


def test_a_loading_request_holds_its_place_through_a_pass():
    # "l" is coming back from the host tier: it keeps its pages and seat, so a pass neither gives
    # them to the new request nor leaves it out of the decision (it would be preempted on landing).
    loading = RequestView("l", 0.5, 20, 19, 5, reading_rate=20.0, buffer=1.0, num_output_tokens=5,
                          max_output_tokens=400)
    v = SchedulerView(now=3.0, running=(running("a", 0.0, 2.0, 20),), waiting=(new("n", 2.0),), free_pages=30,
                      total_pages=40, page_size=PS, token_budget=64, max_num_seqs=1, cost=COST, loading=(loading,))
    d = TokenFlowPolicy(PARAMS).balance(v)
    assert "l" in d.run and "a" in d.run and "n" not in d.run


def test_reload_is_chosen_when_io_beats_recompute():
    v = view([], [preempted("fast", 0.0, 5.0, 20, n=400, io_time=0.001),
                  preempted("slow", 0.0, 5.0, 20, n=400, io_time=1.0)], free=400, max_num_seqs=4, budget=1024)
    d = TokenFlowPolicy(PARAMS).balance(v)
    assert set(d.run) == {"fast", "slow"}
    assert d.reload == ("fast",)  # recomputing 400 tokens takes 40 ms: 1 s of I/O loses


def test_between_passes_the_decision_holds():
    pol = TokenFlowPolicy(PARAMS)
    r1, r2 = running("R1", 0.0, 40.0, 20), running("R2", 0.0, 20.0, 30)
    pol.plan(view([r1, r2], [new("R3", 2.0)], now=2.0))
    # 0.5 s later R1's buffer is safe, but the next pass is due at t = 3
    assert pol.plan(view([running("R1", 0.0, 60.0, 20), r2], [new("R3", 2.0)], now=2.5)).preempted == ()
    assert pol.plan(view([running("R1", 0.0, 60.0, 20), r2], [new("R3", 2.0)], now=3.0)).preempted == ("R1",)
    assert pol.num_passes == 2


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.integers(1, 30), st.floats(0, 100)), min_size=1, max_size=40), st.integers(1, 120),
       st.integers(1, 12))
def test_greedy_and_local_search_never_break_the_memory_constraint(items, capacity, max_seqs):
    pages = [p for p, _ in items]
    utility = [u for _, u in items]
    order = sorted(range(len(items)), key=lambda i: -utility[i])
    greedy, used = TokenFlowPolicy._fill(order, pages, capacity, max_seqs)
    assert used == sum(pages[i] for i in greedy)
    chosen = TokenFlowPolicy._local_search(order, greedy, pages, utility, capacity, max_seqs)
    assert sum(pages[i] for i in chosen) <= capacity
    assert len(chosen) <= max_seqs
    assert len(set(chosen)) == len(chosen)
    assert sum(utility[i] for i in chosen) >= sum(utility[i] for i in greedy)


def test_local_search_swaps_a_big_request_for_two_that_fit():
    pages, utility = [10, 4, 5], [10.0, 9.0, 8.0]  # big, small, other
    greedy, _ = TokenFlowPolicy._fill([0, 1, 2], pages, 10, 4)
    assert greedy == [0]
    assert sorted(TokenFlowPolicy._local_search([0, 1, 2], greedy, pages, utility, 10, 4)) == [1, 2]


req_view = st.builds(
    lambda i, n, computed_frac, started, buffer, rate, prio: (i, n, computed_frac, started, buffer, rate, prio),
    st.integers(0, 10**6), st.integers(2, 80), st.floats(0, 1), st.booleans(), st.floats(0, 200),
    st.sampled_from([5.0, 15.0, 20.0, 30.0]), st.integers(0, 1),
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(req_view, max_size=10), st.lists(req_view, max_size=12), st.integers(0, 60), st.integers(1, 64),
       st.integers(1, 6), st.floats(0, 3))
def test_plans_keep_the_seam_invariants(run_specs, wait_specs, free, budget, max_seqs, now):
    running_views, waiting_views = [], []
    for k, (i, n, frac, started, buffer, rate, prio) in enumerate(run_specs[:max_seqs]):
        computed = max(1, min(n - 1, int(n * frac)))
        out = 3 if started else 0
        running_views.append(RequestView(f"r{k}", float(k), n, computed, cdiv(computed, PS), reading_rate=rate,
                                         buffer=buffer if started else 0.0, num_output_tokens=out, priority=prio))
    for k, (i, n, frac, started, buffer, rate, prio) in enumerate(wait_specs):
        out = 3 if started else 0
        waiting_views.append(RequestView(f"w{k}", 10.0 + k, n, 0, 0, reading_rate=rate,
                                         buffer=buffer if started else 0.0, num_output_tokens=out, priority=prio))
    v = view(running_views, waiting_views, free=free, budget=budget, max_num_seqs=max_seqs, now=now)
    plan = TokenFlowPolicy(PARAMS).plan(v)
    assert_plan_keeps_the_seam(v, plan)
    ids = [rid for rid, _ in plan.scheduled]
    kept = {r.request_id for r in running_views} - set(plan.preempted)
    # every decode that stays keeps its token each step (FCFS inside the decision)
    for r in running_views:
        if r.request_id in kept and r.tokens_left == 1 and budget >= len(kept):
            assert r.request_id in ids
