"""The simulator's Executor: no tensors, no KV; the cost model says how long each step took."""
from __future__ import annotations

from tokenflowd.engine.executor import Executor
from tokenflowd.engine.scheduler import ScheduledBatch
from tokenflowd.sim.cost import CostModel


class CostModelExecutor(Executor):
    """Samples a token for every request whose chunk reaches its last known token: `eos_token_id`
    as its `output_lens[request_id]`-th output token (the workload's length: the model "decides"
    to stop there, and the engine learns it only then), `token_id` before. The ids carry no meaning."""

    def __init__(self, cost: CostModel, output_lens: dict[str, int], token_id: int = 0, eos_token_id: int = 1) -> None:
        self.cost = cost
        self.output_lens = output_lens
        self.token_id = token_id
        self.eos_token_id = eos_token_id

    def step_time(self, batch: ScheduledBatch) -> float:
        """Seconds the step takes. Call it before `scheduler.update`, which moves the counters
        the chunks are measured from."""
        return self.cost.step_time(zip((r.num_computed_tokens for r in batch.requests), batch.num_tokens))

    def execute(self, batch: ScheduledBatch) -> list[int | None]:
        out: list[int | None] = []
        for r, n in zip(batch.requests, batch.num_tokens):
            if r.num_computed_tokens + n < r.num_tokens:
                out.append(None)  # mid-prompt (or mid-recompute): nothing to sample yet
            elif r.num_output_tokens + 1 >= self.output_lens[r.request_id]:
                out.append(self.eos_token_id)
            else:
                out.append(self.token_id)
        return out
