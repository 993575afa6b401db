"""Attention split over pieces of the context and merged by log-sum-exp equals attention over the
whole context (fp32, 1e-5): for random splits, GQA shapes and page sizes, through the plain
functions and through the backend seam (the pool's query service reads whole prefix pages with
`attend_pages`, the requester attends to the rest with `forward_with_lse` and merges)."""
from __future__ import annotations

import shutil

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenflowd.engine.attention.base import AttentionInputs, PageQuery
from tokenflowd.engine.attention.partial import FUSED_CPU as FUSED
from tokenflowd.engine.attention.partial import attention_with_lse, merge_all, merge_states
from tokenflowd.engine.attention.torch_backend import TorchAttentionBackend

TOL = 1e-5
SHAPES = st.sampled_from([(4, 4), (9, 3), (8, 2), (6, 1)])  # (heads, kv_heads): MHA, GQA, MQA


def full(q, k, v, scale, mask=None):
    """SDPA over all keys: q [T, H, d], k/v [L, KVH, d]."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                       enable_gqa=True, scale=scale)
    return o.transpose(0, 1)


@settings(max_examples=60, deadline=None)
@given(shape=SHAPES, d=st.sampled_from([8, 64]), t=st.integers(1, 5), length=st.integers(1, 90),
       cuts=st.lists(st.integers(0, 90), max_size=4), seed=st.integers(0, 2**16))
def test_pieces_merged_by_lse_equal_attention_over_all_keys(shape, d, t, length, cuts, seed):
    heads, kvh = shape
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, heads, d, generator=gen)
    k, v = torch.randn(length, kvh, d, generator=gen), torch.randn(length, kvh, d, generator=gen)
    # Cut points are drawn as integers: once an in-process engine has set flush-to-zero
    # (torch.set_flush_denormal, engine/runner.py), hypothesis cannot draw floats in this process.
    bounds = sorted({0, length, *(min(c, length) for c in cuts)})
    states = [attention_with_lse(q, k[a:b], v[a:b], d**-0.5) for a, b in zip(bounds, bounds[1:])]
    o, s = merge_all(states)
    assert (o - full(q, k, v, d**-0.5)).abs().max() <= TOL
    scores = torch.einsum("thd,lhd->thl", q, k.repeat_interleave(heads // kvh, dim=1)) * d**-0.5
    assert (s - torch.logsumexp(scores, -1)).abs().max() <= TOL


def test_on_a_cpu_torchs_fused_kernel_gives_the_explicit_scores_state_where_every_query_sees_a_key(monkeypatch):
    import tokenflowd.engine.attention.partial as partial

    assert partial.FUSED_CPU is not None, "this torch lacks the fused CPU kernel that returns the LSE"
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(7, 9, 64, generator=gen), torch.randn(300, 3, 64, generator=gen), torch.randn(300, 3, 64,
                                                                                                          generator=gen)
    causal = torch.arange(300)[None, :] <= torch.arange(293, 300)[:, None]
    monkeypatch.setattr(partial, "FUSED_CPU", None)  # the explicit scores, as off the CPU
    explicit = [attention_with_lse(q, k, v, 0.125, mask) for mask in (None, causal)]
    calls = []
    monkeypatch.setattr(partial, "FUSED_CPU", lambda *a, **kw: calls.append(1) or FUSED(*a, **kw))
    for mask, (eo, es) in zip((None, causal), explicit):
        o, s = attention_with_lse(q, k, v, 0.125, mask)
        assert (o - eo).abs().max() <= TOL and (s - es).abs().max() <= TOL and s.dtype == torch.float32
    assert len(calls) == 2
    # a query that sees no key: the explicit path's o = 0, s = -inf
    attention_with_lse(q, k, v, 0.125, torch.zeros(7, 300, dtype=torch.bool))
    assert len(calls) == 2


def test_an_empty_piece_weighs_nothing_and_two_empty_pieces_stay_empty():
    q, k, v = torch.randn(2, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    o, s = attention_with_lse(q, k, v, 0.3)
    none = (torch.zeros_like(o), torch.full_like(s, float("-inf")))
    mo, ms = merge_states(*none, o, s)
    assert torch.equal(ms, s) and (mo - o).abs().max() <= 1e-6
    eo, es = merge_states(*none, *none)
    assert torch.isneginf(es).all() and torch.equal(eo, torch.zeros_like(eo))
    masked_o, masked_s = attention_with_lse(q, k, v, 0.3, torch.zeros(2, 5, dtype=torch.bool))
    assert torch.isneginf(masked_s).all() and not masked_o.isnan().any()


@settings(max_examples=40, deadline=None)
@given(shape=SHAPES, page=st.sampled_from([1, 4, 16]), data=st.data(), seed=st.integers(0, 2**16),
       kernel=st.booleans())
def test_pages_held_elsewhere_merged_with_the_rest_equal_attention_over_all_pages(shape, page, data, seed, kernel):
    """Per request: its first `held` full pages are another engine's segment (attend_pages on that
    cache); its remaining tokens, with the step's new ones, are attended here (forward_with_lse on a
    block table that starts after the segment). The merge equals forward over all its pages. With
    `kernel`, one-row requests' segments go through the C++ kernel (where it builds)."""
    heads, kvh = shape
    d, num_pages = 16, 160  # enough for 3 requests of 47 one-token pages
    gen = torch.Generator().manual_seed(seed)
    args = (heads, kvh, d, page, torch.float32, torch.device("cpu"))
    backend = TorchAttentionBackend(*args, paged_kernel=kernel)
    if kernel and shutil.which("c++") is not None:
        assert backend.kernel_lse is not None, "the kernel must build where a compiler is"
    n_req = data.draw(st.integers(1, 3))
    perm = torch.randperm(num_pages, generator=gen).tolist()
    seq_lens, q_lens, held, tables = [], [], [], []
    for _ in range(n_req):
        q_len = data.draw(st.integers(1, 6))
        past_pages = data.draw(st.integers(0, 40 // page + 1))
        seq = past_pages * page + data.draw(st.integers(0, page - 1)) + q_len
        seq_lens.append(seq)
        q_lens.append(q_len)
        held.append(data.draw(st.integers(0, (seq - q_len) // page)))  # whole pages before every query
        tables.append([perm.pop() for _ in range(-(-seq // page))])
    start = [0]
    for n in q_lens:
        start.append(start[-1] + n)
    T = start[-1]
    q = torch.randn(T, heads, d, generator=gen)
    k, v = torch.randn(T, kvh, d, generator=gen), torch.randn(T, kvh, d, generator=gen)
    cache = torch.randn(backend.kv_cache_shape(num_pages), generator=gen)

    def slots(tabs, lens):
        return torch.tensor([tabs[i][p // page] * page + p % page
                             for i, n in enumerate(lens) for p in range(n - q_lens[i], n)], dtype=torch.int64)

    whole = AttentionInputs(start, seq_lens, tables, slots(tables, seq_lens))
    reference = TorchAttentionBackend(*args, paged_kernel=False)
    want = reference.forward(0, q, k, v, cache.clone(), reference.prepare(whole))

    rest_tables = [t[h:] for t, h in zip(tables, held)]
    rest_lens = [n - h * page for n, h in zip(seq_lens, held)]
    rest = AttentionInputs(start, rest_lens, rest_tables, slots(rest_tables, rest_lens))
    local = cache.clone()
    o_local, s_local = backend.forward_with_lse(0, q, k, v, local, backend.prepare(rest))
    o_seg, s_seg = backend.attend_pages(q, local, PageQuery(start, [t[:h] for t, h in zip(tables, held)]))
    o, _ = merge_states(o_seg, s_seg, o_local, s_local)
    assert (o - want).abs().max() <= TOL
