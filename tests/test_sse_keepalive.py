"""SSE keep-alive: a stream the engine leaves silent (its reader far ahead) gets a comment line
every sse_keepalive seconds, so no proxy or client read timeout cuts it off; never while bytes
still wait to go out."""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from tokenflowd.api.app import _KEEP_ALIVE, Front, _SSEConnection
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
    conn = _SSEConnection(SimpleNamespace(transport=transport), False, None, None)
    conn.last_write = time.monotonic() - age
    return conn


def test_silent_streams_get_a_comment_and_busy_or_blocked_ones_do_not():
    quiet, busy, blocked = Transport(), Transport(), Transport(pending=5000)
    # `busy` wrote "a minute from now": however late the sweep runs on a loaded box, it is not quiet
    front = SimpleNamespace(config=ServerConfig(sse_keepalive=0.2),
                            streams={connection(quiet, 1.0), connection(busy, -60.0), connection(blocked, 1.0)})

    async def sweep_once() -> None:
        task = asyncio.create_task(Front.keep_alive(front))
        await asyncio.sleep(0.15)  # one sweep after 0.1 s
        task.cancel()

    asyncio.run(sweep_once())
    assert quiet.written == [_KEEP_ALIVE] and _KEEP_ALIVE.startswith(b":")  # a comment: no event
    assert busy.written == [] and blocked.written == []


def test_a_comment_restarts_the_silence():
    quiet = Transport()
    conn = connection(quiet, 10.0)
    conn.keep_alive()
    assert time.monotonic() - conn.last_write < 1.0
