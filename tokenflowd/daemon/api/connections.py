"""The front's TCP connections: how many may be open, how long a request head may take, and a
wait for a slow reader's socket that costs no wake-ups.

    ConnectionGuard(inner, ...)   the listening socket's protocol factory: each accepted connection
                                  gets aiohttp's protocol (`inner()`) wrapped in a _Guarded one
    guard.expire()                a task for the server's life: closes connections whose request
                                  head is overdue (slow-loris), a few times a second
    writable(transport, timeout)  waits until a paused connection's send buffer drains (its
                                  resume_writing), or the timeout: no polling
    quiet_malformed_requests()    a request aiohttp cannot parse is one log line, not a traceback

A connection beyond `max_connections` gets a canned 503 with Retry-After and is closed before
aiohttp sees it. A request head (request line and headers) must arrive within `header_timeout`
of the connection opening, or of its first byte after the previous response; the body has its
own deadline (daemon/api/app.py). Idle keep-alive connections are aiohttp's (keepalive_timeout).

The wrapper forwards every protocol callback to aiohttp's RequestHandler unchanged. It only
watches: bytes arriving (to start a head's clock), writing paused and resumed (for writable()),
and the connection closing.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from tokenflowd.openai_api.schema import ErrorDetail, ErrorResponse

log = logging.getLogger("tokenflowd.api")


def _refusal() -> bytes:
    body = msgspec.json.encode(ErrorResponse(ErrorDetail(
        "the server holds as many connections as it is configured to (--max-connections): retry shortly",
        "service_unavailable", None, "too_many_connections")))
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Retry-After: 1\r\nConnection: close\r\n\r\n")
    return head.encode() + body


_REFUSAL = _refusal()


class ConnectionGuard:
    def __init__(self, inner: Callable[[], asyncio.Protocol], max_connections: int | None = None,
                 header_timeout: float = 10.0, on_close: Callable[[str], None] | None = None) -> None:
        """`on_close(reason)` counts connections the guard refused ("limit") or closed ("header_timeout")."""
        self.inner = inner
        self.max_connections = max_connections
        self.header_timeout = header_timeout
        self.on_close = on_close or (lambda reason: None)
        self.open: set[_Guarded] = set()
        self.heads: set[_Guarded] = set()  # connections whose request head is on its way (a deadline runs)

    def __call__(self) -> asyncio.Protocol:
        if self.max_connections is not None and len(self.open) >= self.max_connections:
            self.on_close("limit")
            return _Refuse()
        return _Guarded(self, self.inner())

    async def expire(self) -> None:
        """Close the connections whose request head is overdue, checking every quarter timeout (at
        most every second): a slow-loris connection lives at most 1.25 header timeouts."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(1.0, self.header_timeout / 4))
            now = loop.time()
            for conn in [c for c in self.heads if c.deadline <= now]:
                self.heads.discard(conn)
                self.on_close("header_timeout")
                log.debug("closed a connection whose request head took over %g s", self.header_timeout)
                conn.transport.abort()


@web.middleware
async def head_middleware(request: web.Request, handler) -> web.StreamResponse:
    """A request's head has arrived (its handler runs): its connection's head clock stops until the
    next request's first byte."""
    transport = request.transport
    conn = transport.get_protocol() if transport is not None else None
    if not isinstance(conn, _Guarded):
        return await handler(request)
    conn.busy += 1
    conn.guard.heads.discard(conn)
    try:
        return await handler(request)
    finally:
        conn.busy -= 1


class _Guarded(asyncio.Protocol):
    __slots__ = ("guard", "inner", "transport", "deadline", "busy", "paused", "waiters")

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol) -> None:
        self.guard = guard
        self.inner = inner
        self.transport: asyncio.Transport | None = None
        self.deadline = 0.0
        self.busy = 0  # requests of this connection whose handler runs
        self.paused = False
        self.waiters: list[asyncio.Future[None]] = []

    def _start_head_clock(self) -> None:
        self.deadline = asyncio.get_running_loop().time() + self.guard.header_timeout
        self.guard.heads.add(self)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.guard.open.add(self)
        self._start_head_clock()
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self.busy and self not in self.guard.heads:  # the first byte of a new request
            self._start_head_clock()
        self.inner.data_received(data)  # type: ignore[attr-defined]

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()  # type: ignore[attr-defined]

    def pause_writing(self) -> None:
        self.paused = True
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.paused = False
        self._wake()
        self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.open.discard(self)
        self.guard.heads.discard(self)
        self.paused = False
        self._wake()
        self.inner.connection_lost(exc)

    def _wake(self) -> None:
        waiters, self.waiters = self.waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)


class _Refuse(asyncio.Protocol):
    """The 503, then our half closed. Closing at once with the client's request still unread would
    send a reset, which some clients report instead of the answer: the connection closes when the
    client closes its half, or after a second."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(_REFUSAL)  # type: ignore[attr-defined]
        transport.write_eof()  # type: ignore[attr-defined]
        asyncio.get_running_loop().call_later(1.0, transport.close)

    def data_received(self, data: bytes) -> None:
        pass  # the request it will not serve

    def eof_received(self) -> bool:
        return False  # the transport closes


async def writable(transport: asyncio.BaseTransport | None, timeout: float | None) -> bool:
    """Wait until the connection may be written to again: its send buffer fell below the low-water
    mark (resume_writing) or it closed. False when `timeout` s passed first (a reader that stopped
    reading). A connection the guard does not wrap is polled every 10 ms (in-process tests)."""
    conn = transport.get_protocol() if transport is not None else None
    if not isinstance(conn, _Guarded):
        return await _poll_writable(transport, timeout)
    if not conn.paused or transport.is_closing():
        return True
    fut = asyncio.get_running_loop().create_future()
    conn.waiters.append(fut)
    try:
        async with asyncio.timeout(timeout):
            await fut
    except TimeoutError:
        return False
    return True


async def _poll_writable(transport: asyncio.BaseTransport | None, timeout: float | None) -> bool:
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    while transport is not None and not transport.is_closing() \
            and transport.get_write_buffer_size() > transport.get_write_buffer_limits()[1]:  # type: ignore[attr-defined]
        if deadline is not None and loop.time() >= deadline:
            return False
        await asyncio.sleep(0.01)
    return True


class MalformedRequestFilter(logging.Filter):
    """aiohttp logs a request it cannot parse (a NUL byte in a header, a bad request line) as an
    ERROR with a full traceback: any client could fill the journal with them. This filter, on the
    "aiohttp.server" logger, turns each into one INFO line without the traceback, at most one a
    `every` seconds, counting those it left out."""

    def __init__(self, every: float = 10.0) -> None:
        super().__init__()
        self.every = every
        self._last = float("-inf")
        self._dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        now = record.created
        if now - self._last < self.every:
            self._dropped += 1
            return False
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        more = f" ({self._dropped} more since the last such line)" if self._dropped else ""
        record.msg, record.args = "malformed request refused (400): %s%s", (first_line, more)
        record.levelno, record.levelname = logging.INFO, "INFO"
        record.exc_info = record.exc_text = None
        self._last, self._dropped = now, 0
        return True


def quiet_malformed_requests() -> None:
    """Install MalformedRequestFilter on aiohttp's server logger (once)."""
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, MalformedRequestFilter) for f in server_log.filters):
        server_log.addFilter(MalformedRequestFilter())
