"""What this machine offers: a CUDA device, fast bf16 on the CPU, flashinfer."""
from __future__ import annotations

import functools
import importlib.util

import torch


def pick_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """bf16 matmuls beat fp32 ~3x on CPUs with AVX512-BF16 or AMX (measured on the CI machine);
    without them oneDNN emulates bf16 and fp32 is faster."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


@functools.cache
def has_flashinfer() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None
