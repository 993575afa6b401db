"""Host values a step sends to the device (indices, per-row parameters), without a pageable copy.

A copy from pageable memory makes the driver stage it through its own pinned buffer, and it may
wait for the stream first: under overlap scheduling, that wait is for the whole step in flight.
So on a GPU every such value is written into page-locked memory taken from torch's caching host
allocator and copied with one non-blocking copy. The allocator keeps a block from reuse until the
copies that read it have run (it records an event on the stream at the copy), so no buffer is
overwritten under a copy in flight and no step waits on a host buffer. On a CPU the host tensor
is the value itself.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def host_tensor(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised 1-D host tensor of `n` values, page-locked when `device` is a GPU."""
    return torch.empty(n, dtype=dtype, pin_memory=device.type == "cuda")


def to_device(values: Sequence[int] | Sequence[float] | np.ndarray, dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """`values` as a 1-D tensor on `device`: through page-locked memory and one non-blocking copy
    on a GPU (module doc); the host tensor itself on a CPU."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype) if not isinstance(values, np.ndarray) \
            else torch.from_numpy(np.ascontiguousarray(values)).to(dtype)
    host = host_tensor(len(values), dtype, device)
    host.numpy()[:] = values
    return host.to(device, non_blocking=True)


def concat_to_device(parts: Sequence[np.ndarray], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The concatenation of `parts` (integer arrays) as `dtype` on `device`, written straight into the
    staging memory (one copy on the host, one non-blocking copy to a GPU)."""
    n = sum(len(p) for p in parts)
    host = host_tensor(n, dtype, device)
    if n:
        np.concatenate(parts, out=host.numpy())
    return host.to(device, non_blocking=True) if device.type == "cuda" else host
