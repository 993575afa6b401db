"""The decoder's small per-layer operations, plain (torch) or fused (flashinfer's kernels on a GPU).

    rms_norm(x, w)                    the block's input norm
    add_rms_norm(x, residual, w)      residual += x, then its norm: one kernel where fused
    rope_of(positions) -> rope        what the step's RoPE reads (once a step, not once a layer)
    rope(qkv, rope)                   q and k of a fused q|k|v projection rotated (in place where fused)
    silu_and_mul(gate_up)             SiLU(gate) * up of a fused gate|up projection

A model asks its attention backend which to use (`fused_ops`): flashinfer's backend says yes, so
the engine's start-up check (engine/self_check.py), which compares a backend's logits with the
torch backend's, covers these kernels too, and a failure steps down to the plain path. On a CPU,
and with the torch backend, the plain ops run: exactly the operations, in the order, the model ran
before they were factored out here.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, head_dim]; cos/sin: [T, 1, head_dim/2] in x's dtype. rotate_half convention.
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class TorchOps:
    """The plain ops. `cos`/`sin`: [max_len, head_dim/2] in the model's dtype."""

    name = "torch"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, eps: float, cos: torch.Tensor,
                 sin: torch.Tensor) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim, self.eps = num_heads, num_kv_heads, head_dim, eps
        self.cos, self.sin = cos, sin

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # torch's fused kernel accumulates in fp32 for bf16/fp16 input, as the reference models do.
        return F.rms_norm(x, weight.shape, weight, self.eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor,
                     weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm of residual + x, residual + x)."""
        residual = residual + x
        return self.rms_norm(residual, weight), residual

    def rope_of(self, positions: torch.Tensor) -> object:
        """cos and sin [T, 1, head_dim/2] at the step's positions."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def rope(self, qkv: torch.Tensor, rope: object) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, heads, d] and k [T, kv_heads, d] of `qkv` [T, (heads + 2 kv_heads) d], rotated: the q
        and k heads side by side take RoPE in one pass."""
        T, d, h, hk = qkv.shape[0], self.head_dim, self.num_heads, self.num_kv_heads
        cos, sin = rope  # type: ignore[misc]
        qk = _rotate(qkv[:, : (h + hk) * d].view(T, h + hk, d), cos, sin)
        return qk.split([h, hk], dim=1)

    @staticmethod
    def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class FlashInferOps(TorchOps):
    """flashinfer's fused kernels: add+RMSNorm in one pass (in place on both), RMSNorm, RoPE in place
    from an fp32 cos|sin cache (the q|k|v projection's q and k, strided, not copied), SiLU-and-mul."""

    name = "flashinfer"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, eps: float, cos: torch.Tensor,
                 sin: torch.Tensor, cos_sin_fp32: torch.Tensor) -> None:
        """`cos_sin_fp32`: [max_len, head_dim], the fp32 tables (llama.rope_tables) side by side."""
        super().__init__(num_heads, num_kv_heads, head_dim, eps, cos, sin)
        import flashinfer

        self._fi = flashinfer
        # [max_len, head_dim]: cos then sin, fp32, as flashinfer's cache layout asks
        self.cos_sin_cache = cos_sin_fp32.to(device=cos.device, dtype=torch.float32).contiguous()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self._fi.norm.rmsnorm(x, weight, self.eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor,
                     weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._fi.norm.fused_add_rmsnorm(x, residual, weight, self.eps)  # residual += x; x = norm(residual)
        return x, residual

    def rope_of(self, positions: torch.Tensor) -> object:
        return positions

    def rope(self, qkv: torch.Tensor, rope: object) -> tuple[torch.Tensor, torch.Tensor]:
        T, d, h, hk = qkv.shape[0], self.head_dim, self.num_heads, self.num_kv_heads
        q, k = qkv[:, : h * d], qkv[:, h * d : (h + hk) * d]
        self._fi.rope.apply_rope_with_cos_sin_cache_inplace(rope, q, k, d, self.cos_sin_cache, is_neox=True)
        return q.view(T, h, d), k.view(T, hk, d)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._fi.activation.silu_and_mul(gate_up)
