"""TCP's own congestion signal on a node's egress: the share of its TCP segments the kernel had to
send again (RetransSegs over OutSegs in /proc/net/snmp, for the node's network namespace) over the
last WINDOW s. A link that drops or overflows its queue (a policer, a full switch port) shows here
while transfers still run, before their achieved bandwidth has fallen far: the conductor raises
PrfaaS's t while a remote prefill node's share is above `prfaas_retransmit_share`
(federation/conductor/remote_prefill.py).

The counters are the namespace's, every TCP connection included; on a prefill node nearly all the
bytes it sends are KV. Where there is no /proc/net/snmp (not Linux) the share is None: not
measured, never a guess.
"""
from __future__ import annotations

import collections
import time
from typing import Callable


def read_snmp(path: str = "/proc/net/snmp") -> tuple[int, int] | None:
    """(RetransSegs, OutSegs) of the Tcp lines, or None where they cannot be read."""
    try:
        with open(path) as f:
            rows = [line.split() for line in f if line.startswith("Tcp:")]
        names, values = rows[0], rows[1]
        row = dict(zip(names[1:], values[1:]))
        return int(row["RetransSegs"]), int(row["OutSegs"])
    except (OSError, IndexError, KeyError, ValueError):
        return None


class Retransmits:
    WINDOW = 5.0  # s
    MIN_SEGMENTS = 1000  # fewer sent in the window (an idle node's polls): too few to judge, None

    def __init__(self, read: Callable[[], tuple[int, int] | None] = read_snmp,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._read, self._clock = read, clock
        self._samples: collections.deque[tuple[float, int, int]] = collections.deque()

    def share(self) -> float | None:
        """Segments sent again over segments sent, since the newest sample at least WINDOW s old
        (since the first, until there is one); None where the counters cannot be read, or where
        fewer than MIN_SEGMENTS were sent (a retransmitted tail of an idle node's few would read
        as congestion)."""
        counters = self._read()
        if counters is None:
            return None
        now = self._clock()
        self._samples.append((now, *counters))
        while len(self._samples) > 1 and self._samples[1][0] <= now - self.WINDOW:
            self._samples.popleft()
        _, retrans0, out0 = self._samples[0]
        sent = counters[1] - out0
        return (counters[0] - retrans0) / sent if sent >= self.MIN_SEGMENTS else None
