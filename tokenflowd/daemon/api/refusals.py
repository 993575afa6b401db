"""Every refusal counted and said, and the event loop's lag watched.

    refusal_middleware   the outermost middleware: each response of status 400, 401, 403, 404,
                         405, 408, 409, 413, 429 or 503 counts once in
                         tokenflowd_requests_refused_total{status, reason} (the reason: the error's
                         code, errors.py REFUSAL) and is logged once at INFO with its reason, at most
                         LOG_EVERY s apart per (status, reason) with the count left out in between
    watch_loop           samples the event loop's lag every TICK s into
                         tokenflowd_event_loop_lag_seconds, and logs a lag above LAG_WARN s
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from aiohttp import web

from tokenflowd.openai_api.errors import REFUSAL

log = logging.getLogger("tokenflowd.api")

REFUSED_STATUSES = frozenset({400, 401, 403, 404, 405, 408, 409, 413, 429, 503})
LOG_EVERY = 5.0  # s between two lines of one (status, reason)
TICK = 0.1  # s between the loop's lag samples
LAG_WARN = 0.5  # s of lag worth a log line


class RefusalLog:
    """One INFO line per refusal, at most one per LOG_EVERY s for each (status, reason): a flood of
    one kind says how many it left out, and does not flood the journal."""

    def __init__(self, every: float = LOG_EVERY, clock: Callable[[], float] = time.monotonic) -> None:
        self.every = every
        self.clock = clock
        self._last: dict[tuple[int, str], float] = {}
        self._left_out: dict[tuple[int, str], int] = {}

    def __call__(self, status: int, reason: str, method: str, path: str, peer: str | None) -> None:
        key, now = (status, reason), self.clock()
        if now - self._last.get(key, -self.every) < self.every:
            self._left_out[key] = self._left_out.get(key, 0) + 1
            return
        self._last[key] = now
        left_out = self._left_out.pop(key, 0)
        log.info("refused %s %s from %s: %d %s%s", method, path, peer or "?", status, reason,
                 f" (and {left_out} more like it in the last {self.every:g} s)" if left_out else "")


def refusal_middleware(count: Callable[[int, str], None], say: Callable[..., None]):
    @web.middleware
    async def refusals(request: web.Request, handler) -> web.StreamResponse:
        response = await handler(request)
        if response.status in REFUSED_STATUSES:
            reason = response.get(REFUSAL) or "refused"
            count(response.status, reason)
            say(response.status, reason, request.method, request.path, request.remote)
        return response
    return refusals


async def watch_loop(observe: Callable[[float], None], tick: float = TICK, warn: float = LAG_WARN) -> None:
    """Forever: how late the loop wakes from a `tick` s sleep, into `observe`; a lag above `warn`
    s is logged (something held the loop: a handler computing, a blocking call)."""
    while True:
        start = time.monotonic()
        await asyncio.sleep(tick)
        lag = max(0.0, time.monotonic() - start - tick)
        observe(lag)
        if lag > warn:
            log.warning("the event loop was held for %.2f s: streams and /health waited that long", lag)
