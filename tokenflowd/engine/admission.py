"""Load shedding (`--max-queue-delay S`): predict a new request's time to first token from the
queue ahead of it and the live step-time model; refuse it at once when the prediction exceeds S.

Both policies let TTFT grow without bound when more work arrives than the engine computes: every
request still gets served, after a wait that grows with the queue. A client is better off with an
immediate 429 and a Retry-After than with a stream that answers after a minute. Mooncake §7
(mooncake.txt) rejects a request on arrival when the load predicted for its lifetime breaks the
TTFT or TBT objective ("Early Rejection", §7.2), rather than after its prefill was spent, and
predicts that load at the system level, every decode taking a uniform time (§7.4). Here one
engine predicts for itself: the TTFT objective only (TBT is the scheduler's business), from what
is queued ahead, each request's expected length, and the step costs fitted to recent steps.

The model (FCFS semantics; times in steps, then seconds):

    prompt pipeline   prompts ahead are computed in queue order, `chunk` tokens a step beside
                      the batch's decodes (chunk = token_budget − decodes):
                          step ───┬──────┬──────┬──────┬──────┬──────►
                          decodes  n      n      n      n      n       every step
                          prompts [ running mid-prompt | ahead 1 | ahead 2 | … | new ]
                                                                                   ^ first token
    seats and pages   a request ahead enters the pipeline once a seat and the KV pages of its
                      whole life (prompt + expected output) are free; a running request gives
                      its seat and pages back after its expected output is out, one token a step
    seconds           ttft = (steps · t_step(n) + prompt tokens up to the new one's · t_token) · pace

where t_step(n) is a step of n decodes (n: the batch once the queue ahead is seated), t_token
the marginal time of a prompt token inside a step (StepCost.recompute_time), and the pace how
much longer than the model prices them the last steps took, whole (AdmissionControl). Assumptions,
each named where it errs:

  - Queue order is priority, then arrival (the scheduler's waiting list); a higher-priority request
    arriving later jumps ahead and can push an admitted request past the bound.
  - Output lengths are the engine's expectation (max_tokens capping what finished requests
    produced), so a seat comes free about when expected; a long tail of outputs can delay seats.
  - A page reservation of a request's whole life is conservative: FCFS admits on the prompt's
    pages and preempts when they run out, which the reservation treats as a wait.
  - Prefix-cache hits shorten prompts; a preempted request whose KV the host tier holds comes back
    by a load, overlapped with compute: only what the host lacks counts as prompt.
  - The batch size n is taken as constant over the wait: steps are priced as when the queue is in.
  - A buffer-aware policy (tokenflow, andes) orders requests by more than arrival; the model
    prices the FCFS order, which those policies fall back to under load.

An idle engine never sheds (a prediction there is the request's own prefill), nor does one whose
step-time model has seen fewer than MIN_OBSERVED_STEPS steps (it would be the prior's guess).
With several engines the router picks one and that engine decides: a request it sheds is shed,
not offered to another engine. A decode node's reservation for a prompt's KV from a prefill node
(EngineCore.add_remote) is bounded alike, priced with its prompt computed (a seat and one token);
past the bound nothing is reserved and the request is admitted, or shed, as a local one.
"""
from __future__ import annotations

import heapq
import math
from typing import TYPE_CHECKING, NamedTuple, Sequence

import numpy as np

from tokenflowd.buffer.estimates import StepCost
from tokenflowd.engine.request import Request, RequestStatus
from tokenflowd.kv.pages import cdiv

if TYPE_CHECKING:
    from tokenflowd.engine.scheduler import Scheduler

MIN_OBSERVED_STEPS = 16  # the step-time model's first least-squares fit (estimates.py refit_every)
PACE_WEIGHT = 0.1  # of the last step in the pace: about the last ten steps count


class AdmissionControl:
    """`--max-queue-delay`: refuses a request whose predicted TTFT exceeds `bound` seconds.

    The step-time model is a least-squares fit of the compute of the last 256 steps, refitted
    every 16: it learns the machine's speed over a minute or so, while a wait of a few seconds goes
    at the speed of the next few seconds, scheduling and bookkeeping included. A CPU shared with
    other work (the front, the clients, other processes) slows every step at once. So the model's
    prices are scaled by the `pace`: a moving average of the whole step's time over the model's
    price of it, for the last ten steps or so (1: the model is right). On a busy 2-core box the
    pace ran at 1.3, and without it admitted requests waited up to 1.6× the bound."""

    def __init__(self, bound: float) -> None:
        self.bound = bound
        self.pace = 1.0
        self.num_steps = 0  # observed
        self.num_shed = 0

    def observe_step(self, predicted: float, seconds: float) -> None:
        """A step the step-time model priced at `predicted` s took `seconds`."""
        self.num_steps += 1
        if predicted > 0:
            self.pace += PACE_WEIGHT * (seconds / predicted - self.pace)

    def check(self, scheduler: Scheduler, req: Request) -> None:
        """Raise QueueDelayExceeded (nothing changes) when `req`, validated and not yet added,
        would wait longer than the bound. An idle engine never sheds, nor one whose step-time model
        has not yet been fitted to steps of its own."""
        ttft = self.over_bound(scheduler, req)
        if ttft is not None:
            self.num_shed += 1
            raise QueueDelayExceeded(ttft, self.bound)

    def over_bound(self, scheduler: Scheduler, req: Request, remote: bool = False) -> float | None:
        """`req`'s predicted TTFT when it exceeds the bound, else None (as `check`, counting nothing).
        `remote`: its prompt's KV comes from a prefill node, so it waits here only for a seat."""
        if not scheduler.has_unfinished() or self.num_steps < MIN_OBSERVED_STEPS:
            return None
        ttft = engine_ttft(scheduler, req, self.pace, remote)
        return ttft if ttft > self.bound else None


class QueuedWork(NamedTuple):
    """One request as the prediction sees it (running, waiting ahead, or the new one)."""

    prefill_tokens: int  # tokens to compute before its next sample (0: it is decoding)
    decode_steps: float  # steps it keeps its seat after that: its expected output still to come
    pages: int  # KV pages it holds at its peak (prompt and expected output)
    pages_held: int = 0  # pages it holds now (running requests; waiting ones take theirs on admission)


class QueueDelayExceeded(Exception):
    """EngineCore.add_request refused a request: its predicted TTFT exceeds the bound. Nothing was
    queued and no page allocated. `retry_after`: whole seconds until the queue ahead has drained
    enough for the prediction to fit the bound (at least 1)."""

    def __init__(self, predicted_ttft: float, bound: float) -> None:
        self.predicted_ttft = predicted_ttft
        self.bound = bound
        self.retry_after = max(1, math.ceil(predicted_ttft - bound))
        super().__init__(f"predicted time to first token {predicted_ttft:.1f} s exceeds this server's bound of "
                         f"{bound:g} s (--max-queue-delay); retry after {self.retry_after} s")


def predict_ttft(new: QueuedWork, running: Sequence[QueuedWork], ahead: Sequence[QueuedWork], cost: StepCost, *,
                 max_num_seqs: int, free_pages: int, token_budget: int, mean_context: float = 0.0) -> float:
    """Seconds from now until `new` samples its first token, were it queued behind `ahead` (in
    queue order) while `running` hold seats (in the scheduler's order). `free_pages`: free and
    evictable device pages; `mean_context`: the mean KV length of a decode in the batch."""
    n = min(max_num_seqs, len(running) + len(ahead))  # decodes a step carries while the queue drains
    t_step = cost.step_time(n, int(n * mean_context))
    t_token = cost.recompute_time(1)
    chunk = max(1, token_budget - n)

    seats = max_num_seqs - len(running)
    free = free_pages - sum(max(0, r.pages - r.pages_held) for r in running)  # running requests grow first
    releases: list[tuple[float, int]] = []  # (step its seat comes free, pages it gives back)
    releasing = 0  # pages in `releases`
    pipeline = 0.0  # the step by which the prompt pipeline is through what it holds
    prompt_tokens = 0  # prompt tokens it holds, the new request's last
    for r in running:  # mid-prompt ones are first in the pipeline (FCFS: running chunks before admissions)
        if r.prefill_tokens:
            pipeline += r.prefill_tokens / chunk
            prompt_tokens += r.prefill_tokens
        heapq.heappush(releases, ((_step_of(pipeline) if r.prefill_tokens else 0) + r.decode_steps, r.pages))
        releasing += r.pages
    now = 0.0  # FCFS: nothing is seated before the request ahead of it
    for r in (*ahead, new):
        need = max(0, min(r.pages, free + releasing))  # no more than could ever come free
        while (seats < 1 or free < need) and releases:
            at, pages = heapq.heappop(releases)
            now = max(now, at)
            seats += 1
            free += pages
            releasing -= pages
        seats -= 1
        free -= need
        pipeline = max(pipeline, now) + r.prefill_tokens / chunk
        prompt_tokens += r.prefill_tokens
        heapq.heappush(releases, (_step_of(pipeline) + r.decode_steps, need))
        releasing += need
    return _step_of(pipeline) * t_step + prompt_tokens * t_token


def _step_of(pipeline: float) -> int:
    """The step that computes a prompt's last token, the pipeline through it at `pipeline`: it
    samples the first token. (Whole steps: a prompt done a fraction into a step waits for its end.)"""
    return math.ceil(pipeline - 1e-9)


def engine_ttft(scheduler: Scheduler, req: Request, pace: float = 1.0, remote: bool = False) -> float:
    """predict_ttft for `req` (validated, not yet added) on `scheduler`'s queue as it stands,
    the step-time model's prices scaled by `pace`. `remote`: a prefill node computes its prompt;
    here it takes a seat and the pages of its life, and its first decode is one token."""
    kv = scheduler.kv
    ps = kv.page_size
    key = (-req.priority, req.arrival_time)
    ahead = []
    for r in scheduler.waiting:  # in queue order: those ahead of `req` are a prefix
        if (-r.priority, r.arrival_time) > key:
            break
        ahead.append(r)
    seated = [*scheduler.running, *scheduler.loading]
    everyone = [*seated, *ahead, req]
    expected = scheduler.output_lengths.expected(
        np.fromiter((r.num_output_tokens for r in everyone), dtype=np.float64, count=len(everyone)),
        np.fromiter((r.max_tokens for r in everyone), dtype=np.float64, count=len(everyone))).tolist()

    def peak_pages(r: Request, e: float) -> int:
        return cdiv(r.num_prompt_tokens + math.ceil(e), ps)

    running = []
    for r, e in zip(seated, expected):
        computed = kv.state(r).num_load_tokens if r.status is RequestStatus.LOADING else r.num_computed_tokens
        left = r.num_tokens - computed
        prefill = left if left > 1 else 0  # 1: a decode (the last sampled token is computed as it runs)
        running.append(QueuedWork(prefill, max(0.0, e - r.num_output_tokens - (1 if prefill else 0)),
                                  peak_pages(r, e), len(kv.block_table(r))))
    queued = []
    for r, e in zip([*ahead, req], expected[len(seated):]):
        # a preempted request's KV on the host comes back by a load, under compute
        computed = r.num_tokens if remote and r is req else max(kv.match(r).num_device_pages * ps,
                                                                 kv.num_host_tokens(r))
        queued.append(QueuedWork(max(1, r.num_tokens - computed), max(0.0, e - r.num_output_tokens - 1),
                                 peak_pages(r, e)))
    contexts = [r.num_tokens for r in seated] or [r.num_tokens for r in (*ahead, req)]
    c = scheduler.cost
    cost = StepCost(c.base * pace, c.per_token * pace, c.per_context * pace)
    return predict_ttft(queued[-1], running, queued[:-1], cost,
                        max_num_seqs=scheduler.max_num_seqs, free_pages=kv.pool.num_free,
                        token_budget=scheduler.token_budget, mean_context=sum(contexts) / len(contexts))
