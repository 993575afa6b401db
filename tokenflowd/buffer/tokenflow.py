"""The buffer-aware preemptive policy (tokenflow.txt §3.3, §4).

While the engine is not stressed (no request waits, no started buffer below T_critical) it is
prefill-first FCFS. While stressed, every `schedule_interval` seconds a buffer-balancing pass
decides which requests hold the device until the next pass; the steps in between carry that
decision out (FCFS inside it: decodes first, then prompt and recompute chunks).

A pass, over the working set W (requests whose clients are reading: running, loading or preempted
after their first token) and the queue of new requests:

  1. Estimates: per-request decode rate g and capacity Γ at the batch the device holds, from the
     live step-time model (view.cost); the overhead of resuming a preempted request,
     min(t_IO, t_recompute) (§4.2.3), which also says whether it is reloaded or recomputed. Each
     reader's demand is min(r_i, g): no schedule feeds one request faster than g, so a client
     stating an absurd rate counts as one stream, not as a reason to give up balancing.
  2. Schedulability (§4.3): if Σ_{i∈W} min(r_i, g) > Γ not every reader can be fed; the device
     goes first to running requests whose next tokens still count, then to new requests (a first
     token is what a reader waits for most), then to preempted members and running ones whose
     tokens are worth little now (_fallback). A member whose reader has waited on an empty buffer
     for max_stall comes before new requests, and after twice that displaces a running one: an
     overloaded engine spreads its stalls instead of silencing some streams for minutes.
  3. Buffer balancing in W (§4.2.2): utility
         U_i = v_i·(t − t_i^overhead) + γ·φ(b_i^pred),   φ(b) = e^(−b / r_i)
     with v_i = g·w(b_i^pred) (w: the §7.1.3 token weight, so tokens that would pile up beyond
     10–20% of the output are worth less), t the interval, b^pred the buffer left once the
     overhead has passed. Greedy fill by swap tier, then U, under the device's pages and seats,
     then a local search over adjacent swaps inside a tier that keeps the memory constraint.
  4. Admission (§4.2.1): new requests in queue order. Free room always takes the next one;
     displacing a running request needs |W| < W_scheduled (eq. 4–5), Σ r ≤ Γ with the newcomer,
     and a victim whose buffer covers μ× its swap time: b ≥ μ·r·(τ_evict + τ_load + τ_schedule).
     Room left then goes to running requests whose readers are far ahead (idle), then to
     preempted members with buffer to spare. The output lengths behind w are the engine's
     prediction (buffer/estimates.py OutputLengthModel), capped by a client's max_tokens.

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
from typing import TYPE_CHECKING, Iterable

import numpy as np

from tokenflowd.buffer.fcfs import FCFSPolicy
from tokenflowd.buffer.policy import Plan, RequestView, SchedulerView, SchedulingPolicy, cdiv
from tokenflowd.buffer.working_set import (
    IDLE_RUNNING,
    URGENT,
    WorkingSet,
    buffer_utility,
    build_working_set,
    swap_tiers,
)

if TYPE_CHECKING:
    from tokenflowd.config import PolicyConfig


def new_request_pages(r: RequestView, growth: int, page_size: int) -> int:
    """The pages a new request adds to the balance's count over an interval of `growth` tokens
    (RequestView.pages_to_run): its context's, less the pages of its prefix that running requests
    hold. Those are counted in their pages already, and sharing them takes no more room. (Cached pages nobody references are among
    the free ones, and taking them uses them up: they count.) Counted again, a reader of a document
    other requests run over waited behind room it did not need: in the node simulator (a quarter of
    the A100's KV, 12K-token documents with 32 questions each, 16 req/s, seed 2) the pool served
    0.79x routing's tokens, and 0.93x counting them once."""
    return r.pages_to_run(r.tokens_left + growth, page_size)  # as fcfs counts it


def idle_device_pages(r: RequestView, need: int, page_size: int) -> int:
    """An idle device takes a new request if its prompt fits at all, whatever its growth over the
    interval would need (`need`): nobody's room is at stake."""
    return min(need, cdiv(r.num_tokens + 1, page_size))


@dataclass(frozen=True, slots=True)
class Decision:
    """What a balancing pass chose: the requests that hold the device until the next pass."""

    run: tuple[str, ...]  # running requests kept and waiting requests to admit, in priority order
    reload: tuple[str, ...] = ()  # of the admitted, those whose KV comes back from the host tier
    fallback: bool = False  # Σ r > Γ: FCFS over the working set, nothing new admitted


class TokenFlowPolicy(SchedulingPolicy):
    name = "tokenflow"

    def __init__(self, params: "PolicyConfig") -> None:
        self.params = params
        self._fcfs = FCFSPolicy()
        self._decision: Decision | None = None
        self._next_pass = -math.inf
        # (the queue's first new request, running requests) at the last pass: room for that head
        # then or since is what a pass between intervals looks for
        self._room_key: tuple[str | None, int] | None = None
        self._growth = 1  # tokens a chosen request adds over an interval, at the last pass
        self.num_passes = 0

    # -- the per-step entry point ---------------------------------------------------------------
    def plan(self, view: SchedulerView) -> Plan:
        if not self._stressed(view):
            self._decision = None
            return self._fcfs.plan(view)
        if self._decision is None or view.now >= self._next_pass or self._room_opened(view):
            self._decision = self.balance(view)
            self._next_pass = view.now + self.params.schedule_interval
            self._room_key = self._head_key(view)
            self.num_passes += 1
        return self._carry_out(view, self._decision)

    def _stressed(self, view: SchedulerView) -> bool:
        """§4.2.1: requests wait, or a reading client's buffer is below T_critical."""
        if view.waiting:
            return True
        t_crit = self.params.critical_buffer
        return any(r.started and r.time_to_empty < t_crit for r in view.running)

    @staticmethod
    def _head(view: SchedulerView) -> RequestView | None:
        return next((r for r in view.waiting if not r.started), None)

    def _head_key(self, view: SchedulerView) -> tuple[str | None, int]:
        head = self._head(view)
        return (head.request_id if head else None, len(view.running))

    def _room_opened(self, view: SchedulerView) -> bool:
        """The queue's first new request changed (it arrived, or the one before it was admitted) or
        a running request left since the last pass, and that head would fit in the free room: a
        pass now admits it without waiting out the interval (no one is displaced). Keyed by the
        head's id, not the queue's length: one admitted and one arrived leave the length as it was.
        The head fits as a pass counts it (new_request_pages): its whole prompt and an interval's
        growth, or on an idle device its prompt. Its first chunk alone fitting is no reason: such a
        pass admits it only by displacing running requests, which is the interval's pass to do, and a
        32K-token prompt at the head made one pass at every step, each time the running set changed
        (the node simulator, the A100's trace in overload)."""
        if self._head_key(view) == self._room_key or len(view.running) >= view.max_num_seqs:
            return False
        head = self._head(view)
        if head is None or head.request_id in self._decision.run:
            return False
        need = new_request_pages(head, self._growth, view.page_size)
        if not view.running and not view.loading:
            need = idle_device_pages(head, need, view.page_size)
        return need <= view.free_pages

    def _carry_out(self, view: SchedulerView, decision: Decision) -> Plan:
        """One step of the decision: preempt running requests it left out, then FCFS over the rest
        (decodes first, then prompt and recompute chunks) with the admitted in decision order."""
        chosen = set(decision.run)
        kept = tuple(r for r in view.running if r.request_id in chosen)
        preempted = tuple(r.request_id for r in view.running if r.request_id not in chosen)
        freed = sum(r.pages_freed for r in view.running if r.request_id not in chosen)
        by_id = {r.request_id: r for r in view.waiting}
        reload = set(decision.reload)
        # A reloaded request arrives with its host tokens computed: FCFS sees only what is left.
        admit = tuple(by_id[rid].replace(num_computed_tokens=max(by_id[rid].num_computed_tokens, by_id[rid].host_tokens))
                      if rid in reload else by_id[rid] for rid in decision.run if rid in by_id)
        sub = replace(view, running=kept, waiting=admit, free_pages=view.free_pages + freed)
        plan = self._fcfs.plan(sub)
        scheduled = {rid for rid, _ in plan.scheduled}
        return Plan(plan.scheduled, preempted + plan.preempted, tuple(r for r in decision.reload if r in scheduled))

    # -- the balancing pass ---------------------------------------------------------------------
    def balance(self, view: SchedulerView) -> Decision:
        t = self.params.schedule_interval
        members = [r for r in view.waiting if r.num_output_tokens]  # started: their clients read
        new = [r for r in view.waiting if not r.num_output_tokens]
        ws = build_working_set(view, members, self.params.expected_output_len)
        reqs = ws.reqs

        # 1. Estimates at the batch the device can hold.
        mean_ctx = float(ws.num_tokens.mean()) if reqs else new[0].num_tokens
        capacity = view.free_pages + sum(r.pages_held for r in (*view.running, *view.loading))
        footprint = max(1, cdiv(int(mean_ctx), view.page_size))
        batch = max(1, min(view.max_num_seqs + len(view.loading), capacity // footprint))
        g = 1.0 / view.cost.decode_step_time(batch, mean_ctx)  # tokens/s of one running request
        gamma_cap = batch * g  # Γ
        growth = int(g * t) + 1  # tokens a chosen request adds over the interval
        self._growth = growth
        # held through the interval, capped at the device: a request the device can hold at all is
        # never left out for the growth of an interval it may not even need (it once preempted the
        # only running request of a small pool, over and over). One whose tokens alone outgrow the
        # room keeps its true size: capped, it looked as if it fitted, took the whole room in the
        # plan, could not be admitted, and left the device idle with smaller ones waiting
        ps = view.page_size
        pages = np.minimum(-(-(ws.num_tokens + growth) // ps),
                           np.maximum(-(-(ws.num_tokens + 1) // ps), max(capacity, 1))).tolist()
        pages[ws.num_running: ws.num_on_device] = [r.pages_held for r in view.loading]  # in place already
        max_seqs = view.max_num_seqs + len(view.loading)  # loading requests hold seats of their own
        # A request can never be fed faster than one running request decodes: a stated rate above g
        # asks for what no schedule gives, and must not let one client tip the test below.
        demand = np.minimum(ws.rate, g)
        load = float(demand.sum())
        tier, victim_ok = swap_tiers(ws, t, self.params.buffer_conservativeness)
        # pages a new request takes over the interval (a generator: the queue is read only as far
        # as admission goes)
        new_pages = (new_request_pages(r, growth, view.page_size) for r in new)

        # 2. Schedulability (§4.3): Σ_{i∈W} min(r_i, g) > Γ cannot be balanced; serve in FCFS
        # spirit instead, with what each token is worth deciding who holds the device.
        if load > gamma_cap:
            return self._fallback(ws, tier, new, new_pages, pages, capacity, max_seqs, view.page_size)

        # 3. Buffer balancing inside W: greedy by utility within swap tiers, then adjacent swaps
        # inside a tier. A swap costs a recompute (or a reload), so it happens only where a buffer
        # asks for it: a preempted request displaces a running one only once its own buffer is
        # down to μ× its way back, and only a running one whose buffer outlasts its time away.
        # Idle running requests (their readers far ahead), resting and dormant members (buffer to
        # spare) get the room left once new requests are in, in that order.
        u = buffer_utility(ws, g, t, self.params.stall_penalty)
        utility = u.tolist()
        order = self._within_recompute_budget(np.lexsort((-u, tier)), ws, tier, (1.0 - load / gamma_cap) * t,
                                              self.params.max_stall)
        order = np.asarray(order, dtype=np.int64)
        in_core = tier[order] < IDLE_RUNNING
        later = order[~in_core].tolist()  # in tier order: idle running, resting, dormant
        order = order[in_core].tolist()
        chosen, _ = self._fill(order, pages, capacity, max_seqs)
        chosen = self._local_search(order, chosen, pages, utility, capacity, max_seqs, tier.tolist())

        # 4. Admission of new requests (§4.2.1). Free device room always takes the next new
        # request: an empty device serves no one, and a resting member can wait. Displacing a
        # running request needs more: the working set below W_scheduled (eq. 4–5), Σ r ≤ Γ with
        # the newcomer, and a victim whose buffer covers μ× its swap time.
        used = sum(pages[i] for i in chosen)
        w_sched = self._working_set_size(view, footprint, gamma_cap)
        size = len(reqs)
        victims = sorted((i for i in chosen if i < ws.num_running and victim_ok[i]), key=utility.__getitem__)
        displaced: list[int] = []
        seqs = len(chosen)
        admitted: list[str] = []
        for r, need in zip(new, new_pages):  # queue order
            if not chosen and not admitted:  # an idle device takes its head if the prompt fits at all
                need = idle_device_pages(r, need, view.page_size)
            before = (len(displaced), used, seqs)
            if used + need > capacity or seqs >= max_seqs:
                if size >= w_sched or load + min(r.reading_rate, g) > gamma_cap:
                    break
                while (used + need > capacity or seqs >= max_seqs) and len(displaced) < len(victims):
                    v = victims[len(displaced)]
                    displaced.append(v)
                    used -= pages[v]
                    seqs -= 1
            if used + need > capacity or seqs >= max_seqs:
                # head of line: nothing behind it jumps the queue, and the victims it could not use
                # stay (displaced for nothing, they came back at the next pass to be displaced again)
                del displaced[before[0]:]
                _, used, seqs = before
                break
            admitted.append(r.request_id)
            used += need
            seqs += 1
            size += 1
            load += min(r.reading_rate, g)
        gone = set(displaced)
        kept = [i for i in chosen if i not in gone]
        for i in later:  # room nobody else takes
            if seqs < max_seqs and used + pages[i] <= capacity:
                kept.append(i)
                used += pages[i]
                seqs += 1
        # Admitted requests come last in `run`: carrying the decision out, FCFS serves the working
        # set's decodes before their prompts.
        return Decision(tuple(reqs[i].request_id for i in kept) + tuple(admitted), self._reloads(ws, kept))

    def _fallback(self, ws: WorkingSet, tier: np.ndarray, new: list[RequestView], new_pages: Iterable[int],
                  pages: list[int], capacity: int, max_seqs: int, page_size: int) -> Decision:
        """Σr > Γ: not every reader can be kept fed, so who holds the device goes by what its next
        tokens are worth, in this order:
          1. loading requests, then preempted members whose readers have waited on an empty buffer
             for 2×max_stall or more (longest first, at most half the batch a pass), and running
             requests whose next tokens still count (least buffered first), together by priority:
             the overdue displace running requests of equal or lower priority, those with the
             most buffer first (they can best afford it);
          2. preempted members silent for max_stall or more: free room goes to them before new
             requests, so a stream does not go silent for good while new requests keep coming;
          3. new requests, in queue order (their first token is the one a reader waits for most);
          4. other preempted members and running ones whose tokens are worth little now
             (IDLE_RUNNING: the §7.1.3 weight of their next token below 0.5, a buffer that
             outlasts μ× their time away), in swap-tier order: urgent, idle running, resting,
             dormant.
        Greedy within the device's pages and seats; a new request that does not fit stops the
        queue behind it. Bringing silent streams back in two steps keeps the swaps few: most come
        back in room that finishing requests free, and only the ones that room does not reach in
        time cost a running request its place."""
        index = np.arange(len(ws.reqs))
        worthless = tier == IDLE_RUNNING
        seconds = ws.buffer / ws.rate
        priority = np.array([r.priority for r in ws.reqs], dtype=np.int64)
        preempted = index >= ws.num_on_device
        silent = preempted & (ws.dry >= self.params.max_stall)
        # overdue: silent for twice as long, longest first, at most half the batch a pass (a swap
        # costs a reload or a recompute; the rest come back in the next passes or in free room)
        overdue = np.flatnonzero(preempted & (ws.dry >= 2.0 * self.params.max_stall))
        overdue = overdue[np.argsort(-ws.dry[overdue], kind="stable")][: max(1, max_seqs // 2)]
        # running requests whose prompt or recompute is part done: displaced, that work is thrown
        # away, and two silent streams that need long recomputes displaced each other for good
        computing = np.array([i < ws.num_running and r.num_computed_tokens < r.num_tokens - 1
                              for i, r in enumerate(ws.reqs)], dtype=bool)
        counting = np.flatnonzero((index < ws.num_running) & ~worthless & ~computing)
        # priority first: an overdue stream takes the place of one of equal or lower priority only,
        # and not of one whose way back (a recompute or reload) is over a pass and longer than its
        # buffer lasts: displaced, that one goes as silent as the overdue one was, and pays that
        # way back to return. Streams that each needed a long recompute (pool readers that gave
        # their pins back) took a small device from each other one token at a time, each swap a
        # recompute of 12-30K tokens (the node simulator, the A100's sessions in overload: one
        # engine ran twice as long as the rest)
        away = ws.away[counting]
        dear = (away >= self.params.schedule_interval) & (seconds[counting] < away)
        ahead = np.concatenate([overdue, counting])
        group = np.r_[np.zeros(len(overdue)), np.where(dear, -1, 1)]
        within = np.r_[np.arange(len(overdue)), seconds[counting]]  # overdue: longest silent; counting: least buffered
        ahead = ahead[np.lexsort((within, group, -priority[ahead]))]
        waiting_room = np.flatnonzero(silent & ~np.isin(index, overdue))
        waiting_room = waiting_room[np.argsort(-ws.dry[waiting_room], kind="stable")]
        first = [*range(ws.num_running, ws.num_on_device), *np.flatnonzero(computing).tolist(), *ahead.tolist(),
                 *waiting_room.tolist()]
        rest = np.flatnonzero((preempted & ~silent) | (worthless & ~computing))
        rest = rest[np.lexsort((seconds[rest], tier[rest]))].tolist()
        chosen, used = self._fill(first, pages, capacity, max_seqs)
        admitted = []
        for r, need in zip(new, new_pages):
            if not chosen and not admitted:  # an idle device takes its head if the prompt fits at all
                need = idle_device_pages(r, need, page_size)
            if used + need > capacity or len(chosen) + len(admitted) >= max_seqs:
                break
            admitted.append(r.request_id)
            used += need
        for i in rest:
            if len(chosen) + len(admitted) >= max_seqs:
                break
            if used + pages[i] <= capacity:
                chosen.append(i)
                used += pages[i]
        return Decision(tuple(ws.reqs[i].request_id for i in chosen) + tuple(admitted), self._reloads(ws, chosen),
                        fallback=True)

    @staticmethod
    def _within_recompute_budget(order: np.ndarray, ws: WorkingSet, tier: np.ndarray, budget: float,
                                 max_stall: float) -> list[int]:
        """`order` without the urgent preempted requests whose recompute would overrun `budget` s.

        An urgent request comes back by displacing a running one: work thrown away and redone,
        and while the recompute runs every decode in the batch waits, buffers drain, and more
        requests turn urgent — a cascade. So one pass recomputes urgent requests for at most what
        the capacity left over by the readers (1 − Σr/Γ of the interval) pays for. Resting ones
        only take room nobody runs in (they come after every running request in `order`): their
        recompute is owed anyway and idle room only delays it. Reloads use the host link, not the
        compute, and are not counted. An idle device stalls no decode, so there the first
        recompute always goes ahead: a pass never leaves the device idle with requests to serve.
        A stream silent for max_stall or more comes back whatever its recompute costs."""
        cost = np.where(ws.reloaded | (tier != URGENT) | (ws.dry >= max_stall), 0.0, ws.overhead)[order]
        over = np.cumsum(cost) > budget
        costly = np.flatnonzero(cost > 0)
        if ws.num_on_device == 0 and costly.size:
            over[costly[0]] = False
        return order[~(over & (cost > 0))].tolist()

    @staticmethod
    def _fill(order: Iterable[int], pages: list[int], capacity: int, max_seqs: int) -> tuple[list[int], int]:
        """Greedy: in `order`, take each candidate that still fits the pages and the batch. The
        chosen, and the pages they take. (A plain loop: it stops at max_seqs, and at a thousand
        candidates it ran 2.7× faster than a cumulative sum over numpy arrays.)"""
        chosen, used = [], 0
        for i in order:
            if len(chosen) >= max_seqs:
                break
            if used + pages[i] <= capacity:
                chosen.append(i)
                used += pages[i]
        return chosen, used

    @staticmethod
    def _local_search(order: list[int], chosen: list[int], pages: list[int], utility: list[float], capacity: int,
                      max_seqs: int, tier: list[int] | None = None) -> list[int]:
        """Adjacent swaps in priority order: at each boundary of the greedy choice (a chosen
        candidate followed by one left out), replace the chosen one by the next when the pages
        that frees let a further candidate in and the utility of the choice rises. Every accepted
        swap keeps Σ pages ≤ capacity and the batch ≤ max_seqs. One pass, over the boundaries only;
        with `tier`, only between candidates of one tier."""
        in_set = set(chosen)
        used = sum(pages[i] for i in chosen)
        order = list(order)
        flags = np.zeros(len(pages), dtype=bool)
        flags[chosen] = True
        in_order = flags[order]
        boundaries = np.flatnonzero(in_order[:-1] & ~in_order[1:]).tolist()
        for k in boundaries:
            a, b = order[k], order[k + 1]
            if a not in in_set or b in in_set or pages[b] >= pages[a] or len(in_set) + 1 > max_seqs:
                continue
            if tier is not None and tier[a] != tier[b]:
                continue  # swaps stay inside a tier: never drop a pinned request, never promote a resting one
            room = capacity - used + pages[a] - pages[b]
            extra = next((c for c in order[k + 2:] if c not in in_set and pages[c] <= room
                          and (tier is None or tier[c] == tier[a])), None)
            if extra is None or utility[b] + utility[extra] <= utility[a]:
                continue
            in_set ^= {a, b, extra}
            used += pages[b] + pages[extra] - pages[a]
            order[k], order[k + 1] = b, a
        return [i for i in order if i in in_set]

    def _working_set_size(self, view: SchedulerView, footprint: int, gamma_cap: float) -> int:
        """Eq. 4–5. M counts the tiers a preempted request's KV can live in; with no host tier it
        is recomputed and holds nothing, so the bound is the streams Γ can feed at the mean rate."""
        if view.host_pages:
            w_static = (view.total_pages + view.host_pages) // footprint
        else:
            rates = [r.reading_rate for r in view.running] + [r.reading_rate for r in view.waiting]
            w_static = max(1, int(gamma_cap / (sum(rates) / len(rates))))
        n_running = len(view.running)
        if n_running < w_static:  # eq. 5, rounded up so that an idle engine admits at least one
            return math.ceil(w_static - self.params.working_set_lambda * (w_static - n_running))
        return w_static

    @staticmethod
    def _reloads(ws: WorkingSet, chosen: list[int]) -> tuple[str, ...]:
        """Preempted requests brought back from the host tier rather than recomputed (§4.2.3)."""
        return tuple(ws.reqs[i].request_id for i in chosen if ws.reloaded[i])
