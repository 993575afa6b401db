"""Early rejection under overload (Mooncake §7): refuse a request before any prefill is spent on it
when the decode pool will be too loaded to serve it.

Judged on the *current* decode load, early rejection oscillates: the conductor accepts while the
decode nodes are idle, the prefill nodes fill, their requests reach decode a prefill later, the
decode load peaks, the conductor rejects, the prefill nodes empty, decode drains, and the cycle
starts again (§7.3, Figure 10a). Judged on the decode load *predicted* for when the request would
reach decode, it does not (§7.4, system level): every decode is taken to last a uniform time T_d
(the mean of the recent ones), so at a future time t the decode pool holds

    the decodes running now that will not have ended by t      (started after t − T_d)
  + the accepted requests whose prefill ends by t and whose decode will not have ended by t
  + the requests not yet arrived that will be decoding at t   (the recent rate of decode starts
                                                                × the time from the earliest a
                                                                request arriving now could reach
                                                                decode to t, at most T_d)

and a request is accepted if that count, itself included, stays within the pool's capacity.

The third term is not in the paper's description. Without it the count falls the further t lies
ahead, as running decodes end and nobody replaces them, so the gate takes most readily the requests
whose decode starts latest (long prompts, long prefill queues) and refuses those that would reach
decode soon. In the cluster simulator that bias cost more than the oscillation it removes: it shed
more than the current load's gate at nearly every overload tried (`tokenflowd sim-cluster`, gate
`uniform`; bench/results/cluster_sim_*.json). The earliest
a new request could reach decode is now plus the shortest prefill queue: when every prefill queue
is long, nobody arriving later overtakes this request, and the term is ~0.

`DecodeLoad` keeps those times; `EarlyRejection` decides with it: by this prediction, by the
paper's (`uniform`, without the third term), by the survival estimate, or by the current load.
"""
from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field


@dataclass
class DecodeLoad:
    """The decode pool's requests as the conductor sees them, and the uniform decode time."""

    capacity: int  # requests the decode pool serves within its TBT SLO
    decode_seconds: float  # T_d until finished decodes say otherwise
    window: int = 256  # finished decodes T_d is the mean of
    _decoding: dict[str, float] = field(default_factory=dict)  # request -> when its decode started
    _pending: dict[str, float] = field(default_factory=dict)  # request -> when its decode is predicted to start
    _durations: deque = field(default_factory=deque)
    _starts: deque = field(default_factory=deque)  # when recent decodes started, in order

    def accepted(self, request_id: str, decode_start: float) -> None:
        """Accepted: its prefill is predicted to end (its decode to start) at `decode_start`."""
        self._pending[request_id] = decode_start

    def pending_start(self, request_id: str) -> float | None:
        """When its decode was predicted to start (None: not pending)."""
        return self._pending.get(request_id)

    def started(self, request_id: str, now: float) -> None:
        """Its decode started at `now` (which may be a past moment: a whole response's predicted start)."""
        self._pending.pop(request_id, None)
        self._decoding[request_id] = now
        bisect.insort(self._starts, now)
        while self._starts and (self._starts[0] < now - 4 * self.decode_seconds or len(self._starts) > 100_000):
            self._starts.popleft()

    def finished(self, request_id: str, now: float) -> None:
        """Its decode ended (or it failed or was aborted anywhere on its way)."""
        self._pending.pop(request_id, None)
        start = self._decoding.pop(request_id, None)
        if start is not None:
            self._durations.append(now - start)
            if len(self._durations) > self.window:
                self._durations.popleft()
            self.decode_seconds = sum(self._durations) / len(self._durations)

    def current(self) -> int:
        return len(self._decoding)

    def inflow(self, now: float) -> float:
        """Decodes started per second over the last T_d."""
        td = self.decode_seconds
        return (len(self._starts) - bisect.bisect_right(self._starts, now - td)) / td

    def arriving(self, t: float, now: float, earliest: float) -> float:
        """Requests not yet arrived that are decoding at t: none reaches decode before `earliest`,
        and one that reached it before t − T_d has ended by t."""
        return self.inflow(now) * min(self.decode_seconds, max(0.0, t - earliest))

    def expected(self, t: float, now: float) -> float:
        """Requests the decode pool holds at time t ≥ now, in expectation over the recent decode
        times (their survival function S): a running one of age a is still running with probability
        S(a + t − now) / S(a); an accepted one whose decode starts at s ≤ t, with S(t − s). Until
        `min_samples` decodes have finished, the uniform time's count."""
        if len(self._durations) < 16:
            return float(self.predicted(t, now))
        ordered = sorted(self._durations)
        n = len(ordered)

        def survival(x: float) -> float:  # share of recent decodes that lasted longer than x
            return (n - bisect.bisect_right(ordered, x)) / n

        total = 0.0
        for start in self._decoding.values():
            age = now - start
            alive = survival(age)
            total += survival(age + t - now) / alive if alive > 0 else 0.5
        for start in self._pending.values():
            if start <= t:
                total += survival(t - start)
        return total

    def predicted(self, t: float, now: float) -> int:
        """Requests the decode pool holds at time t ≥ now, every decode lasting decode_seconds (§7.4):
        the running ones whose T_d has not elapsed by t, plus the accepted ones whose prefill has
        ended by t and whose T_d has not. NOTE: a running decode already older than T_d counts as
        ended, as in the paper; the survival estimate (`expected`) is the variant that does not."""
        td = self.decode_seconds
        running = sum(start + td > t for start in self._decoding.values())
        coming = sum(start <= t < start + td for start in self._pending.values())
        return running + coming


GATES = ("current", "predicted", "uniform", "survival")


@dataclass
class EarlyRejection:
    load: DecodeLoad
    # "predicted": the uniform-T_d prediction with the requests still to arrive (the module's
    # docstring); "uniform": the paper's, without them; "survival": the survival estimate with them;
    # "current": the decode load now (§7.2, for comparison)
    predict: str = "predicted"

    def __post_init__(self) -> None:
        if self.predict not in GATES:
            raise ValueError(f"predict must be one of {', '.join(GATES)}, got {self.predict!r}")

    def admit(self, now: float, decode_start: float, earliest: float | None = None) -> bool:
        """Whether a request whose decode would start at `decode_start` (now + its predicted TTFT)
        is taken: the decode pool, this request included, within its capacity then (or now).
        `earliest`: the soonest a request arriving now could reach decode (now + the shortest
        prefill queue; now if unknown)."""
        load, t = self.load, decode_start
        later = load.arriving(t, now, now if earliest is None else earliest)
        if self.predict == "current":
            n = load.current()
        elif self.predict == "uniform":
            n = load.predicted(t, now)
        elif self.predict == "survival":
            n = load.expected(t, now) + later
        else:
            n = load.predicted(t, now) + later
        return n + 1 <= load.capacity
