"""Pages to byte runs for a KV transfer (federation/transport.py's kv_blocks), without a transport:
offsets in the torch layout, runs merged only where both sides are adjacent, and refusals."""
from __future__ import annotations

import pytest

from tokenflowd.federation.transport import Block, KVLayout, kv_blocks


def test_runs_follow_the_layout_and_merge_where_both_sides_are_adjacent():
    # one layer, 2 kv heads, page 4 x d 8 x 2 bytes = 64 bytes a page; 8 pages here, 16 there
    src, dst = KVLayout((1000,), (2, 2, 8, 4, 8), 2), KVLayout((50_000,), (2, 2, 16, 4, 8), 2)
    blocks = kv_blocks(src, dst, [1, 2, 6], [3, 4, 10])
    page = 64
    want = []
    for plane in (0, 1):
        for head in range(2):
            s0, d0 = 1000 + (plane * 2 + head) * 8 * page, 50_000 + (plane * 2 + head) * 16 * page
            want += [Block(s0 + 1 * page, d0 + 3 * page, 2 * page), Block(s0 + 6 * page, d0 + 10 * page, page)]
    assert blocks == want
    assert kv_blocks(src, dst, [1, 2], [4, 3]) == [b for plane in (0, 1) for head in range(2) for b in (
        Block(1000 + ((plane * 2 + head) * 8 + 1) * page, 50_000 + ((plane * 2 + head) * 16 + 4) * page, page),
        Block(1000 + ((plane * 2 + head) * 8 + 2) * page, 50_000 + ((plane * 2 + head) * 16 + 3) * page, page))]


def test_caches_of_other_shapes_pages_out_of_range_and_repeated_destinations_are_refused():
    a = KVLayout((0,), (2, 2, 8, 4, 8), 2)
    with pytest.raises(ValueError):
        kv_blocks(a, KVLayout((0,), (2, 2, 8, 4, 16), 2), [1], [1])
    with pytest.raises(ValueError):
        kv_blocks(a, KVLayout((0,), (2, 2, 4, 4, 8), 2), [1], [5])
    with pytest.raises(ValueError):
        kv_blocks(a, a, [1, 2], [3, 3])


def test_pages_gathered_into_a_staging_run_and_scattered_land_as_a_direct_copy_would():
    import torch

    from tokenflowd.kv.staging import gather_pages, scatter_pages

    g = torch.Generator().manual_seed(0)
    src = [torch.randn(2, 3, 10, 4, 8, generator=g) for _ in range(2)]
    dst = [torch.zeros(2, 3, 16, 4, 8) for _ in range(2)]
    staging = torch.empty(10_000)
    staged = gather_pages(src, [7, 1, 4], staging)
    assert staged.is_contiguous() and staged.data_ptr() == staging.data_ptr()
    scatter_pages(staged.clone(), dst, [0, 15, 9])
    for s, d in zip(src, dst):
        assert torch.equal(d[:, :, [0, 15, 9]], s[:, :, [7, 1, 4]])
        assert not d[:, :, [p for p in range(16) if p not in (0, 15, 9)]].any()


def test_runs_and_staged_pages_carry_pages_between_caches_of_different_layouts():
    """A torch-layout cache ([2, kv_heads, pages, ...], page axis 2) and a flashinfer-layout one
    ([2, pages, kv_heads, ...], page axis 1): byte runs and staged pages land each value in place."""
    import ctypes

    import torch

    from tokenflowd.kv.staging import gather_pages, scatter_pages

    g = torch.Generator().manual_seed(1)
    src = [torch.randn(2, 3, 10, 4, 8, generator=g) for _ in range(2)]  # torch layout
    dst = [torch.zeros(2, 16, 3, 4, 8) for _ in range(2)]  # flashinfer layout
    blocks = kv_blocks(KVLayout.of(src), KVLayout.of(dst, page_axis=1), [7, 1, 4], [0, 15, 9])
    for b in blocks:
        ctypes.memmove(b.dst, b.src, b.nbytes)
    for s, d in zip(src, dst):
        for sp, dp in zip([7, 1, 4], [0, 15, 9]):
            assert torch.equal(d[:, dp], s[:, :, sp])
        assert not d[:, [p for p in range(16) if p not in (0, 15, 9)]].any()
    back = [torch.zeros(2, 3, 10, 4, 8) for _ in range(2)]
    staged = gather_pages(dst, [0, 15, 9], torch.empty(10_000), page_axis=1)
    assert staged.shape == (2, 3, 2, 3, 4, 8)  # [layers, pages, 2, kv_heads, page_size, d]
    scatter_pages(staged, back, [7, 1, 4])
    for s, b in zip(src, back):
        assert torch.equal(b[:, :, [7, 1, 4]], s[:, :, [7, 1, 4]])


def test_a_tokens_kv_bytes_are_the_same_whatever_the_layout():
    # 3 layers of [2, kv_heads 2, 10 pages, page 4, d 8] (torch) or [2, 10 pages, 2, 4, 8] (flashinfer), bf16
    torch_layout = KVLayout((0, 1, 2), (2, 2, 10, 4, 8), 2, page_axis=2)
    flashinfer = KVLayout((0, 1, 2), (2, 10, 2, 4, 8), 2, page_axis=1)
    assert torch_layout.token_bytes == flashinfer.token_bytes == 2 * 3 * 2 * 8 * 2
