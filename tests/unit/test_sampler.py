"""The sampler: greedy, top-k / top-p support, seeds, min_tokens."""
from __future__ import annotations

import torch

from tokenflowd.engine.request import Request, SamplingParams, SamplingRow
from tokenflowd.engine.sampler import Sampler


def request(**kw) -> Request:
    return Request("r", [1, 2, 3], SamplingParams(**kw), eos_token_ids=(2,), max_model_len=100)


def req(**kw) -> SamplingRow:
    return request(**kw).sampling_row()


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 1.0, 0.0]])
    assert Sampler()(logits, [req(temperature=0), req(top_k=1)]) == [1, 0]


def test_top_k_and_top_p_restrict_support():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(400, 1)
    s = Sampler(seed=1)
    k2 = s(logits.clone(), [req(top_k=2) for _ in range(400)])
    assert set(k2) == {0, 1}
    p = s(logits.clone(), [req(top_p=0.7) for _ in range(400)])  # 0.5 + 0.3 reach 0.7
    assert set(p) == {0, 1}
    free = s(logits.clone(), [req() for _ in range(400)])
    assert set(free) == {0, 1, 2, 3}
    assert 0.4 < free.count(0) / 400 < 0.6


def test_seed_makes_a_row_independent_of_its_batch():
    logits = torch.randn(1, 50)
    a = [Sampler(seed=s)(logits.clone(), [req(seed=42)])[0] for s in range(3)]
    other = torch.cat([torch.randn(3, 50), logits])
    b = Sampler(seed=9)(other, [req(), req(), req(), req(seed=42)])[3]
    assert len(set(a)) == 1 and a[0] == b


def test_min_tokens_masks_stop_tokens():
    logits = torch.tensor([[0.0, 0.0, 10.0, 0.0]])  # eos (2) is by far the likeliest
    assert Sampler()(logits.clone(), [req(temperature=0, min_tokens=1)]) != [2]
    assert Sampler()(logits.clone(), [req(temperature=0)]) == [2]


def test_top_p_one_rows_keep_the_whole_vocab_beside_filtered_rows():
    torch.manual_seed(0)
    logits = torch.randn(2, 49152)
    probs = Sampler._probs(logits.clone(), [req(top_p=0.5), req()])
    assert (probs[1] > 0).all()  # the unfiltered row lost nothing to its neighbour's sort
    torch.testing.assert_close(probs[1], logits[1].softmax(-1))


def test_min_tokens_lifts_once_reached():
    r = request(temperature=0, min_tokens=1)
    r.token_ids.append(7)  # one output token already
    assert Sampler()(torch.tensor([[0.0, 0.0, 10.0, 0.0]]), [r.sampling_row()]) == [2]


def test_temperature_sharpens():
    logits = torch.log(torch.tensor([[0.6, 0.4]])).repeat(2000, 1)
    cold = Sampler(seed=0)(logits.clone(), [req(temperature=0.2) for _ in range(2000)])
    assert cold.count(0) / 2000 > 0.85  # 0.6^5 / (0.6^5 + 0.4^5) = 0.88
