"""Scheduling on a tiny model: preemption by recompute keeps greedy output; budgets hold."""
from __future__ import annotations

import time

import pytest
import torch

from tokenflowd.config import EngineConfig
from tokenflowd.engine.core import EngineCore
from tokenflowd.engine.request import Request, SamplingParams


def run(core: EngineCore, prompts: list[list[int]], max_tokens: int = 20) -> dict[str, list[int]]:
    reqs = [Request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
            for i, p in enumerate(prompts)]
    for r in reqs:
        core.add_request(r)
    budgets = []
    for _ in range(5000):  # a cap: a livelock fails instead of hanging
        if not core.has_unfinished():
            break
        core.step()
        budgets.append(core.last_batch.total_tokens)
    assert not core.has_unfinished()
    core.wait_copies()  # write-through copies still in flight pin their pages until they end
    assert max(budgets) <= core.config.max_num_batched_tokens
    return {r.request_id: r.output_token_ids for r in reqs}


def make(hf_dirs, **kw) -> EngineCore:
    return EngineCore.from_config(EngineConfig.resolve(model=str(hf_dirs["llama"]), device="cpu", dtype="float32", **kw))


def test_preemption_by_recompute_keeps_greedy_tokens(hf_dirs):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (30, 22, 41, 17, 35, 26)]
    roomy = make(hf_dirs, page_size=4, num_pages=200)
    # fcfs without a host tier: preemption by recompute (the default, tokenflow with write-through
    # offload, reloads; tests/unit/test_offload.py checks that path)
    tight = make(hf_dirs, page_size=4, num_pages=30, max_num_batched_tokens=24, policy="fcfs", offload="none")
    expected = run(roomy, prompts)
    got = run(tight, prompts)
    assert tight.scheduler.num_preemptions > 0
    assert got == expected
    assert tight.pool.num_used == 0


def test_small_pool_many_requests_all_finish(hf_dirs):
    """The livelock the FCFS rewrite fixed: a pool of 10 pages, a 4-token budget, and prompts
    that need most of it; every request must finish."""
    core = make(hf_dirs, page_size=4, num_pages=10, max_num_batched_tokens=4)
    g = torch.Generator().manual_seed(3)
    out = run(core, [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (7, 8, 28, 21)], max_tokens=3)
    assert all(len(t) == 3 for t in out.values())
    assert core.pool.num_used == 0  # run() waited for the copies


def fail_steps(core: EngineCore, error: str) -> None:
    """Every step from now on raises `error` in the model (both step paths run compute_logits)."""
    def boom(*args):
        raise RuntimeError(error)

    core.runner.compute_logits = boom


def step_and_collect(core: EngineCore):
    """One step's outputs, and with overlap those of the step it launched (collected at once)."""
    return core.step() + core.drain()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_fault_ends_the_step_with_an_error_and_frees_pages(hf_dirs, overlap):
    from tokenflowd.engine.request import FinishReason

    core = make(hf_dirs, page_size=4, num_pages=50, overlap=overlap)
    core.add_request(Request("a", list(range(5, 30)), SamplingParams(temperature=0, max_tokens=5)))
    step_and_collect(core)
    fail_steps(core, "device lost")
    outs = step_and_collect(core)
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", FinishReason.ERROR)]
    assert "device lost" in outs[0].error
    core.wait_copies()
    assert core.pool.num_used == 0 and not core.has_unfinished()


@pytest.mark.parametrize("overlap", [False, True])
def test_steps_that_keep_failing_end_the_engine(hf_dirs, overlap):
    """A fault that does not go away (N failed steps in a row), or a lost device at once, raises
    EngineFailed: the engine process exits and is restarted instead of failing every request."""
    from tokenflowd.engine.core import MAX_FAILED_STEPS, EngineFailed

    core = make(hf_dirs, page_size=4, num_pages=50, overlap=overlap)
    fail_steps(core, "stuck")
    for i in range(MAX_FAILED_STEPS):
        core.add_request(Request(f"r{i}", list(range(5, 30)), SamplingParams(temperature=0, max_tokens=5)))
        if i < MAX_FAILED_STEPS - 1:
            assert step_and_collect(core)[0].error.endswith("stuck")
    with pytest.raises(EngineFailed, match="3 steps in a row"):
        step_and_collect(core)
    core.wait_copies()  # (overlap: a write issued behind a failed step fails with it, and lets go)
    assert core.pool.num_used == 0 and not core.has_unfinished()  # every request ended, no page kept

    core = make(hf_dirs, page_size=4, num_pages=50, overlap=overlap)
    core.add_request(Request("a", list(range(5, 30)), SamplingParams(temperature=0, max_tokens=5)))
    fail_steps(core, "CUDA error: an illegal memory access")
    with pytest.raises(EngineFailed, match="device failed"):
        step_and_collect(core)


def test_higher_priority_is_admitted_first_and_tokens_feed_the_buffer(hf_dirs):
    core = make(hf_dirs, page_size=4, num_pages=200, max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    core.add_request(Request("human", list(range(5, 15)), params, arrival_time=1.0, reading_rate=8.0))
    core.add_request(Request("agent", list(range(5, 15)), params, arrival_time=2.0, reading_rate=500.0, priority=5))
    core.step()
    assert [r.request_id for r in core.scheduler.running] == ["agent"]
    while core.has_unfinished():
        core.step()
    agent_done = core.scheduler.requests.get("agent")
    assert agent_done is None  # finished and gone
    # The sampled tokens were fed to each request's buffer model at their reading rates.
    req = Request("r", [5, 6, 7], params, reading_rate=8.0)
    core.add_request(req)
    while core.has_unfinished():
        core.step()
    assert req.buffer.num_generated == 2 and req.buffer.reading_rate == 8.0
    assert req.first_token_time is not None


def test_the_policy_view_carries_each_clients_buffer(hf_dirs):
    core = make(hf_dirs, page_size=4, num_pages=50)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    core.add_request(Request("fast", list(range(5, 20)), sp, reading_rate=1000.0))
    core.add_request(Request("slow", list(range(30, 45)), sp, reading_rate=0.1))
    for _ in range(4):
        core.step()
    view = core.scheduler._view()
    by_id = {v.request_id: v for v in view.running}
    slow, fast = by_id["slow"], by_id["fast"]
    assert slow.reading_rate == 0.1 and fast.reading_rate == 1000.0
    assert slow.started and slow.num_output_tokens >= 3 and slow.max_output_tokens == 8
    assert slow.buffer >= slow.num_output_tokens - 1  # at 0.1 token/s it has read under one token
    assert fast.buffer <= 1.0  # a fast reader has read all but (part of) the newest token
    assert slow.time_to_empty == slow.buffer / 0.1
    # a rate measured by the front (SetReadingRate) is the one the policy sees from then on
    assert core.set_reading_rate("fast", 3.0, time.monotonic())
    assert {v.request_id: v for v in core.scheduler._view().running}["fast"].reading_rate == 3.0


def test_what_the_scheduler_defers_of_a_plan_the_next_view_names(hf_dirs):
    """A plan that overestimates the room: the request that does not fit waits, and the policy's
    next view says which of its plan was not carried out."""
    from tokenflowd.buffer.policy import Plan, SchedulingPolicy

    views = []

    class Everything(SchedulingPolicy):
        name = "everything"

        def plan(self, view):
            views.append(view)
            return Plan(tuple((r.request_id, r.tokens_left) for r in view.waiting)
                        + tuple((r.request_id, 1) for r in view.running))

    core = make(hf_dirs, page_size=4, num_pages=7, max_num_batched_tokens=64)
    core.scheduler.policy = Everything()
    for rid in ("a", "b"):
        core.add_request(Request(rid, list(range(5 + len(rid), 25 + len(rid))), SamplingParams(temperature=0, max_tokens=2)))
    core.step()
    assert core.last_batch.request_ids == ["a"] and views[-1].deferred == ()
    core.step()
    assert views[-1].deferred == ("b",)


def test_a_held_request_keeps_its_room_but_does_not_stop_the_queue_behind_it(hf_dirs):
    """A request held back (the pool pins what it reads first: Scheduler.held) waits, with room kept
    for its whole prompt; a request behind it that fits in the rest runs meanwhile. It stopped the
    queue before: an engine whose head waited for a document a peer was computing ran nothing, and
    after STUCK_SECONDS the requests behind it gave their pins back and computed their documents."""
    core = make(hf_dirs, page_size=4, num_pages=30, policy="fcfs", offload="none")
    g = torch.Generator().manual_seed(5)
    head, behind, big = (Request(rid, torch.randint(3, 1000, (n,), generator=g).tolist(),
                                 SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
                         for rid, n in (("head", 40), ("behind", 10), ("big", 70)))
    for r in (head, behind, big):
        core.add_request(r)
    core.scheduler.held = {"head"}
    core.step()
    assert core.last_batch.request_ids == ["behind"]
    assert core.scheduler.held_back == ("head",)
    assert {r.request_id for r in core.scheduler.waiting} == {"head", "big"}
    assert core.pool.num_free >= 10  # the head's 40 tokens: nothing behind it took them
    core.scheduler.held = ()
    for _ in range(200):
        if not core.has_unfinished():
            break
        core.step()
    assert not core.has_unfinished() and core.pool.num_used == 0
    assert head.output_token_ids and behind.output_token_ids and big.output_token_ids


def test_a_request_waiting_for_a_peer_to_compute_its_prefix_is_out_of_the_policys_view(hf_dirs):
    """Scheduler.waiting_on (the pool's requests told that another request is computing their
    prefix) are not in the view: the step's budget goes to the requests that can run. Picked, the
    head took the whole budget and the step ran nothing."""
    core = make(hf_dirs, page_size=4, num_pages=60, policy="fcfs", offload="none", max_num_batched_tokens=32)
    g = torch.Generator().manual_seed(6)
    head, behind = (Request(rid, torch.randint(3, 1000, (40,), generator=g).tolist(),
                            SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)) for rid in ("head", "behind"))
    core.add_request(head)
    core.add_request(behind)
    core.scheduler.held = core.scheduler.waiting_on = {"head"}
    assert [v.request_id for v in core.scheduler._view().waiting] == ["behind"]
    core.step()
    assert core.last_batch.request_ids == ["behind"] and core.last_batch.total_tokens == 32
    core.scheduler.held = core.scheduler.waiting_on = ()
    for _ in range(200):
        if not core.has_unfinished():
            break
        core.step()
    assert not core.has_unfinished() and core.pool.num_used == 0
