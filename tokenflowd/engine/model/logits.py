"""The lm_head product, with int8 candidates rescored exactly where that is faster.

A small model's lm_head is a large share of a decode step on a CPU: the embedded model's is
49152 x 576, 113 MB in fp32, read whole for every step (its share of a step: bench/results/
code_figures.md). Int8 rows read a quarter of the bytes, but int8 logits change greedy answers
(9 of 20 on the embedded model). So the int8 product only picks candidates: the `RESCORED` highest
int8 logits of each row are recomputed from the dense weight and replace their int8 values. The
greedy token is then the dense weight's own unless the dense argmax falls outside the int8 top 32,
and every token that sampling is likely to draw has its exact logit; the tail keeps int8's (about
0.5 % relative error), which moves probabilities far below any top-p cut-off.

Int8 wins at few rows and loses at many (the kernel's cost grows with the rows, the dense GEMM's
barely): `calibrate` times both at start-up and `FastLogits` uses int8 up to the measured row count.
"""
from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F

from tokenflowd.engine.model.quant import Int8Rows

log = logging.getLogger(__name__)

RESCORED = 32  # candidates per row recomputed from the dense weight
CALIBRATION_ROWS = (1, 2, 4, 8, 16, 32, 64)


class FastLogits:
    """logits = hidden @ weight.T in fp32, through int8 candidates for up to `max_rows` rows."""

    def __init__(self, weight: torch.Tensor, max_rows: int | None = None) -> None:
        self.weight = weight  # [vocab, hidden], dense: the exact logits' source
        self.int8 = Int8Rows(weight)
        self.max_rows = calibrate(self) if max_rows is None else max_rows

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[0] > self.max_rows:
            return self.dense(hidden)
        return self.rescored(hidden)

    def dense(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight).float()

    def rescored(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.int8.matmul(hidden).float()  # [N, vocab]
        top = logits.topk(min(RESCORED, logits.shape[1]), dim=-1, sorted=False).indices  # [N, R]
        exact = torch.bmm(self.weight[top], hidden.to(self.weight.dtype)[:, :, None])[..., 0]  # [N, R]
        return logits.scatter_(1, top, exact.float())


def calibrate(head: FastLogits, rows: tuple[int, ...] = CALIBRATION_ROWS, repeats: int = 2) -> int:
    """The largest row count, from small to large, at which int8 + rescoring beats the dense
    product on this machine (0: it never does, and every call is dense)."""
    best = 0
    with torch.inference_mode():
        for n in rows:
            x = torch.randn(n, head.weight.shape[1], generator=torch.Generator().manual_seed(n)).to(head.weight)
            head.dense(x), head.rescored(x)  # warm-up: allocator, kernel dispatch
            dense = min(_timed(head.dense, x) for _ in range(repeats))
            fast = min(_timed(head.rescored, x) for _ in range(repeats))
            if fast >= dense:
                break
            best = n
    log.info("lm_head: int8 candidates rescored exactly up to %d row(s) a step, the dense product above "
             "(timed at start-up)", best)
    return best


def _timed(f, x: torch.Tensor) -> float:
    t = time.perf_counter()
    f(x)
    return time.perf_counter() - t
