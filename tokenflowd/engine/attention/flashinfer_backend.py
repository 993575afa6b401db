"""FlashInfer paged attention on GPU: a batch-prefill wrapper for steps with prompt chunks, and a
batch-decode wrapper for pure-decode steps (CUDA-graph capturable with fixed-size index buffers).

Page table as flashinfer wants it, per request i (int32 on the device):

    kv_indices[kv_indptr[i] : kv_indptr[i+1]]  = its pages covering seq_lens[i] tokens
    kv_last_page_len[i]                        = tokens in its last page, 1..page_size
    qo_indptr                                  = AttentionInputs.query_start

A step's new K and V go into the cache with flashinfer's paged-KV append, one kernel a layer (each
token's request and its position in that request's KV, staged with the page table); a CUDA graph
reads the same from fixed buffers.
"""
from __future__ import annotations

import itertools
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from tokenflowd.engine.attention.base import AttentionBackend, AttentionInputs, PageQuery
from tokenflowd.engine.staging import concat_to_device, host_tensor, to_device

WORKSPACE_BYTES = 256 * 1024 * 1024
# attend_pages keeps this many plans at once, each on its own wrapper: a step that reads a prompt's
# segments where they live attends to one cache per engine holding them (up to the node's 8 GPUs),
# every layer, and a wrapper planned for each is planned once a step, not once a layer each.
PAGES_PLANS = 8
# what one more prefill wrapper holds on the device: its 8 MiB plan workspace (flashinfer 0.7.2),
# its buffer of KV lengths and the plan's index copies, rounded up
PLAN_BYTES = 9 << 20
LN2 = math.log(2.0)  # flashinfer's log-sum-exp is base 2; the seam's is base e


@dataclass
class PageTable:
    indptr: torch.Tensor  # [B+1] int32, host
    indices: torch.Tensor  # [num_pages_used] int32, host
    last_page_len: torch.Tensor  # [B] int32, host

    @classmethod
    def build(cls, inputs: AttentionInputs, page_size: int, device: torch.device, pad_to: int = 0,
              pad_page: int = 0) -> "PageTable":
        """The step's page table, in page-locked memory when `device` is a GPU (flashinfer's plan
        copies it there, engine/staging.py); padded to `pad_to` rows of one `pad_page` each (a CUDA
        graph's batch)."""
        indptr, indices, last = [0], [], []
        for table, n in zip(inputs.block_tables, inputs.seq_lens):
            pages = -(-n // page_size)
            indices.extend(table[:pages])
            indptr.append(indptr[-1] + pages)
            last.append(n - (pages - 1) * page_size)
        pad = max(0, pad_to - len(last))
        end = indptr[-1]
        indptr.extend(end + k for k in range(1, pad + 1))
        indices.extend([pad_page] * pad)
        last.extend([1] * pad)
        return cls(*(_host_i32(v, device) for v in (indptr, indices, last)))


def _host_i32(values: list[int], device: torch.device) -> torch.Tensor:
    t = host_tensor(len(values), torch.int32, device)
    t.numpy()[:] = values
    return t


class Append(NamedTuple):
    """What flashinfer's paged-KV append reads (int32 on the device): each new token's request and
    position in that request's KV, and the step's page table."""

    batch_indices: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    indices: torch.Tensor
    indptr: torch.Tensor  # [B+1]
    last_page_len: torch.Tensor  # [B]


@dataclass
class FlashInferMeta:
    slot_page: torch.Tensor
    slot_offset: torch.Tensor
    wrapper: object  # a planned flashinfer prefill or decode wrapper
    # the step's K/V go in with one append kernel a layer; None: written at slot_page/slot_offset
    append: Append | None = None


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"
    # the model's layers run flashinfer's fused norm, RoPE and SiLU-and-mul (engine/model/fused.py):
    # the start-up check of this backend against the torch one covers them too
    fused_ops = True

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        import flashinfer

        self._fi = flashinfer
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "HND")
        # attend_pages runs between a step's layers (the pool's query service): wrappers and a
        # workspace of its own, so the step's planned wrapper stays as planned. Its wrappers share
        # the workspace as the step's two share theirs: both of its callers (the engine's step, the
        # query service's thread) issue on the device's default stream, so their runs queue one
        # after another. (On two streams they would race in it, as one wrapper would.)
        self.pages_workspace = torch.empty(WORKSPACE_BYTES // 4, dtype=torch.uint8, device=self.device)
        self._pages_lock = threading.Lock()  # plan + run of the pages wrappers: one thread at a time
        # plan -> (a wrapper planned for it, the event behind that plan's copies, the stream they are
        # queued on), least recently used first
        self._pages: OrderedDict[tuple, tuple[object, torch.cuda.Event, object]] = OrderedDict()
        self.pages_plans = 0  # plans made (a plan per source a step, not per layer)
        group = self.num_heads // self.num_kv_heads
        # Tensor cores pay off for decode once several query heads share a KV head.
        self.decode_tensor_cores = group >= 4
        self._planned = None  # the event behind the last plan's copies (wait_planned)
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "HND", use_tensor_cores=self.decode_tensor_cores
        )

    def graph_decode_wrapper(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor) -> object:
        """A decode wrapper for a CUDA graph of len(last_page_len) rows, over page-table buffers that
        never move (int32 on the device: indptr [B+1], indices [max_pages], last_page_len [B]).
        Graphs of several sizes may share them: each is planned right before it replays."""
        return self._fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "HND", use_cuda_graph=True, use_tensor_cores=self.decode_tensor_cores,
            paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last_page_len,
        )

    def wait_planned(self) -> None:
        if self._planned is not None:
            self._planned.synchronize()

    def _plan_queued(self) -> None:
        """An event behind the copies the plan just queued from its page-locked buffer."""
        self._planned = torch.cuda.Event()
        self._planned.record()

    def plan_decode(self, wrapper: object, table: PageTable, indices: torch.Tensor | None = None) -> None:
        """Plan `wrapper` for `table`; `indices`: the table's indices already on the device."""
        wrapper.plan(
            table.indptr, to_device(table.indices.numpy(), torch.int32, self.device) if indices is None else indices,
            table.last_page_len,
            self.num_heads, self.num_kv_heads, self.head_dim, self.page_size,
            pos_encoding_mode="NONE", q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.scale,
        )
        self._plan_queued()

    def kv_cache_shape(self, num_pages: int) -> tuple[int, ...]:
        return (2, num_pages, self.num_kv_heads, self.page_size, self.head_dim)  # HND

    def slots(self, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return slot_mapping // self.page_size, slot_mapping % self.page_size

    def prepare(self, inputs: AttentionInputs) -> FlashInferMeta:
        table = PageTable.build(inputs, self.page_size, self.device)
        indices = to_device(table.indices.numpy(), torch.int32, self.device)
        append = self._append(inputs, table, indices)
        is_decode = all(inputs.query_len(i) == 1 for i in range(inputs.num_requests))
        if is_decode:
            self.plan_decode(self.decode, table, indices)
            return FlashInferMeta(*self.slots(inputs.slot_mapping), self.decode, append)
        qo_indptr = _host_i32(inputs.query_start, self.device)
        self.prefill.plan(
            qo_indptr, table.indptr, indices, table.last_page_len,
            self.num_heads, self.num_kv_heads, self.head_dim, self.page_size,
            causal=True, pos_encoding_mode="NONE", sm_scale=self.scale,
            q_data_type=self.dtype, kv_data_type=self.dtype,
        )
        self._plan_queued()
        return FlashInferMeta(*self.slots(inputs.slot_mapping), self.prefill, append)

    def _append(self, inputs: AttentionInputs, table: PageTable, indices: torch.Tensor) -> Append:
        """The append's inputs for the step, staged in one copy (with the page table's indices)."""
        starts = np.asarray(inputs.query_start, dtype=np.int32)
        lens = np.diff(starts)
        rows = np.repeat(np.arange(len(lens), dtype=np.int32), lens)
        # a token's place in its request's KV: its seq_len less its chunk's length, plus its index in it
        first = np.asarray(inputs.seq_lens, dtype=np.int32) - lens
        positions = (first - starts[:-1])[rows] + np.arange(starts[-1], dtype=np.int32)
        flat = concat_to_device([rows, positions, table.indptr.numpy(), table.last_page_len.numpy()], torch.int32,
                                self.device)
        T, B = len(rows), len(lens)
        batch_indices, pos, indptr, last = flat.split([T, T, B + 1, B])
        return Append(batch_indices, pos, indices, indptr, last)

    def _write_kv(self, k, v, kv_cache, meta: FlashInferMeta) -> None:
        a = meta.append
        if a is not None:
            self._fi.page.append_paged_kv_cache(k, v, a.batch_indices, a.positions, (kv_cache[0], kv_cache[1]),
                                                a.indices, a.indptr, a.last_page_len, kv_layout="HND")
        else:
            kv_cache[0][meta.slot_page, :, meta.slot_offset] = k  # [T, kv_heads, d]
            kv_cache[1][meta.slot_page, :, meta.slot_offset] = v

    def forward(self, layer, q, k, v, kv_cache, meta: FlashInferMeta):
        self._write_kv(k, v, kv_cache, meta)
        return meta.wrapper.run(q, (kv_cache[0], kv_cache[1]))

    def forward_with_lse(self, layer, q, k, v, kv_cache, meta: FlashInferMeta):
        self._write_kv(k, v, kv_cache, meta)
        out, lse2 = meta.wrapper.run(q, (kv_cache[0], kv_cache[1]), return_lse=True)
        return out, lse2.float() * LN2

    def _pages_wrapper(self, plan: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], requests: int) -> object:
        """A pages wrapper planned for `plan` (qo_indptr, indptr, pages): every layer of a step asks
        the same of each source it reads (this engine's pages, each peer's), so each source's is
        planned once and kept while the step's other sources are attended to, up to PAGES_PLANS.
        Re-planning a wrapper first waits for its last plan's copy out of its page-locked buffer,
        which the new plan rewrites (the step's plans: wait_planned); its last run is queued ahead
        of the new plan's copies on the default stream both callers issue on. A plan kept is run
        after its copies: asked from the stream they are queued on, in order already (no call a
        layer); from another, that stream waits for them first."""
        stream = torch.cuda.current_stream(self.device)
        hit = self._pages.get(plan)
        if hit is not None:
            self._pages.move_to_end(plan)
            wrapper, planned, planned_on = hit
            if stream != planned_on:
                stream.wait_event(planned)
            return wrapper
        if len(self._pages) < PAGES_PLANS:
            wrapper = self._fi.BatchPrefillWithPagedKVCacheWrapper(self.pages_workspace, "HND")
        else:
            wrapper, planned, _ = self._pages.popitem(last=False)[1]
            planned.synchronize()
        ps, i32 = self.page_size, dict(dtype=torch.int32)
        qo_indptr, indptr, pages = plan
        wrapper.plan(
            torch.tensor(qo_indptr, **i32), torch.tensor(indptr, **i32),
            to_device(pages, torch.int32, self.device), torch.full((requests,), ps, **i32),
            self.num_heads, self.num_kv_heads, self.head_dim, ps,
            causal=False, pos_encoding_mode="NONE", sm_scale=self.scale, q_data_type=self.dtype,
            kv_data_type=self.dtype,
        )
        planned = torch.cuda.Event()
        planned.record(stream)
        self._pages[plan] = (wrapper, planned, stream)  # (a plan that fails is not kept)
        self.pages_plans += 1
        return wrapper

    def attend_pages(self, q, kv_cache, query: PageQuery):
        # Only requests with pages here are planned (a request of zero pages has no valid page
        # table); the rows of the others keep the empty state (o 0, lse −inf).
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
        held = [i for i, pages in enumerate(query.pages)
                if pages and query.query_start[i + 1] > query.query_start[i]]
        if not held:
            return out, lse
        rows = [r for i in held for r in range(query.query_start[i], query.query_start[i + 1])]
        qo_indptr = (0, *itertools.accumulate(query.query_start[i + 1] - query.query_start[i] for i in held))
        indptr = (0, *itertools.accumulate(len(query.pages[i]) for i in held))
        pages = tuple(p for i in held for p in query.pages[i])
        index = to_device(rows, torch.int64, self.device)
        with self._pages_lock:  # the pool's query service and the engine's own step share the wrappers
            wrapper = self._pages_wrapper((qo_indptr, indptr, pages), len(held))
            sub_out, sub_lse2 = wrapper.run(q.index_select(0, index), (kv_cache[0], kv_cache[1]), return_lse=True)
        out.index_copy_(0, index, sub_out)
        lse.index_copy_(0, index, sub_lse2.float() * LN2)
        return out, lse
