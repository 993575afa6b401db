"""Attention with torch's SDPA, for CPU and GPU.

Torch has no paged kernel. On CPU, decodes (one query each) go through the project's own C++
kernel (cpu_paged_decode.cpp, built by cpu_kernels.py), which reads K/V in place from the pages.
Elsewhere, or where the kernel cannot be built, K/V are gathered from pages only where they must
be and once per layer, page by page (not token by token):
  - a prompt chunk with no earlier context attends to its own fresh k/v: no gather at all;
  - decodes without the kernel are batched: their pages are gathered into one padded
    [B, max_pages * page_size] block, masked past each seq_len;
  - a prompt chunk that continues earlier context (chunked prefill, prefix-cache hit) gathers
    its own pages (SDPA's flash kernel then does the work; a chunk has many queries).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenflowd.engine.attention.base import AttentionBackend, AttentionInputs, PageQuery
from tokenflowd.engine.attention.partial import attention_with_lse


@dataclass
class _Chunk:
    start: int
    stop: int
    pages: torch.Tensor | None  # [n_pages] int64, None when there is no earlier context
    mask: torch.Tensor | None  # [q_len, seq_len] bool, causal with the context offset
    seq_len: int


class _Spans:
    """Each request's rows and pages, built at the first iteration (forward_with_lse's first layer)
    and kept for the step's other layers; a step that never merges never builds them."""

    def __init__(self, inputs: AttentionInputs, page_size: int, device: torch.device) -> None:
        self.inputs, self.page_size, self.device = inputs, page_size, device
        self._spans: list[tuple[int, int, torch.Tensor, int]] | None = None

    def __iter__(self):
        if self._spans is None:
            inputs, ps = self.inputs, self.page_size
            self._spans = [(inputs.query_start[i], inputs.query_start[i + 1],
                            torch.tensor(inputs.block_tables[i][: -(-n // ps)], dtype=torch.int64, device=self.device), n)
                           for i, n in enumerate(inputs.seq_lens)]
        return iter(self._spans)


@dataclass
class TorchAttentionMeta:
    slot_page: torch.Tensor  # [T] page of each new token
    slot_offset: torch.Tensor  # [T] its offset in the page
    decode_rows: torch.Tensor | None  # [Bd] query rows of decoding requests
    decode_all: bool  # every row is a decode, in order: no row gather/scatter needed
    decode_pages: torch.Tensor | None  # [Bd * max_pages] int64, request-major (padded with page 0)
    decode_bias: torch.Tensor | None  # [Bd, 1, max_pages * page_size] fp32: 0, or -inf past seq_len
    decode_table: torch.Tensor | None  # with the kernel: [Bd, max_pages] int32 (instead of the two above)
    decode_lens: torch.Tensor | None  # with the kernel: [Bd] int32 seq_lens
    chunks: list[_Chunk]
    spans: _Spans  # every request: (row start, stop, pages, seq_len), for forward_with_lse


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, *args, paged_kernel: bool = True) -> None:
        """`paged_kernel`: decode through the CPU kernel where the device is a CPU and it builds."""
        super().__init__(*args)
        self.kernel = self.kernel_lse = None
        if paged_kernel and self.device.type == "cpu":
            from tokenflowd.engine.attention.cpu_kernels import paged_decode, paged_decode_lse

            self.kernel, self.kernel_lse = paged_decode(), paged_decode_lse()

    def kv_cache_shape(self, num_pages: int) -> tuple[int, ...]:
        return (2, self.num_kv_heads, num_pages, self.page_size, self.head_dim)

    def prepare(self, inputs: AttentionInputs) -> TorchAttentionMeta:
        dev, ps = self.device, self.page_size
        decode_idx = [i for i in range(inputs.num_requests) if inputs.query_len(i) == 1]
        chunks: list[_Chunk] = []
        for i in range(inputs.num_requests):
            q_len, seq_len = inputs.query_len(i), inputs.seq_lens[i]
            if q_len == 1:
                continue
            start = inputs.query_start[i]
            past = seq_len - q_len
            if past == 0:
                chunks.append(_Chunk(start, start + q_len, None, None, seq_len))
                continue
            n_pages = -(-seq_len // ps)
            pages = torch.tensor(inputs.block_tables[i][:n_pages], dtype=torch.int64, device=dev)
            qpos = torch.arange(past, seq_len, device=dev)[:, None]
            mask = torch.arange(seq_len, device=dev)[None, :] <= qpos
            chunks.append(_Chunk(start, start + q_len, pages, mask, seq_len))
        rows = pages_t = mask_t = table_t = lens_t = None
        decode_all = False
        if decode_idx:
            lens = [inputs.seq_lens[i] for i in decode_idx]
            max_pages = -(-max(lens) // ps)
            table = [inputs.block_tables[i][:max_pages] + [0] * (max_pages - len(inputs.block_tables[i][:max_pages]))
                     for i in decode_idx]
            if self.kernel is not None:
                table_t = torch.tensor(table, dtype=torch.int32, device=dev)
                lens_t = torch.tensor(lens, dtype=torch.int32, device=dev)
            else:
                pages_t = torch.tensor(table, dtype=torch.int64, device=dev).flatten()
                lens64 = torch.tensor(lens, dtype=torch.int64, device=dev)
                past_end = torch.arange(max_pages * ps, device=dev)[None, :] >= lens64[:, None]
                mask_t = torch.zeros(past_end.shape, device=dev).masked_fill_(past_end, float("-inf"))[:, None, :]
            rows_list = [inputs.query_start[i] for i in decode_idx]
            decode_all = len(decode_idx) == inputs.num_requests
            rows = torch.tensor(rows_list, dtype=torch.int64, device=dev)
        slots = inputs.slot_mapping
        return TorchAttentionMeta(slots // ps, slots % ps, rows, decode_all, pages_t, mask_t, table_t, lens_t,
                                  chunks, _Spans(inputs, ps, dev))

    def forward(self, layer, q, k, v, kv_cache, meta: TorchAttentionMeta):
        kv_cache[0][:, meta.slot_page, meta.slot_offset] = k.transpose(0, 1)  # [kv_heads, T, d]
        kv_cache[1][:, meta.slot_page, meta.slot_offset] = v.transpose(0, 1)
        out = torch.empty_like(q)
        # SDPA on 4-D inputs (a batch of one): on a CPU only those reach torch's fused (flash)
        # kernel; 3-D ones take the math path, 3x slower for a 256-token chunk over 4K tokens
        # (bench/results/code_figures.md)
        for c in meta.chunks:
            qc = q[c.start : c.stop].transpose(0, 1)[None]  # [1, heads, q_len, d]
            if c.pages is None:
                kc = k[c.start : c.stop].transpose(0, 1)[None]  # [1, kv_heads, q_len, d]
                vc = v[c.start : c.stop].transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, enable_gqa=True, scale=self.scale)
            else:
                kc, vc = self._gather(kv_cache, c.pages, c.seq_len)  # [kv_heads, seq_len, d]
                o = F.scaled_dot_product_attention(qc, kc[None], vc[None], attn_mask=c.mask, enable_gqa=True,
                                                   scale=self.scale)
            out[c.start : c.stop] = o[0].transpose(0, 1)
        if meta.decode_rows is not None:
            qd = q if meta.decode_all else q[meta.decode_rows]  # [Bd, heads, d]
            if meta.decode_table is not None:
                o = self.kernel(qd, kv_cache[0], kv_cache[1], meta.decode_table, meta.decode_lens, self.scale)
            else:
                o = self._decode(qd, kv_cache, meta)
            if meta.decode_all:
                return o
            out[meta.decode_rows] = o
        return out

    def forward_with_lse(self, layer, q, k, v, kv_cache, meta: TorchAttentionMeta):
        # The pool's requester side, run only for steps whose requests attend to context held
        # elsewhere: decodes through the paged kernel with LSE, in one call, where it builds; the
        # other requests by the gathering path with explicit scores (SDPA returns no LSE).
        kv_cache[0][:, meta.slot_page, meta.slot_offset] = k.transpose(0, 1)
        kv_cache[1][:, meta.slot_page, meta.slot_offset] = v.transpose(0, 1)
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        decoded = meta.decode_table is not None and self.kernel_lse is not None
        if decoded:
            rows = meta.decode_rows
            out[rows], lse[rows] = self.kernel_lse(q[rows], kv_cache[0], kv_cache[1], meta.decode_table,
                                                   meta.decode_lens, self.scale)
            if meta.decode_all:
                return out, lse
        for start, stop, pages, seq_len in meta.spans:
            if decoded and stop - start == 1:
                continue
            kc, vc = self._gather(kv_cache, pages, seq_len)  # [kv_heads, seq_len, d]
            qpos = torch.arange(seq_len - (stop - start), seq_len, device=q.device)[:, None]
            mask = torch.arange(seq_len, device=q.device)[None, :] <= qpos
            out[start:stop], lse[start:stop] = attention_with_lse(
                q[start:stop], kc.transpose(0, 1), vc.transpose(0, 1), self.scale, mask)
        return out, lse

    def attend_pages(self, q: torch.Tensor, kv_cache: torch.Tensor, query: PageQuery):
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
        starts = query.query_start
        single = [i for i, pages in enumerate(query.pages) if pages and starts[i + 1] - starts[i] == 1]
        if self.kernel_lse is not None and single:  # one row each (decodes): the kernel reads pages in place
            width = max(len(query.pages[i]) for i in single)
            table = torch.tensor([query.pages[i] + [0] * (width - len(query.pages[i])) for i in single],
                                 dtype=torch.int32)
            lens = torch.tensor([len(query.pages[i]) * self.page_size for i in single], dtype=torch.int32)
            rows = torch.tensor([starts[i] for i in single], dtype=torch.int64)
            out[rows], lse[rows] = self.kernel_lse(q[rows], kv_cache[0], kv_cache[1], table, lens, self.scale)
        done = set(single) if self.kernel_lse is not None else set()
        for i, pages in enumerate(query.pages):
            start, stop = starts[i], starts[i + 1]
            if not pages or start == stop or i in done:
                continue
            index = torch.tensor(pages, dtype=torch.int64, device=q.device)
            kc, vc = self._gather(kv_cache, index, len(pages) * self.page_size)
            out[start:stop], lse[start:stop] = attention_with_lse(
                q[start:stop], kc.transpose(0, 1), vc.transpose(0, 1), self.scale)
        return out, lse

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: TorchAttentionMeta) -> torch.Tensor:
        # q: [B, heads, d] -> [B, heads, d]; one query per request over its gathered pages.
        # NOTE: explicit matmuls, not SDPA: for one query per sequence torch's CPU SDPA kernel is
        # several times slower than these two bmms (bench/results/code_figures.md).
        B = q.shape[0]
        kvh, d = self.num_kv_heads, self.head_dim
        L = meta.decode_pages.numel() // B * self.page_size
        group = self.num_heads // kvh
        # One index_select of whole pages per plane yields [kvh, B, L, d]: each (head, request)
        # pair is a contiguous matrix and both products are plain bmms (3x faster than indexing
        # a transposed view of page-major pages, measured on 2 cores).
        k = self._pages(kv_cache[0], meta.decode_pages).view(kvh * B, L, d)
        v = self._pages(kv_cache[1], meta.decode_pages).view(kvh * B, L, d)
        qg = q.view(B, kvh, group, d).transpose(0, 1).reshape(kvh * B, group, d)  # GQA: no K/V repeat
        scores = torch.bmm(qg, k.transpose(1, 2)).float().view(kvh, B, group, L)
        probs = (scores * self.scale + meta.decode_bias).softmax(dim=-1).to(q.dtype)  # [kvh, B, group, L]
        o = torch.bmm(probs.view(kvh * B, group, L), v)  # [kvh*B, group, d]
        return o.view(kvh, B, group, d).transpose(0, 1).reshape(B, self.num_heads, d)

    def _gather(self, kv_cache: torch.Tensor, pages: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        # -> [kv_heads, seq_len, d] each
        kvh, d = self.num_kv_heads, self.head_dim
        kc = self._pages(kv_cache[0], pages).view(kvh, -1, d)[:, :seq_len]
        vc = self._pages(kv_cache[1], pages).view(kvh, -1, d)[:, :seq_len]
        return kc, vc

    def _pages(self, plane: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
        # plane: [kvh, num_pages, page_size, d] -> [kvh, len(pages), page_size * d]
        kvh, num_pages = plane.shape[:2]
        return plane.view(kvh, num_pages, -1).index_select(1, pages)
