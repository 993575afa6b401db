"""The seam between the scheduler's plan and whatever computes it.

    scheduler.schedule() -> ScheduledBatch -> executor.execute(batch) -> sampled -> scheduler.update(batch, sampled)

Two implementations: the model runner (engine/runner.py: real tensors, a real sampler) and the
simulator's (sim/executor.py: no tensors; a cost model says how long the step took). The
scheduler cannot tell them apart, which is what lets the simulator drive the real scheduler and
policies on a virtual clock.
"""
from __future__ import annotations

import abc
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenflowd.engine.scheduler import ScheduledBatch


class Executor(abc.ABC):
    """Computes one scheduled step.

    Invariants:
    - `execute` returns exactly `len(batch)` entries, entry i for `batch.requests[i]`;
    - entry i is a token id (an int >= 0) when that request's chunk reaches its last known token
      (`num_computed_tokens + batch.num_tokens[i] == num_tokens`), and None otherwise (the chunk
      ended mid-prompt, or mid-recompute of a preempted request's earlier tokens);
    - it computes the KV of tokens [num_computed_tokens, num_computed_tokens + num_tokens[i]) of
      each request into the pages of its `block_table`, which the scheduler sized beforehand;
    - it changes no request state: counters, token lists and page tables move only in
      `scheduler.update`, so a failed step leaves the scheduler consistent.
    """

    @abc.abstractmethod
    def execute(self, batch: "ScheduledBatch") -> list[int | None]: ...
