"""How long an engine of the pool may sit with requests waiting, none running and nothing admitted
before its waiting requests give their pins back (pool/engine_hooks.py `_unblock`, and the node
simulator's): a few steps' worth, since a step that admits nothing now and then is not a deadlock."""
from __future__ import annotations

STUCK_SECONDS = 0.5


class StuckTimer:
    """Since when an engine has been stuck: requests waiting, none running, nothing run."""

    def __init__(self) -> None:
        self.since: float | None = None

    def expired(self, now: float, stuck: bool) -> bool:
        """`stuck`: whether the engine is stuck now. -> True once it has been for STUCK_SECONDS (and
        the timer starts over); any moment not stuck resets it."""
        if not stuck:
            self.since = None
            return False
        if self.since is None:
            self.since = now
            return False
        if now - self.since < STUCK_SECONDS:
            return False
        self.since = None
        return True
