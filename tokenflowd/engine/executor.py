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
    - `execute` returns exactly `len(batch)` entries, entry i for row i;
    - entry i is a token id (an int >= 0) when `batch.sampling[i]` is set (the row's chunk reaches
      its request's last known token), and None otherwise (the chunk ended mid-prompt, or
      mid-recompute of a preempted request's earlier tokens);
    - it computes the KV of tokens [positions[i], positions[i] + num_tokens[i]) of each row into the
      pages of `block_tables[i]`, which the scheduler sized beforehand;
    - the batch is plain data, and the executor holds no request: counters, token lists and page
      tables move only in `scheduler.update`, so a failed step leaves the scheduler consistent.
    """

    # A fresh executor's first step pays one-time costs (kernel and allocator set-up): its time says
    # nothing of the next steps', and the step-time model skips it.
    cold_start: bool = False

    @abc.abstractmethod
    def execute(self, batch: "ScheduledBatch") -> list[int | None]: ...

    def step_seconds(self, started: float, ended: float) -> float:
        """How long the step that ran from `started` to `ended` on the engine's clock took."""
        return ended - started
