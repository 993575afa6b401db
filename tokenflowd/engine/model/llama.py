"""A Llama-family decoder (Llama 2/3, Qwen2, Mistral, SmolLM2) over a flat batch of tokens.

Tokens of all requests in a step are concatenated: x is [T, hidden]. Attention, the only operation
that looks across tokens, goes through an AttentionBackend that reads and writes the paged KV cache.
Projections are fused (q|k|v and gate|up) so a layer runs four matmuls; dense fp32 ones on a CPU are
packed once for oneDNN (engine/model/packed.py). With quantization "int4" or
"int8" (CPU) the projections are int4 or int8 weights (engine/model/quant.py); the embedding and the
lm_head stay dense, and logits come through int8 candidates rescored exactly (engine/model/logits.py).
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from tokenflowd.engine.attention.base import AttentionBackend
from tokenflowd.engine.model.config import ModelConfig
from tokenflowd.engine.model.fused import FlashInferOps, TorchOps
from tokenflowd.engine.model.logits import FastLogits
from tokenflowd.engine.model.packed import PackedDense
from tokenflowd.engine.model.quant import GROUP_SIZE, Int4Codes, Int4Weight, Int8Rows, quantize

Weight = torch.Tensor | Int4Weight | Int8Rows | PackedDense


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] fp32, with llama3-style frequency-dependent scaling."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    rs = cfg.rope_scaling
    if rs is None:
        return inv.float()
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    scaled = torch.where(wavelen > low_wavelen, inv / rs.factor, inv)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    scaled = torch.where(mid, (1 - smooth) * inv / rs.factor + smooth * inv, scaled)
    return scaled.float()


def rope_tables(inv_freq: torch.Tensor, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_positions, head_dim/2] fp32 of each position's angles: the angle taken in
    fp32, as the reference models take it, its cos and sin in float64 (numpy), rounded once.

    NOTE: not torch's CPU cos and sin. They call MKL's vector math, and a first call split over two
    threads has come back with one thread's half of the table bit for bit MKL's low-accuracy results
    (VML_EP, up to 1.5e-4 off) though torch asks for high accuracy: in about one engine start in 35
    on an Intel Xeon with AVX-512 and AMX, and never in the calls after. Built once, such a table
    kept every logprob of that engine up to 2.3e-3 off for its whole life."""
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq.float())
    angles = angles.numpy().astype(np.float64)
    return torch.from_numpy(np.cos(angles).astype(np.float32)), torch.from_numpy(np.sin(angles).astype(np.float32))


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(w, (Int4Weight, Int8Rows, PackedDense)):
        y = w.matmul(x)
        return y if bias is None else y + bias
    return F.linear(x, w, bias)


class LlamaModel(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, dtype: torch.dtype, device: torch.device,
                 quantization: str = "none") -> None:
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        self.quantization = quantization
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        cos, sin = rope_tables(rope_inv_freq(cfg), max_positions)
        # cos/sin: [max_positions, head_dim/2] in the model dtype, indexed by position each step
        self.register_buffer("rope_cos", cos.to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("rope_sin", sin.to(device=device, dtype=dtype), persistent=False)
        self.layers: list[dict[str, Weight]] = []
        self.logits: FastLogits | None = None  # int4, int8: the lm_head through int8 candidates
        # the per-layer small ops: plain, and flashinfer's fused kernels for a backend that asks
        # for them (engine/model/fused.py), built on first use
        shape = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps)
        self.plain_ops = TorchOps(*shape, self.rope_cos, self.rope_sin)
        self._fused_ops: FlashInferOps | None = None

    def ops_for(self, attn: object) -> TorchOps:
        if not getattr(attn, "fused_ops", False):
            return self.plain_ops
        if self._fused_ops is None:
            cfg = self.cfg
            self._fused_ops = FlashInferOps(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps,
                                            self.rope_cos, self.rope_sin,
                                            torch.cat(rope_tables(rope_inv_freq(cfg), self.rope_cos.shape[0]), dim=-1))
        return self._fused_ops

    def load_weights(self, w: dict[str, torch.Tensor | Int4Codes]) -> None:
        """Take Hugging Face-named weights (already in dtype/device, or int4 codes), fusing q|k|v and
        gate|up; with quantization "int4" every projection ends up an Int4Weight, with "int8" Int8Rows."""
        cfg = self.cfg
        int4, int8 = self.quantization == "int4", self.quantization == "int8"

        def pop(name: str) -> torch.Tensor | Int4Codes:
            t = w.pop(name, None)
            if t is None:
                raise KeyError(f"weight {name} missing from the checkpoint")
            return t

        def dense(t: torch.Tensor | Int4Codes) -> torch.Tensor:
            t = t.dequantize() if isinstance(t, Int4Codes) else t
            return t.to(device=self.device, dtype=self.dtype)

        def take(name: str) -> torch.Tensor:
            return dense(pop(name))

        def proj(*names: str) -> Weight:
            """One projection, the rows of `names` fused (int4 where its input width is whole groups)."""
            parts = [pop(n) for n in names]
            if int4 and parts[0].shape[1] % GROUP_SIZE == 0:
                return Int4Codes.cat([p if isinstance(p, Int4Codes) else quantize(p) for p in parts]).pack()
            if int8:
                return Int8Rows(torch.cat([p.float() for p in parts]))
            t = dense(parts[0]) if len(parts) == 1 else torch.cat([dense(p) for p in parts])
            return PackedDense.make(t) or t  # fp32 on a CPU: packed once for oneDNN (engine/model/packed.py)

        self.embed = take("model.embed_tokens.weight")  # [vocab, hidden]
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            layer = {
                "attn_norm": take(p + "input_layernorm.weight"),
                "qkv": proj(*(p + f"self_attn.{n}_proj.weight" for n in "qkv")),  # [q+2kv, hidden]
                "o": proj(p + "self_attn.o_proj.weight"),  # [hidden, q]
                "mlp_norm": take(p + "post_attention_layernorm.weight"),
                "gate_up": proj(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                "down": proj(p + "mlp.down_proj.weight"),  # [hidden, inter]
            }
            if cfg.attention_bias:
                layer["qkv_bias"] = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
            self.layers.append(layer)
        self.norm = take("model.norm.weight")
        # [vocab, hidden]; tied: the embedding's. It stays dense with int4 projections: int4 logits
        # changed 16 of 20 greedy answers on the embedded model, int8 per row 9 of 20 (dense: 4 of
        # 20, from the projections' bf16 activations). With int4 or int8 the product goes through int8
        # candidates rescored from the dense weight where that is faster (engine/model/logits.py).
        self.lm_head: torch.Tensor = self.embed if cfg.tie_word_embeddings else take("lm_head.weight")
        self.logits = FastLogits(self.lm_head) if int4 or int8 else None
        if w:
            raise KeyError(f"unexpected weights in the checkpoint: {sorted(w)[:5]}")

    def state_tensors(self) -> list[torch.Tensor]:
        """Every weight tensor once (tied embeddings counted once)."""
        seen: dict[int, torch.Tensor] = {}
        for t in [self.embed, self.norm, self.lm_head, *(t for layer in self.layers for t in layer.values())]:
            parts = (t.packed, t.scales_zeros) if isinstance(t, Int4Weight) else (
                (t.codes, t.scales) if isinstance(t, Int8Rows) else ((t.packed,) if isinstance(t, PackedDense) else (t,)))
            for part in parts:
                seen.setdefault(id(part), part)
        return list(seen.values())

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],  # per layer, in attn.kv_cache_shape(num_pages)
        attn: AttentionBackend,
        attn_meta: object,
    ) -> torch.Tensor:  # [T, hidden]
        cfg = self.cfg
        T = input_ids.shape[0]
        ops = self.ops_for(attn)
        rope = ops.rope_of(positions)
        h = F.embedding(input_ids, self.embed)  # the residual stream
        x = ops.rms_norm(h, self.layers[0]["attn_norm"]) if self.layers else h
        for i, layer in enumerate(self.layers):
            qkv = linear(x, layer["qkv"], layer.get("qkv_bias"))
            q, k = ops.rope(qkv, rope)  # [T, heads, head_dim], [T, kv_heads, head_dim]
            v = qkv[:, self.q_size + self.kv_size :].view(T, cfg.num_kv_heads, cfg.head_dim)
            o = attn.forward(i, q, k, v, kv_caches[i], attn_meta)  # [T, heads, head_dim]
            x, h = ops.add_rms_norm(linear(o.reshape(T, self.q_size), layer["o"]), h, layer["mlp_norm"])
            out = linear(ops.silu_and_mul(linear(x, layer["gate_up"])), layer["down"])
            # the residual add and the next norm (the next layer's input norm, or the final one)
            x, h = ops.add_rms_norm(out, h, self.layers[i + 1]["attn_norm"] if i + 1 < len(self.layers) else self.norm)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, hidden] -> logits [N, vocab] fp32
        return self.logits(hidden) if self.logits is not None else F.linear(hidden, self.lm_head).float()
