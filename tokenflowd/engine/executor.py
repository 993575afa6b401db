"""The seam between the scheduler's plan and whatever computes it.

    scheduler.schedule() -> ScheduledBatch -> executor.execute(batch) -> sampled -> scheduler.update(batch, sampled)

or, overlapped (engine/core.py), launched now and collected after the next step is scheduled:

    executor.launch(batch) -> handle ... executor.collect(handle) -> sampled

Two implementations: the model runner (engine/runner.py: real tensors, a real sampler) and the
simulator's (sim/executor.py: no tensors; a cost model says how long the step took). The
scheduler cannot tell them apart, which is what lets the simulator drive the real scheduler and
policies on a virtual clock.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenflowd.engine.scheduler import ScheduledBatch
    from tokenflowd.protocol import TokenLogprobs


@dataclass
class Launched:
    """A step handed to the executor and not yet collected. `seconds`: how long its compute took
    (set once it has ended); `work`: the executor's own handle."""

    batch: "ScheduledBatch"
    work: Any = None
    seconds: float | None = None


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

    # An executor that overlaps sets this: `launch` returns before the step has been computed, and a
    # row of a later batch may name, in `batch.prev_sample`, the token an earlier launched step
    # samples (its input id is then PLACEHOLDER until the executor puts that token in its place).
    overlaps: bool = False

    def launch(self, batch: "ScheduledBatch") -> Launched:
        """Start computing `batch` and return at once; `collect` waits for it (executors that overlap)."""
        raise NotImplementedError(f"{type(self).__name__} does not overlap steps")

    def collect(self, launched: Launched) -> list[int | None]:
        """The sampled tokens of a launched step, as `execute` returns them (raises its error)."""
        raise NotImplementedError(f"{type(self).__name__} does not overlap steps")

    def take_logprobs(self) -> "dict[int, TokenLogprobs]":
        """After `execute` or `collect`: batch row -> its sampled token's logprobs, for the rows whose
        request asks for them (SamplingParams.logprobs); each call hands them over once."""
        return {}

    def step_seconds(self, started: float, ended: float) -> float:
        """How long the step that ran from `started` to `ended` on the engine's clock took."""
        return ended - started
