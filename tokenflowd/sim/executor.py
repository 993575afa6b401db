"""The simulator's Executor: no tensors, no KV; the cost model says how long each step took."""
from __future__ import annotations

import math
import random

from tokenflowd.engine.executor import Executor
from tokenflowd.engine.scheduler import ScheduledBatch
from tokenflowd.sim.clock import VirtualClock
from tokenflowd.sim.cost import CostModel


class CostModelExecutor(Executor):
    """Moves the virtual clock by the cost model's time for the step, and samples a token for every
    row that samples: `eos_token_id` as its request's `output_lens[request_id]`-th output token
    (the workload's length: the model "decides" to stop there, and the engine learns it only
    then), `token_id` before. The ids carry no meaning.

    `jitter` σ > 0 multiplies each step's time by a lognormal factor of mean 1 (seeded by
    `jitter_seed`), as a real device's steps of one shape vary by a few percent: without it, every
    tie between requests breaks the same way in every run, and a tail figure (the last first token
    of a burst) hangs on one step more or less."""

    def __init__(self, cost: CostModel, output_lens: dict[str, int], clock: VirtualClock, token_id: int = 0,
                 eos_token_id: int = 1, jitter: float = 0.0, jitter_seed: int = 0) -> None:
        if not 0.0 <= jitter < 1.0:
            raise ValueError(f"step jitter must be in [0, 1), got {jitter}")
        self.cost = cost
        self.output_lens = output_lens
        self.clock = clock
        self.token_id = token_id
        self.eos_token_id = eos_token_id
        self._last = 0.0
        self.jitter = jitter
        self._rng = random.Random(jitter_seed)

    def step_time(self, batch: ScheduledBatch) -> float:
        """Seconds the step takes."""
        return self.chunks_time(zip(batch.positions, batch.num_tokens))

    def chunks_time(self, chunks) -> float:
        """Seconds of a step computing, per request, (computed, n): n new tokens after `computed`
        tokens that have KV (CostModel.work), jittered."""
        t = self.cost.step_time(chunks)
        if self.jitter:
            t *= math.exp(self._rng.gauss(-self.jitter**2 / 2, self.jitter))
        return t

    def execute(self, batch: ScheduledBatch) -> list[int | None]:
        self._last = self.step_time(batch)
        self.clock.now += self._last
        out: list[int | None] = []
        for rid, row in zip(batch.request_ids, batch.sampling):
            if row is None:
                out.append(None)  # mid-prompt (or mid-recompute): nothing to sample yet
            elif row.num_output_tokens + 1 >= self.output_lens[rid]:
                out.append(self.eos_token_id)
            else:
                out.append(self.token_id)
        return out

    def step_seconds(self, started: float, ended: float) -> float:
        return self._last  # exactly the cost model's figure, not a difference of clock readings
