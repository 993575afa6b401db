"""The buffer-aware policy in the real engine (CPU, the embedded model): a burst beyond capacity
is served by preempting and resuming, and every stream the clients see is complete and in order."""
from __future__ import annotations

import pytest

from tokenflowd.config import EngineConfig, PolicyConfig
from tokenflowd.engine.core import EngineCore
from tokenflowd.engine.request import Request, SamplingParams

QUESTIONS = ["What is 2+2?", "Name a colour.", "Why is the sky blue?", "Count to five.", "Say hello.",
             "What is a cat?", "Spell 'dog'.", "Name a planet.", "What is rain?", "Give a number.",
             "What is ice?", "Name a fruit."]


def burst(core: EngineCore, max_tokens: int, rates: list[float]) -> tuple[dict[str, list[int]], list[Request]]:
    """Add every question at once; return each request's streamed tokens in the order they came."""
    reqs = []
    for i, q in enumerate(QUESTIONS):
        ids = core.tokenizer.encode_chat([{"role": "user", "content": q}])
        reqs.append(Request(f"q{i}", ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                            reading_rate=rates[i % len(rates)]))
        core.add_request(reqs[-1])
    streams: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    for _ in range(20_000):  # a cap: a livelock fails instead of hanging
        if not core.has_unfinished():
            break
        for out in core.step():
            streams[out.request_id] += out.new_token_ids
    assert not core.has_unfinished()
    core.wait_copies()
    return streams, reqs


@pytest.mark.slow
def test_tokenflow_burst_preempts_resumes_and_streams_stay_complete(embedded_fp32):
    dtype, loaded = embedded_fp32
    # dense fp32: greedy tokens that do not depend on the batch (int4's bf16 products do)
    base = dict(device="cpu", dtype=dtype, quantization="none", page_size=16, max_num_batched_tokens=256)
    reference, _ = burst(EngineCore.from_config(EngineConfig.resolve(**base, policy="fcfs"), loaded), 24, [4.0])

    # Four slots for twelve readers at 3 and 5 tokens/s: an agile μ and a short interval, so
    # buffers that fill are soon worth displacing and drained ones are soon brought back.
    params = PolicyConfig(schedule_interval=0.2, buffer_conservativeness=1.0, critical_buffer=0.5)
    core = EngineCore.from_config(EngineConfig.resolve(**base, max_num_seqs=4, policy="tokenflow", policy_params=params), loaded)
    streams, reqs = burst(core, 24, [3.0, 5.0])

    assert core.scheduler.policy.num_passes > 1
    assert core.scheduler.num_preemptions > 0
    resumed = [r for r in reqs if r.num_preemptions > 0]
    assert resumed, "no request was preempted"
    for r in reqs:
        assert r.finish_reason is not None and r.finish_reason.value == "length"
        # complete and in order: exactly what was generated, each token once, as an uncontended run
        assert streams[r.request_id] == r.output_token_ids == reference[r.request_id]
    assert core.pool.num_used == 0
