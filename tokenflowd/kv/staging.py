"""KV pages staged as one contiguous run, whatever the cache's layout: gathered for a copy out,
scattered on arrival (the federation's transfers between nodes, the pool's puts between engines).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch


def gather_pages(layers: Sequence[torch.Tensor], pages: Sequence[int], out: torch.Tensor,
                 page_axis: int = 2) -> torch.Tensor:
    """Copy `pages` of every layer into `out`, a contiguous staging buffer, as [layers, pages, 2,
    kv_heads, page_size, d] whatever the cache's layout (`page_axis`), so that they travel as one
    run instead of one per (layer, plane, head, page), and a receiver of another layout can take
    them. -> the filled view."""
    index = torch.tensor(list(pages), dtype=torch.int64, device=layers[0].device)
    shape = layers[0].shape
    wire = (len(layers), len(pages), *shape[:page_axis], *shape[page_axis + 1 :])
    view = out.view(-1)[: math.prod(wire)].view(wire)
    for i, layer in enumerate(layers):
        view[i].copy_(layer.index_select(page_axis, index).movedim(page_axis, 0))
    return view


def scatter_pages(staged: torch.Tensor, layers: Sequence[torch.Tensor], pages: Sequence[int],
                  page_axis: int = 2) -> None:
    """The receiver's half of gather_pages: put a staged run of pages into `pages` of its layers."""
    index = torch.tensor(list(pages), dtype=torch.int64, device=layers[0].device)
    for i, layer in enumerate(layers):
        layer.index_copy_(page_axis, index, staged[i].to(layer.device).movedim(0, page_axis))
