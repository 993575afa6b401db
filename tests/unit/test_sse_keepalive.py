"""SSE keep-alive: a stream the engine leaves silent (its reader far ahead) gets a comment line
every sse_keepalive seconds, so no proxy or client read timeout cuts it off; never while bytes
still wait to go out."""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from tokenflowd.daemon.api.front import Front
from tokenflowd.daemon.api.sse import KEEP_ALIVE as _KEEP_ALIVE, SSEConnection as _SSEConnection
from tokenflowd.config import ServerConfig


class Transport:
    def __init__(self, pending: int = 0) -> None:
        self.pending = pending
        self.written: list[bytes] = []

    def is_closing(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return self.pending

    def write(self, data: bytes) -> None:
        self.written.append(data)


def connection(transport: Transport, age: float) -> _SSEConnection:
    conn = _SSEConnection(SimpleNamespace(transport=transport), False, None, None, None)
    conn.last_write = time.monotonic() - age
    return conn


def test_silent_streams_get_a_comment_and_busy_or_blocked_ones_do_not():
    quiet, busy, blocked = Transport(), Transport(), Transport(pending=5000)
    front = SimpleNamespace(config=ServerConfig(sse_keepalive=0.2),
                            streams={connection(quiet, 1.0), connection(busy, 0.0), connection(blocked, 1.0)})
    Front.sweep_keep_alive(front, time.monotonic())  # one sweep, at a time of the test's choosing
    assert quiet.written == [_KEEP_ALIVE] and _KEEP_ALIVE.startswith(b":")  # a comment: no event
    assert busy.written == [] and blocked.written == []


def test_the_background_sweep_runs_every_half_interval():
    quiet = Transport()
    front = SimpleNamespace(config=ServerConfig(sse_keepalive=0.02), streams={connection(quiet, 1.0)})
    front.sweep_keep_alive = lambda now: Front.sweep_keep_alive(front, now)

    async def until_written() -> None:
        task = asyncio.create_task(Front.keep_alive(front))
        while not quiet.written:  # however slow the box: no deadline but pytest's own
            await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(until_written())
    assert quiet.written[0] == _KEEP_ALIVE


def test_a_comment_restarts_the_silence():
    quiet = Transport()
    conn = connection(quiet, 10.0)
    conn.keep_alive()
    assert time.monotonic() - conn.last_write < 1.0
