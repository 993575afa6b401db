"""Scheduling on a tiny model: preemption by recompute keeps greedy output; budgets hold."""
from __future__ import annotations

import torch

from tokenflowd.config import EngineConfig
from tokenflowd.engine.core import EngineCore
from tokenflowd.engine.request import Request, SamplingParams


def run(core: EngineCore, prompts: list[list[int]], max_tokens: int = 20) -> dict[str, list[int]]:
    reqs = [Request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
            for i, p in enumerate(prompts)]
    for r in reqs:
        core.add_request(r)
    budgets = []
    while core.has_unfinished():
        batch = core.scheduler.schedule()
        budgets.append(batch.total_tokens)
        core.scheduler.update(batch, core.runner.execute(batch))
    assert max(budgets) <= core.config.max_num_batched_tokens
    return {r.request_id: r.output_token_ids for r in reqs}


def make(hf_dirs, **kw) -> EngineCore:
    return EngineCore(EngineConfig.resolve(model=str(hf_dirs["llama"]), device="cpu", dtype="float32", **kw))


def test_preemption_by_recompute_keeps_greedy_tokens(hf_dirs):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (30, 22, 41, 17, 35, 26)]
    roomy = make(hf_dirs, page_size=4, num_pages=200)
    tight = make(hf_dirs, page_size=4, num_pages=30, max_num_batched_tokens=24)
    expected = run(roomy, prompts)
    got = run(tight, prompts)
    assert tight.scheduler.num_preemptions > 0
    assert got == expected
    assert tight.pool.num_used == 0
