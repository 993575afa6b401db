"""Presence, frequency and repetition penalties (engine/sampler.py `penalize`): applied as OpenAI
and Hugging Face define them, to the rows that ask for them only, counting a token still on the
device (overlap scheduling) as generated; and, on the embedded model, a frequency penalty of 2.0
lowers a repeated token's logit by 2.0 times its count at every step."""
from __future__ import annotations

import pytest
import torch

from tokenflowd.config import EngineConfig
from tokenflowd.engine.offline import Engine
from tokenflowd.engine.request import PLACEHOLDER, InvalidRequestError, SamplingParams, SamplingRow
from tokenflowd.engine.sampler import Sampler


def row(tokens: list[int], num_prompt: int, foreign: list[int] | None = None, **penalties) -> SamplingRow:
    params = SamplingParams(temperature=0.0, **penalties)
    if not params.penalized:
        return SamplingRow(params, None, len(tokens) - num_prompt, frozenset())
    return SamplingRow(params, None, len(tokens) - num_prompt, frozenset(), tokens, foreign or [], num_prompt)


def test_frequency_and_presence_count_only_the_output():
    logits = torch.zeros(1, 8)
    Sampler.penalize(logits, [row([1, 2, 3, 3, 3, 5], 2, frequency_penalty=2.0, presence_penalty=0.5)])
    # output: 3 three times, 5 once; prompt tokens 1, 2 are not penalized
    assert logits[0].tolist() == [0, 0, 0, -6.5, 0, -2.5, 0, 0]


def test_repetition_divides_positive_and_multiplies_negative_logits_of_prompt_and_output_tokens():
    logits = torch.tensor([[4.0, -4.0, 4.0, -4.0, 4.0, 4.0]])
    Sampler.penalize(logits, [row([1, 2, 3], 2, foreign=[0], repetition_penalty=2.0)])
    assert logits[0].tolist() == [2.0, -8.0, 2.0, -8.0, 4.0, 4.0]  # 0 (the pool's prefix), 1, 2: prompt; 3: output


def test_rows_without_penalties_are_untouched_and_cost_no_count():
    logits = torch.randn(3, 16)
    before = logits.clone()
    rows = [row([1, 2, 3], 1), row([4, 4, 4], 1, frequency_penalty=1.0), row([5, 6], 1)]
    Sampler.penalize(logits, rows)
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    assert logits[1, 4].item() == pytest.approx(before[1, 4].item() - 2.0)
    assert rows[0].tokens is None and rows[2].tokens is None  # nothing of theirs was looked at


def test_a_token_still_on_the_device_counts_and_its_placeholder_does_not():
    logits = torch.zeros(2, 8)
    prev = torch.tensor([7, 6])  # what the step in flight samples for its two rows
    rows = [row([1, 2, PLACEHOLDER], 1, frequency_penalty=1.0), row([1, 6], 1, frequency_penalty=1.0)]
    Sampler.penalize(logits, rows, prev, pending=[1, -1])
    assert logits[0].tolist() == [0, 0, -1, 0, 0, 0, -1, 0]  # 2, and 6 from the device
    assert logits[1].tolist() == [0, 0, 0, 0, 0, 0, -1, 0]


@pytest.mark.parametrize("bad", [dict(frequency_penalty=2.5), dict(presence_penalty=-2.1),
                                 dict(repetition_penalty=0.0)])
def test_out_of_range_penalties_are_refused(bad):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**bad)


def test_a_frequency_penalty_lowers_each_repeated_tokens_logit_by_its_count_on_the_model(embedded_fp32, monkeypatch):
    dtype, loaded = embedded_fp32
    engine = Engine(EngineConfig.resolve(device="cpu", dtype=dtype, quantization="none", kv_cache_memory="64MiB"),
                    loaded)
    prompt = engine.tokenizer.encode("one two three one two three one two three one two three", add_special_tokens=True)
    plain = engine.generate({"a": dict(prompt=prompt, sampling_params=SamplingParams(temperature=0.0, max_tokens=16,
                                                                                      ignore_eos=True))})["a"]
    assert len(set(plain.token_ids)) < len(plain.token_ids), "the prompt should make greedy decoding repeat itself"
    seen = []
    penalize = Sampler.penalize

    def recording(logits, reqs, prev=None, pending=None):
        before = logits.clone()
        penalize(logits, reqs, prev, pending)
        seen.append((before, logits.clone(), [r.tokens[r.num_prompt_tokens:] if r.tokens else None for r in reqs]))

    monkeypatch.setattr(Sampler, "penalize", staticmethod(recording))
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, frequency_penalty=2.0)
    out = engine.generate({"b": dict(prompt=prompt, sampling_params=params)})["b"]
    assert len(seen) == 16
    repeated = 0
    for step, (before, after, (output,)) in enumerate(seen):
        assert output == out.token_ids[:step]
        counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=before.shape[1]).float()
        assert torch.allclose(after[0], before[0] - 2.0 * counts[: before.shape[1]])
        assert out.token_ids[step] == int(after[0].argmax())  # greedy over the penalized logits
        repeated += int(counts[plain.token_ids[step]] > 0) if out.token_ids[:step] == plain.token_ids[:step] else 0
    assert repeated, "the plain greedy's first repeated token was never penalized"
    assert out.token_ids != plain.token_ids
