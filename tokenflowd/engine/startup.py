"""The engine's start-up sequence: build the runner with the fast paths it was given, check them
against the plain ones (self_check.py), and on any failure step down one path at a time:

    flashinfer + CUDA graphs ──graphs fail──────► flashinfer, eager
             │                                      │
             └──────────flashinfer fails────────────┴──► torch attention, eager (pages gathered)
    flashinfer's fused layer ops ──they fail──► the same attention, plain layer ops
    torch + paged decode kernel (CPU) ──kernel fails──► torch attention, pages gathered

A failure is anything raised while building the backend, capturing the graphs or running either
check, and any check whose logits disagree. Only a lost device is not stepped down from: nothing
can run on it any more, and the process exits so that its supervisor starts a fresh one. Each
step down is logged and reported (Ready.fallback: /health and /metrics); flashinfer is not tried
for a head dim it has no kernels for.
"""
from __future__ import annotations

import dataclasses
import gc
import importlib.util
import logging
from dataclasses import dataclass
from typing import Callable, TypeVar

import torch

from tokenflowd.engine.errors import FastPathFailed

log = logging.getLogger(__name__)

# Head dims flashinfer 0.2-0.7 compiles its prefill and decode kernels for; others fail at plan or
# capture time ("Unsupported head_dim").
FLASHINFER_HEAD_DIMS = (64, 128, 256)
ATTENTION, GRAPHS, FUSED = "attention", "graphs", "fused ops"

R = TypeVar("R")


@dataclass(frozen=True)
class FastPaths:
    """Which fast paths a runner is built with (EngineConfig's attention_backend, cuda_graphs and
    paged_kernel)."""

    attention_backend: str  # "flashinfer" | "torch"
    cuda_graphs: bool
    paged_kernel: bool  # the torch backend's CPU decode kernel
    plain_ops: bool = False  # flashinfer stepped down to plain layer ops (its fused ones failed)

    @classmethod
    def of(cls, config) -> "FastPaths":
        return cls(config.attention_backend, config.cuda_graphs, config.paged_kernel, config.plain_layer_ops)

    def apply(self, config):
        return dataclasses.replace(config, attention_backend=self.attention_backend, cuda_graphs=self.cuda_graphs,
                                   paged_kernel=self.paged_kernel, plain_layer_ops=self.plain_ops)

    def describe(self, device: str = "cpu") -> str:
        if self.attention_backend == "flashinfer":
            text = "flashinfer, CUDA graphs" if self.cuda_graphs else "flashinfer, eager"
            return text + ", plain layer ops" if self.plain_ops else text
        if self.paged_kernel and device == "cpu":
            return "torch, paged decode kernel"
        return "torch, pages gathered"

    def without(self, path: str) -> "FastPaths | None":
        """The paths one step down from a failure of `path`; None: there is nothing lower."""
        if path == GRAPHS and self.cuda_graphs:
            return dataclasses.replace(self, cuda_graphs=False)
        if path == FUSED and self.attention_backend == "flashinfer" and not self.plain_ops:
            return dataclasses.replace(self, plain_ops=True)
        if path == ATTENTION and self.attention_backend == "flashinfer":
            return FastPaths("torch", False, False)
        if path == ATTENTION and self.paged_kernel:
            return dataclasses.replace(self, paged_kernel=False)
        return None


def supported(paths: FastPaths, head_dim: int) -> str | None:
    """Why `paths` cannot run a model of `head_dim` (None: nothing known stops them)."""
    if paths.attention_backend == "flashinfer" and head_dim not in FLASHINFER_HEAD_DIMS:
        return f"flashinfer has no kernels for head_dim {head_dim} (it has {', '.join(map(str, FLASHINFER_HEAD_DIMS))})"
    return None


def why_not_flashinfer(config) -> str | None:
    """Why "auto" chose the torch backend on a GPU (None: it did not, or the engine is on a CPU)."""
    if not config.attention_auto or not config.device.startswith("cuda") or config.attention_backend != "torch":
        return None
    if importlib.util.find_spec("flashinfer") is None:
        return "flashinfer is not installed (pip install 'tokenflowd[gpu]'; make run does where nvidia-smi answers)"
    if config.dtype == "float32":
        return "flashinfer has no float32 kernels"
    return None


def start(paths: FastPaths, build: Callable[[FastPaths], R], check: Callable[[R], dict[str, str]],
          device: str = "cpu", why_not: str | None = None) -> tuple[R, FastPaths, str]:
    """Build and check with `paths`, stepping down on each failure until a runner passes. Returns
    it, the paths it runs, and what was stepped down from ("": nothing). `why_not`: a reason
    known before building that the attention backend cannot serve (supported())."""
    steps: list[str] = []

    def step_down(path: str, reason: str) -> FastPaths:
        lower = paths.without(path)
        if lower is None:
            raise RuntimeError(f"the plain path failed its start-up: {path}: {reason}")
        steps.append(f"{paths.describe(device)} -> {lower.describe(device)}: {path}: {reason}")
        log.warning("start-up: %s failed (%s); stepping down to %s", path, reason, lower.describe(device))
        return lower

    if why_not is not None:
        paths = step_down(ATTENTION, why_not)
    while True:
        runner = None
        try:
            runner = build(paths)
            failed = check(runner)
        except FastPathFailed as e:  # building the backend or capturing the graphs (guarded)
            failed = {e.path: e.reason}
        if not failed:
            log.info("attention: %s", paths.describe(device))
            return runner, paths, "; ".join(steps)
        del runner
        release(device)
        path = next(p for p in (ATTENTION, FUSED, GRAPHS) if p in failed)
        paths = step_down(path, failed[path])


def device_alive(device: str) -> bool:
    """Whether kernels still run on `device` after a failure (a sticky CUDA error stops them all)."""
    if not device.startswith("cuda"):
        return True
    try:
        torch.cuda.synchronize()
        return torch.ones(1, device=device).add_(1).item() == 2.0
    except Exception as e:  # noqa: BLE001 - any error here means the context is gone
        log.error("the device does not answer after a failed start-up step: %s", e)
        return False


def release(device: str) -> None:
    """Give back what a runner that failed held, before the next one is built."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def guarded(path: str, stage: Callable[[], None], device: str) -> None:
    """Run one start-up stage of a fast path: what it raises is that path's failure, unless the
    device is lost (then it propagates: nothing lower would run either)."""
    try:
        stage()
    except FastPathFailed:
        raise
    except Exception as e:
        if not device_alive(device):
            raise
        raise FastPathFailed(path, describe_error(e)) from e


def describe_error(e: BaseException) -> str:
    """One line for a log and /health: the exception's type and its message's first line."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__
