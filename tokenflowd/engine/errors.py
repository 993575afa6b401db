"""How a step or an engine fails, as the engine's callers see it: the step loop (core.py), the
engine process (process/) and the pool's members (pool/), which raise ForeignPrefixLost."""
from __future__ import annotations

import torch


class ForeignPrefixLost(RuntimeError):
    """A peer engine holding the leading KV of some requests is gone (pool/member.py): the step
    that needed it did not happen; those requests recompute their prefix here, the rest go on."""

    def __init__(self, request_ids: list[str], why: str) -> None:
        super().__init__(why)
        self.request_ids = request_ids


class EngineFailed(RuntimeError):
    """The engine cannot go on (steps keep failing, the device is lost): its process exits non-zero
    and the supervisor starts a fresh one, instead of failing every request forever."""


def device_lost(e: BaseException) -> bool:
    """A CUDA error is sticky: once one is raised, no later kernel on that context can succeed."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    return (accelerator_error is not None and isinstance(e, accelerator_error)) or "CUDA error" in str(e)


class FastPathFailed(RuntimeError):
    """A fast path could not be built or captured (engine/startup.py steps down from it): `path` is
    "attention" (the backend, or its kernel) or "graphs" (CUDA graph capture)."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason
