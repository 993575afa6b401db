"""A client's token buffer: what it has received minus what it has read at its reading rate.

The client starts reading at its first token and reads `reading_rate` tokens/s while its buffer
holds any; when the buffer runs dry the client stalls until the next token arrives (rebuffering):

    tokens ▲                    generated(t) ┌──┐   ┌──
           │                      ┌──────────┘  └───┘        b(t) = generated(t) − read(t)
           │          ┌───────────┘    ....../                read(t) grows at r while b(t) > 0
           │    ┌─────┘     ....../‾‾‾‾‾‾                      and is flat while the client stalls
           │ ┌──┘ ..../‾‾‾‾‾  read(t)
           └─┴──────────────────────────────────► t
            first token

Generation is a step function (tokens arrive at step boundaries), so the model is exact when
advanced at every arrival. One implementation, used by the engine's scheduler, the front's
metrics, the simulator and the load generator.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TokenBuffer:
    reading_rate: float  # tokens/s the client reads (finite; agents state a high rate and a priority)
    first_token_time: float | None = None
    num_generated: int = 0  # tokens delivered to the client
    num_read: float = 0.0  # tokens the client has read by `clock`
    stall_time: float = 0.0  # seconds the client spent waiting with an empty buffer, after its first token
    num_stalls: int = 0
    clock: float = 0.0  # the time num_read and stall_time were advanced to
    stalled: bool = False  # the buffer ran dry before `clock` and no token has come since
    dry_since: float = 0.0  # while stalled: when the buffer ran dry

    def __post_init__(self) -> None:
        _check_rate(self.reading_rate)

    def advance(self, now: float) -> None:
        """Let the client read until `now`, counting a stall if the buffer runs dry."""
        if self.first_token_time is None or now <= self.clock:
            return
        dt = now - self.clock
        have = self.num_generated - self.num_read
        want = self.reading_rate * dt
        if want <= have:
            self.num_read += want
        else:
            if not self.stalled:
                self.num_stalls += 1
                self.stalled = True
                self.dry_since = self.clock + have / self.reading_rate
            self.stall_time += dt - have / self.reading_rate
            self.num_read = float(self.num_generated)
        self.clock = now

    def on_tokens(self, num_tokens: int, now: float) -> None:
        """`num_tokens` new tokens reached the client at `now`."""
        if num_tokens <= 0:
            return
        if self.first_token_time is None:
            self.first_token_time = self.clock = now
        else:
            self.advance(now)
        self.num_generated += num_tokens
        self.stalled = False

    def set_rate(self, reading_rate: float, now: float) -> None:
        """The client's rate changed (or was measured) at `now`: the past is read at the old rate."""
        _check_rate(reading_rate)
        self.advance(now)
        self.reading_rate = reading_rate

    def set_read(self, num_read: int, now: float) -> None:
        """The client reports that it has read `num_read` tokens by `now` (a read cursor): the
        model's reading position moves there, forwards or back, and from `now` on the client reads
        on at reading_rate. A report from before `clock` counts as made at `clock`, read on at the
        rate; a position beyond what was delivered is capped at it. Stall time already counted
        stays (it is the model's: a cursor says where the reader is, not when it waited)."""
        if self.first_token_time is None:
            return  # nothing delivered yet: nothing can have been read
        self.advance(now)
        lag = max(0.0, self.clock - now)
        self.num_read = min(max(0.0, num_read + self.reading_rate * lag), float(self.num_generated))
        if self.num_read < self.num_generated:
            self.stalled = False  # the reader has tokens in hand: a later dry spell is a new stall

    def buffer(self, now: float) -> float:
        """Tokens the client holds unread at `now` (0 before the first token and while stalled)."""
        if self.first_token_time is None:
            return 0.0
        read = self.num_read + self.reading_rate * max(0.0, now - self.clock)
        return max(0.0, self.num_generated - read)

    def time_to_empty(self, now: float) -> float:
        """Seconds until the buffer runs dry if no token arrives."""
        return self.buffer(now) / self.reading_rate

    def dry_for(self, now: float) -> float:
        """Seconds the client has been waiting with an empty buffer at `now` (0 while it holds
        tokens, and before its first token)."""
        if self.first_token_time is None:
            return 0.0
        if self.stalled:
            return max(0.0, now - self.dry_since)
        return self._dry_after_clock(now)

    def _dry_after_clock(self, now: float) -> float:
        """Seconds between the buffer running dry after `clock` (what it held then, read at the rate)
        and `now`; 0 if it has not run dry by then."""
        return max(0.0, now - self.clock - (self.num_generated - self.num_read) / self.reading_rate)

    def stall_time_at(self, now: float) -> float:
        """Stall seconds up to `now`, including a stall still going on (without advancing)."""
        if self.first_token_time is None:
            return self.stall_time
        return self.stall_time + self._dry_after_clock(now)


def _check_rate(rate: float) -> None:
    if not 0 < rate < float("inf"):
        raise ValueError(f"reading_rate must be a finite number of tokens/s above 0, got {rate}")
