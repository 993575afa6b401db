"""The discrete-event simulator: the engine's own EngineCore (its Scheduler, KV manager, page pool
and policy) on a virtual clock, with the cost model's executor in place of the model runner.

One step is EngineCore.step (engine/core.py); around it the simulator only feeds arrivals and
keeps the records:

    admit arrivals with arrival_time <= now      scheduler.add(Request(..., arrival_time=t))
    core.step():
      batch = scheduler.schedule()               the view is taken at `now` (the step's start)
      executor.execute(batch): now += dt         the step's tokens exist from its end
      scheduler.update(batch, sampled)           buffers see each token at `now`
      scheduler.observe_step(batch, dt)          the live step-time model the policies read
    record core.last_batch and the outputs       admissions, preemptions, token times

When nothing is unfinished the clock jumps to the next arrival. A request ends at its workload
output length: the executor samples the end-of-sequence token there, so the engine learns a
request's length only when it ends, as a real one does (it knows the client's max_tokens where the
workload sets one). Arrivals during a step join at its end, as they would join a real engine's
queue between steps; arrivals at one instant join in workload order, and the scheduler's arrival
sequence keeps that order through preemptions.

Per step the loop outside the scheduler does O(batch) work; nothing here walks all requests.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from tokenflowd.buffer.policy import SchedulingPolicy
from tokenflowd.engine.core import EngineCore
from tokenflowd.engine.request import Request, SamplingParams
from tokenflowd.engine.scheduler import Scheduler
from tokenflowd.kv.manager import KVCacheManager
from tokenflowd.kv.pages import PagePool
from tokenflowd.offload.tiers import HostTier
from tokenflowd.offload.traffic import HostOffloader
from tokenflowd.sim.clock import VirtualClock
from tokenflowd.sim.copier import SimCopier
from tokenflowd.sim.cost import CostModel
from tokenflowd.sim.executor import CostModelExecutor
from tokenflowd.sim.workload import WorkloadRequest, prompt_token_ids

SIM_VOCAB_SIZE = 32_000  # prompt token ids are drawn below it; the cost model does not care which
SIM_EOS = 1  # the token the executor ends a response with
IDLE_LIMIT = 120.0  # virtual s a policy may schedule nothing while requests wait and none arrives


def host_offloader(cost: CostModel, pool: PagePool, clock: VirtualClock, mode: str, host_pages: int,
                   overlap: bool = True, prefix_caching: bool = True) -> HostOffloader:
    """A host KV tier of `host_pages` pages behind `pool`, bookkeeping only (offload/), its copies
    at the cost model's host link in `clock`'s virtual time: one engine's, here or in a node."""
    copier = SimCopier(cost.host_link_bandwidth * cost.host_link_efficiency, clock)
    host = HostTier(host_pages, cost.kv_bytes_per_token * cost.page_size, None, prefix_caching)
    return HostOffloader(pool, cost.page_size, host, copier, mode, overlap)


class SimulationError(RuntimeError):
    """The run cannot finish: a livelock, a policy that stopped scheduling, or leaked pages."""


@dataclass(slots=True)
class RequestRecord:
    """One request's life in virtual seconds. Its device intervals are
    [admit, p1), [r1, p2), ..., [rk, finish): preempt_times[i] ends one, resume_times[i] starts the next."""

    request_id: str
    arrival: float
    reading_rate: float
    prompt_len: int
    output_len: int
    token_times: list[float] = field(default_factory=list)  # each sampled token at its step's end
    admit_time: float | None = None
    preempt_times: list[float] = field(default_factory=list)
    resume_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served at the first admission

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    def running_intervals(self) -> list[tuple[float, float]]:
        if self.admit_time is None:
            return []
        starts = [self.admit_time, *self.resume_times]
        ends = [*self.preempt_times, self.finish_time]
        return [(s, e) for s, e in zip(starts, ends) if e is not None]


@dataclass(slots=True)
class SimResult:
    records: list[RequestRecord]  # in workload order
    num_steps: int
    num_preemptions: int
    computed_tokens: int  # tokens computed over all steps, recomputation included
    makespan: float  # virtual s from t = 0 to the last token
    policy: str


class Simulator:
    def __init__(self, cost: CostModel, workload: Sequence[WorkloadRequest], policy: SchedulingPolicy, *,
                 enable_prefix_caching: bool = True, max_steps: int | None = None,
                 max_steps_without_token: int = 100_000, offload: str = "none", host_kv_memory: int = 0,
                 load_evict_overlap: bool = True, expected_output_len: float = 1024.0, step_jitter: float = 0.0,
                 jitter_seed: int = 0) -> None:
        self.cost = cost
        self.workload = sorted(workload, key=lambda r: r.arrival_time)  # stable: ties keep workload order
        self._check_fits()
        self.clock = VirtualClock()
        self.pool = PagePool(cost.num_pages, enable_prefix_caching)
        self.kv = self._kv(offload, host_kv_memory, load_evict_overlap, enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, policy, cost.max_num_batched_tokens, cost.max_num_seqs, clock=self.clock,
                                   expected_output_len=expected_output_len)
        self.executor = CostModelExecutor(cost, {r.request_id: r.output_len for r in self.workload}, self.clock,
                                          eos_token_id=SIM_EOS, jitter=step_jitter, jitter_seed=jitter_seed)
        self.core = EngineCore(self.executor, self.scheduler, max_model_len=cost.max_model_len,
                               vocab_size=SIM_VOCAB_SIZE, eos_token_ids=(SIM_EOS,))
        # Enough for every token in its own step and every prompt re-run a few times; a run that
        # needs more is stuck, and says so instead of running for hours.
        self.max_steps = max_steps or 10 * sum(r.output_len + r.prompt_len // cost.max_num_batched_tokens + 1
                                               for r in self.workload) + 10_000
        self.max_steps_without_token = max_steps_without_token
        self.records = {r.request_id: RequestRecord(r.request_id, r.arrival_time, r.reading_rate, r.prompt_len,
                                                    r.output_len) for r in workload}
        if len(self.records) != len(workload):
            raise ValueError("workload request ids must be unique")

    def _kv(self, mode: str, host_kv_memory: int, overlap: bool, prefix_caching: bool) -> KVCacheManager:
        """The engine's KV manager; with offload, over a bookkeeping-only host tier and a virtual-time copier."""
        if mode == "none":
            return KVCacheManager(self.pool, self.cost.page_size)
        page_bytes = self.cost.kv_bytes_per_token * self.cost.page_size
        if host_kv_memory < page_bytes:
            raise ValueError(f"offload {mode} needs a host tier of at least one page ({page_bytes} bytes)")
        return KVCacheManager(self.pool, self.cost.page_size,
                              host_offloader(self.cost, self.pool, self.clock, mode, host_kv_memory // page_bytes,
                                             overlap, prefix_caching))

    def _check_fits(self) -> None:
        room = self.cost.max_tokens_in_pool
        for r in self.workload:
            if r.prompt_len + r.output_len > room:
                raise ValueError(
                    f"request {r.request_id} needs {r.prompt_len + r.output_len} tokens of KV but the "
                    f"{self.cost.name} pool holds {room}: use a larger kv_memory, or cap prompts (--max-prompt-len)"
                )

    def _request(self, w: WorkloadRequest) -> Request:
        """The workload's request, valid by construction (_check_fits): each is given a context of
        its own (at least the cost model's), so EngineCore.add_request's checks are not needed."""
        req = Request(w.request_id, prompt_token_ids(w, SIM_VOCAB_SIZE), SamplingParams(max_tokens=w.max_tokens),
                      eos_token_ids=(SIM_EOS,), arrival_time=w.arrival_time, reading_rate=w.reading_rate,
                      priority=w.priority)
        req.max_model_len = max(self.cost.max_model_len, w.prompt_len + w.output_len)
        return req

    def run(self) -> SimResult:
        clock, core, sched, records = self.clock, self.core, self.scheduler, self.records
        pending = deque(self.workload)
        on_device: set[str] = set()  # ids the loop has seen start running and not stop (membership only)
        steps = computed = steps_since_token = 0
        idle_since: float | None = None
        while pending or sched.has_unfinished():
            while pending and pending[0].arrival_time <= clock.now:
                sched.add(self._request(pending.popleft()))
            if not sched.has_unfinished():
                clock.now = pending[0].arrival_time  # idle: jump to the next arrival
                continue
            start = clock.now
            outs = core.step()
            batch = core.last_batch
            for rid in batch.preempted:
                records[rid].preempt_times.append(start)
                on_device.discard(rid)
            if not len(batch):
                if clock.now > start:
                    continue  # the step waited for a load in flight (the copier moved the clock)
                # The policy ran nothing: let virtual time pass (buffers drain, the interval
                # elapses) up to the next arrival, and give up if that never ends.
                idle_since = start if idle_since is None else idle_since
                if start - idle_since > IDLE_LIMIT:
                    raise SimulationError(
                        f"policy {sched.policy.name} scheduled nothing for {IDLE_LIMIT:g} virtual s at t={start:.3f} "
                        f"with {len(sched.running)} running and {len(sched.waiting)} waiting requests"
                    )
                tick = max(self.cost.step_overhead, 1e-3)
                clock.now = min(start + tick, pending[0].arrival_time) if pending else start + tick
                continue
            idle_since = None
            for rid in batch.request_ids:
                if rid not in on_device:
                    on_device.add(rid)
                    rec = records[rid]
                    if rec.admit_time is None:
                        rec.admit_time = start
                        rec.num_cached_tokens = sched.requests[rid].num_cached_tokens if rid in sched.requests \
                            else next(o.num_cached_tokens for o in outs if o.request_id == rid)
                    else:
                        rec.resume_times.append(start)
            computed += batch.total_tokens
            now = clock.now
            steps_since_token += 1
            for out in outs:
                if out.new_token_ids:
                    records[out.request_id].token_times.append(now)
                    steps_since_token = 0
                if out.finished:
                    records[out.request_id].finish_time = now
                    on_device.discard(out.request_id)
            steps += 1
            if steps >= self.max_steps or steps_since_token >= self.max_steps_without_token:
                raise SimulationError(
                    f"policy {sched.policy.name}: {steps} steps by t={now:.3f} ({steps_since_token} without a "
                    f"new token), {len(sched.running)} running and {len(sched.waiting)} waiting requests: a livelock"
                )
        self._check_end()
        ordered = [records[w.request_id] for w in self.workload]
        makespan = max((r.token_times[-1] for r in ordered if r.token_times), default=0.0)
        return SimResult(ordered, steps, sched.num_preemptions, computed, makespan, sched.policy.name)

    def _check_end(self) -> None:
        self.core.wait_copies()  # copies still in flight pin pages: let them end
        if self.kv.host.pool.num_used:
            raise SimulationError(f"{self.kv.host.pool.num_used} host KV pages still held at the end")
        if self.pool.num_used:
            raise SimulationError(f"{self.pool.num_used} KV pages still held after every request finished")
        short = [r.request_id for r in self.records.values() if len(r.token_times) != r.output_len]
        if short:
            raise SimulationError(f"requests {', '.join(short[:5])} ended without their output length of tokens")
