"""Attention split over pieces of a sequence's KV, and the exact merge of the pieces.

Softmax attention over keys K = K_a ∪ K_b can be computed per piece. Piece a gives its output
o_a (softmax over K_a only) and its log-sum-exp s_a = log Σ_{k in K_a} exp(q·k·scale); then

    s = log(exp(s_a) + exp(s_b))
    o = exp(s_a − s) · o_a + exp(s_b − s) · o_b

is exactly the attention over K (FlashInfer's merge_state; its own states keep s in base 2, ours
in base e). A piece with no keys has s = −inf and weighs nothing. The pool (tokenflowd/pool/) uses
this to attend to prefix segments where they live: each holder returns (o, s) of its segments and
the requester merges them with its own attention over the rest.

States are (o [T, heads, d] in the query's dtype, s [T, heads] fp32).
"""
from __future__ import annotations

import torch


def _fused_cpu_op():
    """torch's fused CPU attention that also returns the log-sum-exp (what SDPA runs on a CPU, its
    LSE kept): 3.8x faster than the explicit scores below for 256 rows over 4K keys
    (bench/results/code_figures.md). A private op: None where this torch lacks it or calls it
    otherwise (tried once on a tiny input)."""
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is None:
        return None
    try:
        x = torch.zeros(1, 1, 2, 8)
        o, s = op(x, x, x, 0.0, False, attn_mask=torch.zeros(2, 2), scale=1.0)
    except (RuntimeError, TypeError):
        return None
    return op if o.shape == x.shape and s.shape == (1, 1, 2) else None


FUSED_CPU = _fused_cpu_op()


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, heads, d], k and v [L, kv_heads, d] (GQA: heads a multiple of kv_heads); mask [T, L]
    bool, True where a query sees a key (None: every key). -> (o [T, heads, d], s [T, heads] fp32).
    Scores and the softmax run in fp32. A query that sees no key gets o = 0 and s = −inf.
    On a CPU, where every query sees a key, through torch's fused kernel (where this torch has it)."""
    if (FUSED_CPU is not None and q.device.type == "cpu" and k.shape[0]
            and (mask is None or bool(mask.any(1).all()))):
        return _fused_cpu(q, k, v, scale, mask)
    T, H, d = q.shape
    kvh = k.shape[1]
    g = H // kvh
    qg = q.float().view(T, kvh, g, d).permute(1, 0, 2, 3).reshape(kvh, T * g, d)
    kf, vf = k.float().transpose(0, 1), v.float().transpose(0, 1)  # [kvh, L, d]
    scores = torch.bmm(qg, kf.transpose(1, 2)).mul_(scale).view(kvh, T, g, -1)
    if mask is not None:
        scores.masked_fill_(~mask[None, :, None, :], float("-inf"))
    s = torch.logsumexp(scores, dim=-1)  # [kvh, T, g]
    probs = torch.exp(scores - s.unsqueeze(-1).clamp_min(torch.finfo(torch.float32).min)).nan_to_num_(0.0)
    o = torch.bmm(probs.view(kvh, T * g, -1), vf).view(kvh, T, g, d)
    o = o.permute(1, 0, 2, 3).reshape(T, H, d).to(q.dtype)
    return o, s.permute(1, 0, 2).reshape(T, H)


def _fused_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    g = q.shape[1] // k.shape[1]
    kh, vh = k.transpose(0, 1), v.transpose(0, 1)  # [kv_heads, L, d]
    if g > 1:  # (the kernel takes as many kv heads as query heads)
        kh, vh = kh.repeat_interleave(g, 0), vh.repeat_interleave(g, 0)
    bias = None if mask is None else torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, float("-inf"))
    o, s = FUSED_CPU(q.transpose(0, 1)[None], kh[None], vh[None], 0.0, False, attn_mask=bias, scale=scale)
    return o[0].transpose(0, 1), s[0].transpose(0, 1).float()


def merge_states(o_a: torch.Tensor, s_a: torch.Tensor, o_b: torch.Tensor,
                 s_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The state of attention over both pieces' keys (see the module docstring)."""
    s = torch.logaddexp(s_a, s_b)
    finite = torch.isfinite(s)
    safe = torch.where(finite, s, torch.zeros_like(s))
    w_a = torch.where(finite, torch.exp(s_a - safe), torch.zeros_like(s)).unsqueeze(-1)
    w_b = torch.where(finite, torch.exp(s_b - safe), torch.zeros_like(s)).unsqueeze(-1)
    o = (w_a * o_a.float() + w_b * o_b.float()).to(o_a.dtype)
    return o, s


def merge_all(states: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge any number of states of the same rows (at least one)."""
    o, s = states[0]
    for o_b, s_b in states[1:]:
        o, s = merge_states(o, s, o_b, s_b)
    return o, s
