"""The simulator's clock: virtual seconds, moved only by the simulation (a step's cost, a copy's end)."""
from __future__ import annotations


class VirtualClock:
    """The scheduler's clock in the simulator: the time the loop set, never the wall clock."""

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now
