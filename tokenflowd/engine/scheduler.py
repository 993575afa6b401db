"""Turns the policy's plan into page allocations and a batch; applies the step's sampled tokens.

    schedule() -> ScheduledBatch      (copies done -> view -> policy.plan -> preempt / admit / grow)
    issue_copies(batch)               (the step's write-through and load chunks)
    update(batch, sampled)            (counters, new tokens, stop checks, page publication)

Scheduled `ahead` (overlap scheduling, engine/core.py), the next step is scheduled before the last one's
tokens reach the host: a row's tokens count as computed when it is scheduled, a row that samples
leaves a PLACEHOLDER at the end of its request's tokens (the next step's row of that request reads
the token from the device, `prev_sample`), and update fills it in. So EOS and stop tokens are seen
a step late: the extra row's token is never applied. A request whose pending token is its last
(max_tokens) is not scheduled again; one preempted or aborted with a step in flight gets its token
applied, or dropped with it.

A request is waiting (new or preempted), running, or loading (admitted, its KV coming back from
a lower tier; it rejoins the running set when every page is in place). The scheduler keeps the
three queues; where each request's KV lives is the KV manager's (kv/manager.py).
"""
from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Container

import numpy as np

from tokenflowd.buffer.estimates import OutputLengthModel, StepCost, StepTimeModel
from tokenflowd.buffer.policy import RequestView, SchedulerView, SchedulingPolicy
from tokenflowd.engine.request import PLACEHOLDER, FinishReason, Request, RequestStatus, SamplingRow
from tokenflowd.kv.manager import KVCacheManager, PrefixMatch
from tokenflowd.kv.pages import cdiv


def _request_view(req: Request, now: float, num_computed: int, pages_held: int, expected: float,
                  pages_reclaimed: int = 0, pages_exclusive: int | None = None, io_time: float | None = None,
                  host_tokens: int = 0, dry_for: float = 0.0) -> RequestView:
    """What a policy sees of `req`: the memory fields given, its client's side read from it (its
    output tokens as its client gets them: not a token still in flight). Built for every tracked
    request every step, so positionally, in RequestView's field order."""
    ids = req.token_ids
    n = len(ids)
    return RequestView(
        req.request_id, req.arrival_time, n, num_computed, pages_held, pages_reclaimed, pages_exclusive, req.priority,
        req.buffer.reading_rate, req.buffer.buffer(now), n - req.num_prompt_tokens - (ids[-1] == PLACEHOLDER),
        req.sampling_params.max_tokens, expected, req.arrival_seq, io_time, host_tokens, dry_for)


def _queue_order(req: Request) -> tuple[int, float, int]:
    """Priority (higher first), then arrival; equal arrival times (a burst) keep the order in which
    the engine took the requests, preempted or not."""
    return -req.priority, req.arrival_time, req.arrival_seq


def _arrival_order(req: Request) -> tuple[float, int]:
    return req.arrival_time, req.arrival_seq


@dataclass
class ScheduledBatch:
    """One step as plain data. Row i computes tokens [positions[i], positions[i] + num_tokens[i]) of
    request_ids[i], whose ids are input_ids[i], into the pages of block_tables[i] (sized beforehand).
    A row whose chunk reaches its request's last known token samples: sampling[i] says how (None
    for a chunk that ends mid-prompt or mid-recompute). Executors read it and change nothing."""

    request_ids: list[str] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    input_ids: list[list[int]] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    sampling: list[SamplingRow | None] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    num_context_tokens: int = 0  # KV tokens the batch's attention covers (computed + new, summed)
    # per row: tokens before the request's own whose KV peers of the pool hold (request.py
    # prefix_offset): its positions in the sequence are positions[i] + offsets[i]
    offsets: list[int] = field(default_factory=list)
    # per row, scheduled ahead: the index, among the sampling rows of the step launched before this one,
    # of the row whose token is this row's last input id (a PLACEHOLDER here); -1: none
    prev_sample: list[int] = field(default_factory=list)
    # per row, scheduled ahead: where in its request's token_ids its sampled token goes (-1: it samples none)
    token_index: list[int] = field(default_factory=list)
    seq: int = 0  # the scheduler's count of batches before this one
    ahead: bool = False  # scheduled ahead of the step in flight (the module's doc)
    num_sampling: int = 0  # rows that sample

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def __len__(self) -> int:
        return len(self.request_ids)

    def add(self, req: Request, n: int, block_table: list[int]) -> None:
        start = req.num_computed_tokens
        self.request_ids.append(req.request_id)
        self.num_tokens.append(n)
        self.positions.append(start)
        self.input_ids.append(req.token_ids[start : start + n])
        self.block_tables.append(list(block_table))  # a copy: the manager's list grows in later steps
        samples = start + n == req.num_tokens
        self.sampling.append(req.sampling_row() if samples else None)
        self.num_sampling += samples
        self.offsets.append(req.prefix_offset)
        self.num_context_tokens += req.prefix_offset + start + n
        self.prev_sample.append(-1)
        self.token_index.append(-1)


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
        self.loading: list[Request] = []  # admission order: admitted, their KV coming back
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._num_arrivals = 0
        self._num_preempted_waiting = 0  # of self.waiting, those admitted before (num_preemptions > 0)
        self._matches: dict[str, PrefixMatch] = {}  # this step's prefix matches of the waiting requests in view
        # waiting requests with no token yet: their view of the last pass and what it was built from
        self._waiting_views: dict[str, tuple] = {}
        self._deferred: tuple[str, ...] = ()  # of the last plan, what was scheduled and not run
        self.step_model = StepTimeModel()  # fed by observe_step; read by policies through the view
        # of this engine's time, the share its pool peers take (their queries and puts, pool/member.py):
        # the model fits the engine's own work, and `cost` slows it by this share
        self.pool_share = 0.0
        # queued requests not to be admitted yet: the pool pins what they read first (pool/ahead.py).
        # Such a request keeps room for its whole prompt: one behind it is admitted only in what is
        # left (it stopped the queue before, and an engine whose head waited for a document a peer
        # was computing ran nothing while the requests behind it, their reads pinned, could have:
        # after STUCK_SECONDS they gave their pins back and computed their documents whole)
        self.held: Container[str] = ()
        # of those, the ones waiting for another request to compute the prefix they read (the pool's
        # Reads.pending): hidden from the policy until then, since nothing it plans can run them.
        # Picked, such a request took the step's budget: an engine whose head waited for a document
        # a peer was computing ran nothing for seconds
        self.waiting_on: Container[str] = ()
        self.held_back: tuple[str, ...] = ()  # of the last plan, the held requests it would have admitted
        # fed by the requests that finish; the view's expected output lengths (the prior until then)
        self.output_lengths = OutputLengthModel(expected_output_len)
        # of batches scheduled ahead: request id -> (seq of the batch, index among its sampling rows) of the step whose
        # token the request's PLACEHOLDER stands for
        self._pending: dict[str, tuple[int, int]] = {}
        self._num_batches = 0

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
        self.kv.track(req)
        bisect.insort(self.waiting, req, key=_queue_order)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- schedule -----------------------------------------------------------------------------
    def _view(self) -> SchedulerView:
        now = self.clock()
        kv = self.kv
        pool = kv.pool
        # Every started request (preempted ones wait here too) and the new ones that could be
        # admitted this step: a policy that saw only the queue's head could starve a preempted
        # request queued behind newer ones of higher priority.
        waiting = self._visible_waiting()
        expected = self._expected_outputs([*self.running, *self.loading]).tolist()
        # Preemption is possible only when the free pages cannot give every running request one
        # more page; only then is it worth counting which of a request's pages are its alone.
        tight = pool.num_free < len(self.running)
        nr = len(self.running)
        running = tuple(
            _request_view(r, now, r.num_computed_tokens, len(kv.block_table(r)), e,
                          pages_exclusive=kv.pages_exclusive(r) if tight else None,
                          io_time=kv.preempt_io_time(r) if tight else None)
            for r, e in zip(self.running, expected)
        )
        self._matches = {}
        waiting_views = self._waiting_views_of(waiting, now)
        loading_views = tuple(_request_view(r, now, kv.state(r).num_load_tokens, len(kv.block_table(r)), e)
                              for r, e in zip(self.loading, expected[nr:]))
        return SchedulerView(
            now=now,
            running=running,
            waiting=tuple(waiting_views),
            free_pages=pool.num_free,
            total_pages=pool.num_pages,
            page_size=kv.page_size,
            token_budget=self.token_budget,
            max_num_seqs=max(1, self.max_num_seqs - len(self.loading)),
            cost=self.cost,
            host_pages=kv.host.num_pages,
            loading=loading_views,
            deferred=self._deferred,
        )

    def _waiting_views_of(self, waiting: list[Request], now: float) -> list[RequestView]:
        """The views of `waiting`, with their prefix matches kept for this pass. A request whose
        client has no token yet keeps its view of the last pass while its match (kv.view_match),
        the output-length model and its own fields are as they were: its buffer is 0 and it has
        waited on nothing, so nothing else in its view moves."""
        kv, cache, version = self.kv, self._waiting_views, self.output_lengths.version
        views: list[RequestView | None] = []
        missed: list[tuple[int, Request, PrefixMatch]] = []
        for r, m in zip(waiting, kv.view_matches(waiting)):
            self._matches[r.request_id] = m
            last = cache.get(r.request_id)
            if (last is not None and last[0] is m and last[1] == version and r.buffer.first_token_time is None
                    and last[2] == r.buffer.reading_rate and last[3] == r.priority):
                views.append(last[4])
            else:
                missed.append((len(views), r, m))
                views.append(None)
        if missed:
            expected = self._expected_outputs([r for _, r, _ in missed]).tolist()
            for (i, r, m), e in zip(missed, expected):
                # how long its reader has waited: only a waiting request's silence is scheduled on
                # (a view is built every step, so running requests do not pay for it)
                view = views[i] = _request_view(
                    r, now, m.num_device_pages * kv.page_size, m.num_device_pages, e, m.num_evictable,
                    io_time=m.io_time, host_tokens=m.num_load_tokens, dry_for=r.buffer.dry_for(now))
                if r.buffer.first_token_time is None:
                    cache[r.request_id] = (m, version, r.buffer.reading_rate, r.priority, view)
        return views  # type: ignore[return-value]

    def _ending(self, req: Request) -> bool:
        """Ahead: its token in flight is its last (max_tokens, or the context's end)."""
        return req.request_id in self._pending and req.num_output_tokens >= req.max_tokens

    def _visible_waiting(self) -> list[Request]:
        """The waiting requests a plan may touch: every preempted one, and new ones up to
        max_num_seqs (no more could be admitted in one step), in queue order; none `waiting_on`."""
        out, num_new = [], 0
        hidden = self.waiting_on if self.waiting_on else None  # (its truth taken once, not per request)
        for r in self.waiting:
            if r.num_preemptions:
                out.append(r)
            elif hidden is not None and r.request_id in hidden:
                continue
            elif num_new < self.max_num_seqs:
                out.append(r)
                num_new += 1
            elif self._num_preempted_waiting == len(out) - num_new:
                break  # every preempted request is in already
        return out

    def _expected_outputs(self, reqs: list[Request]) -> np.ndarray:
        # (Request.num_output_tokens and .max_tokens, inlined: this runs over every running request
        # every step, and the properties' calls were most of its cost)
        outs, bounds = [], []
        for r in reqs:
            outs.append(len(r.token_ids) - r.num_prompt_tokens)
            mt, room = r.sampling_params.max_tokens, r.max_model_len - r.num_prompt_tokens
            bounds.append(room if mt is None or mt > room else mt)
        return self.output_lengths.expected(np.array(outs, dtype=np.float64), np.array(bounds, dtype=np.float64))

    def _match(self, req: Request) -> PrefixMatch:
        """The view's prefix match of `req`, as it stands now (earlier admissions may have moved it)."""
        m = self._matches.get(req.request_id)
        return self.kv.match(req) if m is None else self.kv.refresh(req, m)

    def _try_load(self, req: Request, m: PrefixMatch, planned: bool) -> bool | None:
        """Admit `req` by loading its KV from a lower tier when the plan says so or it is faster
        than recomputing. None: not a load (admit as usual); else whether it was admitted."""
        if m.io_time is None:
            return None
        recompute = self.cost.recompute_time(m.num_load_tokens - m.num_device_pages * self.kv.page_size)
        if not planned and m.io_time >= recompute:
            return None
        if not self.kv.start_load(req, m):
            return False
        self._leave_queue(req)
        req.status = RequestStatus.LOADING
        self.loading.append(req)
        return True

    def _leave_queue(self, req: Request) -> None:
        self.waiting.remove(req)
        self._waiting_views.pop(req.request_id, None)
        if req.num_preemptions:
            self._num_preempted_waiting -= 1

    def _requeue(self, req: Request) -> None:
        """Back to the waiting queue (a preemption, a failed load), in queue order."""
        req.status = RequestStatus.PREEMPTED if req.num_preemptions else RequestStatus.WAITING
        bisect.insort(self.waiting, req, key=_queue_order)
        self._num_preempted_waiting += bool(req.num_preemptions)

    def issue_copies(self, batch: ScheduledBatch) -> None:
        """Before the step runs: write-through and load chunks sized to end within it (§5.2)."""
        # An empty step hides nothing: then every queued load and write goes at once.
        seconds = self.cost.step_time(batch.total_tokens, batch.num_context_tokens) if len(batch) \
            else math.inf
        now = self.clock()
        self.kv.issue(seconds, self.running, self.loading, lambda r: r.buffer.buffer(now))

    def add_remote(self, req: Request, num_tokens: int) -> list[int] | None:
        """A request another node (its prefill node) computes: its first `num_tokens` of KV (the
        prompt's) will be written into the pages returned. It waits in `loading` until
        `remote_arrived`. None (and nothing changes) when the pages are not free now, or no seat
        (max_num_seqs) is: its pages would sit idle while it waits, and it would go ahead of the
        requests queued before it."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        ahead = bisect.bisect_left(self.waiting, _queue_order(req), key=_queue_order)
        if len(self.running) + len(self.loading) + ahead >= self.max_num_seqs:
            return None
        self.kv.track(req)
        pages = self.kv.start_remote(req, num_tokens)
        if pages is None:
            self.kv.free(req)
            return None
        self.requests[req.request_id] = req
        req.arrival_seq = self._num_arrivals
        self._num_arrivals += 1
        req.status = RequestStatus.LOADING
        self.loading.append(req)
        return pages

    def remote_arrived(self, req: Request, first_token: int | None, settled: bool = True) -> bool:
        """Its KV is in place and `first_token` is what the prefill node sampled (it joins the batch
        at the next step), or the transfer failed (None: it computes its prompt here; `settled` as
        in kv.remote_done). -> whether the first token ended it (a stop token, max_tokens 1)."""
        if first_token is None:
            self.kv.remote_done(req, False, settled)
            return False
        req.token_ids.append(first_token)
        req.buffer.on_tokens(1, self.clock())
        reason = self._stop_reason(req, first_token, req.num_output_tokens)
        if reason is not None:
            self.kv.finish_load(req)  # the pages hold the prompt: cached for the next turn
            self.finish(req, reason)
            return True
        self.kv.remote_done(req, True)
        return False

    def poll_copies(self) -> None:
        """Account for the copies that ended: requests whose pages are in place run again, and those
        whose load failed wait again (they recompute)."""
        done = self.kv.poll()
        for req in done.ready:
            self.loading.remove(req)
            req.status = RequestStatus.RUNNING
            self.kv.finish_load(req)
            bisect.insort(self.running, req, key=_arrival_order)
        for req in done.failed:
            self.loading.remove(req)
            self._requeue(req)

    def schedule(self, ahead: bool = False) -> ScheduledBatch:
        """The next step's batch; `ahead`: while another step is in flight (the module's doc)."""
        self.poll_copies()
        plan = self.policy.plan(self._view())
        ids = [rid for rid, _ in plan.scheduled]
        assert len(set(ids)) == len(ids), f"{self.policy.name} scheduled a request twice"
        assert not set(ids) & set(plan.preempted), f"{self.policy.name} scheduled a preempted request"
        assert sum(n for _, n in plan.scheduled) <= self.token_budget, f"{self.policy.name} overspent the budget"
        batch = ScheduledBatch(seq=self._num_batches, ahead=ahead)
        self._num_batches += 1
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
            batch.preempted.append(rid)
        if plan.preempted:
            self.waiting.sort(key=_queue_order)
        assert self.kv.can_reload or not plan.reload, f"{self.policy.name} planned a reload, but there is no host KV tier"
        reload = set(plan.reload)
        deferred, held_back = [], []
        admitted = blocked = False
        kept = 0  # pages kept for the held requests passed over (`held`)
        for rid, n in plan.scheduled:
            req = self.requests[rid]
            assert n >= 1, f"{self.policy.name} scheduled {n} tokens of {rid}"
            if req.status is RequestStatus.RUNNING:
                assert n <= req.num_tokens - req.num_computed_tokens, f"{self.policy.name} overran {rid}"
                if ahead and self._ending(req):  # its token in flight is its last: it ends when that comes back
                    continue
                ok = self.kv.grow(req, n)
            elif blocked:
                deferred.append(rid)
                continue  # keep arrival order: nothing jumps a request that could not be admitted
            elif rid in self.held:
                held_back.append(rid)
                deferred.append(rid)
                kept += cdiv(req.num_tokens, self.kv.page_size)
                continue
            else:
                m = self._match(req)
                if kept and m.io_time is not None:  # (a load's pages are not weighed against them)
                    blocked = True
                    deferred.append(rid)
                    continue
                loading = self._try_load(req, m, rid in reload)
                if loading is not None:  # it rejoins the batch once its pages are in place
                    blocked = not loading
                    if blocked:
                        deferred.append(rid)
                    continue
                ok = self.kv.admit(req, m, n, keep_free=kept)
                blocked = not ok
                if ok:
                    req.status = RequestStatus.RUNNING
                    self._leave_queue(req)
                    self.running.append(req)
                    admitted = True
            # The plan can overestimate room (its prefix hit was evicted by an earlier admission
            # this step): what does not fit waits for the next step's view, which says so.
            if ok:
                batch.add(req, min(n, req.num_tokens - req.num_computed_tokens), self.kv.block_table(req))
                if ahead:
                    self._schedule_ahead(req, batch)
            else:
                deferred.append(rid)
        if admitted:
            self.running.sort(key=_arrival_order)
        self._deferred = tuple(deferred)
        self.held_back = tuple(held_back)
        self._matches = {}
        return batch

    def _schedule_ahead(self, req: Request, batch: ScheduledBatch) -> None:
        """Ahead: the row just added to `batch` counts as computed now; if it samples, its token is
        a PLACEHOLDER until update. A row whose last input is the token in flight reads it there."""
        i = len(batch) - 1
        ids = batch.input_ids[i]
        if ids[-1] == PLACEHOLDER:
            seq, k = self._pending[req.request_id]
            assert seq == batch.seq - 1 and PLACEHOLDER not in ids[:-1], "a pending token outside the last step"
            batch.prev_sample[i] = k
        req.num_computed_tokens += batch.num_tokens[i]
        if batch.sampling[i] is not None:
            batch.token_index[i] = len(req.token_ids)
            self._pending[req.request_id] = (batch.seq, batch.num_sampling - 1)
            req.token_ids.append(PLACEHOLDER)

    def observe_step(self, batch: ScheduledBatch, seconds: float) -> None:
        """How long `batch` took to compute (wall time on the engine, virtual in the simulator)."""
        self.step_model.observe(batch.total_tokens, batch.num_context_tokens, seconds * (1.0 - self.pool_share))

    @property
    def cost(self) -> StepCost:
        """What steps cost from here on: the model of the engine's own work, slowed by the share of
        the engine its pool peers take (TokenLake's get_cache_load, measured here rather than bounded:
        the holder's query service times its work)."""
        c = self.step_model.cost
        if not self.pool_share:
            return c
        k = 1.0 / (1.0 - self.pool_share)
        return StepCost(c.base * k, c.per_token * k, c.per_context * k)

    # -- update -------------------------------------------------------------------------------
    def update(self, batch: ScheduledBatch, sampled: list[int | None]) -> list[Request]:
        """Apply one step's results. `sampled[i]` is the token drawn for batch row i, or None when
        its chunk ended mid-prompt. Returns the requests that finished this step."""
        if batch.ahead:
            return self._update_lagged(batch, sampled)
        finished = []
        now = self.clock()
        for rid, n, token in zip(batch.request_ids, batch.num_tokens, sampled):
            req = self.requests.get(rid)
            if req is None or req.status is not RequestStatus.RUNNING:  # ended while the step ran
                continue
            req.num_computed_tokens += n
            self.kv.commit(req)
            if token is None:
                continue
            req.token_ids.append(token)
            req.buffer.on_tokens(1, now)
            reason = self._stop_reason(req, token, req.num_output_tokens)
            if reason is not None:
                self.finish(req, reason)
                finished.append(req)
        return finished

    def _update_lagged(self, batch: ScheduledBatch, sampled: list[int | None]) -> list[Request]:
        """update of a batch scheduled ahead: the rows' counters moved when they were scheduled; a later step may be
        in flight. A request that ended since (EOS seen a step late, an abort) takes nothing more."""
        finished = []
        now = self.clock()
        for i, (rid, token) in enumerate(zip(batch.request_ids, sampled)):
            req = self.requests.get(rid)
            if req is None:  # ended while the step ran
                continue
            if self._pending.get(rid, (-1,))[0] == batch.seq:
                del self._pending[rid]
            k = batch.token_index[i]
            if token is not None:
                assert req.token_ids[k] == PLACEHOLDER, f"{rid}: token {k} is not the one this step samples"
                req.token_ids[k] = token
            if req.status is RequestStatus.RUNNING:  # what this step computed is in place: publish it
                self.kv.commit(req, batch.positions[i] + batch.num_tokens[i])
            if token is None:
                continue
            req.buffer.on_tokens(1, now)
            reason = self._stop_reason(req, token, k + 1 - req.num_prompt_tokens)
            if reason is not None:
                self._pending.pop(rid, None)
                self.finish(req, reason)
                finished.append(req)
        return finished

    def drop_pending(self, batch: ScheduledBatch) -> None:
        """Ahead: `batch` was launched and will not be collected (it failed): forget its tokens."""
        for rid in batch.request_ids:
            if self._pending.get(rid, (-1,))[0] == batch.seq:
                del self._pending[rid]

    @staticmethod
    def _stop_reason(req: Request, token: int, num_output: int) -> FinishReason | None:
        """Why `token`, the request's `num_output`-th, ends it (None: it does not)."""
        if token in req.stop_token_ids:  # the sampler masks them until min_tokens
            return FinishReason.STOP
        if num_output >= req.max_tokens:
            return FinishReason.LENGTH
        return None

    def finish(self, req: Request, reason: FinishReason, error: str | None = None) -> None:
        """End a request wherever it is, and free its pages at once."""
        if req.is_finished:
            return
        self._remove(req)
        self._pending.pop(req.request_id, None)
        while req.token_ids and req.token_ids[-1] == PLACEHOLDER:  # tokens of steps in flight: never applied
            req.token_ids.pop()
        req.num_computed_tokens = min(req.num_computed_tokens, len(req.token_ids))
        if reason in (FinishReason.STOP, FinishReason.LENGTH):
            self.output_lengths.observe(req.num_output_tokens)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.error = error
        del self.requests[req.request_id]

    def _remove(self, req: Request) -> None:
        """Out of whichever of the three queues holds it."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.LOADING:
            self.loading.remove(req)
        else:
            self._leave_queue(req)

    def give_foreign_prefix(self, req: Request, num_tokens: int, key_seed: bytes) -> None:
        """A queued request that has computed nothing reads its first `num_tokens` prompt tokens
        (whole pages) where peers of the pool hold them from now on (its pins are taken as it
        nears the front: pool/ahead.py); `key_seed` is the key of the last of those pages."""
        assert req.status is RequestStatus.WAITING and not req.num_computed_tokens, "only a fresh queued request"
        self._leave_queue(req)
        self.kv.drop(req)
        req.set_foreign_prefix(num_tokens, key_seed)
        req.max_model_len -= num_tokens  # its own tokens' room (EngineCore._validate)
        self.kv.track(req)
        self._requeue(req)

    def take_foreign_prefix(self, req: Request) -> None:
        """The peers holding `req`'s leading KV are gone (pool/member.py): it lets go of its KV
        and waits again with the whole prompt as its own, to recompute it here; the tokens it
        produced stay, so its stream goes on where it was."""
        if req.is_finished or not req.foreign_token_ids:
            return
        self._remove(req)
        self.kv.drop(req)
        req.take_foreign_prefix()
        req.num_cached_tokens = 0
        req.num_preemptions += 1  # its KV was dropped: what it admits again is no saving
        self.kv.track(req)
        self._requeue(req)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, FinishReason.ABORT)
        return req
