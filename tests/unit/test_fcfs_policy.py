"""The FCFS prefill-first policy on hand-built views."""
from __future__ import annotations

from tokenflowd.buffer.fcfs import FCFSPolicy
from tokenflowd.buffer.policy import RequestView, SchedulerView


def view(running=(), waiting=(), free=100, budget=64, total=100, max_num_seqs=8):
    return SchedulerView(now=0.0, running=tuple(running), waiting=tuple(waiting), free_pages=free,
                         total_pages=total, page_size=4, token_budget=budget, max_num_seqs=max_num_seqs)


def decode(rid, t, n=20):
    return RequestView(rid, t, num_tokens=n, num_computed_tokens=n - 1, pages_held=5)


def waiting(rid, t, n=30, hit=0):
    return RequestView(rid, t, num_tokens=n, num_computed_tokens=hit * 4, pages_held=hit)


def test_decodes_keep_their_token_and_prompts_share_the_rest():
    plan = FCFSPolicy(watermark=0).plan(view([decode("d1", 0), decode("d2", 1)], [waiting("w1", 2, n=60)], budget=61))
    assert plan.scheduled == (("d1", 1), ("d2", 1), ("w1", 59))


def test_long_prompt_is_chunked_to_the_budget():
    plan = FCFSPolicy(watermark=0).plan(view(waiting=[waiting("w", 0, n=100)], budget=32))
    assert plan.scheduled == (("w", 32),)


def test_head_of_line_blocks_admission():
    plan = FCFSPolicy(watermark=0).plan(view(waiting=[waiting("big", 0, n=60), waiting("small", 1, n=4)], free=10))
    assert plan.scheduled == ()  # 'big' needs 15 pages; 'small' does not jump it


def test_memory_pressure_preempts_the_newest():
    # Three decodes each at a page boundary need one new page each; only one is free.
    rs = [RequestView(f"d{i}", i, num_tokens=21, num_computed_tokens=20, pages_held=5) for i in range(3)]
    plan = FCFSPolicy(watermark=0).plan(view(rs, free=1, total=16))
    assert plan.preempted == ("d2",)
    assert plan.scheduled == (("d0", 1), ("d1", 1))  # d2's five pages paid for d1's one


def test_prefix_hit_pages_reduce_what_admission_needs():
    w = RequestView("w", 0, num_tokens=40, num_computed_tokens=32, pages_held=8, pages_reclaimed=8)
    # 8 hit pages come out of the free pool (they were evictable) plus 2 new ones for 8 tokens.
    assert w.pages_to_run(8, 4) == 10
    plan = FCFSPolicy(watermark=0).plan(view(waiting=[w], free=10))
    assert plan.scheduled == (("w", 8),)
    assert FCFSPolicy(watermark=0).plan(view(waiting=[w], free=9)).scheduled == ()


def test_max_num_seqs_caps_admission():
    plan = FCFSPolicy(watermark=0).plan(view([decode("d", 0)], [waiting("a", 1, n=4), waiting("b", 2, n=4)], max_num_seqs=2))
    assert [rid for rid, _ in plan.scheduled] == ["d", "a"]


def test_prefills_that_outgrow_memory_preempt_the_newest_not_deadlock():
    # Two half-done prompts hold all pages; the older one takes the newer one's pages.
    a = RequestView("a", 0, num_tokens=40, num_computed_tokens=20, pages_held=5)
    b = RequestView("b", 1, num_tokens=40, num_computed_tokens=20, pages_held=5)
    plan = FCFSPolicy(watermark=0).plan(view([a, b], free=0, total=10))
    assert plan.preempted == ("b",)
    assert plan.scheduled == (("a", 20),)


def test_a_prompt_as_large_as_the_pool_is_admitted_when_idle():
    plan = FCFSPolicy(watermark=0.5).plan(view(waiting=[waiting("w", 0, n=40)], free=10, total=10, budget=64))
    assert plan.scheduled == (("w", 40),)


def test_plans_respect_budget_and_memory_on_random_views():
    import random

    rng = random.Random(0)
    for _ in range(20000):
        ps, total = 4, rng.randint(4, 40)
        running, held = [], 0
        for i in range(rng.randint(0, 6)):
            n = rng.randint(2, min(40, total * ps))  # the engine caps a request at the pool
            comp = rng.randint(1, n - 1)
            pages = -(-comp // ps)
            if held + pages > total:
                break
            held += pages
            running.append(RequestView(f"r{i}", i, n, comp, pages))
        waits = []
        for i in range(rng.randint(0, 4)):
            hit = rng.randint(0, 2)
            waits.append(RequestView(f"w{i}", 10 + i, rng.randint(hit * ps + 1, 30), hit * ps, hit, rng.randint(0, hit)))
        v = SchedulerView(0.0, tuple(running), tuple(waits), total - held, total, ps, rng.randint(1, 32), 8)
        plan = FCFSPolicy().plan(v)
        by_id = {r.request_id: r for r in running + waits}
        assert sum(n for _, n in plan.scheduled) <= v.token_budget
        assert not set(plan.preempted) & {rid for rid, _ in plan.scheduled}
        freed = sum(by_id[rid].pages_held for rid in plan.preempted)
        used = sum(by_id[rid].pages_to_run(n, ps) for rid, n in plan.scheduled)
        assert used <= v.free_pages + freed
        assert all(1 <= n <= by_id[rid].tokens_left for rid, n in plan.scheduled)
        if running:  # no livelock: the oldest keeps its pages and runs unless the budget is spent
            assert running[0].request_id not in plan.preempted
            assert running[0].request_id in dict(plan.scheduled) or sum(n for _, n in plan.scheduled) == v.token_budget
