"""What this machine offers: CUDA devices, fast bf16 on the CPU, flashinfer; and a child process's
death with its parent (the supervisor's engines and API server processes).

Asked without importing torch into the calling process: the front resolves the engine config
(how many engines, which device) but never computes, and torch costs it ~300 MB of RSS. Where
the GPU question cannot be settled from the environment, one short-lived child process asks
torch and exits.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import importlib.util
import os
import signal
import subprocess
import sys

_PROBE = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
PROBE_TIMEOUT = 120.0  # s: a CUDA initialisation can be slow, a hung driver must not hang start-up


def pick_device() -> str:
    return "cuda" if cuda_device_count() > 0 else "cpu"


@functools.cache
def cuda_device_count() -> int:
    """CUDA devices torch can use here (0 without a driver, a device node or a CUDA build)."""
    torch = sys.modules.get("torch")
    if torch is not None:  # an engine or the in-process API: torch is here already (never imported here)
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    if os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1") or not glob.glob("/dev/nvidia[0-9]*"):
        return 0
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=PROBE_TIMEOUT)
        return int(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else 0
    except (subprocess.TimeoutExpired, ValueError, IndexError, OSError):
        return 0


MPS_DEFAULT_PIPE = "/tmp/nvidia-mps"  # where CUDA clients look when CUDA_MPS_PIPE_DIRECTORY is unset


def mps_pipe_directory() -> str:
    """The CUDA MPS control daemon's pipe directory when one runs there (its `control` pipe exists),
    so this process's CUDA context is one of its clients; "" when none runs."""
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or MPS_DEFAULT_PIPE
    return pipe if os.path.exists(os.path.join(pipe, "control")) else ""


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
    return cuda_device_count() > 0 and importlib.util.find_spec("flashinfer") is not None


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux prctl PR_SET_PDEATHSIG):
    an engine must not outlive a supervisor killed with SIGKILL, holding its GPU and memory. The
    signal follows the parent's *thread* that spawned it; the supervisor spawns engines from its
    event loop's thread, which lives as long as the supervisor. Called first thing in an engine
    process's main(), never in a library (it would bind the caller's process). Elsewhere than
    Linux a no-op (the loop's orphan check still ends the engine)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
