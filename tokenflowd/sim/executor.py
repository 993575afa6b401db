"""The simulator's Executor: no tensors, no KV; the cost model says how long each step took."""
from __future__ import annotations

from tokenflowd.engine.executor import Executor
from tokenflowd.engine.scheduler import ScheduledBatch
from tokenflowd.sim.cost import CostModel


class CostModelExecutor(Executor):
    """Samples `token_id` for every request whose chunk reaches its last known token. The
    simulator ends requests by length (`max_tokens`, `ignore_eos`), so the id only has to be one
    the request does not stop on; it carries no meaning."""

    def __init__(self, cost: CostModel, token_id: int = 0) -> None:
        self.cost = cost
        self.token_id = token_id

    def step_time(self, batch: ScheduledBatch) -> float:
        """Seconds the step takes. Call it before `scheduler.update`, which moves the counters
        the chunks are measured from."""
        return self.cost.step_time(zip((r.num_computed_tokens for r in batch.requests), batch.num_tokens))

    def execute(self, batch: ScheduledBatch) -> list[int | None]:
        return [self.token_id if r.num_computed_tokens + n == r.num_tokens else None
                for r, n in zip(batch.requests, batch.num_tokens)]
