"""The Andes policy: its QoE on hand-computed timelines, the greedy knapsack, preemption of a
request far ahead of its reader, the preemption cap, the oldest-request guarantee, the seam's
invariants over random views, and a burst through the real scheduler on a tiny model."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenflowd.buffer.andes import AndesPolicy, Item, _min_ramp_area, expected_area, greedy_knapsack, qoe
from tokenflowd.buffer.estimates import StepCost
from tokenflowd.buffer.fcfs import FCFSPolicy
from tokenflowd.buffer.policy import RequestView, SchedulerView, cdiv
from tokenflowd.config import PolicyConfig

from policy_checks import assert_plan_keeps_the_seam

pytestmark = pytest.mark.usefixtures("denormals_on")  # hypothesis draws floats

PS = 4
COST = StepCost(base=0.025, per_token=1e-4, per_context=0.0)  # ~40 tokens/s per request at small batches
PARAMS = PolicyConfig(andes_horizon=2.0, andes_expected_ttft=1.0, andes_interval=0.5)


def running(rid, t, out, rate=10.0, prompt=16):
    n = prompt + out
    return RequestView(rid, t, num_tokens=n, num_computed_tokens=n - 1, pages_held=cdiv(n - 1, PS),
                       reading_rate=rate, num_output_tokens=out)


def new(rid, t, prompt=16, rate=10.0):
    return RequestView(rid, t, num_tokens=prompt, num_computed_tokens=0, pages_held=0, reading_rate=rate)


def view(running=(), waiting=(), free=0, now=2.0, budget=256, max_num_seqs=8, total=None):
    total = free + sum(r.pages_held for r in running) if total is None else total
    return SchedulerView(now=now, running=tuple(running), waiting=tuple(waiting), free_pages=free,
                         total_pages=total, page_size=PS, token_budget=budget, max_num_seqs=max_num_seqs, cost=COST)


# -- QoE ----------------------------------------------------------------------------------------
# Arrival 0, expected TTFT 1 s, 2 tokens/s: four tokens are expected at 1, 1.5, 2 and 2.5 s.
@pytest.mark.parametrize("times, expected", [
    ([1.0, 1.5, 2.0, 2.5], 1.0),  # on time
    ([0.1, 0.2, 0.3, 0.4], 1.0),  # early tokens count when expected: no credit for speed
    ([2.0, 2.5, 3.0, 3.5], 3 / 7),  # 1 s late throughout: end 3.5; areas Σ(3.5 − max) = 3, Σ(3.5 − e) = 7
    ([1.0, 1.5, 3.0, 3.5], 5 / 7),  # a 1 s stall after two tokens: 2.5 + 2 + 0.5 + 0 over 7
    ([2.0, 2.1, 2.2, 2.3], 0.4),  # late first token, then fast: end 2.5; 0.5 + 0.4 + 0.3 + 0 over 3
])
def test_qoe_on_hand_computed_timelines(times, expected):
    assert qoe(times, arrival=0.0, expected_ttft=1.0, tds=2.0) == pytest.approx(expected)


def test_fluid_areas_by_hand():
    assert expected_area(3.0, start=1.0, tds=2.0, length=math.inf) == pytest.approx(4.0)  # 2·2²/2
    assert expected_area(3.0, start=1.0, tds=2.0, length=2.0) == pytest.approx(3.0)  # 1 up to t=2, then 2·1
    assert expected_area(0.5, start=1.0, tds=2.0, length=2.0) == 0.0
    # ∫_0^2 min(clip(r(t − s_u), 0, cap), g(t − t_v)⁺)
    assert _min_ramp_area(0, 2, s_u=0, r=1, cap=math.inf, t_v=0, g=2) == pytest.approx(2.0)  # ∫ t
    assert _min_ramp_area(0, 2, s_u=0, r=1, cap=1, t_v=0, g=2) == pytest.approx(1.5)  # 1/2 + 1
    assert _min_ramp_area(0, 2, s_u=0, r=1, cap=math.inf, t_v=1, g=1) == pytest.approx(0.5)  # ∫_1^2 (t − 1)
    assert _min_ramp_area(0, 2, s_u=0, r=2, cap=math.inf, t_v=-1, g=1) == pytest.approx(3.5)  # 2t, t+1 cross at 1
    # element-wise over arrays, as a pass computes every request's gain at once
    got = _min_ramp_area(0, 2, s_u=[0, 0, 0], r=[1, 1, 2], cap=[math.inf, 1, math.inf], t_v=[0, 0, -1], g=2)
    assert got == pytest.approx([2.0, 1.5, 4.0])  # the last: min(2t, 2(t + 1)) = 2t


def test_gain_is_the_horizon_area_over_the_expected_area():
    pol = AndesPolicy(PARAMS)
    # Arrived at 0 reading 2 tokens/s, nothing yet, now 0: expected from 1 s; horizon to 2 s.
    # S_expected(2) = 2·1²/2 = 1; served at 10 tokens/s from now the delivered curve stays above
    # the expected one, so the gain is that whole area: 1.
    r = RequestView("a", 0.0, 16, 0, 0, reading_rate=2.0)
    assert pol._gain(Item(r, False, 4, 0.0), g=10.0, now=0.0) == pytest.approx(1.0)
    # Served only from 1.5 s (its prompt) at 2 tokens/s it delivers 2(t − 1.5) against 2(t − 1):
    # 0.25 of the area 1.
    assert pol._gain(Item(r, False, 4, 1.5), g=2.0, now=0.0) == pytest.approx(0.25)
    # Ten tokens ahead at 2 tokens/s are 5 s of reading: nothing to gain within the horizon.
    ahead = RequestView("b", 0.0, 26, 25, 7, reading_rate=2.0, num_output_tokens=10)
    assert pol._gain(Item(ahead, True, 7, 0.0), g=10.0, now=0.0) == 0.0


# -- the knapsack -------------------------------------------------------------------------------
def _items(*spec):
    return [Item(new(rid, float(i)), False, pages, 0.0, gain) for i, (rid, pages, gain) in enumerate(spec)]


def test_knapsack_takes_the_highest_gain_per_page_under_the_memory_limit():
    a, b, c = _items(("a", 5, 10.0), ("b", 3, 9.0), ("c", 3, 8.0))
    # 11 pages do not fit in 6: by gain per page b (3.0) then c (2.67) for a gain of 17; by gain
    # alone 'a' (2.0 a page) would take 5 pages and leave room for nothing else (a gain of 10)
    assert [x.req.request_id for x in greedy_knapsack([a, b, c], 6, 4)] == ["b", "c"]
    # everything fits: the batch binds, so by gain
    assert [x.req.request_id for x in greedy_knapsack([a, b, c], 11, 2)] == ["a", "b"]
    # a pinned item goes in first whatever its gain
    assert [x.req.request_id for x in greedy_knapsack([a, b, c], 6, 4, pinned=c)] == ["c", "b"]


# -- the policy on hand-built views -------------------------------------------------------------
def test_a_request_far_ahead_of_its_reader_makes_way_for_a_waiting_one():
    # 'old' is behind its timeline, 'ahead' has 40 tokens for a 10 tokens/s reader (4 s of reading,
    # beyond the 2 s horizon), 'new' waits. The pages hold 'old' and 'ahead' exactly.
    old, ahead, waiting = running("old", 0.0, out=4), running("ahead", 0.2, out=40), new("new", 1.5)
    v = view([old, ahead], [waiting], free=0)
    assert FCFSPolicy().plan(v).preempted == ()  # FCFS keeps it and 'new' waits
    plan = AndesPolicy(PARAMS).plan(v)
    assert plan.preempted == ("ahead",)
    assert plan.scheduled == (("old", 1), ("new", 16))


def _cap_view():
    # 'old' (behind), four requests far ahead, four new ones of 13 pages each: the knapsack wants
    # every 'ahead' out (4 · 13 + 5 = 57 of 61 pages leave no room for one of 14).
    run = [running("old", 0.0, out=4)] + [running(f"a{i}", 0.1 * (i + 1), out=40) for i in range(4)]
    wait = [new(f"n{i}", 1.5 + 0.1 * i, prompt=52) for i in range(4)]
    return view(run, wait, free=0, budget=512)


@pytest.mark.parametrize("fraction, cap", [(0.5, 2), (0.2, 1), (1.0, 4)])
def test_the_preemption_cap_bounds_one_pass(fraction, cap):
    params = PolicyConfig(andes_horizon=2.0, andes_max_preempt_fraction=fraction)
    plan = AndesPolicy(params).plan(_cap_view())
    assert len(plan.preempted) == cap  # ⌊fraction · 5 running⌋, at least 1
    assert set(plan.preempted) <= {"a0", "a1", "a2", "a3"}
    # the victims that stay are the older ones (equal gain per page); the admissions shrank to fit
    assert plan.preempted == tuple(f"a{i}" for i in range(4 - cap, 4))
    # each victim kept displaced the least dense admission: the newest arrivals (smallest expected
    # area, so the largest gain) are the ones still admitted
    assert [rid for rid, _ in plan.scheduled if rid.startswith("n")] == [f"n{i}" for i in range(4 - cap, 4)]


def test_the_oldest_request_is_always_chosen():
    # A preempted request from long ago (its QoE is ruined: a huge expected area, a tiny gain)
    # against fresh arrivals that would each gain far more: the oldest is still admitted.
    stale = RequestView("stale", 0.0, 40, 0, 0, reading_rate=10.0, num_output_tokens=24)
    fresh = [new(f"f{i}", 99.0 + 0.1 * i, prompt=24) for i in range(4)]
    v = view([running("busy", 50.0, out=4)], [stale, *fresh], free=10, now=100.0, max_num_seqs=3)
    pol = AndesPolicy(PARAMS)
    d = pol.knapsack_pass(v)
    g = 1.0 / COST.decode_step_time(d.batch_size, 30.0)
    gains = [pol._gain(pol._item(r, False, v), g, v.now) for r in (stale, *fresh)]
    assert all(0 < gains[0] < 0.01 * f for f in gains[1:])  # on its own merit it would lose
    assert d.run == ("busy", "stale")  # 10 + 5 of the 15 pages: no fresh one fits beside them
    assert AndesPolicy(PARAMS).plan(v).scheduled == (("busy", 1), ("stale", 40))


def test_not_contended_is_fcfs_and_passes_are_spaced_by_the_interval():
    roomy = view([running("a", 0.0, out=4)], [new("b", 1.0)], free=100)
    pol = AndesPolicy(PARAMS)
    assert pol.plan(roomy) == FCFSPolicy().plan(roomy)
    assert pol.num_passes == 0
    old, ahead = running("old", 0.0, out=4), running("ahead", 0.2, out=40)
    tight = view([old, ahead], [new("new", 1.5)], free=0, now=2.0)
    pol.plan(tight)
    pol.plan(replace(tight, now=2.2))
    assert pol.num_passes == 1  # the decision holds between passes
    pol.plan(replace(tight, now=2.5))
    assert pol.num_passes == 2


def test_a_chosen_request_that_finishes_triggers_a_pass_early():
    old, ahead = running("old", 0.0, out=4), running("ahead", 0.2, out=40)
    pol = AndesPolicy(PARAMS)
    assert pol.plan(view([old, ahead], [new("new", 1.5)], free=0)).preempted == ("ahead",)
    assert pol.num_passes == 1
    # 0.1 s later 'old' has finished and its 5 pages are free: a pass runs at once, not at 2.5 s
    resumed = RequestView("ahead", 0.2, 56, 0, 0, reading_rate=10.0, num_output_tokens=40)
    later = view([running("new", 1.5, out=1)], [resumed], free=15, now=2.1, total=19)
    pol.plan(later)
    assert pol.num_passes == 2
    pol.plan(replace(later, now=2.2))
    assert pol.num_passes == 2


# -- the seam's invariants over random views ----------------------------------------------------
req_spec = st.tuples(st.integers(2, 80), st.floats(0, 1), st.integers(0, 60), st.sampled_from([2.0, 10.0, 30.0]),
                     st.floats(0, 5))


@settings(max_examples=400, deadline=None, derandomize=True)
@given(st.lists(req_spec, max_size=10), st.lists(req_spec, max_size=10), st.integers(0, 60), st.integers(1, 64),
       st.integers(1, 6), st.floats(0, 8), st.sampled_from([0.2, 0.5, 1.0]))
def test_plans_keep_the_seam_invariants(run_specs, wait_specs, free, budget, max_seqs, now, fraction):
    running_views, waiting_views = [], []
    for k, (n, frac, out, rate, age) in enumerate(run_specs[:max_seqs]):
        computed = max(1, min(n - 1, int(n * frac)))
        running_views.append(RequestView(f"r{k}", now - age, n, computed, cdiv(computed, PS), reading_rate=rate,
                                         num_output_tokens=min(out, n - 1), max_output_tokens=out + 20))
    for k, (n, frac, out, rate, age) in enumerate(wait_specs):
        waiting_views.append(RequestView(f"w{k}", now - age, n, 0, 0, reading_rate=rate,
                                         num_output_tokens=min(out, n - 1) if frac > 0.5 else 0))
    running_views.sort(key=lambda r: (r.arrival_time, r.request_id))  # the view's order (SchedulerView)
    waiting_views.sort(key=lambda r: (r.arrival_time, r.request_id))
    held = sum(r.pages_held for r in running_views)
    pol = AndesPolicy(PolicyConfig(andes_max_preempt_fraction=fraction, andes_interval=0.5))
    for dt in (0.0, 0.1):  # a pass, then a step that carries its decision out
        v = SchedulerView(now + dt, tuple(running_views), tuple(waiting_views), free, held + free, PS, budget,
                          max_seqs, COST)
        plan = pol.plan(v)
        assert_plan_keeps_the_seam(v, plan)
        ids = [rid for rid, _ in plan.scheduled]
        running_ids = {r.request_id for r in running_views}
        # the oldest request is preempted only when its next token needs more than the whole pool,
        # and a running oldest progresses unless the budget is spent
        oldest = min(running_views + waiting_views, key=lambda r: (r.arrival_time, r.request_id), default=None)
        if oldest is not None and oldest.request_id in running_ids:
            fits = oldest.pages_held + oldest.pages_to_run(1, PS) <= held + free
            assert oldest.request_id not in plan.preempted or not fits
            assert oldest.request_id in ids or not fits or sum(n for _, n in plan.scheduled) == budget


# -- the real scheduler on a tiny model ---------------------------------------------------------
def test_a_burst_over_a_small_pool_keeps_greedy_tokens(hf_dirs):
    from tokenflowd.config import EngineConfig
    from tokenflowd.engine.core import EngineCore
    from tokenflowd.engine.request import Request, SamplingParams

    def make(**kw):
        return EngineCore.from_config(EngineConfig.resolve(model=str(hf_dirs["llama"]), device="cpu", dtype="float32", **kw))

    def run(core, prompts, step_time):
        clock = [0.0]
        core.scheduler.clock = lambda: clock[0]  # virtual time: the passes fall on the same steps every run
        reqs = [Request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                        arrival_time=0.01 * i, reading_rate=10.0) for i, p in enumerate(prompts)]
        for r in reqs:
            core.add_request(r)
        for _ in range(5000):  # a cap: a livelock fails instead of hanging
            if not core.has_unfinished():
                break
            batch = core.scheduler.schedule()
            core.scheduler.issue_copies(batch)
            assert batch.total_tokens <= core.config.max_num_batched_tokens
            if len(batch):
                core.scheduler.update(batch, core.executor.execute(batch))
            clock[0] += step_time
        assert not core.has_unfinished()
        core.wait_copies()
        return {r.request_id: r.output_token_ids for r in reqs}, reqs

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (30, 22, 41, 17, 35, 26, 19, 33)]
    expected, _ = run(make(page_size=4, num_pages=400), prompts, 0.01)
    # 40 pages hold about three of the eight; each step is 10 ms of virtual time, so the running
    # requests outrun their 10 tokens/s readers and make way for the waiting ones.
    params = PolicyConfig(andes_interval=0.05, andes_horizon=1.0)
    tight = make(page_size=4, num_pages=40, max_num_batched_tokens=32, policy="andes", policy_params=params)
    got, reqs = run(tight, prompts, 0.01)
    assert tight.scheduler.policy.num_passes > 1
    assert tight.scheduler.num_preemptions > 0
    assert got == expected
    assert tight.pool.num_used == 0
