"""CUDA graphs of pure-decode steps (GPU with the flashinfer backend only).

One graph per padded batch size, captured largest first into one memory pool. A step of B decodes
replays the graph of the smallest size >= B; the padding rows read and write a scratch page that
the page pool never hands out:

    kv pages:  [ 0 .. num_pages-1 : the pool's ][ num_pages : scratch ]
"""
from __future__ import annotations

import bisect
import logging
from collections import Counter

import torch

from tokenflowd.engine.attention.base import AttentionInputs
from tokenflowd.engine.attention.flashinfer_backend import Append, FlashInferBackend, FlashInferMeta, PageTable
from tokenflowd.engine.staging import to_device

log = logging.getLogger(__name__)

GRAPH_BATCH_SIZES = [1, 2, 4, 8] + list(range(16, 513, 16))


class DecodeGraphs:
    def __init__(self, model, attn: FlashInferBackend, kv_layers: list[torch.Tensor], scratch_page: int,
                 max_batch: int, max_model_len: int) -> None:
        self.model, self.attn, self.kv_layers = model, attn, kv_layers
        self.page_size = attn.page_size
        self.scratch_page = scratch_page
        self.sizes = [s for s in GRAPH_BATCH_SIZES if s <= max_batch] or [1]
        dev = attn.device
        n = self.sizes[-1]
        # Static inputs: graphs read these addresses on every replay.
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_page = torch.full((n,), scratch_page, dtype=torch.int64, device=dev)
        self.slot_offset = torch.zeros(n, dtype=torch.int64, device=dev)
        # the paged-KV append's: row b appends to request b, at its position in that request's KV
        self.batch_indices = torch.arange(n, dtype=torch.int32, device=dev)
        self.kv_positions = torch.zeros(n, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, object, torch.Tensor]] = {}
        self.num_replays: Counter[int] = Counter()  # by graph size: what ran, for tests and /health
        # Shared prefix pages count once per request in the index buffer: size it for the worst case.
        self._capture(max_pages=n * -(-max_model_len // self.page_size))

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def _capture(self, max_pages: int) -> None:
        pool = torch.cuda.graph_pool_handle()
        dev, i32, n = self.attn.device, torch.int32, self.sizes[-1]
        # one page table for every size: graphs replay one at a time, each planned just before
        indptr = torch.zeros(n + 1, dtype=i32, device=dev)
        indices = torch.zeros(max_pages, dtype=i32, device=dev)
        last_page_len = torch.ones(n, dtype=i32, device=dev)
        for bs in reversed(self.sizes):
            wrapper = self.attn.graph_decode_wrapper(indptr[: bs + 1], indices, last_page_len[:bs])
            empty = PageTable.build(AttentionInputs([0], [], [], self.slot_page[:0]), self.page_size, dev, pad_to=bs,
                                    pad_page=self.scratch_page)
            self.attn.plan_decode(wrapper, empty)
            append = Append(self.batch_indices[:bs], self.kv_positions[:bs], indices, indptr[: bs + 1], last_page_len[:bs])
            meta = FlashInferMeta(self.slot_page[:bs], self.slot_offset[:bs], wrapper, append)
            args = (self.input_ids[:bs], self.positions[:bs], self.kv_layers, self.attn, meta)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up: kernel selection and lazy allocations stay out of the graph
                    self.model(*args)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.model(*args)
            self.graphs[bs] = (graph, wrapper, hidden)
        torch.cuda.synchronize()
        log.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        """Hidden states [B, hidden] of B one-token decodes, B <= max_batch."""
        B = input_ids.shape[0]
        bs = self.sizes[bisect.bisect_left(self.sizes, B)]
        graph, wrapper, hidden = self.graphs[bs]
        self.input_ids[:B].copy_(input_ids)
        self.positions[:B].copy_(positions)
        self.slot_page[:B].copy_(inputs.slot_mapping // self.page_size)
        self.slot_offset[:B].copy_(inputs.slot_mapping % self.page_size)
        self.input_ids[B:bs].zero_()
        self.positions[B:bs].zero_()
        self.slot_page[B:bs].fill_(self.scratch_page)
        self.slot_offset[B:bs].zero_()
        self.kv_positions[:B].copy_(to_device([n - 1 for n in inputs.seq_lens], torch.int32, self.kv_positions.device))
        self.kv_positions[B:bs].zero_()  # the padding rows' one scratch page
        self.attn.plan_decode(wrapper, PageTable.build(inputs, self.page_size, self.input_ids.device, pad_to=bs,
                                                       pad_page=self.scratch_page))
        graph.replay()
        self.num_replays[bs] += 1
        return hidden[:B]
