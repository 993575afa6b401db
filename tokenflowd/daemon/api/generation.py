"""One request as the HTTP front sees it: engine deltas in, text pieces out.

    Supervisor ─Delta─► Generation.on_delta ─Piece─► push(piece)  the client, at once (streaming, room to write)
                        detokenize · stop strings └─► held ─► take()  the handler task

Pieces are made in the supervisor's loop as deltas arrive. While a streaming handler has attached
a `push` function, each piece goes from there straight to the client's connection, with no task
switch: at thousands of streams the front's per-token cost is what limits it, and a queue plus a
task wake-up per token was most of it (bench/front_capacity.py). Everything else is held, in
order, for the handler to `take()`: the first piece (the headers are not sent yet), the last (the
handler ends the stream), pieces of non-streaming requests, and pieces that arrive while the
client is not reading (`push` refuses them; the handler waits for room and sends them as one event).

`delivered()` is called as pieces are handed to the connection: TTFT, inter-token latency and the
client's rebuffering are measured then, as the client sees them, with the same TokenBuffer model
the engine schedules by, and so is the client's real reading rate (daemon/api/rates.py: send-side
backpressure, and the read cursor a client may report with `read()`). `close()` always runs: a
request that did not finish (client gone, stop string, error in the handler) is aborted in its
engine, which frees its pages.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable

from tokenflowd.buffer.tracker import TokenBuffer
from tokenflowd.daemon.api.metrics import EngineMetrics
from tokenflowd.daemon.api.rates import RateMonitor
from tokenflowd.daemon.engine_handle import EngineHandle
from tokenflowd.daemon.supervisor import Supervisor
from tokenflowd.protocol import AddRequest, Delta, TokenLogprobs
from tokenflowd.text.stream import IncrementalDetokenizer, StopStringMatcher
from tokenflowd.text.tools import ToolCall, ToolCallParser
from tokenflowd.text.tokenizer import Tokenizer

request_log = logging.getLogger("tokenflowd.requests")


@dataclass(slots=True)
class Piece:
    text: str
    num_tokens: int  # tokens behind this text (text can lag a multi-byte character)
    finish_reason: str | None = None  # stop | length | error | rejected | shed
    error: str | None = None
    retry_after: float | None = None  # shed: s after which a retry can expect to be admitted
    logprobs: "list[tuple[int, TokenLogprobs]] | None" = None  # (token id, its logprobs), where asked
    tool_calls: "list[ToolCall] | None" = None  # calls the text up to here completed (text/tools.py)


class Generation:
    """Submits `add` to the engine in `slot` on construction (raises NoEngineReady if it is not
    serving). `rate` measures the client's rate (default: from add.reading_rate, unclamped);
    `keep_text` keeps the text sent, for the conversation's cadence (daemon/api/cadence.py)."""

    def __init__(
        self, supervisor: Supervisor, slot: EngineHandle, add: AddRequest, tokenizer: Tokenizer,
        stop: tuple[str, ...], metrics: EngineMetrics, arrival_time: float, *,
        rate: RateMonitor | None = None, keep_text: bool = False, keep_ids: bool = False,
        tool_parser: ToolCallParser | None = None,
    ) -> None:
        self.supervisor = supervisor
        self.request_id = add.request_id
        self.num_prompt_tokens = len(add.prompt_token_ids)
        self.num_cached_tokens = 0
        self.num_output_tokens = 0
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self._first_sent: float | None = None
        self.wants_logprobs = add.sampling.logprobs >= 0
        self._tools = tool_parser  # the reply's calls are taken out of its text
        self.num_tool_calls = 0
        self._detok = IncrementalDetokenizer(tokenizer, add.prompt_token_ids)
        self._stops = StopStringMatcher(stop)
        self._metrics = metrics
        self._arrival = arrival_time
        self._last_sent: float | None = None
        self._held: list[Piece] = []
        self._waiter: asyncio.Future[None] | None = None
        self._push: Callable[[Piece], bool] | None = None
        self._closed = False
        self.buffer = TokenBuffer(add.reading_rate)  # the client's buffer as delivered by the front
        self.rate = rate or RateMonitor(add.reading_rate)
        self.text_parts: list[str] | None = [] if keep_text else None
        self.output_ids: list[int] | None = [] if keep_ids else None  # a federated reply's, for MemServe
        self.stream = supervisor.submit(slot, add, self.on_delta)

    # -- the supervisor's side ---------------------------------------------------------------
    def on_delta(self, delta: Delta) -> None:
        piece = self._piece(delta)
        if piece is None:
            return
        push = self._push
        if push is not None and not self._held and piece.finish_reason is None and push(piece):
            return
        self._push = None  # the handler takes over until it attaches again
        self._held.append(piece)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _piece(self, delta: Delta) -> Piece | None:
        if delta.finish_reason == "rejected":
            self.finish_reason = "rejected"
            return Piece("", 0, "rejected", delta.error or "the engine refused the request")
        if delta.finish_reason == "shed":  # --max-queue-delay: it would wait too long for a first token
            self.finish_reason = "shed"
            return Piece("", 0, "shed", delta.error or "the engine is overloaded", delta.retry_after)
        self.num_output_tokens += len(delta.token_ids)
        if self.output_ids is not None:
            self.output_ids += delta.token_ids
        if delta.num_cached_tokens > self.num_cached_tokens:
            self.num_cached_tokens = delta.num_cached_tokens
        self.num_preemptions = delta.num_preemptions
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
        if text and self.text_parts is not None:
            self.text_parts.append(text)
        calls = None
        if self._tools is not None:
            text, calls = self._tools.push(text) if text else ("", [])
            if reason is not None:
                tail, more = self._tools.flush()
                text, calls = text + tail, calls + more
            self.num_tool_calls += len(calls)
            if reason == "stop" and self.num_tool_calls:
                reason = "tool_calls"  # what the client is told; the request itself ended as "stop"
        if text or delta.token_ids or reason:
            # a first token computed on a prefill node (federation) comes without logprobs: none listed
            logprobs = (list(zip(delta.token_ids, delta.logprobs or ())) if self.wants_logprobs else None)
            return Piece(text, len(delta.token_ids), reason, delta.error, logprobs=logprobs, tool_calls=calls or None)
        return None

    # -- the handler's side ------------------------------------------------------------------
    async def take(self) -> list[Piece]:
        """The pieces held since the last call, in order; waits for at least one. The first piece
        of a refused request has finish_reason "rejected" (what it asks) or "shed" (the load)."""
        while not self._held:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        held, self._held = self._held, []
        return held

    def attach(self, push: Callable[[Piece], bool]) -> None:
        """From now on, pieces go to `push` as they are made, for as long as it returns True (it
        wrote the piece and called `delivered`); a piece it refuses, and the last piece, are held."""
        if self.finish_reason is None:
            self._push = push

    def delivered(self, num_tokens: int, blocked: float = 0.0, now: float | None = None) -> None:
        """`num_tokens` tokens have been handed to the client's connection, whose write waited
        `blocked` seconds for the client to make room (send-side backpressure)."""
        if not num_tokens:
            return
        now = time.monotonic() if now is None else now
        m = self._metrics
        # Inter-token latency per token: the tokens of one event share the gap since the last one (a
        # first event's later tokens came with the first, a gap of 0).
        if self._last_sent is None:
            self._first_sent = now
            m.ttft.observe(now - self._arrival)
            gap, count = 0.0, num_tokens - 1
        else:
            gap, count = (now - self._last_sent) / num_tokens, num_tokens
        m.itl.observe_many(gap, count)
        self._last_sent = now
        self.buffer.on_tokens(num_tokens, now)
        m.generation_tokens.inc(num_tokens)
        rate = self.rate.observe(num_tokens, blocked, now)
        if rate is not None:  # the client set the pace (or is back to its rate)
            self.buffer.set_rate(rate, now)
            self.supervisor.set_reading_rate(self.stream, rate)

    @property
    def num_delivered(self) -> int:
        """Tokens handed to the client's connection so far."""
        return self.buffer.num_generated

    @property
    def first_sent(self) -> float | None:
        return self._first_sent

    @property
    def last_sent(self) -> float | None:
        return self._last_sent

    def read(self, num_read: int, now: float | None = None) -> bool:
        """The client's reader has read `num_read` of the delivered tokens (a read cursor; the
        caller checked 0 <= num_read <= num_delivered). A cursor behind the last one is ignored
        (False): reports may cross on the way, and reading does not go back."""
        if self.rate.num_read is not None and num_read < self.rate.num_read:
            return False
        now = time.monotonic() if now is None else now
        self.buffer.set_read(num_read, now)
        self.supervisor.set_read_cursor(self.stream, num_read, now)
        rate = self.rate.on_read(num_read, self.num_delivered, now)
        if rate is not None:
            self.buffer.set_rate(rate, now)
            self.supervisor.set_reading_rate(self.stream, rate)
        return True

    def close(self, outcome: str | None = None) -> None:
        """End of the handler, whatever the reason: aborts an unfinished request and records metrics,
        once. `outcome` is what the client got when the handler knows better than the engine
        (write_stall: it stopped reading before the end reached it); else the finish reason, or
        abort (the client went away)."""
        if self._closed:
            return
        self._closed = True
        self._push = None
        now = time.monotonic()
        m = self._metrics
        if self.finish_reason is None:
            self.supervisor.abort(self.stream)
        outcome = outcome or self.finish_reason or "abort"
        if outcome == "rejected":
            return
        self._log_line(outcome, now)
        if outcome == "shed":  # counted by the front with its 429s
            return
        m.requests(outcome).inc()
        m.prompt_tokens.inc(self.num_prompt_tokens)
        if outcome in ("stop", "length") and self._last_sent is not None:
            m.e2e.observe(now - self._arrival)
            m.rebuffer.observe(self.buffer.stall_time_at(self._last_sent))

    def _log_line(self, outcome: str, now: float) -> None:
        """One structured line a request (logfmt: journald keeps it whole, and a grep or a log
        pipeline splits it into fields)."""
        ttft = f"{self._first_sent - self._arrival:.3f}" if self._first_sent is not None else "none"
        stall = self.buffer.stall_time_at(self._last_sent) if self._last_sent is not None else 0.0
        request_log.info(
            "request id=%s engine=%d outcome=%s reading_rate=%.2f ttft=%s prompt_tokens=%d cached_tokens=%d "
            "output_tokens=%d preemptions=%d rebuffer=%.3f duration=%.3f", self.request_id,
            self.stream.engine.engine_id, outcome, self.rate.initial_rate, ttft, self.num_prompt_tokens,
            self.num_cached_tokens, self.num_output_tokens, self.num_preemptions, stall, now - self._arrival)

