"""Which reading rate a request is scheduled by, and how it changes while the request streams.

Sources, highest precedence first:

    1. read cursor    POST /v1/requests/{id}/read: how far the client's reader has really got
    2. backpressure   windows in which the client's connection, not the engine, set the pace
    3. stated         `reading_rate` in the body or the X-Reading-Rate header
    4. learned        the conversation's cadence over its earlier turns (daemon/api/cadence.py)
    5. default        --default-reading-rate

A request starts with the first of 3–5 it has (`choose_rate`); 1 and 2 are measured on the request
itself while it streams (`RateMonitor`) and replace what it started with. Why this order:
measurements of this very request beat anything said or inferred before it started. Of the two,
real reads beat the transport: a chat UI drains its socket at once whatever its reader does, so
backpressure measures a reader only when the client reads its stream at reading pace (a terminal,
a text-to-speech pipe); once a client reports reads, backpressure is ignored for the request. The
client's word beats our inference: an agent or a voice knows its rate, while the cadence is a
bound with the user's thinking and typing time in it. Any of them beats a guess.

Every rate, stated, learned or measured, is clamped to `max_reading_rate`: a client cannot buy a
place at the head of the schedule by claiming to read a million tokens a second (the policies
serve high rates first). `priority` is the sanctioned way to jump the queue (daemon/api/auth.py).

Rates are raised as well as lowered, but only on evidence of the reader's pace:

  * read cursor: the pace between reports at least `window` apart. If the reader still had unread
    tokens at the end (it had not read past what was delivered when the window opened), it never
    waited, so its pace is its rate, up or down. Otherwise it may have waited for tokens, and the
    pace is only a lower bound: it can raise the rate, never lower it.
  * backpressure: a window with writes blocked more than half of the time was paced by the client,
    so its tokens/s is the client's rate, up or down. A window without blocking shows only that the
    connection drains faster than tokens come, a lower bound on the transport, not on the reader:
    it restores the starting rate when the current one is below it and never raises beyond it.
"""
from __future__ import annotations

from dataclasses import dataclass

MIN_READING_RATE = 0.1  # tokens/s: a reader that stopped (a background tab) is slow, never at rate 0


@dataclass(frozen=True, slots=True)
class RateChoice:
    """The rate a request starts with and where it came from."""

    reading_rate: float
    source: str  # stated | learned | default
    stated: float | None = None  # what the client asked for, before the clamp

    @property
    def clamped(self) -> bool:
        return self.stated is not None and self.stated > self.reading_rate


def choose_rate(stated: float | None, learned: float | None, default: float, max_rate: float) -> RateChoice:
    """Stated (clamped to `max_rate`), else learned (clamped), else the server's default."""
    if stated is not None:
        return RateChoice(min(stated, max_rate), "stated", stated)
    if learned is not None:
        return RateChoice(min(learned, max_rate), "learned")
    return RateChoice(default, "default")


class RateMonitor:
    """Measures a streaming client's real reading rate (see the module docstring for what counts).

    `observe` takes each write to the connection (tokens, seconds it waited for room); `on_read`
    each read-cursor report. Both return the new rate when it changes by more than `tolerance`
    (and the caller tells the engine), else None."""

    def __init__(self, initial_rate: float, window: float = 2.0, max_rate: float = float("inf"),
                 initial_source: str = "stated", tolerance: float = 0.1) -> None:
        self.initial_rate = initial_rate  # what the request started with (stated, learned or default)
        self.initial_source = initial_source
        self.current = initial_rate
        self.source = initial_source  # of `current`: one of RateChoice's, backpressure or read_cursor
        self.window = window
        self.max_rate = max_rate
        self.tolerance = tolerance
        self.num_read: int | None = None  # the last read cursor; None: the client reports none
        self._start: float | None = None  # backpressure window: opened at, tokens, seconds blocked
        self._tokens = 0
        self._blocked = 0.0
        self._read_anchor: tuple[int, int, float] = (0, 0, 0.0)  # cursor window: (read, delivered, time) at its start

    def observe(self, num_tokens: int, blocked: float, now: float) -> float | None:
        if self.num_read is not None:
            return None  # real reads rule; the transport says less
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
        if blocked_share > 0.5:
            return self._set(measured, "backpressure")
        if blocked_share < 0.1 and self.current < self.initial_rate:
            return self._set(self.initial_rate, self.initial_source, exact=True)
        return None

    def on_read(self, num_read: int, num_delivered: int, now: float) -> float | None:
        """The reader has read `num_read` of the `num_delivered` tokens handed to it, at `now`.
        The caller has checked 0 <= num_read <= num_delivered and that it does not go back."""
        if self.num_read is None:
            self.num_read = num_read
            self._read_anchor = (num_read, num_delivered, now)
            return None
        self.num_read = num_read
        read0, delivered0, t0 = self._read_anchor
        span = now - t0
        if span < self.window:
            return None
        self._read_anchor = (num_read, num_delivered, now)
        pace = (num_read - read0) / span
        never_waited = num_read < delivered0  # tokens in hand all through the window
        if never_waited or pace > self.current:
            return self._set(pace, "read_cursor")
        return None

    def _set(self, rate: float, source: str, exact: bool = False) -> float | None:
        rate = min(max(rate, MIN_READING_RATE), self.max_rate)
        if not exact and abs(rate - self.current) <= self.tolerance * self.current:
            return None
        self.current, self.source = rate, source
        return rate
