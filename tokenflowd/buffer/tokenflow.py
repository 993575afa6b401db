"""The buffer-aware preemptive policy (tokenflow.txt §3.3, §4).

While the engine is not stressed (no request waits, no started buffer below T_critical) it is
prefill-first FCFS. While stressed, every `schedule_interval` seconds a buffer-balancing pass
decides which requests hold the device until the next pass; the steps in between carry that
decision out (FCFS inside it: decodes first, then prompt and recompute chunks).

A pass, over the working set W (requests whose clients are reading: running or preempted after
their first token) and the queue of new requests:

  1. Estimates: per-request decode rate g and capacity Γ at the batch the device holds, from the
     live step-time model (view.cost); the overhead of resuming a preempted request,
     min(t_IO, t_recompute) (§4.2.3), which also says whether it is reloaded or recomputed.
  2. Schedulability (§4.3): if Σ_{i∈W} r_i > Γ, fall back to FCFS over W within device memory
     and admit nothing new.
  3. Buffer balancing in W (§4.2.2): utility
         U_i = v_i·(t − t_i^overhead) + γ·φ(b_i^pred),   φ(b) = e^(−b / r_i)
     with v_i = g·w(b_i^pred) (w: the §7.1.3 token weight, so tokens that would pile up beyond
     10–20% of the output are worth less), t the interval, b^pred the buffer left once the
     overhead has passed. Greedy fill by U under the device's pages and max_num_seqs, then a
     local search over adjacent swaps that keeps the memory constraint.
  4. Admission (§4.2.1): new requests in queue order while |W| < W_scheduled (eq. 4–5) and
     Σ r ≤ Γ; each takes free room, or displaces the lowest-utility chosen running request whose
     buffer covers μ× its swap time: b ≥ μ·r·(τ_evict + τ_load + τ_schedule).

NOTE: eq. 3 writes the penalty as −γ·φ(b) in U, which would favour full buffers; §4.2.2 says
requests with nearly empty buffers must come first. The penalty is what *not* running a request
costs, so choosing it gains +γ·φ(b). φ takes the buffer in seconds of reading (b / r): e^(−b)
over tokens vanishes after a few tokens whatever the reader's pace.
NOTE: t' (the paper's moving-average queueing delay) is the interval: a request left out now
waits at least until the next pass.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from tokenflowd.buffer.fcfs import FCFSPolicy
from tokenflowd.buffer.policy import Plan, RequestView, SchedulerView, SchedulingPolicy, cdiv
from tokenflowd.buffer.qos import effective_weight

if TYPE_CHECKING:
    from tokenflowd.config import PolicyConfig


@dataclass(frozen=True, slots=True)
class Decision:
    """What a balancing pass chose: the requests that hold the device until the next pass."""

    run: tuple[str, ...]  # running requests kept and waiting requests to admit, in priority order
    reload: tuple[str, ...] = ()  # of the admitted, those whose KV comes back from the host tier
    fallback: bool = False  # Σ r > Γ: FCFS over the working set, nothing new admitted


@dataclass(slots=True)
class _Candidate:
    req: RequestView
    running: bool
    pages: int  # device pages it holds through the interval
    overhead: float  # s before it produces again (0 when running)
    utility: float = 0.0


class TokenFlowPolicy(SchedulingPolicy):
    name = "tokenflow"

    def __init__(self, params: "PolicyConfig") -> None:
        self.params = params
        self._fcfs = FCFSPolicy()
        self._decision: Decision | None = None
        self._next_pass = -math.inf
        self._room_key: tuple[int, int] | None = None  # (running, waiting) when the last pass found no room
        self.num_passes = 0

    # -- the per-step entry point ---------------------------------------------------------------
    def plan(self, view: SchedulerView) -> Plan:
        if not self._stressed(view):
            self._decision = None
            return self._fcfs.plan(view)
        if self._decision is None or view.now >= self._next_pass or self._room_opened(view):
            self._decision = self.balance(view)
            self._next_pass = view.now + self.params.schedule_interval
            self._room_key = (len(view.running), len(view.waiting))
            self.num_passes += 1
        return self._carry_out(view, self._decision)

    def _stressed(self, view: SchedulerView) -> bool:
        """§4.2.1: requests wait, or a reading client's buffer is below T_critical."""
        if view.waiting:
            return True
        t_crit = self.params.critical_buffer
        return any(r.started and r.time_to_empty < t_crit for r in view.running)

    def _room_opened(self, view: SchedulerView) -> bool:
        """A request left or arrived since the last pass and the next new one would fit in the free
        room: a pass now admits it without waiting out the interval (no one is displaced)."""
        if (len(view.running), len(view.waiting)) == self._room_key or len(view.running) >= view.max_num_seqs:
            return False
        head = next((r for r in view.waiting if not r.started), None)
        if head is None:
            return False
        return head.pages_to_run(min(head.tokens_left, view.token_budget), view.page_size) <= view.free_pages

    def _carry_out(self, view: SchedulerView, decision: Decision) -> Plan:
        """One step of the decision: preempt running requests it left out, then FCFS over the rest
        (decodes first, then prompt and recompute chunks) with the admitted in decision order."""
        chosen = set(decision.run)
        kept = tuple(r for r in view.running if r.request_id in chosen)
        preempted = tuple(r.request_id for r in view.running if r.request_id not in chosen)
        freed = sum(r.pages_freed for r in view.running if r.request_id not in chosen)
        by_id = {r.request_id: r for r in view.waiting}
        admit = tuple(by_id[rid] for rid in decision.run if rid in by_id)
        sub = replace(view, running=kept, waiting=admit, free_pages=view.free_pages + freed)
        plan = self._fcfs.plan(sub)
        reload = tuple(rid for rid in decision.reload if any(rid == s for s, _ in plan.scheduled))
        return Plan(plan.scheduled, preempted + plan.preempted, reload)

    # -- the balancing pass ---------------------------------------------------------------------
    def balance(self, view: SchedulerView) -> Decision:
        p = self.params
        ps = view.page_size
        t = p.schedule_interval
        members = [r for r in view.waiting if r.started]
        new = [r for r in view.waiting if not r.started]
        everyone = list(view.running) + members + new
        mean_ctx = sum(r.num_tokens for r in everyone) / len(everyone)

        # 1. Estimates at the batch the device can hold.
        capacity_pages = view.free_pages + sum(r.pages_held for r in view.running)
        footprint = max(1, cdiv(int(mean_ctx), ps))
        batch = max(1, min(view.max_num_seqs, capacity_pages // footprint))
        step = view.cost.decode_step_time(batch, mean_ctx)
        g = 1.0 / step  # tokens/s one running request generates
        gamma_cap = batch * g  # Γ
        growth = int(g * t) + 1  # tokens a chosen request adds over the interval

        cands = [self._candidate(r, True, ps, growth, view) for r in view.running]
        cands += [self._candidate(r, False, ps, growth, view) for r in members]

        # 2. Schedulability: Σ_{i∈W} r_i ≤ Γ, else FCFS over W and nothing new.
        load = sum(c.req.reading_rate for c in cands)
        if load > gamma_cap:
            cands.sort(key=lambda c: (-c.req.priority, c.req.arrival_time))
            chosen = self._fill(cands, capacity_pages, view.max_num_seqs)
            return Decision(tuple(c.req.request_id for c in chosen), self._reloads(chosen), fallback=True)

        # 3. Buffer balancing inside W: greedy by utility, then adjacent swaps.
        for c in cands:
            c.utility = self._utility(c, g, t)
        cands.sort(key=lambda c: (-c.utility, c.req.time_to_empty, -c.req.reading_rate, c.req.arrival_time))
        chosen = self._local_search(cands, self._fill(cands, capacity_pages, view.max_num_seqs), capacity_pages,
                                    view.max_num_seqs)

        # 4. Admission of new requests into the working set (eq. 4–5 and the buffer rule).
        used = sum(c.pages for c in chosen)
        w_sched = self._working_set_size(view, footprint, gamma_cap)
        size = len(cands)
        victims = sorted((c for c in chosen if c.running), key=lambda c: c.utility)  # cheapest to displace first
        admitted: list[_Candidate] = []
        for r in new:  # queue order
            if size >= w_sched or load + r.reading_rate > gamma_cap:
                break
            c = self._candidate(r, False, ps, growth, view)
            while (used + c.pages > capacity_pages or len(chosen) + len(admitted) >= view.max_num_seqs) and victims:
                v = victims[0]
                if not self._safe_to_displace(v, view.cost, t):
                    break
                victims.pop(0)
                chosen.remove(v)
                used -= v.pages
            if used + c.pages > capacity_pages or len(chosen) + len(admitted) >= view.max_num_seqs:
                break  # head of line: nothing behind it jumps the queue
            admitted.append(c)
            used += c.pages
            size += 1
            load += r.reading_rate
        run = [c.req.request_id for c in chosen] + [c.req.request_id for c in admitted]
        return Decision(tuple(run), self._reloads(chosen))

    def _candidate(self, r: RequestView, running: bool, ps: int, growth: int, view: SchedulerView) -> _Candidate:
        pages = cdiv(r.num_tokens + growth, ps)
        if running:
            return _Candidate(r, True, pages, 0.0)
        recompute = view.cost.recompute_time(r.num_tokens - r.num_computed_tokens)
        overhead = recompute if r.io_time is None else min(r.io_time, recompute)
        return _Candidate(r, False, pages, overhead)

    def _utility(self, c: _Candidate, g: float, t: float) -> float:
        r = c.req
        b_pred = max(0.0, r.buffer - r.reading_rate * c.overhead)
        expected = r.max_output_tokens or self.params.expected_output_len
        v = g * effective_weight(b_pred, max(1, expected))
        return v * max(0.0, t - c.overhead) + self.params.stall_penalty * math.exp(-b_pred / r.reading_rate)

    @staticmethod
    def _fill(cands: list[_Candidate], capacity_pages: int, max_seqs: int) -> list[_Candidate]:
        """Greedy: in order, take each candidate that still fits the pages and the batch."""
        chosen, used = [], 0
        for c in cands:
            if len(chosen) >= max_seqs:
                break
            if used + c.pages <= capacity_pages:
                chosen.append(c)
                used += c.pages
        return chosen

    @staticmethod
    def _local_search(cands: list[_Candidate], chosen: list[_Candidate], capacity_pages: int,
                      max_seqs: int) -> list[_Candidate]:
        """Adjacent swaps in priority order: replace a chosen candidate by the next one down when
        the pages that frees let a further candidate in and the utility of the choice rises.
        Every accepted swap keeps Σ pages ≤ capacity_pages and the batch ≤ max_seqs."""
        in_set = {id(c) for c in chosen}
        used = sum(c.pages for c in chosen)
        for i in range(len(cands) - 1):
            a, b = cands[i], cands[i + 1]
            if id(a) not in in_set or id(b) in in_set or b.pages >= a.pages:
                continue
            room = capacity_pages - used + a.pages - b.pages
            extra = next((c for c in cands[i + 2:] if id(c) not in in_set and c.pages <= room), None)
            if extra is None or b.utility + extra.utility <= a.utility or len(chosen) + 1 > max_seqs:
                continue
            chosen.remove(a)
            chosen += [b, extra]
            in_set ^= {id(a), id(b), id(extra)}
            used += b.pages + extra.pages - a.pages
            cands[i], cands[i + 1] = b, a
        return chosen

    def _working_set_size(self, view: SchedulerView, footprint: int, gamma_cap: float) -> int:
        """Eq. 4–5. M counts the tiers a preempted request's KV can live in; with no host tier it
        is recomputed and holds nothing, so the bound is the streams Γ can feed at the mean rate."""
        if view.host_pages:
            w_static = (view.total_pages + view.host_pages) // footprint
        else:
            rates = [r.reading_rate for r in view.running] + [r.reading_rate for r in view.waiting]
            w_static = int(gamma_cap / (sum(rates) / len(rates)))
        n_running = len(view.running)
        if n_running < w_static:  # eq. 5, rounded up so that an idle engine admits at least one
            return math.ceil(w_static - self.params.working_set_lambda * (w_static - n_running))
        return w_static

    def _safe_to_displace(self, c: _Candidate, cost, interval: float) -> bool:
        """§4.2.1: its buffer covers μ× the time it is away: evict + load (or recompute) + one pass."""
        r = c.req
        away = cost.recompute_time(r.num_tokens) + interval
        return r.buffer >= self.params.buffer_conservativeness * r.reading_rate * away

    @staticmethod
    def _reloads(chosen: list[_Candidate]) -> tuple[str, ...]:
        """Preempted requests brought back from the host tier rather than recomputed (§4.2.3)."""
        out = []
        for c in chosen:
            r = c.req
            if not c.running and r.io_time is not None and c.overhead == r.io_time:
                out.append(r.request_id)
        return tuple(out)
