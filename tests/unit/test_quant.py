"""int4 weights at run time (engine/model/quant.py): the same products as the dequantized fp32 weights."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tokenflowd.config import EngineConfig, resolve_quantization
from tokenflowd.engine.model.quant import Int4Codes, Int8Rows, from_q4_0, from_q4_1, quantize
from tokenflowd.text.source import embedded_gguf_path, open_gguf


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("n,k", [(64, 32), (960, 576), (576, 1536)])
def test_int4_products_match_the_dequantized_fp32_weight_on_random_weights(n, k):
    torch.manual_seed(0)
    codes = quantize(torch.randn(n, k))
    w = codes.dequantize()
    assert (codes.codes >= 0).all() and (codes.codes <= 15).all()
    x = torch.randn(5, k)
    # bf16 activations and bf16 scales: a few parts in a thousand
    assert _rel(codes.pack().matmul(x), x @ w.t()) < 0.01
    assert codes.pack().matmul(x).dtype == torch.float32


def test_min_max_quantization_is_within_half_a_step():
    torch.manual_seed(1)
    w = torch.randn(32, 64) * 3
    codes = quantize(w)
    step = codes.scales.repeat_interleave(32, dim=1)
    assert ((codes.dequantize() - w).abs() <= step / 2 + 1e-5).all()


def test_q4_1_and_q4_0_blocks_map_exactly():
    rng = np.random.default_rng(0)
    rows, cols = 8, 64
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    for qtype, convert in ((gguf.GGMLQuantizationType.Q4_1, from_q4_1), (gguf.GGMLQuantizationType.Q4_0, from_q4_0)):
        blocks = gguf.quants.quantize(w, qtype)
        ref = gguf.quants.dequantize(blocks, qtype)
        assert np.array_equal(convert(blocks, rows, cols).dequantize().numpy(), ref)


def test_the_embedded_models_layers_in_int4_compute_their_fp32_products():
    reader = open_gguf(embedded_gguf_path())
    x = torch.randn(4, 576, generator=torch.Generator().manual_seed(2))
    for name in ("blk.0.attn_q.weight", "blk.7.ffn_down.weight", "blk.29.ffn_gate.weight"):
        t = next(t for t in reader.tensors if t.name == name)
        rows, cols = int(t.shape[1]), int(t.shape[0])
        ref = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
        codes = from_q4_1(t.data, rows, cols)
        assert torch.equal(codes.dequantize(), ref)
        xin = x if cols == 576 else torch.randn(4, cols, generator=torch.Generator().manual_seed(3))
        assert _rel(codes.pack().matmul(xin), xin @ ref.t()) < 0.01


@pytest.mark.parametrize("n,k", [(576, 576), (3072, 576), (576, 1536)])
def test_int8_rows_compute_the_fp32_products(n, k):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)) * 0.05
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(1))
    assert _rel(Int8Rows(w).matmul(x), x @ w.t()) < 0.01


def test_fused_rows_pack_like_their_parts():
    torch.manual_seed(4)
    a, b = quantize(torch.randn(96, 64)), quantize(torch.randn(32, 64))
    x = torch.randn(3, 64)
    fused = Int4Codes.cat([a, b]).pack().matmul(x)
    assert torch.equal(fused, torch.cat([a.pack().matmul(x), b.pack().matmul(x)], dim=1))


def test_the_flag_is_checked_and_auto_follows_the_file():
    assert resolve_quantization("auto", "smollm2-135m", "cpu") == "int4"  # the embedded GGUF is Q4_1
    assert resolve_quantization("auto", "dummy:smollm2-135m", "cpu") == "none"
    assert resolve_quantization("auto", "smollm2-135m", "cuda:0") == "none"
    assert resolve_quantization("int4", "dummy:smollm2-135m", "cpu") == "int4"
    assert EngineConfig.resolve(device="cpu").quantization == "none"  # the default: int4 is asked for
    assert resolve_quantization("int8", "dummy:smollm2-135m", "cpu") == "int8"
    with pytest.raises(ValueError, match="quantization must be auto or one of none, int4, int8"):
        resolve_quantization("int3", "smollm2-135m", "cpu")
    for q in ("int4", "int8"):
        with pytest.raises(ValueError, match=f"{q} weights run on the CPU"):
            EngineConfig(device="cuda:0", dtype="bfloat16", quantization=q)
