"""Rate-aware coalescing at the engine's output: a client far ahead gets its tokens in batches.

A reader at 20 tokens/s with 5 s of tokens in its buffer gains nothing from one SSE event per
token, and every event costs the front CPU (a delta to dispatch, a detokenizer step, JSON, a
write). So the engine's endpoint models each streaming client's buffer (buffer/tracker.py, the
model the scheduler uses, advanced as deltas leave) and:

    buffer < coalesce.buffer s of reading   each step's tokens go out at once
    buffer ≥ coalesce.buffer                the tokens are held; what is held goes out as one delta
                                            coalesce.interval s after the first of it, or with the
                                            next step after the buffer fell below the mark, or with
                                            the request's end

The front writes each delta as one event, so a held batch is one event. While a token waits the
buffer drops by at most `interval` s of reading, so it never empties. Held here, the tokens never
reach the front one by one: the front's cost per token is paid once per batch (SGLang holds its
outputs in the scheduler for its stream interval for the same reason). The client's rate and read
cursor, as the front measures them, update the model (SetReadingRate, SetReadCursor).
"""
from __future__ import annotations

import heapq

from tokenflowd.buffer.tracker import TokenBuffer
from tokenflowd.protocol import Coalesce, Delta, TokenLogprobs


class _Paced:
    __slots__ = ("buffer", "coalesce", "held", "held_logprobs", "due", "num_cached_tokens", "num_preemptions")

    def __init__(self, reading_rate: float, coalesce: Coalesce) -> None:
        self.buffer = TokenBuffer(reading_rate)  # as delivered: advanced when tokens leave
        self.coalesce = coalesce
        self.held: list[int] = []
        self.held_logprobs: list[TokenLogprobs] | None = None  # theirs, where the request asks
        self.due = 0.0  # while holding: when the held tokens go out
        self.num_cached_tokens = 0  # of the latest delta held
        self.num_preemptions = 0


class DeltaPacer:
    def __init__(self) -> None:
        self._streams: dict[str, _Paced] = {}
        self._releases: list[tuple[float, str]] = []  # (due, request id), stale entries skipped

    def track(self, request_id: str, reading_rate: float, coalesce: Coalesce | None) -> None:
        """A request whose deltas may be held (None or a zero interval: every step's at once)."""
        if coalesce is not None and coalesce.interval > 0 and reading_rate > 0:
            self._streams[request_id] = _Paced(reading_rate, coalesce)

    def forget(self, request_id: str) -> None:
        """The request is gone (aborted): what it held is dropped with it."""
        self._streams.pop(request_id, None)

    def set_rate(self, request_id: str, reading_rate: float, now: float) -> None:
        s = self._streams.get(request_id)
        if s is not None and reading_rate > 0:
            s.buffer.set_rate(reading_rate, now)

    def set_read(self, request_id: str, num_read: int, now: float) -> None:
        s = self._streams.get(request_id)
        if s is not None:
            s.buffer.set_read(num_read, now)

    def next_release(self) -> float | None:
        """When the earliest held tokens are due (None: nothing is held)."""
        releases, streams = self._releases, self._streams
        while releases:
            due, rid = releases[0]
            s = streams.get(rid)
            if s is not None and s.held and s.due == due:
                return due
            heapq.heappop(releases)
        return None

    def pace(self, deltas: list[Delta], now: float) -> list[Delta]:
        """What goes out now: each delta, with what its request held, unless its tokens are held;
        then every held batch that is due."""
        streams = self._streams
        if not streams:
            return deltas
        out: list[Delta] = []
        for d in deltas:
            s = streams.get(d.request_id)
            if s is None:
                out.append(d)
                continue
            if d.finish_reason is not None or not d.token_ids:
                if d.finish_reason is not None:
                    del streams[d.request_id]
                out.append(self._with_held(s, d, now))
                continue
            if s.buffer.time_to_empty(now) >= s.coalesce.buffer:
                if not s.held:
                    s.due = now + s.coalesce.interval
                    heapq.heappush(self._releases, (s.due, d.request_id))
                s.held.extend(d.token_ids)
                if d.logprobs is not None:
                    s.held_logprobs = (s.held_logprobs or []) + d.logprobs
                s.num_cached_tokens, s.num_preemptions = d.num_cached_tokens, d.num_preemptions
                continue
            out.append(self._with_held(s, d, now))
        releases = self._releases
        while releases and releases[0][0] <= now:
            due, rid = heapq.heappop(releases)
            s = streams.get(rid)
            if s is not None and s.held and s.due == due:
                out.append(self._with_held(s, Delta(rid, [], num_cached_tokens=s.num_cached_tokens,
                                                    num_preemptions=s.num_preemptions), now))
        return out

    @staticmethod
    def _with_held(s: _Paced, d: Delta, now: float) -> Delta:
        """`d` with the held tokens before its own, counted as delivered at `now`."""
        if s.held:
            logprobs = d.logprobs
            if s.held_logprobs is not None:
                logprobs = s.held_logprobs + (d.logprobs or [])
            d = Delta(d.request_id, s.held + d.token_ids, d.finish_reason, d.error, d.num_cached_tokens,
                      d.num_preemptions, d.retry_after, logprobs)
            s.held, s.held_logprobs = [], None
        s.buffer.on_tokens(len(d.token_ids), now)
        return d
