"""Read mode picks, per request and step, where its attention over a peer's pages runs
(pool/member.py `holders`, --pool-read-rows): a peer in this engine's memory (a CPU's, or the same
GPU's) is always read in place; a peer on another GPU, whose pages a kernel here reads over NVLink
or PCIe, is read in place by a request with many rows in the step (a prompt chunk, bound by its
FLOPs) and queried by one with few (a decode row over a long prefix: the peer reads it at its own
memory's speed). Both answers merge by LSE into the same attention."""
from __future__ import annotations

import os
import threading
from types import SimpleNamespace

import pytest
import torch
from test_pool_put import HEAD_DIM, HEADS, LAYERS, PAGE, held_segment

from tokenflowd import protocol as p
from tokenflowd.engine.attention.partial import merge_states
from tokenflowd.engine.attention.torch_backend import TorchAttentionBackend
from tokenflowd.kv.pages import PagePool
from tokenflowd.pool.attention import PeerCache, QueriedHolder
from tokenflowd.pool.member import PoolMember
from tokenflowd.pool.names import cache_name
from tokenflowd.pool.shared_kv import SharedKV

PAGES = 4  # of the peer's prefix each request reads
ROWS = (6, 1)  # a prompt chunk's rows and a decode step's


@pytest.fixture
def node(tmp_path):
    """Engine 0 in read mode with --pool-read-rows 4, reading engine 1's cache (shared memory)."""
    backend = TorchAttentionBackend(HEADS, 2, HEAD_DIM, PAGE, torch.float32, torch.device("cpu"), paged_kernel=False)
    shape = backend.kv_cache_shape(9)  # the holder's 8 pages and its scratch page (runner.py)
    shared = SharedKV.create(cache_name(str(tmp_path), 1, 1), LAYERS, shape, torch.float32)
    gen = torch.Generator().manual_seed(1)
    for layer in shared.layers:
        layer.copy_(torch.randn(shape, generator=gen))
    mine = [torch.zeros(backend.kv_cache_shape(16)) for _ in range(LAYERS)]
    a = PoolMember(0, 1, "read", str(tmp_path), backend, mine, PagePool(16), threading.Lock(), 8, read_rows=4)
    b = PoolMember(1, 1, "read", str(tmp_path), backend, shared.layers, PagePool(8), threading.Lock(), 8)
    a.set_peers([p.PoolPeer(1, 1, os.getpid(), 8)])
    keys, _ = held_segment(b, PAGES)
    for rid in ("chunk", "decode"):
        assert a.pin(rid, [p.PrefixRun(1, keys)]) == PAGES
    yield a, b
    a.close()
    b.close()
    shared.close()


def step(a: PoolMember, q: torch.Tensor) -> tuple[torch.Tensor, dict[str, list[str]]]:
    """One layer of a step running both requests: their rows' attention over the peer's pages, as
    PooledAttention merges it, and which requests each kind of source served."""
    starts = [0, ROWS[0], sum(ROWS)]
    sources = a.holders(SimpleNamespace(request_ids=["chunk", "decode"], offsets=[PAGES * PAGE] * 2), starts)
    o = torch.zeros(q.shape[0], HEADS, HEAD_DIM)
    lse = torch.full((q.shape[0], HEADS), -torch.inf)
    served: dict[str, list[str]] = {}
    for src in sources:
        idx = src.rows.index(q.device)
        src.submit(0, q[idx])
        o_s, lse_s = (t.clone() for t in src.collect(0, q[idx]))
        o[idx], lse[idx] = merge_states(o[idx], lse[idx], o_s, lse_s)
        served.setdefault(type(src).__name__, []).extend(src.rows.request_ids)
    return o, served


def test_a_peer_in_this_engines_memory_is_read_in_place_whatever_the_rows(node):
    a, b = node
    q = torch.randn(sum(ROWS), HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(2))
    _, served = step(a, q)
    assert served == {PeerCache.__name__: ["chunk", "decode"]}
    assert a.stats["read_calls"] == 1 and a.stats["query_calls"] == 0
    assert b.service.busy_seconds == 0, "the peer computed nothing"


def test_a_peer_on_another_gpu_is_read_in_place_for_a_prompt_chunk_and_queried_for_a_decode_row(node, monkeypatch):
    a, _ = node
    q = torch.randn(sum(ROWS), HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(2))
    want, _ = step(a, q)  # all of it read in place
    monkeypatch.setattr(a, "same_memory", lambda peer: False)  # as a peer's cache on another GPU is
    got, served = step(a, q)
    assert served == {PeerCache.__name__: ["chunk"], QueriedHolder.__name__: ["decode"]}
    assert a.stats["query_calls"] == 1 and a.stats["read_calls"] == 2
    assert torch.allclose(got, want, atol=1e-5), "the same attention, wherever it ran"
    a.read_rows = 1  # --pool-read-rows 1: every row in place
    _, served = step(a, q)
    assert served == {PeerCache.__name__: ["chunk", "decode"]}


def test_query_mode_sends_every_row_and_reads_nothing_in_place(tmp_path):
    from test_pool_put import member
    a, b = member(0, 16, str(tmp_path)), member(1, 8, str(tmp_path))
    try:
        a.set_peers([p.PoolPeer(1, 1, os.getpid(), 8)])
        keys, _ = held_segment(b, PAGES)
        for rid in ("chunk", "decode"):
            assert a.pin(rid, [p.PrefixRun(1, keys)]) == PAGES
        _, served = step(a, torch.randn(sum(ROWS), HEADS, HEAD_DIM))
        assert served == {QueriedHolder.__name__: ["chunk", "decode"]} and a.stats["read_calls"] == 0
    finally:
        a.close()
        b.close()
