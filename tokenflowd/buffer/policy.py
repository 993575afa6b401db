"""The seam between the scheduler and a scheduling policy: plain data in, a plain-data plan out.

A policy never touches requests, pages or tensors. The scheduler builds a `SchedulerView`, asks
`policy.plan(view)`, then carries the plan out; so a policy is testable and simulable without a
model (the simulator builds views itself).
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from tokenflowd.buffer.estimates import StepCost
from tokenflowd.kv.pages import cdiv

if TYPE_CHECKING:
    from tokenflowd.config import PolicyConfig


class RequestView(msgspec.Struct, frozen=True):
    """One request as a policy sees it. A msgspec Struct: the scheduler builds one per tracked
    request every step, and a Struct is built several times faster than a frozen dataclass."""

    request_id: str
    arrival_time: float
    num_tokens: int  # prompt + output so far
    num_computed_tokens: int  # waiting: what its prefix-cache hit would give it
    pages_held: int  # waiting: the hit's pages
    pages_reclaimed: int = 0  # waiting only: hit pages now unreferenced (counted in free_pages)
    pages_exclusive: int | None = None  # running: pages only it holds; None: all of pages_held
    priority: int = 0
    # The client's side (buffer/tracker.py): what buffer-aware policies schedule by.
    reading_rate: float = 20.0  # tokens/s its client reads
    buffer: float = 0.0  # tokens its client holds unread at view.now (0 before the first token)
    num_output_tokens: int = 0
    max_output_tokens: int | None = None  # the most it may generate in all (None: to the context)
    # what the engine expects it to generate in all: its max_tokens capping a prediction learned
    # from finished requests (buffer/estimates.py OutputLengthModel); None: the policy's prior
    expected_output_tokens: float | None = None
    arrival_seq: int = 0  # arrival order at the engine: breaks ties of arrival_time (a burst at one instant)
    # waiting: s to bring its KV back from the host tier (None: no host copy); running: s to write
    # what the host lacks and load it all back were it preempted now (None: no host tier)
    io_time: float | None = None
    host_tokens: int = 0  # waiting: leading tokens whose KV the host tier holds (a reload restores them)
    # waiting only: s its client has been waiting on an empty buffer (0: it holds tokens, or has none yet)
    dry_for: float = 0.0

    def replace(self, **changes) -> RequestView:
        return msgspec.structs.replace(self, **changes)

    @property
    def started(self) -> bool:
        """Its client has its first token (and reads from its buffer)."""
        return self.num_output_tokens > 0

    @property
    def time_to_empty(self) -> float:
        """Seconds its client can read on without a new token."""
        return self.buffer / self.reading_rate

    @property
    def pages_freed(self) -> int:
        """Pages preempting this request returns to the free pool (shared prefix pages stay)."""
        return self.pages_held if self.pages_exclusive is None else self.pages_exclusive

    @property
    def tokens_left(self) -> int:
        """Tokens to compute before the request can sample (1 for a decode)."""
        return self.num_tokens - self.num_computed_tokens

    def pages_to_run(self, num_tokens: int, page_size: int) -> int:
        """Free pages consumed by running `num_tokens` more tokens of this request."""
        grow = max(0, cdiv(self.num_computed_tokens + num_tokens, page_size) - self.pages_held)
        return grow + self.pages_reclaimed


@dataclass(frozen=True, slots=True)
class SchedulerView:
    now: float
    running: tuple[RequestView, ...]  # in arrival order
    # in queue order: every preempted request and the first max_num_seqs new ones (no more could
    # be admitted this step); a started request is never left out of the view
    waiting: tuple[RequestView, ...]
    free_pages: int  # free + evictable cached pages
    total_pages: int
    page_size: int
    token_budget: int  # tokens one step may compute
    max_num_seqs: int
    cost: StepCost = field(default_factory=StepCost)  # live step-time estimate (buffer/estimates.py)
    host_pages: int = 0  # pages of the host KV tier (0: none; preempted KV is recomputed)
    # admitted, their KV coming back from the host tier: they hold pages_held device pages and a
    # seat (counted out of max_num_seqs already), and rejoin `running` when the load lands. A plan
    # neither schedules nor preempts them; a policy that decides for a while keeps them in mind.
    loading: tuple[RequestView, ...] = ()
    # what the previous plan scheduled and the scheduler did not run (its pages did not fit after
    # all, or a request before it in arrival order could not be admitted): they are still waiting
    deferred: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Plan:
    """One step: which requests compute how many tokens, and which running ones give up their KV."""

    scheduled: tuple[tuple[str, int], ...] = ()  # (request_id, num_tokens), num_tokens >= 1
    preempted: tuple[str, ...] = ()
    # admitted requests whose KV comes back from the host tier, not recompute (the scheduler also
    # loads any other admitted request whose host copy is faster to load than to recompute)
    reload: tuple[str, ...] = ()


class SchedulingPolicy(abc.ABC):
    """Invariants a plan must keep (the scheduler asserts the first four; what does not fit in
    pages after all waits for the next step):
    - sum of scheduled tokens <= view.token_budget; no request scheduled twice;
    - a request is never both scheduled and preempted; only running requests are preempted;
    - scheduled tokens of a request <= its tokens_left;
    - pages consumed by the scheduled requests <= free_pages + pages freed by the preemptions;
    - running plus admitted requests <= max_num_seqs.
    """

    name: str

    @abc.abstractmethod
    def plan(self, view: SchedulerView) -> Plan: ...

    def set_params(self, params: "PolicyConfig") -> None:
        """New parameters, read from the next plan on (a SIGHUP reload); decisions already taken
        stand until their next pass."""
        self.params = params
