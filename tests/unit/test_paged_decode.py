"""The CPU paged decode kernel against the gather path and a plain per-request reference: same
outputs on scattered pages, partial last pages, GQA, mixed batches, fp32 and bf16; a bad page is
an error, not a read out of bounds."""
from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from tokenflowd.engine.attention.base import AttentionInputs
from tokenflowd.engine.attention.cpu_kernels import paged_decode
from tokenflowd.engine.attention.torch_backend import TorchAttentionBackend

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler to build the kernel")

HEADS, KV_HEADS, HEAD_DIM, PAGE = 9, 3, 64, 16


def backends(dtype):
    args = (HEADS, KV_HEADS, HEAD_DIM, PAGE, dtype, torch.device("cpu"))
    gather = TorchAttentionBackend(*args, paged_kernel=False)
    kernel = TorchAttentionBackend(*args)
    assert gather.kernel is None and kernel.kernel is not None, "the kernel must build where a compiler is"
    return gather, kernel


def batch(seq_lens, query_lens, num_pages, gen):
    """Scattered pages per request (a shuffled pool), the slots of each request's new tokens."""
    perm = torch.randperm(num_pages, generator=gen).tolist()
    tables, start, slots = [], [0], []
    for n, q in zip(seq_lens, query_lens):
        need = -(-n // PAGE)
        tables.append([perm.pop() for _ in range(need)])
        slots += [tables[-1][p // PAGE] * PAGE + p % PAGE for p in range(n - q, n)]
        start.append(start[-1] + q)
    return AttentionInputs(start, list(seq_lens), tables, torch.tensor(slots, dtype=torch.int64))


def reference(q, cache, inputs, scale):
    """Each request's queries over its own tokens, gathered token by token, with SDPA."""
    out = torch.empty_like(q)
    for i in range(inputs.num_requests):
        a, b, n = inputs.query_start[i], inputs.query_start[i + 1], inputs.seq_lens[i]
        slots = [inputs.block_tables[i][t // PAGE] * PAGE + t % PAGE for t in range(n)]
        k = cache[0].reshape(KV_HEADS, -1, HEAD_DIM)[:, slots].float()
        v = cache[1].reshape(KV_HEADS, -1, HEAD_DIM)[:, slots].float()
        mask = torch.arange(n)[None, :] <= torch.arange(n - (b - a), n)[:, None]
        o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1).float(), k, v, attn_mask=mask, enable_gqa=True,
                                           scale=scale)
        out[a:b] = o.transpose(0, 1).to(q.dtype)
    return out


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("seq_lens,query_lens", [
    ([1], [1]),
    ([37], [1]),
    ([16, 17, 200, 5, 64, 1, 33, 129], [1] * 8),  # page boundaries, one token, long
    ([40, 23, 90], [1, 23, 5]),  # a decode between a fresh prompt and a continued chunk
])
def test_kernel_matches_gather_and_reference(dtype, tol, seq_lens, query_lens):
    gen = torch.Generator().manual_seed(sum(seq_lens))
    num_pages = 64
    gather, kernel = backends(dtype)
    inputs = batch(seq_lens, query_lens, num_pages, gen)
    T = sum(query_lens)
    cache0 = torch.randn(gather.kv_cache_shape(num_pages), generator=gen).to(dtype)
    qkv = torch.randn(T, HEADS + 2 * KV_HEADS, HEAD_DIM, generator=gen).to(dtype)  # q a strided view, as in the model
    q, k, v = qkv.split([HEADS, KV_HEADS, KV_HEADS], dim=1)
    outs = []
    for backend in (gather, kernel):
        cache = cache0.clone()
        outs.append(backend.forward(0, q, k, v, cache, backend.prepare(inputs)))
    want = reference(q, cache, inputs, gather.scale)
    assert (outs[0].float() - want.float()).abs().max() <= tol
    assert (outs[1].float() - want.float()).abs().max() <= tol


def test_a_page_out_of_range_is_an_error():
    op = paged_decode()
    q = torch.randn(1, HEADS, HEAD_DIM)
    k = v = torch.randn(KV_HEADS, 4, PAGE, HEAD_DIM)
    lens = torch.tensor([20], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="out of range"):
        op(q, k, v, torch.tensor([[0, 4]], dtype=torch.int32), lens, 0.125)
    with pytest.raises(RuntimeError, match="outside the block table"):
        op(q, k, v, torch.tensor([[0]], dtype=torch.int32), lens, 0.125)


def test_off_by_environment(monkeypatch):
    monkeypatch.setenv("TOKENFLOWD_CPU_KERNELS", "0")
    assert paged_decode() is None
    assert TorchAttentionBackend(HEADS, KV_HEADS, HEAD_DIM, PAGE, torch.float32, torch.device("cpu")).kernel is None
