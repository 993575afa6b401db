"""The lm_head through int8 candidates rescored exactly (engine/model/logits.py)."""
from __future__ import annotations

import torch

from tokenflowd.engine.model.logits import RESCORED, FastLogits


def test_rescored_logits_are_the_dense_ones_at_the_top_and_close_elsewhere(embedded_fp32):
    w = embedded_fp32[1].weights["model.embed_tokens.weight"]  # [49152, 576]: the tied lm_head
    head = FastLogits(w, max_rows=64)
    hidden = torch.randn(64, w.shape[1], generator=torch.Generator().manual_seed(0)) * 2
    dense, fast = head.dense(hidden), head(hidden)
    assert torch.equal(fast.argmax(-1), dense.argmax(-1))  # greedy tokens: the dense weight's
    top = dense.topk(RESCORED // 2, dim=-1).indices
    assert torch.allclose(fast.gather(1, top), dense.gather(1, top), rtol=1e-5, atol=1e-4)
    assert (fast - dense).abs().max() < 0.05 * dense.abs().max()  # the tail: int8's error


def test_past_the_calibrated_rows_the_product_is_dense():
    w = torch.randn(4096, 64, generator=torch.Generator().manual_seed(1))
    head = FastLogits(w, max_rows=2)
    x = torch.randn(3, 64)
    assert torch.equal(head(x), head.dense(x))
    assert not torch.equal(head(x[:2]), head.dense(x[:2]))  # the int8 tail


def test_calibration_picks_a_row_count_it_timed():
    head = FastLogits(torch.randn(8192, 128, generator=torch.Generator().manual_seed(2)))
    assert head.max_rows in (0, 1, 2, 4, 8, 16, 32, 64)


class _Clock:
    """A virtual perf_counter: only the costs the products declare pass (a loaded machine's
    scheduling delays do not)."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class _Paced(FastLogits):
    """The products with a cost set per row count: int8 loses from `int8_loses_at` rows on."""

    def __init__(self, weight: torch.Tensor, int8_loses_at: int, clock: _Clock) -> None:
        self.int8_loses_at, self.clock = int8_loses_at, clock
        super().__init__(weight)

    def dense(self, hidden):
        self.clock.now += 0.05
        return super().dense(hidden)

    def rescored(self, hidden):
        self.clock.now += 0.25 if hidden.shape[0] >= self.int8_loses_at else 0.01
        return super().rescored(hidden)


def test_calibration_stops_at_the_first_row_count_where_int8_loses(monkeypatch):
    import tokenflowd.engine.model.logits as logits

    clock = _Clock()
    monkeypatch.setattr(logits, "time", clock)
    w = torch.randn(1024, 32, generator=torch.Generator().manual_seed(3))
    assert _Paced(w, int8_loses_at=8, clock=clock).max_rows == 4
    assert _Paced(w, int8_loses_at=1, clock=clock).max_rows == 0
    assert _Paced(w, int8_loses_at=10**6, clock=clock).max_rows == 64
