"""The seam's invariants (buffer/policy.py, SchedulingPolicy) checked on one plan of one view."""
from __future__ import annotations

from tokenflowd.buffer.policy import Plan, SchedulerView


def assert_plan_keeps_the_seam(view: SchedulerView, plan: Plan) -> None:
    ids = [rid for rid, _ in plan.scheduled]
    assert len(ids) == len(set(ids)), "a request scheduled twice"
    assert not set(ids) & set(plan.preempted), "a request both scheduled and preempted"
    assert sum(n for _, n in plan.scheduled) <= view.token_budget, "the token budget overspent"
    running_ids = {r.request_id for r in view.running}
    assert set(plan.preempted) <= running_ids, "a request preempted that was not running"
    by_id = {r.request_id: r for r in view.running + view.waiting}
    for rid, n in plan.scheduled:
        assert 1 <= n <= by_id[rid].tokens_left, f"{rid}: {n} tokens scheduled of {by_id[rid].tokens_left}"
    kept = running_ids - set(plan.preempted)
    assert len(kept | set(ids)) <= view.max_num_seqs, "more requests than max_num_seqs"
    freed = sum(by_id[r].pages_freed for r in plan.preempted)
    used = sum(by_id[rid].pages_to_run(n, view.page_size) for rid, n in plan.scheduled)
    assert used <= view.free_pages + freed, "more pages than are free"
