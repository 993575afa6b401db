"""One request as the HTTP front sees it: engine deltas in, text pieces out.

    Stream (token ids from the engine) ──► Generation.pieces() ──► Piece(text, tokens, finish_reason)
                                             detokenize · stop strings · latency and buffer metrics

The handler writes each piece and then calls `delivered(piece)`: TTFT, inter-token latency and the
client's rebuffering are measured at that moment, as the client sees them, with the same
TokenBuffer model the engine schedules by. `close()` always runs: a request that did not finish
(client gone, stop string, error in the handler) is aborted in its engine, which frees its pages.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import AsyncIterator

from tokenflowd.api.metrics import Metrics
from tokenflowd.buffer.tracker import TokenBuffer
from tokenflowd.engine.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer
from tokenflowd.supervisor import Stream, Supervisor


class Refused(Exception):
    """The engine refused the request as given (the message says why); nothing was generated."""


@dataclass(slots=True)
class Piece:
    text: str
    num_tokens: int  # tokens behind this text (text can lag a multi-byte character)
    finish_reason: str | None = None  # stop | length | error
    error: str | None = None


class Generation:
    def __init__(
        self, supervisor: Supervisor, stream: Stream, tokenizer: Tokenizer, prompt_ids: list[int],
        stop: tuple[str, ...], reading_rate: float, metrics: Metrics, arrival_time: float,
    ) -> None:
        self.supervisor = supervisor
        self.stream = stream
        self.request_id = stream.request_id
        self.num_prompt_tokens = len(prompt_ids)
        self.num_cached_tokens = 0
        self.num_output_tokens = 0
        self.finish_reason: str | None = None
        self.stated_rate = reading_rate
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self._stops = StopStringMatcher(stop)
        self._metrics = metrics
        self._engine = str(stream.engine.engine_id)
        self._arrival = arrival_time
        self._last_sent: float | None = None
        self.buffer = TokenBuffer(reading_rate)  # the client's buffer as delivered by the front
        self.rate = RateMonitor(reading_rate)

    async def pieces(self) -> AsyncIterator[Piece]:
        """Text pieces until the request ends; the last one carries the finish reason."""
        while self.finish_reason is None:
            delta = await self.stream.queue.get()
            if delta.finish_reason == "rejected":
                self.finish_reason = "rejected"
                raise Refused(delta.error or "the engine refused the request")
            self.num_output_tokens += len(delta.token_ids)
            self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
            text, matched = self._stops.push(self._detok.push(delta.token_ids)) if delta.token_ids else ("", False)
            reason = delta.finish_reason
            if matched:
                reason = "stop"
                self.supervisor.abort(self.stream)  # no-op when the engine finished it already
            elif reason in ("stop", "length"):
                tail, matched = self._stops.push(self._detok.flush())
                text += tail if matched else tail + self._stops.flush()
                reason = "stop" if matched else reason
            self.finish_reason = reason
            if text or delta.token_ids or reason:
                yield Piece(text, len(delta.token_ids), reason, delta.error)

    def delivered(self, piece: Piece, blocked: float = 0.0, now: float | None = None) -> None:
        """`piece` has been handed to the client's connection, whose write waited `blocked` seconds
        for the client to make room (send-side backpressure)."""
        if not piece.num_tokens:
            return
        now = time.monotonic() if now is None else now
        labels = self._metrics
        if self._last_sent is None:
            labels.ttft.labels(self._engine).observe(now - self._arrival)
        else:
            labels.itl.labels(self._engine).observe(now - self._last_sent)
        self._last_sent = now
        self.buffer.on_tokens(piece.num_tokens, now)
        labels.generation_tokens.labels(self._engine).inc(piece.num_tokens)
        rate = self.rate.observe(piece.num_tokens, blocked, now)
        if rate is not None:  # the client reads slower than it said (or is back to its rate)
            self.buffer.set_rate(rate, now)
            self.supervisor.set_reading_rate(self.stream, rate)

    def close(self) -> None:
        """End of the handler, whatever the reason. Aborts an unfinished request; records metrics."""
        now = time.monotonic()
        m, engine = self._metrics, self._engine
        if self.finish_reason is None:
            self.supervisor.abort(self.stream)
            outcome = "abort"
        else:
            outcome = self.finish_reason
        if outcome == "rejected":
            return
        m.requests.labels(engine, outcome).inc()
        m.prompt_tokens.labels(engine).inc(self.num_prompt_tokens)
        if outcome in ("stop", "length") and self._last_sent is not None:
            m.e2e.labels(engine).observe(now - self._arrival)
            m.rebuffer.labels(engine).observe(self.buffer.stall_time_at(self._last_sent))


class RateMonitor:
    """Estimates a client's real reading rate from send-side backpressure.

    Over windows of `window` seconds it counts tokens accepted by the connection and the time
    writes spent blocked. A window blocked more than half the time means the client, not the
    engine, set the pace: its tokens/s is the client's rate. A new rate is reported when it is
    more than 10% below the rate in use; when writes stop blocking, the stated rate comes back.
    """

    def __init__(self, stated_rate: float, window: float = 2.0) -> None:
        self.stated_rate = stated_rate
        self.current = stated_rate
        self.window = window
        self._start: float | None = None
        self._tokens = 0
        self._blocked = 0.0

    def observe(self, num_tokens: int, blocked: float, now: float) -> float | None:
        if self._start is None:
            self._start = now
        self._tokens += num_tokens
        self._blocked += blocked
        span = now - self._start
        if span < self.window:
            return None
        measured = self._tokens / span
        blocked_share = self._blocked / span
        self._start, self._tokens, self._blocked = now, 0, 0.0
        if blocked_share > 0.5 and measured < 0.9 * self.current:
            self.current = max(measured, 0.1)
            return self.current
        if blocked_share < 0.1 and self.current < self.stated_rate:
            self.current = self.stated_rate
            return self.current
        return None
