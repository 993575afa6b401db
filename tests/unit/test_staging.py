"""engine/staging.py's CPU twin, the flashinfer page table it fills, and the GPU copier's page runs
(the GPU sides, page-locked memory, non-blocking copies and one launch per lane per step, are
tests/gpu/test_gpu.py's no-pageable-copy and copier round-trip tests)."""
from __future__ import annotations

import numpy as np
import torch

from tokenflowd.engine.attention.base import AttentionInputs
from tokenflowd.engine.attention.flashinfer_backend import PageTable
from tokenflowd.engine.staging import concat_to_device, to_device

CPU = torch.device("cpu")


def test_values_reach_the_cpu_as_they_were():
    assert to_device([3, 1, 2], torch.int64, CPU).tolist() == [3, 1, 2]
    assert to_device(np.array([0.5, 2.0]), torch.float32, CPU).dtype == torch.float32
    flat = concat_to_device([np.arange(3), np.array([], dtype=np.int64), np.array([9])], torch.int64, CPU)
    assert flat.tolist() == [0, 1, 2, 9] and flat.dtype == torch.int64
    assert concat_to_device([], torch.int64, CPU).numel() == 0


def test_a_page_table_padded_for_a_graph_gives_each_padding_row_one_scratch_page():
    inputs = AttentionInputs([0, 1, 2], [5, 9], [[4, 7], [1, 2, 3]], torch.zeros(2, dtype=torch.int64))
    t = PageTable.build(inputs, 4, CPU, pad_to=4, pad_page=99)
    assert t.indptr.tolist() == [0, 2, 5, 6, 7]
    assert t.indices.tolist() == [4, 7, 1, 2, 3, 99, 99]
    assert t.last_page_len.tolist() == [1, 1, 1, 1]
    assert all(x.dtype == torch.int32 for x in (t.indptr, t.indices, t.last_page_len))
    unpadded = PageTable.build(inputs, 4, CPU)
    assert unpadded.indptr.tolist() == [0, 2, 5] and unpadded.last_page_len.tolist() == [1, 1]


def test_page_runs_are_consecutive_on_both_sides():
    from tokenflowd.offload.copier import pair_runs

    assert pair_runs([7, 2, 5, 6, 7], [3, 4, 0, 1, 2]) == [(0, 1), (1, 2), (2, 5)]
    assert pair_runs([1, 2, 3], [5, 9, 10]) == [(0, 1), (1, 3)]
    assert pair_runs([], []) == []


def test_the_append_puts_each_new_token_where_its_slot_is():
    """flashinfer's paged-KV append finds a token's page as indices[indptr[b] + pos // page_size]: for
    a step mixing a prompt chunk, a decode and a first chunk, that is the slot the torch path writes."""
    from types import SimpleNamespace

    from tokenflowd.engine.attention.flashinfer_backend import FlashInferBackend

    ps = 4
    tables = [[3, 8, 5], [1, 2], [9, 6, 7]]
    chunks = [(4, 5), (6, 1), (0, 7)]  # (tokens already in its KV, new tokens) per request
    query_start, seq_lens, slots = [0], [], []
    for table, (past, n) in zip(tables, chunks):
        query_start.append(query_start[-1] + n)
        seq_lens.append(past + n)
        slots += [table[p // ps] * ps + p % ps for p in range(past, past + n)]
    inputs = AttentionInputs(query_start, seq_lens, tables, torch.tensor(slots))
    table = PageTable.build(inputs, ps, CPU)
    a = FlashInferBackend._append(SimpleNamespace(device=CPU), inputs, table, table.indices)
    indices, indptr = a.indices.tolist(), a.indptr.tolist()
    got = [indices[indptr[b] + pos // ps] * ps + pos % ps for b, pos in zip(a.batch_indices.tolist(), a.positions.tolist())]
    assert got == slots
    assert a.batch_indices.dtype == a.positions.dtype == torch.int32
