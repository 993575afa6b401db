"""Reading rates learned from a conversation's cadence: how soon each turn follows the last reply.

A chat user reads the reply, then writes the next message. The front sees, for each reply it
streamed, its length L (tokens) and the times its first and last tokens were handed to the client,
t_first and t_end; and the arrival t_next of the request that continues the conversation.

The bound. The reader cannot read a token before it arrives, so reading starts at t_first at the
earliest; if the user reads the whole reply before sending the next message, reading ends by
t_next. L tokens read in at most t_next − t_first seconds:

    reading time ≤ t_next − t_first      ⇒      r ≥ b = L / (t_next − t_first)

So the cadence bounds the reading *time* from above, and the *rate* from below. (Delivery does not
loosen it: a reader at rate b who starts at t_first and is never starved finishes exactly at
t_next; one who is starved by slow delivery finishes later, so it would need a higher rate.) The
slack in b is the user's thinking and typing time, which only makes the real rate higher; b is
tight for a turn sent right after reading. Hence the estimate is a high order statistic of recent
bounds, not a mean: the second largest of the last `window` bounds (the largest while there are
fewer than three), so that one turn sent without reading (a "regenerate" click, a quick "go on")
does not set it. Gaps over `max_gap` (the user went away) and replies shorter than
`min_reply_tokens` (where thinking time swamps reading time) give no bound. The estimate is
clamped to [min_rate, max_rate] and used only for requests that state no rate (daemon/api/rates.py).

Keys. A request with the OpenAI `user` field is matched with that user's last reply. Without it,
a chat request is matched by its conversation: its key is a digest of its messages before the
last one, and a finished reply is filed under the digest of its prompt's messages plus the
assistant message it produced, so turn k+1 (turn k's messages, the reply, a new user message)
finds turn k. Content is normalised (Unicode NFC, whitespace runs collapsed, ends stripped) and
`name` left out, so a client that re-sends the reply with its spacing tidied still matches.
Estimates are kept per user, or per conversation (keyed by its first request) when there is none,
and every key is scoped to the caller's API key. Both tables are LRUs bounded by `capacity`;
pending replies expire after `max_gap`, estimates `ttl` after their last update.
"""
from __future__ import annotations

import hashlib
import unicodedata
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Generic, Iterable, TypeVar

V = TypeVar("V")


class ExpiringLRU(Generic[V]):
    """At most `capacity` entries; an entry not written for `ttl` seconds is gone. The clock is
    the caller's `now`, so tests run on synthetic time."""

    def __init__(self, capacity: int, ttl: float) -> None:
        if capacity < 1 or not ttl > 0:
            raise ValueError("an ExpiringLRU needs capacity >= 1 and ttl > 0")
        self.capacity = capacity
        self.ttl = ttl
        self._items: OrderedDict[str, tuple[float, V]] = OrderedDict()  # oldest write first

    def __len__(self) -> int:
        return len(self._items)

    def put(self, key: str, value: V, now: float) -> None:
        self._items[key] = (now, value)
        self._items.move_to_end(key)
        self._expire(now)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, key: str, now: float) -> V | None:
        item = self._items.get(key)
        if item is None or now - item[0] > self.ttl:
            return None
        return item[1]

    def pop(self, key: str, now: float) -> V | None:
        item = self._items.pop(key, None)
        if item is None or now - item[0] > self.ttl:
            return None
        return item[1]

    def _expire(self, now: float) -> None:
        items = self._items
        while items:
            written, _ = next(iter(items.values()))
            if now - written <= self.ttl:
                return
            items.popitem(last=False)


def normalise(text: str) -> str:
    return unicodedata.normalize("NFC", " ".join(text.split()))


def _feed(h, role: str, content: str) -> None:
    data = normalise(content).encode()
    h.update(b"%s %d:" % (role.encode(), len(data)))
    h.update(data)


@dataclass
class ConversationKeys:
    """The keys of one chat request: `follows` finds the reply it continues, `own` names a new
    conversation, and `reply(text)` files this request's own reply for the next turn."""

    follows: str | None  # digest of the messages before the last one; None for a first message
    own: str
    _hash: "hashlib._Hash" = field(repr=False)

    @classmethod
    def of(cls, scope: str, messages: Iterable[tuple[str, str]]) -> "ConversationKeys":
        """`messages`: (role, text) pairs in order; `scope` (the caller) keeps callers apart."""
        msgs = list(messages)
        h = hashlib.sha256(scope.encode() + b"\0")
        for role, text in msgs[:-1]:
            _feed(h, role, text)
        follows = "conv:" + h.hexdigest() if len(msgs) > 1 else None
        for role, text in msgs[-1:]:
            _feed(h, role, text)
        return cls(follows, "conv:" + h.hexdigest(), h)

    def reply(self, text: str) -> str:
        h = self._hash.copy()
        _feed(h, "assistant", text)
        return "conv:" + h.hexdigest()


@dataclass(slots=True)
class _Turn:
    owner: str
    t_first: float
    t_end: float
    num_tokens: int
    used: bool = False  # filed under two keys (conversation, user): counted once


@dataclass(frozen=True, slots=True)
class Lookup:
    owner: str  # whose estimate this request reads and, once it ends, feeds
    reading_rate: float | None  # the learned rate; None: nothing learned yet


class CadenceEstimator:
    def __init__(self, capacity: int = 10_000, ttl: float = 3600.0, max_gap: float = 600.0,
                 min_reply_tokens: int = 16, window: int = 8, min_rate: float = 1.0,
                 max_rate: float = 100.0) -> None:
        if not 0 < min_rate <= max_rate or min_reply_tokens < 1 or window < 1:
            raise ValueError("CadenceEstimator needs 0 < min_rate <= max_rate, min_reply_tokens >= 1, window >= 1")
        self.max_gap = max_gap
        self.min_reply_tokens = min_reply_tokens
        self.window = window
        self.min_rate, self.max_rate = min_rate, max_rate
        self._pending: ExpiringLRU[_Turn] = ExpiringLRU(capacity, max_gap)  # finished replies awaiting a next turn
        self._bounds: ExpiringLRU[deque[float]] = ExpiringLRU(capacity, ttl)  # owner -> recent bounds

    def on_request(self, now: float, user: str | None = None, keys: ConversationKeys | None = None) -> Lookup:
        """A request arrives at `now`: fold in the bound from the reply it follows, if any, and
        return its owner's estimate. `user` is already scoped to the caller."""
        turn = None
        if keys is not None and keys.follows is not None:
            turn = self._pending.pop(keys.follows, now)
        if (turn is None or turn.used) and user is not None:
            turn = self._pending.pop(user, now)
        if turn is not None and turn.used:
            turn = None
        owner = user if user is not None else turn.owner if turn is not None else keys.own if keys else None
        if owner is None:
            raise ValueError("a cadence lookup needs a user or conversation keys")
        if turn is not None:
            turn.used = True
            bound = self.bound(turn, now)
            if bound is not None:
                bounds = self._bounds.get(owner, now) or deque(maxlen=self.window)
                bounds.append(bound)
                self._bounds.put(owner, bounds, now)
        return Lookup(owner, self.estimate(owner, now))

    def on_reply(self, owner: str, t_first: float, t_end: float, num_tokens: int, *, user: str | None = None,
                 reply_key: str | None = None) -> None:
        """A reply of `num_tokens` tokens was handed to the client from `t_first` to `t_end`."""
        turn = _Turn(owner, t_first, t_end, num_tokens)
        for key in (reply_key, user):
            if key is not None:
                self._pending.put(key, turn, t_end)

    def bound(self, turn: _Turn, t_next: float) -> float | None:
        """b = L / (t_next − t_first), or None when the turn says nothing about reading."""
        if turn.num_tokens < self.min_reply_tokens or not turn.t_first <= turn.t_end < t_next:
            return None  # too short, or a request sent before the reply ended (not a reply to it)
        if t_next - turn.t_end > self.max_gap:
            return None  # the user went away
        return turn.num_tokens / (t_next - turn.t_first)

    def estimate(self, owner: str, now: float) -> float | None:
        bounds = self._bounds.get(owner, now)
        if not bounds:
            return None
        ranked = sorted(bounds)
        rate = ranked[-2] if len(ranked) >= 3 else ranked[-1]
        return min(max(rate, self.min_rate), self.max_rate)
