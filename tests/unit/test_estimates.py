"""The live step-time model: recovers a linear cost exactly, keeps every term non-negative, and
follows a change of speed once the window has turned over."""
from __future__ import annotations

import random

import pytest

from tokenflowd.buffer.estimates import StepCost, StepTimeModel


def feed(model: StepTimeModel, truth: StepCost, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    for _ in range(n):
        seqs = rng.randint(1, 32)
        prefill = rng.choice([0, 0, 0, rng.randint(16, 512)])
        tokens = seqs + prefill
        context = seqs * rng.randint(50, 2000) + prefill
        model.observe(tokens, context, truth.step_time(tokens, context))


def test_recovers_a_linear_cost():
    truth = StepCost(base=0.008, per_token=3e-5, per_context=4e-8)
    m = StepTimeModel()
    feed(m, truth, 200)
    assert m.cost.base == pytest.approx(truth.base, rel=1e-6)
    assert m.cost.per_token == pytest.approx(truth.per_token, rel=1e-6)
    assert m.cost.per_context == pytest.approx(truth.per_context, rel=1e-4)
    assert m.cost.capacity(32, 1000) == pytest.approx(32 / truth.step_time(32, 32_000))


def test_terms_stay_non_negative_and_the_fit_beats_clipping():
    # Step time falls with context here (no cost model does that): the context term must come
    # out 0 and the others fit the rest, instead of a negative term clipped after the fact.
    rng = random.Random(0)
    m = StepTimeModel(window=64, refit_every=1)
    for _ in range(64):
        tokens, context = rng.randint(8, 64), rng.randint(1000, 10_000)
        m.observe(tokens, context, 0.05 + 1e-3 * tokens - 1e-6 * context)
    assert m.cost.per_context == 0.0
    assert m.cost.base >= 0
    assert m.cost.per_token == pytest.approx(1e-3, rel=0.05)


def test_follows_a_slowdown_within_a_window():
    fast, slow = StepCost(0.01, 2e-5, 1e-8), StepCost(0.1, 2e-4, 1e-7)
    m = StepTimeModel(window=128)
    feed(m, fast, 128)
    feed(m, slow, 128, seed=1)
    assert m.cost.step_time(8, 8000) == pytest.approx(slow.step_time(8, 8000), rel=1e-3)


def test_output_lengths_are_learned_from_finished_requests():
    import numpy as np

    from tokenflowd.buffer.estimates import OutputLengthModel

    m = OutputLengthModel(prior=1024, min_samples=4)
    inf = np.array([np.inf])
    assert m.expected(np.array([10.0]), inf)[0] == 1024  # the prior until enough have finished
    for n in (100, 200, 300, 400):
        m.observe(n)
    assert m.expected(np.array([0.0]), inf)[0] == 250  # E[L]
    assert m.expected(np.array([250.0]), inf)[0] == 350  # E[L | L > 250]: an answer under way goes on
    assert m.expected(np.array([500.0]), inf)[0] == 750  # past every sample: n·1.5
    assert m.expected(np.array([250.0]), np.array([300.0]))[0] == 300  # a client's max_tokens caps it
