"""flashinfer's attend_pages keeps a planned wrapper per source of pages (engine/attention/
flashinfer_backend.py PAGES_PLANS): a step reading a prompt's segments where they live attends to
one cache per engine holding them, every layer. With one wrapper, each layer re-planned it for
each source in turn, and each plan first waited for the GPU to drain up to the last one.

flashinfer runs on a GPU only; here a stand-in module takes its place, whose wrapper attends with
whatever it was last planned for (a source run on another source's plan gives wrong rows), and
CUDA events are counted instead of waited on. The GPU twin of this test is tests/gpu/test_gpu.py
test_attention_to_two_sources_of_pages_in_turn_runs_each_on_its_own_plan_while_the_gpu_lags."""
from __future__ import annotations

import math
import sys
import types

import pytest
import torch

from tokenflowd.engine.attention.base import PageQuery


class StandInWrapper:
    made = 0

    def __init__(self, workspace: torch.Tensor, layout: str, **_) -> None:
        assert layout == "HND"
        StandInWrapper.made += 1
        self.planned: tuple | None = None

    def plan(self, qo_indptr, indptr, indices, last_page_len, num_heads, num_kv_heads, head_dim, page_size, *,
             causal, sm_scale, **_) -> None:
        assert not causal and last_page_len.tolist() == [page_size] * (len(indptr) - 1)
        self.planned = (qo_indptr.tolist(), indptr.tolist(), indices.tolist(), sm_scale)

    def run(self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], return_lse: bool = False):
        """Non-causal attention of each planned request's rows over its pages (HND: [pages, kv
        heads, page size, d]), with flashinfer's base-2 log-sum-exp."""
        qo, indptr, pages, scale = self.planned
        out, lse = torch.empty_like(q), torch.empty(q.shape[:2])
        heads, kv_heads = q.shape[1], kv[0].shape[1]
        for i in range(len(qo) - 1):
            index = torch.tensor(pages[indptr[i]:indptr[i + 1]])
            k, v = (plane[index].permute(1, 0, 2, 3).flatten(1, 2) for plane in kv)  # [kv heads, L, d]
            rows = q[qo[i]:qo[i + 1]].transpose(0, 1)  # [heads, r, d]
            k, v = (x.repeat_interleave(heads // kv_heads, dim=0) for x in (k, v))
            scores = rows @ k.transpose(1, 2) * scale  # [heads, r, L]
            out[qo[i]:qo[i + 1]] = (scores.softmax(-1) @ v).transpose(0, 1)
            lse[qo[i]:qo[i + 1]] = (torch.logsumexp(scores, -1) / math.log(2)).transpose(0, 1)
        return (out, lse) if return_lse else out


class CountedEvent:
    waits = 0  # the host's
    followed = 0  # a stream's

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        CountedEvent.waits += 1


class Stream:
    """A CUDA stream: the engine's step's, or another thread's."""

    def wait_event(self, event: CountedEvent) -> None:
        CountedEvent.followed += 1


STEP, OTHER = Stream(), Stream()
asking = [STEP]  # the stream current_stream answers


@pytest.fixture
def backend(monkeypatch):
    stand_in = types.ModuleType("flashinfer")
    stand_in.BatchPrefillWithPagedKVCacheWrapper = StandInWrapper
    stand_in.BatchDecodeWithPagedKVCacheWrapper = lambda *a, **k: object()
    monkeypatch.setitem(sys.modules, "flashinfer", stand_in)
    monkeypatch.setattr(torch.cuda, "Event", CountedEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: asking[0])
    asking[0] = STEP
    from tokenflowd.engine.attention.flashinfer_backend import FlashInferBackend

    fi = FlashInferBackend(8, 2, 16, 4, torch.float32, torch.device("cpu"))
    monkeypatch.setattr(StandInWrapper, "made", 0)  # (the step's prefill wrapper is made)
    monkeypatch.setattr(CountedEvent, "waits", 0)
    monkeypatch.setattr(CountedEvent, "followed", 0)
    return fi


def two_sources(fi):
    """Two caches (this engine's, a peer's) with the rows each source serves, and the torch
    backend's answer for each."""
    from tokenflowd.engine.attention.torch_backend import TorchAttentionBackend

    ref = TorchAttentionBackend(8, 2, 16, 4, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    caches = [torch.randn(fi.kv_cache_shape(64), generator=g) for _ in range(2)]  # HND
    queries = [PageQuery([0, 3, 4], [[1, 2, 3], [7]]), PageQuery([0, 1, 4], [list(range(10, 40)), [5, 6]])]
    q = torch.randn(4, 8, 16, generator=g)
    want = [ref.attend_pages(q, kv.transpose(1, 2).contiguous(), query) for kv, query in zip(caches, queries)]
    return caches, queries, q, want


def four_layers_of_two_sources(fi) -> None:
    """Each layer attends to both sources in turn, as a step reading its own pages and a peer's;
    every call's rows equal the torch backend's."""
    caches, queries, q, want = two_sources(fi)
    for _ in range(4):
        for source, (kv, query) in enumerate(zip(caches, queries)):
            o, lse = fi.attend_pages(q, kv, query)
            torch.testing.assert_close(o, want[source][0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lse, want[source][1], atol=1e-5, rtol=1e-5)


def test_each_source_of_a_steps_pages_is_planned_once_and_every_layer_runs_on_its_own_plan(backend):
    four_layers_of_two_sources(backend)
    assert (backend.pages_plans, StandInWrapper.made, CountedEvent.waits) == (2, 2, 0), \
        "one plan a source, no wait on the GPU between layers"
    assert CountedEvent.followed == 0, "asked on the stream its copies are on: no call a layer"
    asking[0] = OTHER  # the same plans asked from another thread's stream
    four_layers_of_two_sources(backend)
    assert backend.pages_plans == 2 and CountedEvent.followed == 8, \
        "a plan kept runs after its copies on the asker's stream"


def test_with_more_sources_than_plans_kept_the_least_recently_used_is_planned_again(backend, monkeypatch):
    """Two plans kept, sources A B A C A B: C replaces B (A was asked since), then B replaces C."""
    from tokenflowd.engine.attention import flashinfer_backend

    monkeypatch.setattr(flashinfer_backend, "PAGES_PLANS", 2)
    caches, queries, q, want = two_sources(backend)
    third = PageQuery([0, 2, 4], [[20, 21], [30]])
    kv = {"A": caches[0], "B": caches[1], "C": caches[1]}
    query = {"A": queries[0], "B": queries[1], "C": third}
    plans = []
    for source in "ABACAB":
        o, _ = backend.attend_pages(q, kv[source], query[source])
        if source != "C":
            torch.testing.assert_close(o, want["AB".index(source)][0], atol=1e-5, rtol=1e-5)
        plans.append(backend.pages_plans)
    assert plans == [1, 2, 2, 3, 3, 4] and StandInWrapper.made == 2, plans
    assert CountedEvent.waits == 2, "each re-plan waited for the copy of the plan it replaced"


def test_with_more_sources_than_plans_kept_the_oldest_is_planned_again_after_its_copy(backend, monkeypatch):
    from tokenflowd.engine.attention import flashinfer_backend

    monkeypatch.setattr(flashinfer_backend, "PAGES_PLANS", 1)
    four_layers_of_two_sources(backend)
    # every call plans again, each after waiting for the plan before it (its page-locked buffer)
    assert (backend.pages_plans, StandInWrapper.made, CountedEvent.waits) == (8, 1, 7)
