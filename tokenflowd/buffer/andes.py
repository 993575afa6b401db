"""Andes: the QoE-aware preemptive policy (Liu et al., arXiv 2404.16283), TokenFlow's third baseline.

QoE (the paper's §3.1). A reader expects its first token `ttft` after arrival and the rest at its
token delivery speed `tds` (here: its reading rate), so token k is expected at
e_k = a + ttft + (k−1)/tds. QoE compares the areas under the expected and the actual delivery
curves up to the end of the response; a token that comes early counts from when it is expected (a
reader cannot digest faster than its pace):

    QoE = S_actual / S_expected = Σ_k (end − max(d_k, e_k)) / Σ_k (end − e_k),   end = max(d_l, e_l)

so QoE = 1 when every token is on time and falls with a late first token or a slow stream.

Scheduler. At a scheduling point choose the requests x_i that hold the device over the next horizon
Δt to maximise Σ_i x_i·Q_serve,i + (1 − x_i)·Q_wait,i subject to Σ x_i·l_i ≤ M (KV pages) and
Σ x_i ≤ B (the batch). Q_serve − Q_wait is the QoE a request gains by being served over the horizon;
with n its tokens so far, E(t) the tokens its reader expects by t, L its output bound and H = now + Δt:

    gain_i = ∫_now^H min( (min(E, L) − n)⁺,  g_B·(t − now − o_i)⁺ ) dt  /  S_expected,i(H)

o_i is the time to (re)compute its prompt before it produces, g_B the tokens/s one request gets in a
batch of B (view.cost: the step time grows with the batch, so several B are tried and the best
total gain wins). It is the fluid form of the QoE sum above with end = H; serving and waiting differ
only within the horizon, so the past cancels. A request far ahead of its expected timeline gains
nothing and makes way. The knapsack is Andes' greedy: by gain when every candidate fits the pages,
else by gain per page; a request weighs the pages of its context. Preemption is by recompute (as
TokenFlow's authors ran Andes), and one pass preempts at most `andes_max_preempt_fraction` of the
running batch (Andes' preemption cap against thrashing).

When it runs. Andes solves only under memory contention (selective triggering): while nothing
waits, or the queue's head fits below `andes_memory_trigger` of the pages with a free slot, this is
FCFS. Under contention a pass (O(N log N · log B): a few ms for a thousand requests) runs every
`andes_interval` s, and early when a chosen request leaves (its room opens); between passes its
decision is carried out: the running requests it left out are preempted, then FCFS (decodes first,
then prompt chunks) runs over the chosen ones, the admitted in decision order. Requests that arrive
in between wait for the next pass.

NOTE: the normalised gain decays for a request whose QoE is already ruined (S_expected grows with
its age), so under sustained overload an old request could lose to every newcomer forever. The
oldest request is always chosen: it always progresses, so every request finishes in turn.

Sources. The paper's full text was not reachable from here. The QoE follows its abstract, the
authors' project page (an expected TTFT and TDS per request, delivery timelines) and a published
summary of §3.1 (QoE = 1 − S_delay/S_whole, the same ratio). The scheduler follows the authors'
public vLLM scheduler (values from each request's QoE over a look-ahead if run vs if paused;
weights its context in blocks; greedy by value per block, or by value when everything fits; the
batch as an item cap; recompute preemption; solving only above 90% KV use and every few steps);
the batch-size search and the preemption cap as the paper is summarised, not checked against its
text. [inf] Counting early tokens
from their expected time, the fluid horizon gain, the batch sizes tried, the cap as a fraction per
pass and the oldest-request guarantee are this implementation's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Sequence

import numpy as np

from tokenflowd.buffer.fcfs import FCFSPolicy
from tokenflowd.buffer.policy import Plan, RequestView, SchedulerView, SchedulingPolicy, cdiv

if TYPE_CHECKING:
    from tokenflowd.config import PolicyConfig


# -- QoE ----------------------------------------------------------------------------------------
def qoe(token_times: Sequence[float], arrival: float, expected_ttft: float, tds: float) -> float:
    """Andes' QoE of a delivered response: token k came at token_times[k−1] (non-decreasing)."""
    if not token_times:
        return 1.0
    expected = [arrival + expected_ttft + k / tds for k in range(len(token_times))]
    end = max(token_times[-1], expected[-1])
    whole = sum(end - e for e in expected)
    if whole <= 0.0:  # one token, on time at the very end
        return 1.0
    return sum(end - max(d, e) for d, e in zip(token_times, expected)) / whole


def expected_area(t: float, start: float, tds: float, length: float) -> float:
    """S_expected up to t: ∫ min(tds·(τ − start)⁺, length) dτ (the fluid expected timeline)."""
    if t <= start:
        return 0.0
    full = start + length / tds  # when the expected timeline has every token
    if t <= full:
        return 0.5 * tds * (t - start) ** 2
    return 0.5 * length * length / tds + length * (t - full)


def _min_ramp_area(t0: float, t1: float, s_u, r, cap, t_v, g: float) -> np.ndarray:
    """∫_t0^t1 min(clip(r·(t − s_u), 0, cap), g·(t − t_v)⁺) dt, exactly and element-wise over arrays
    of s_u, r, cap, t_v: the integrand is piecewise linear with kinks only at the points collected
    here, so the trapezoid rule over them is exact. Kinks outside [t0, t1] are clipped to its ends,
    where they make segments of zero width."""
    s_u, r, cap, t_v = np.broadcast_arrays(*(np.asarray(x, dtype=float) for x in (s_u, r, cap, t_v)))
    with np.errstate(divide="ignore", invalid="ignore"):
        cross = np.where(r != g, (r * s_u - g * t_v) / (r - g), t0)  # where the two ramps meet
    pts = np.stack([np.full_like(s_u, t0), np.full_like(s_u, t1), s_u, s_u + cap / r, t_v, t_v + cap / g, cross])
    pts = np.sort(np.clip(pts, t0, t1), axis=0)  # [7, ...]
    f = np.minimum(np.minimum(np.maximum(r * (pts - s_u), 0.0), cap), np.maximum(g * (pts - t_v), 0.0))
    return (0.5 * (f[1:] + f[:-1]) * np.diff(pts, axis=0)).sum(axis=0)


# -- the knapsack -------------------------------------------------------------------------------
@dataclass(slots=True)
class Item:
    """One candidate of a pass: a running or waiting request, its weight and its QoE gain."""

    req: RequestView
    running: bool
    pages: int  # l_i: its context (prompt and output so far, the next token's KV included), in pages
    overhead: float  # s before it produces a token if chosen (its prompt or recompute)
    gain: float = 0.0  # Q_serve − Q_wait over the horizon
    order: tuple[float, str] = field(init=False)  # ties go to the older request

    def __post_init__(self) -> None:
        self.order = (self.req.arrival_time, self.req.request_id)

    @property
    def density(self) -> float:
        return self.gain / self.pages


def greedy_knapsack(items: list[Item], capacity: int, max_items: int, pinned: Item | None = None) -> list[Item]:
    """Andes' greedy: the pinned item first, then by gain when everything fits the pages, else by
    gain per page, taking each that still fits (ties: the older request first)."""
    chosen = [pinned] if pinned is not None else []
    used = pinned.pages if pinned is not None else 0
    rest = [c for c in items if c is not pinned]
    if sum(c.pages for c in items) <= capacity:
        rest.sort(key=lambda c: (-c.gain, c.order))
    else:
        rest.sort(key=lambda c: (-c.density, c.order))
    for c in rest:
        if len(chosen) >= max_items:
            break
        if used + c.pages <= capacity:
            chosen.append(c)
            used += c.pages
    return chosen


@dataclass(frozen=True, slots=True)
class Decision:
    """What a pass chose: the requests that hold the device until the next pass."""

    run: tuple[str, ...]  # running requests kept and waiting ones to admit, in admission order
    batch_size: int  # the B whose knapsack won
    gain: float  # its total QoE gain


class AndesPolicy(SchedulingPolicy):
    name = "andes"

    def __init__(self, params: "PolicyConfig") -> None:
        self.params = params
        self._fcfs = FCFSPolicy()
        self._carry = FCFSPolicy(watermark=0.0)  # the pass already planned the pages
        self._decision: Decision | None = None
        self._next_pass = -math.inf
        self.num_passes = 0

    # -- the per-step entry point ---------------------------------------------------------------
    def plan(self, view: SchedulerView) -> Plan:
        if not view.waiting:
            self._decision = None  # nothing to choose between
            return self._fcfs.plan(view)
        if self._decision is None or view.now >= self._next_pass or self._member_left(view):
            self._decision = self.knapsack_pass(view) if self._contended(view) else None
            self._next_pass = view.now + self.params.andes_interval
        if self._decision is None:
            return self._fcfs.plan(view)
        return self._carry_out(view, self._decision)

    def _contended(self, view: SchedulerView) -> bool:
        """Selective triggering: the queue's head would take page use to the trigger, or no slot is free."""
        if len(view.running) >= view.max_num_seqs:
            return True
        head = view.waiting[0]
        need = head.pages_to_run(min(head.tokens_left, view.token_budget), view.page_size)
        used = view.total_pages - view.free_pages + need
        return need > view.free_pages or used >= self.params.andes_memory_trigger * view.total_pages

    def _member_left(self, view: SchedulerView) -> bool:
        """A chosen request finished (or left the visible queue): its room is open now."""
        run = set(self._decision.run)
        present = sum(r.request_id in run for r in view.running) + sum(r.request_id in run for r in view.waiting)
        return present < len(run)

    def _carry_out(self, view: SchedulerView, decision: Decision) -> Plan:
        chosen = set(decision.run)
        kept = tuple(r for r in view.running if r.request_id in chosen)
        out = [r for r in view.running if r.request_id not in chosen]
        by_id = {r.request_id: r for r in view.waiting}
        admit = tuple(by_id[rid] for rid in decision.run if rid in by_id)
        sub = replace(view, running=kept, waiting=admit, free_pages=view.free_pages + sum(r.pages_freed for r in out))
        plan = self._carry.plan(sub)
        return Plan(plan.scheduled, tuple(r.request_id for r in out) + plan.preempted)

    # -- the pass -------------------------------------------------------------------------------
    def knapsack_pass(self, view: SchedulerView) -> Decision:
        self.num_passes += 1
        items = [self._item(r, True, view) for r in view.running] + [self._item(r, False, view) for r in view.waiting]
        pinned = min(items, key=lambda c: c.order)
        capacity = view.free_pages + sum(r.pages_held for r in view.running)
        mean_ctx = sum(c.req.num_tokens for c in items) / len(items)

        # The gain's parts that do not depend on the batch, once: most requests gain nothing.
        live, parts = [], []
        for c in items:
            c.gain = 0.0
            t = self._timeline(c.req, view.now)
            if t is not None:
                live.append(c)
                parts.append((*t, c.req.reading_rate, view.now + c.overhead))
        cols = np.array(parts, dtype=float).reshape(-1, 5).T  # [5, live]: due, room, whole, rate, start

        best: tuple[float, int] | None = None
        for b in self._batch_sizes(min(view.max_num_seqs, len(items)), len(view.running)):
            self._set_gains(live, cols, b, mean_ctx, view)
            total = sum(c.gain for c in greedy_knapsack(items, capacity, b, pinned))
            if best is None or total >= best[0]:  # ties: the larger batch (fewer preemptions)
                best = (total, b)
        b = best[1]
        self._set_gains(live, cols, b, mean_ctx, view)
        chosen = greedy_knapsack(items, capacity, b, pinned)
        chosen = self._cap_preemptions(items, chosen, pinned, capacity, view)
        total = sum(c.gain for c in chosen)
        admit = sorted((c for c in chosen if not c.running), key=lambda c: (c is not pinned, -c.density, c.order))
        run = [c.req.request_id for c in chosen if c.running] + [c.req.request_id for c in admit]
        return Decision(tuple(run), b, total)

    def _set_gains(self, live: list[Item], cols: np.ndarray, batch: int, mean_ctx: float,
                   view: SchedulerView) -> None:
        if not live:
            return
        g = 1.0 / view.cost.decode_step_time(batch, mean_ctx)  # tokens/s each request gets in the batch
        due, room, whole, rate, start = cols
        area = _min_ramp_area(view.now, view.now + self.params.andes_horizon, due, rate, room, start, g)
        for c, gain in zip(live, (area / whole).tolist()):
            c.gain = gain

    @staticmethod
    def _batch_sizes(b_max: int, num_running: int) -> list[int]:
        """Powers of two up to b_max, plus b_max and the running batch: O(log B) knapsacks a pass."""
        sizes = {b_max, max(1, min(num_running, b_max))}
        b = 1
        while b < b_max:
            sizes.add(b)
            b *= 2
        return sorted(sizes)

    def _item(self, r: RequestView, running: bool, view: SchedulerView) -> Item:
        pages = cdiv(r.num_tokens, view.page_size)  # its whole context: what its next token needs
        overhead = view.cost.recompute_time(r.tokens_left) if r.tokens_left > 1 else 0.0
        return Item(r, running, pages, overhead)

    def _timeline(self, r: RequestView, now: float) -> tuple[float, float, float] | None:
        """(due, room, S_expected at the horizon's end) of r's gain; None when it cannot gain within
        the horizon. `due` is when its expected timeline reaches the tokens it has, `room` the tokens
        it may still generate."""
        p = self.params
        length = _expected_length(r)
        room = length - r.num_output_tokens
        start = r.arrival_time + p.andes_expected_ttft
        due = start + r.num_output_tokens / r.reading_rate
        horizon = now + p.andes_horizon
        if room <= 0 or due >= horizon:
            return None  # done, or far enough ahead of its reader to wait out the horizon
        return due, room, expected_area(horizon, start, r.reading_rate, length)

    def _gain(self, c: Item, g: float, now: float) -> float:
        """Q_serve − Q_wait over the horizon at g tokens/s (the module docstring's gain_i)."""
        t = self._timeline(c.req, now)
        if t is None:
            return 0.0
        due, room, whole = t
        return float(_min_ramp_area(now, now + self.params.andes_horizon, due, c.req.reading_rate, room,
                                    now + c.overhead, g)) / whole

    def _cap_preemptions(self, items: list[Item], chosen: list[Item], pinned: Item, capacity: int,
                         view: SchedulerView) -> list[Item]:
        """At most ⌊fraction · running⌋ (≥ 1) preemptions a pass: the densest victims beyond the cap
        stay, and the least dense admissions make room for them. The cap holds where the pages allow:
        a victim that fits not even without admissions goes (FCFS would preempt it anyway), and the
        pinned oldest keeps its room (the guarantee beats the cap)."""
        cap = max(1, int(self.params.andes_max_preempt_fraction * len(view.running)))
        in_set = {id(c) for c in chosen}
        victims = sorted((c for c in items if c.running and id(c) not in in_set), key=lambda c: (-c.density, c.order))
        if len(victims) <= cap:
            return chosen
        kept = [c for c in chosen if c.running or c is pinned]
        admits = sorted((c for c in chosen if not c.running and c is not pinned), key=lambda c: (c.density, c.order))
        used, count = sum(c.pages for c in chosen), len(chosen)
        for v in victims[: len(victims) - cap]:
            dropped = 0
            while dropped < len(admits) and (used + v.pages > capacity or count >= view.max_num_seqs):
                used -= admits[dropped].pages
                count -= 1
                dropped += 1
            if used + v.pages <= capacity and count < view.max_num_seqs:
                kept.append(v)
                del admits[:dropped]
                used += v.pages
                count += 1
            else:  # it does not fit: undo the drops
                used += sum(c.pages for c in admits[:dropped])
                count += dropped
        return kept + admits


def _expected_length(r: RequestView) -> float:
    """Output tokens r is expected to produce in all: the engine's prediction, else its bound."""
    if r.expected_output_tokens is not None:
        return r.expected_output_tokens
    return math.inf if r.max_output_tokens is None else float(r.max_output_tokens)
