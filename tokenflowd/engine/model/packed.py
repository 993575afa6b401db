"""Dense fp32 projections on a CPU, packed once into oneDNN's blocked layout.

`F.linear` on an fp32 weight (MKL) packs the weight's panels again on every call. A decode step's
products are skinny (one row per running request), so that packing is a large share of each call
at a few dozen rows and less; from 64 rows (prefill) the two are even (bench/results/
code_figures.md, bench/cpu_fast_paths.py). The packed product is also batch-invariant: a row's output does not depend on the rows
beside it (MKL's does, in the last bits). `PackedDense.make` returns None where the oneDNN ops are
missing, and the model keeps the plain tensor.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

BATCH_HINT = 32  # the row count oneDNN picks its blocking for; any count runs


class PackedDense:
    """A [out_features, in_features] fp32 weight, packed for oneDNN's inner product."""

    def __init__(self, packed: torch.Tensor, shape: tuple[int, int]) -> None:
        self.packed = packed  # an opaque mkldnn tensor
        self.shape = shape

    @classmethod
    def make(cls, w: torch.Tensor) -> PackedDense | None:
        if w.dtype != torch.float32 or w.device.type != "cpu" or not torch.backends.mkldnn.is_available():
            return None
        try:
            return cls(torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), BATCH_HINT), tuple(w.shape))
        except (RuntimeError, AttributeError) as e:  # a torch build without these ops
            log.info("dense weights stay unpacked: %s", e)
            return None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ w.T for x [T, in_features] fp32."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
