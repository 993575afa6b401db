"""The torch backend's C++ kernels for CPU, built once per machine and cached.

`paged_decode()` returns torch.ops.tokenflowd.paged_decode, compiled from cpu_paged_decode.cpp with
the machine's compiler (torch.utils.cpp_extension, about 15 s on 2 cores). The build lands under
torch's extensions directory (TORCH_EXTENSIONS_DIR or the user's cache), and later processes load
it in well under a second. With TOKENFLOWD_CPU_KERNELS=0 it returns None and the backend gathers
pages; where it cannot be built (no compiler, no headers) it raises KernelUnavailable, which
start-up reports as a step down to gathered pages (engine/startup.py). `paged_decode_lse()` is the same
kernel returning each row's log-sum-exp too (the pool's partial attention).
`python -m tokenflowd.engine.attention.cpu_kernels` builds ahead of time (the Makefile does, so a
first `serve` does not pay the build).
"""
from __future__ import annotations

import functools
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

import torch

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("cpu_paged_decode.cpp")
STALE_LOCK_S = 300  # a build takes ~15 s on 2 cores


class KernelUnavailable(RuntimeError):
    """The paged decode kernel cannot be built on this machine (the message says why)."""


def paged_decode() -> Callable | None:
    """The paged decode op; None when TOKENFLOWD_CPU_KERNELS=0. Raises KernelUnavailable where it
    cannot be built here."""
    if os.environ.get("TOKENFLOWD_CPU_KERNELS", "1") == "0":
        log.info("CPU kernels off (TOKENFLOWD_CPU_KERNELS=0): decode attention gathers pages")
        return None
    failure = _built()
    if failure is not None:
        raise KernelUnavailable(f"the paged decode kernel cannot be built here: {failure}")
    return torch.ops.tokenflowd.paged_decode


def paged_decode_lse() -> Callable | None:
    """The same kernel returning (out, log-sum-exp) as well (None and raises as paged_decode)."""
    return torch.ops.tokenflowd.paged_decode_lse if paged_decode() is not None else None


@functools.cache
def _built() -> str | None:
    """Build the kernels once per process; what went wrong, or None."""
    if hasattr(torch.ops.tokenflowd, "paged_decode"):
        return None
    try:
        _build()
    except Exception as e:  # noqa: BLE001 - no compiler, no headers: reported, and the gather path serves
        text = str(e).strip()
        return text.splitlines()[-1] if text else type(e).__name__
    return None


def _build() -> None:
    from torch.utils import cpp_extension

    t0 = time.monotonic()
    if shutil.which("ninja") is None:  # the ninja wheel's binary, when the venv's bin is not on PATH
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    # one directory per torch and Python: torch's build cache keys on source and flags only
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())
    build_dir = root / f"tokenflowd-torch{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}"
    build_dir.mkdir(parents=True, exist_ok=True)
    lock = build_dir / "lock"  # left by a build that was killed: torch would wait on it for good
    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
        log.warning("removing a stale build lock %s", lock)
        lock.unlink(missing_ok=True)
    # -march=native: the build is per machine and the kernel's inner loops take this CPU's vector
    # width. -ffast-math: the dot products vectorize and exp comes from glibc's vector library (2x
    # faster at batch 1 on 2-core AVX2), keeping infinities (-fno-finite-math-only). -fopenmp: ATen's
    # parallel_for is inline OpenMP; at run time the OpenMP runtime is torch's own (same soname,
    # already loaded), so the kernel shares torch's thread pool.
    flags = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp"]
    cpp_extension.load(
        name="tokenflowd_cpu_kernels", sources=[str(SOURCE)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir), is_python_module=False, verbose=False,
    )
    log.info("paged decode kernel ready in %.1f s", time.monotonic() - t0)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    failure = _built()
    if failure is not None:
        log.warning("paged decode kernel unavailable (%s): decode attention will gather pages", failure)
    raise SystemExit(0 if failure is None else 1)
