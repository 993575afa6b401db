"""Live estimates of what a step costs, from the steps the engine (or the simulator) really ran.

A step's time is modelled as linear in what it computes:

    t_step ≈ base + per_token · (tokens computed) + per_context · (context tokens)

where a request's context tokens are the KV length its attention covers this step
(num_computed_tokens + its new tokens), summed over the batch.

fitted by least squares over a sliding window of recent steps. From it a policy derives the
generation capacity Γ (tokens/s at a given batch), one running request's decode rate, and the
time to recompute a preempted request's KV (tokenflow §4.2.3: "sliding-window-averaged prefill
latencies per token").
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class StepCost:
    """A snapshot of the step-time model (seconds). Plain data: it travels in the policy view."""

    base: float = 0.02
    per_token: float = 1e-4
    per_context: float = 0.0

    def step_time(self, num_tokens: int, num_context: int = 0) -> float:
        return self.base + self.per_token * num_tokens + self.per_context * num_context

    def decode_step_time(self, num_seqs: int, mean_context: float) -> float:
        """One decode step of `num_seqs` requests whose contexts average `mean_context` tokens."""
        return self.step_time(num_seqs, int(num_seqs * mean_context))

    def recompute_time(self, num_tokens: int) -> float:
        """Marginal time to recompute `num_tokens` of KV inside a batch that runs anyway."""
        return (self.per_token + self.per_context) * num_tokens

    def capacity(self, num_seqs: int, mean_context: float) -> float:
        """Γ: tokens/s the engine generates with `num_seqs` decodes in every step."""
        return num_seqs / self.decode_step_time(max(1, num_seqs), mean_context) if num_seqs > 0 else 0.0


class StepTimeModel:
    """Fits StepCost to the last `window` observed steps; refits at most every `refit_every` steps."""

    def __init__(self, prior: StepCost | None = None, window: int = 256, refit_every: int = 16) -> None:
        self._obs: deque[tuple[float, float, float]] = deque(maxlen=window)  # (tokens, context, seconds)
        self._refit_every = refit_every
        self._since_fit = 0
        self.cost = prior or StepCost()

    def observe(self, num_tokens: int, num_context: int, seconds: float) -> None:
        self._obs.append((float(num_tokens), float(num_context), seconds))
        self._since_fit += 1
        if self._since_fit >= self._refit_every or len(self._obs) <= self._refit_every:
            self._fit()

    def _fit(self) -> None:
        self._since_fit = 0
        obs = np.asarray(self._obs)
        if len(obs) < 3:
            # Too few points for three terms: scale the prior to the seconds seen so far.
            pred = np.array([self.cost.step_time(int(t), int(c)) for t, c, _ in obs])
            k = float(obs[:, 2].sum() / max(pred.sum(), 1e-12))
            self.cost = StepCost(self.cost.base * k, self.cost.per_token * k, self.cost.per_context * k)
            return
        x = np.column_stack([np.ones(len(obs)), obs[:, 0], obs[:, 1]])
        coef = _nnls(x, obs[:, 2])
        if coef is not None:
            self.cost = StepCost(*(float(c) for c in coef))


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray | None:
    """Least squares with every coefficient ≥ 0, for a handful of columns: the best of the
    unconstrained fits over each subset of columns whose coefficients all come out ≥ 0. (Clipping
    one unconstrained fit is not this: a negative term pushes its neighbours up to compensate.)"""
    k = x.shape[1]
    best, best_err = None, np.inf
    for mask in range(1, 1 << k):
        cols = [j for j in range(k) if mask >> j & 1]
        sub, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
        if (sub < 0).any():
            continue
        coef = np.zeros(k)
        coef[cols] = sub
        err = float(np.sum((x @ coef - y) ** 2))
        if err < best_err:
            best, best_err = coef, err
    return best


class OutputLengthModel:
    """Predicts how many output tokens a request will produce in all, from the lengths of the
    requests that finished on this engine: what a real engine knows (the simulator must not hand
    the policy the workload's true length).

    For a request that has produced n tokens the prediction is E[L | L > n] over the last `window`
    finished lengths: a long answer already under way is expected to go on. Until `min_samples`
    requests have finished the prior stands in; past the longest length seen, n·(1 + tail) (the
    request has outlived every sample, so its end is not in sight). A client's max_tokens caps
    the prediction: it is the one bound the engine knows for certain.
    """

    def __init__(self, prior: float, window: int = 512, min_samples: int = 8, tail: float = 0.5) -> None:
        self.prior = float(prior)
        self._lengths: deque[int] = deque(maxlen=window)
        self._min_samples = min_samples
        self._tail = tail
        self._sorted: np.ndarray | None = None  # ascending lengths; None: stale
        self._suffix: np.ndarray | None = None  # _suffix[i] = sum of _sorted[i:]
        self.version = 0  # moves on with each observation (a prediction made before may differ now)

    def observe(self, num_output_tokens: int) -> None:
        """A request finished by itself (a stop token or its max_tokens) with this many tokens."""
        self._lengths.append(num_output_tokens)
        self._sorted = None
        self.version += 1

    @property
    def num_samples(self) -> int:
        return len(self._lengths)

    def expected(self, num_output_tokens: np.ndarray, max_tokens: np.ndarray) -> np.ndarray:
        """Expected total output per request (float64), given the tokens each has produced so far
        and its client's bound (np.inf where none)."""
        n = np.asarray(num_output_tokens, dtype=np.float64)
        if len(self._lengths) < self._min_samples:
            guess = np.maximum(self.prior, n * (1.0 + self._tail))
        else:
            if self._sorted is None:
                self._sorted = np.sort(np.fromiter(self._lengths, dtype=np.float64))
                self._suffix = np.concatenate([np.cumsum(self._sorted[::-1])[::-1], [0.0]])
            first = np.searchsorted(self._sorted, n, side="right")  # samples with L > n
            count = len(self._sorted) - first
            mean = self._suffix[first] / np.maximum(count, 1)
            guess = np.where(count > 0, mean, n * (1.0 + self._tail))
        return np.maximum(np.minimum(guess, max_tokens), n + 1.0)
