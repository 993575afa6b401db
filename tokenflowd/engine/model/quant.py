"""Projection weights kept quantized at run time: group-wise int4, multiplied by torch's own CPU kernel.

A decode step reads every weight once, so on a CPU its time is the weights' bytes over the memory
bandwidth: the embedded model's 135M parameters are 540 MB in fp32 and about 75 MB in int4. The
layout is torch's `_weight_int4pack_mm_for_cpu`: codes q in 0..15 packed by
`_convert_weight_to_int4pack_for_cpu`, and per group of `group_size` input columns of each output
row a scale s and a zero z, with w = (q - 8)·s + z. The kernel takes activations in bf16 (fp32
activations take a path 10-30x slower), so the model's fp32 activations are cast for the product
and back.

Sources:
  - GGUF Q4_1 blocks (32 weights: f16 d and m, 4-bit q, w = d·q + m) map onto it exactly:
    s = d, z = m + 8d (up to the rounding of s and z to bf16, the kernel's scale dtype);
  - any other weight (fp32 from a Hugging Face directory, a dummy preset, a GGUF of another type
    dequantized) is quantized here, per group, min/max asymmetric.
"""
from __future__ import annotations

import numpy as np
import torch

GROUP_SIZE = 32  # a GGUF Q4_x block
ACT_DTYPE = torch.bfloat16


class Int4Weight:
    """A [out_features, in_features] weight as int4 codes with per-group scales and zeros."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int = GROUP_SIZE) -> None:
        """codes: [N, K] integers in 0..15; scales, zeros: [N, K / group_size] (w = (q - 8)·s + z)."""
        n, k = codes.shape
        if k % group_size or scales.shape != (n, k // group_size) or zeros.shape != scales.shape:
            raise ValueError(f"int4 weight [{n}, {k}]: scales and zeros must be [{n}, {k // group_size}] "
                             f"(groups of {group_size})")
        self.shape = (n, k)
        self.group_size = group_size
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
        # [K / group, N, 2]: the kernel's layout, in its activation dtype
        self.scales_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(ACT_DTYPE)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ w.T for x [T, in_features], in x's dtype."""
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(ACT_DTYPE), self.packed, self.group_size,
                                                        self.scales_zeros)
        return y.to(x.dtype)


class Int8Rows:
    """A [out_features, in_features] weight as int8 with one symmetric scale per output row,
    multiplied by torch's `_weight_int8pack_mm` (bf16 activations, like the int4 kernel)."""

    def __init__(self, w: torch.Tensor) -> None:
        w = w.float()
        scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        self.codes = (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous()
        self.scales = scales.to(ACT_DTYPE)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ w.T for x [T, in_features], in x's dtype."""
        return torch.ops.aten._weight_int8pack_mm(x.to(ACT_DTYPE), self.codes, self.scales).to(x.dtype)


class Int4Codes:
    """An int4 weight before packing: codes [N, K] int32 in 0..15, scales and zeros [N, K / group]
    fp32. Loaders hand these over; the model fuses (concatenates rows: q|k|v, gate|up) and packs."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> None:
        self.codes, self.scales, self.zeros = codes, scales, zeros

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]

    @staticmethod
    def cat(parts: list[Int4Codes]) -> Int4Codes:
        return Int4Codes(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                         torch.cat([p.zeros for p in parts]))

    def pack(self) -> Int4Weight:
        return Int4Weight(self.codes, self.scales, self.zeros, self.codes.shape[1] // self.scales.shape[1])

    def dequantize(self) -> torch.Tensor:
        """w = (q - 8)·s + z in fp32, [N, K]: the weight before the kernel's bf16 rounding."""
        n, k = self.codes.shape
        g = self.scales.shape[1]
        q = self.codes.float().reshape(n, g, k // g)
        return ((q - 8) * self.scales[..., None] + self.zeros[..., None]).reshape(n, k)


def quantize(w: torch.Tensor, group_size: int = GROUP_SIZE) -> Int4Codes:
    """Min/max asymmetric int4 per group of `group_size` input columns: each group's range in 15 steps."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"int4 needs in_features divisible by {group_size}, got {k}")
    g = w.float().reshape(n, k // group_size, group_size)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    codes = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).reshape(n, k).to(torch.int32)
    return Int4Codes(codes, scale, lo + 8 * scale)


def from_q4_1(blocks: np.ndarray, rows: int, cols: int) -> Int4Codes:
    """GGUF Q4_1 data ([rows, cols / 32 * 20] bytes: f16 d, f16 m, 16 bytes of nibbles) → codes, exact:
    w = d·q + m = (q - 8)·d + (m + 8d)."""
    b = np.ascontiguousarray(blocks).reshape(rows, cols // GROUP_SIZE, 20)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    return Int4Codes(_nibbles(b[..., 4:], rows, cols), torch.from_numpy(d), torch.from_numpy(m + 8 * d))


def from_q4_0(blocks: np.ndarray, rows: int, cols: int) -> Int4Codes:
    """GGUF Q4_0 data ([rows, cols / 32 * 18] bytes: f16 d, 16 bytes of nibbles) → codes, exact:
    w = d·(q - 8), a zero of 0."""
    b = np.ascontiguousarray(blocks).reshape(rows, cols // GROUP_SIZE, 18)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    return Int4Codes(_nibbles(b[..., 2:], rows, cols), torch.from_numpy(d), torch.zeros(d.shape))


def _nibbles(qs: np.ndarray, rows: int, cols: int) -> torch.Tensor:
    # ggml's order within a block: the 16 low nibbles are weights 0..15, the high ones 16..31
    return torch.from_numpy(np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, cols).astype(np.int32))
