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
