"""Turns the policy's plan into page allocations and a batch; applies the step's sampled tokens.

    schedule() -> ScheduledBatch      (loads done -> view -> policy.plan -> preempt / admit / grow)
    issue_copies(batch)               (with a host tier: the step's write-through and load chunks)
    update(batch, sampled)            (counters, new tokens, stop checks, page publication)

A request is waiting (new or preempted), running, or loading (admitted, its KV coming back from
the host tier; it rejoins the running set when every page is in place).
"""
from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from tokenflowd.buffer.estimates import OutputLengthModel, StepTimeModel
from tokenflowd.buffer.policy import RequestView, SchedulerView, SchedulingPolicy
from tokenflowd.engine.kv_manager import KVCacheManager, PrefixHit
from tokenflowd.engine.request import FinishReason, Request, RequestStatus


def _request_view(req: Request, now: float, num_computed: int, pages_held: int, expected: float,
                  pages_reclaimed: int = 0, pages_exclusive: int | None = None, io_time: float | None = None,
                  host_tokens: int = 0, dry_for: float = 0.0) -> RequestView:
    """What a policy sees of `req`: the memory fields given, its client's side read from it."""
    return RequestView(req.request_id, req.arrival_time, req.num_tokens, num_computed, pages_held, pages_reclaimed,
                       pages_exclusive, req.priority, req.buffer.reading_rate, req.buffer.buffer(now),
                       req.num_output_tokens, req.sampling_params.max_tokens, expected, req.arrival_seq, io_time,
                       host_tokens, dry_for)


def _queue_order(req: Request) -> tuple[int, float, int]:
    """Priority (higher first), then arrival; equal arrival times (a burst) keep the order in which
    the engine took the requests, preempted or not."""
    return -req.priority, req.arrival_time, req.arrival_seq


def _arrival_order(req: Request) -> tuple[float, int]:
    return req.arrival_time, req.arrival_seq


@dataclass
class ScheduledBatch:
    """Requests computing this step and how many tokens each, starting at its num_computed_tokens."""

    requests: list[Request] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_context_tokens: int = 0  # KV tokens the batch's attention covers (computed + new, summed)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def __len__(self) -> int:
        return len(self.requests)


class Scheduler:
    def __init__(self, kv: KVCacheManager, policy: SchedulingPolicy, token_budget: int, max_num_seqs: int,
                 clock: Callable[[], float] = time.monotonic, expected_output_len: float = 1024.0) -> None:
        self.kv = kv
        self.clock = clock  # the simulator passes its virtual clock
        self.policy = policy
        self.token_budget = token_budget
        self.max_num_seqs = max_num_seqs
        self.waiting: list[Request] = []  # queue order: priority (higher first), then arrival
        self.running: list[Request] = []  # arrival order
        self.offload = kv.offload  # None: no host tier
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._num_arrivals = 0
        self._num_preempted_waiting = 0  # of self.waiting, those admitted before (num_preemptions > 0)
        self.step_model = StepTimeModel()  # fed by observe_step; read by policies through the view
        # fed by the requests that finish; the view's expected output lengths (the prior until then)
        self.output_lengths = OutputLengthModel(expected_output_len)

    def reset_models(self) -> None:
        """Forget what the step-time and output-length models learned (after the engine's warm-up,
        whose steps and lengths say nothing of its users')."""
        self.step_model = StepTimeModel()
        self.output_lengths = OutputLengthModel(self.output_lengths.prior)

    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        req.arrival_seq = self._num_arrivals
        self._num_arrivals += 1
        bisect.insort(self.waiting, req, key=_queue_order)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- schedule -----------------------------------------------------------------------------
    def _view(self) -> SchedulerView:
        now = self.clock()
        pool, off = self.kv.pool, self.offload
        loading = off.loading if off else []
        # Every started request (preempted ones wait here too) and the new ones that could be
        # admitted this step: a policy that saw only the queue's head could starve a preempted
        # request queued behind newer ones of higher priority.
        waiting = self._visible_waiting()
        expected = self._expected_outputs([*self.running, *waiting, *loading]).tolist()
        # Preemption is possible only when the free pages cannot give every running request one
        # more page; only then is it worth counting which of a request's pages are its alone.
        tight = pool.num_free < len(self.running)
        nr, nw = len(self.running), len(waiting)
        running = tuple(
            _request_view(r, now, r.num_computed_tokens, len(r.block_table), e,
                          pages_exclusive=sum(pool.ref_count(p) == 1 for p in r.block_table) if tight else None,
                          # were it preempted now: write what the host lacks, then load it all back
                          io_time=off.write_time(r) + off.io_time(len(r.block_table)) if off and tight else None)
            for r, e in zip(self.running, expected)
        )
        waiting_views = []
        for r, e in zip(waiting, expected[nr:]):
            hit = self.kv.prefix_hit(r)
            io, host_tokens = self._host_prefix(r, hit.num_pages)
            # how long its reader has waited: only a waiting request's silence is scheduled on (a
            # view is built every step, so running requests do not pay for it)
            waiting_views.append(_request_view(r, now, hit.num_pages * self.kv.page_size, hit.num_pages, e,
                                               hit.num_evictable, io_time=io, host_tokens=host_tokens,
                                               dry_for=r.buffer.dry_for(now)))
        loading_views = tuple(_request_view(r, now, r.num_load_tokens, len(r.block_table), e)
                              for r, e in zip(loading, expected[nr + nw:]))
        return SchedulerView(
            now=now,
            running=running,
            waiting=tuple(waiting_views),
            free_pages=pool.num_free,
            total_pages=pool.num_pages,
            page_size=self.kv.page_size,
            token_budget=self.token_budget,
            max_num_seqs=max(1, self.max_num_seqs - len(loading)),
            cost=self.step_model.cost,
            host_pages=off.host.num_pages if off else 0,
            loading=loading_views,
        )

    def _visible_waiting(self) -> list[Request]:
        """The waiting requests a plan may touch: every preempted one, and new ones up to
        max_num_seqs (no more could be admitted in one step), in queue order."""
        out, num_new = [], 0
        for r in self.waiting:
            if r.num_preemptions:
                out.append(r)
            elif num_new < self.max_num_seqs:
                out.append(r)
                num_new += 1
            elif self._num_preempted_waiting == len(out) - num_new:
                break  # every preempted request is in already
        return out

    def _expected_outputs(self, reqs: list[Request]) -> np.ndarray:
        n = np.fromiter((r.num_output_tokens for r in reqs), dtype=np.float64, count=len(reqs))
        bound = np.fromiter((r.max_tokens for r in reqs), dtype=np.float64, count=len(reqs))
        return self.output_lengths.expected(n, bound)

    def _host_prefix(self, req: Request, device_hit_pages: int) -> tuple[float | None, int]:
        """(t_IO, tokens) of bringing `req`'s KV back from the host tier; (None, 0): nothing to load."""
        if self.offload is None:
            return None, 0
        hp = self.offload.host_prefix(req, device_hit_pages)
        if not hp.num_tokens:
            return None, 0
        return self.offload.io_time(hp.num_pages_to_load, hp.num_disk_pages, hp.num_unwritten_pages), hp.num_tokens

    def _try_load(self, req: Request, hit: PrefixHit, planned: bool) -> bool | None:
        """Admit `req` by loading its KV from the host tier when the plan says so or it is faster
        than recomputing. None: not a load (admit as usual); else whether it was admitted."""
        io, tokens = self._host_prefix(req, hit.num_pages)
        if io is None:
            return None
        if not planned and io >= self.step_model.cost.recompute_time(tokens - hit.num_pages * self.kv.page_size):
            return None
        if not self.kv.start_load(req, hit, tokens):
            return False
        self._leave_queue(req)
        return True

    def _leave_queue(self, req: Request) -> None:
        self.waiting.remove(req)
        if req.num_preemptions:
            self._num_preempted_waiting -= 1

    def _resume(self, req: Request) -> None:
        """Its pages are in place: it runs again with its loaded tokens computed."""
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = req.num_load_tokens
        self.kv.commit(req)
        bisect.insort(self.running, req, key=_arrival_order)

    def issue_copies(self, batch: ScheduledBatch) -> None:
        """Before the step runs: write-through and load chunks sized to end within it (§5.2)."""
        if self.offload is None:
            return
        # An empty step hides nothing: then every queued load and write goes at once.
        seconds = self.step_model.cost.step_time(batch.total_tokens, batch.num_context_tokens) if batch.requests \
            else math.inf
        now = self.clock()
        self.offload.issue(seconds, self.running, lambda r: r.buffer.buffer(now))

    def poll_copies(self) -> None:
        """Account for the host-tier copies that ended; requests whose pages are in place run again."""
        if self.offload is not None:
            for req in self.offload.poll():
                self._resume(req)

    def schedule(self) -> ScheduledBatch:
        self.poll_copies()
        plan = self.policy.plan(self._view())
        ids = [rid for rid, _ in plan.scheduled]
        assert len(set(ids)) == len(ids), f"{self.policy.name} scheduled a request twice"
        assert not set(ids) & set(plan.preempted), f"{self.policy.name} scheduled a preempted request"
        assert sum(n for _, n in plan.scheduled) <= self.token_budget, f"{self.policy.name} overspent the budget"
        batch = ScheduledBatch()
        for rid in plan.preempted:
            req = self.requests[rid]
            assert req.status is RequestStatus.RUNNING, f"policy preempted {rid}, which is not running"
            self.kv.preempt(req)
            req.status = RequestStatus.PREEMPTED
            req.num_preemptions += 1
            self.num_preemptions += 1
            self.running.remove(req)
            self.waiting.append(req)
            self._num_preempted_waiting += 1
            batch.preempted.append(req)
        if plan.preempted:
            self.waiting.sort(key=_queue_order)
        assert self.offload or not plan.reload, f"{self.policy.name} planned a reload, but there is no host KV tier"
        reload = set(plan.reload)
        admitted = blocked = False
        for rid, n in plan.scheduled:
            req = self.requests[rid]
            assert n >= 1, f"{self.policy.name} scheduled {n} tokens of {rid}"
            if req.status is RequestStatus.RUNNING:
                assert n <= req.num_tokens - req.num_computed_tokens, f"{self.policy.name} overran {rid}"
                ok = self.kv.grow(req, n)
            elif blocked:
                continue  # keep arrival order: nothing jumps a request that could not be admitted
            else:
                hit = self.kv.prefix_hit(req)
                loading = self._try_load(req, hit, rid in reload) if self.offload is not None else None
                if loading is not None:  # it rejoins the batch once its pages are in place
                    blocked = not loading
                    continue
                ok = self.kv.admit(req, hit, n)
                blocked = not ok
                if ok:
                    req.status = RequestStatus.RUNNING
                    self._leave_queue(req)
                    self.running.append(req)
                    admitted = True
            # The plan can overestimate room (its prefix hit was evicted by an earlier admission
            # this step): what does not fit waits for the next step's view.
            if ok:
                batch.requests.append(req)
                n = min(n, req.num_tokens - req.num_computed_tokens)
                batch.num_tokens.append(n)
                batch.num_context_tokens += req.num_computed_tokens + n
        if admitted:
            self.running.sort(key=_arrival_order)
        return batch

    def observe_step(self, batch: ScheduledBatch, seconds: float) -> None:
        """How long `batch` took to compute (wall time on the engine, virtual in the simulator)."""
        self.step_model.observe(batch.total_tokens, batch.num_context_tokens, seconds)

    # -- update -------------------------------------------------------------------------------
    def update(self, batch: ScheduledBatch, sampled: list[int | None]) -> list[Request]:
        """Apply one step's results. `sampled[i]` is the token drawn for batch.requests[i], or None
        when its chunk ended mid-prompt. Returns the requests that finished this step."""
        finished = []
        now = self.clock()
        for req, n, token in zip(batch.requests, batch.num_tokens, sampled):
            if req.is_finished:  # aborted while the step ran
                continue
            req.num_computed_tokens += n
            self.kv.commit(req)
            if token is None:
                continue
            req.token_ids.append(token)
            req.buffer.on_tokens(1, now)
            reason = self._stop_reason(req, token)
            if reason is not None:
                self.finish(req, reason)
                finished.append(req)
        return finished

    @staticmethod
    def _stop_reason(req: Request, token: int) -> FinishReason | None:
        if token in req.stop_token_ids:  # the sampler masks them until min_tokens
            return FinishReason.STOP
        if req.num_output_tokens >= req.max_tokens:
            return FinishReason.LENGTH
        return None

    def finish(self, req: Request, reason: FinishReason, error: str | None = None) -> None:
        """End a request wherever it is, and free its pages at once."""
        if req.is_finished:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is not RequestStatus.LOADING:  # a loading one leaves the offload manager in kv.free
            self._leave_queue(req)
        if reason in (FinishReason.STOP, FinishReason.LENGTH):
            self.output_lengths.observe(req.num_output_tokens)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.error = error
        del self.requests[req.request_id]

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, FinishReason.ABORT)
        return req
