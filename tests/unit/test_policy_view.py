"""The policy sees every started request: over random schedules through the real scheduler (the
simulator drives it), no request that was ever admitted and has not finished is missing from a
view, whatever max_num_seqs, priorities and arrival ties do to the queue."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenflowd.buffer import make_policy
from tokenflowd.buffer.policy import Plan, SchedulerView, SchedulingPolicy
from tokenflowd.config import PolicyConfig
from tokenflowd.engine.request import RequestStatus
from tokenflowd.sim.cost import fig6_cost_model
from tokenflowd.sim.simulator import Simulator
from tokenflowd.sim.workload import WorkloadRequest

pytestmark = pytest.mark.usefixtures("denormals_on")  # hypothesis draws floats


class Watching(SchedulingPolicy):
    """Plans as `inner` does, after checking the view against the scheduler's own requests."""

    def __init__(self, inner: SchedulingPolicy) -> None:
        self.inner = inner
        self.name = inner.name
        self.scheduler = None
        self.num_views = self.max_started_seen = 0

    def plan(self, view: SchedulerView) -> Plan:
        started = {rid for rid, r in self.scheduler.requests.items()
                   if r.num_preemptions or r.status in (RequestStatus.RUNNING, RequestStatus.LOADING)}
        seen = [r.request_id for r in (*view.running, *view.waiting, *view.loading)]
        assert len(seen) == len(set(seen)), "a request appears twice in one view"
        missing = started - set(seen)
        assert not missing, f"started requests {sorted(missing)} are missing from the view"
        self.num_views += 1
        self.max_started_seen = max(self.max_started_seen, len(started))
        return self.inner.plan(view)


request = st.tuples(st.integers(4, 120), st.integers(1, 60), st.sampled_from([0.0, 0.0, 0.5, 1.0, 2.0]),
                    st.integers(0, 2), st.sampled_from([5.0, 20.0, 40.0]))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.lists(request, min_size=2, max_size=24), st.integers(1, 4), st.integers(12, 48),
       st.sampled_from(["tokenflow", "fcfs", "andes"]), st.booleans())
def test_a_started_request_is_never_missing_from_the_view(reqs, max_seqs, pages, policy, offload):
    # Arrivals tie (several at one instant), later ones may carry a higher priority and queue ahead
    # of preempted ones, and max_num_seqs is below the queue's length: all that once hid requests.
    workload = [WorkloadRequest(f"r{i:02d}", t, prompt, out, rate, (i,), priority=prio)
                for i, (prompt, out, t, prio, rate) in enumerate(reqs)]
    cost = fig6_cost_model().replace(name="tiny", kv_memory=pages * 16 * 2 * 4, page_size=16, max_num_seqs=max_seqs,
                                     max_num_batched_tokens=64, step_overhead=0.01, num_params=1e9, peak_flops=1e12,
                                     max_model_len=512)
    watching = Watching(make_policy(policy, PolicyConfig(schedule_interval=0.2)))
    sim = Simulator(cost, workload, watching, offload="write-through" if offload else "none",
                    host_kv_memory=1 << 20)
    watching.scheduler = sim.scheduler
    result = sim.run()
    assert watching.num_views > 0
    assert all(len(r.token_times) == r.output_len for r in result.records)


def test_the_simulator_hands_the_policy_only_what_a_real_engine_knows():
    """No output length from the workload: a client's loose max_tokens or nothing; responses end
    when the executor samples the end token, at the workload's length."""
    import dataclasses

    from tokenflowd.sim.workload import WorkloadSpec, build_workload

    spec = WorkloadSpec("burst", num_requests=24, max_tokens_share=0.5, max_tokens_bound=4096, seed=3)
    workload = [dataclasses.replace(w, prompt_len=40, output_len=20 + i, hash_ids=(i,))
                for i, w in enumerate(build_workload(spec))]
    assert {w.max_tokens for w in workload} == {None, 4096}
    bounds = []

    class Spy(Watching):
        def plan(self, view):
            bounds.extend(r.max_output_tokens for r in (*view.running, *view.waiting))
            return super().plan(view)

    cost = fig6_cost_model().replace(name="tiny", kv_memory=64 * 16 * 2 * 4, page_size=16, max_num_seqs=4,
                                     max_num_batched_tokens=128, step_overhead=0.01, num_params=1e9, peak_flops=1e12,
                                     max_model_len=8192)
    spy = Spy(make_policy("tokenflow", PolicyConfig(schedule_interval=0.2)))
    sim = Simulator(cost, workload, spy)
    spy.scheduler = sim.scheduler
    result = sim.run()
    assert set(bounds) == {None, 4096}
    assert [len(r.token_times) for r in result.records] == [w.output_len for w in workload]
    assert sim.scheduler.output_lengths.num_samples == len(workload)
