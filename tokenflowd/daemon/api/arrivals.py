"""Requests that reach the front in one turn of its event loop are placed together.

With the node's pool on, the router's `dispatch` matches a group of arrivals to engines at once
(minimum-cost bipartite matching, router.py); one request at a time, each would see the loads as
they were before the others of its burst. `Arrivals.add` queues a request and returns a future;
the group is handed to `place` when the loop gets to it (`call_soon`: every handler the loop
already runs this turn has added its request by then), so no request waits on a timer."""
from __future__ import annotations

import asyncio
import copy
from typing import Callable, Generic, Sequence, TypeVar

A = TypeVar("A")
C = TypeVar("C")


class Arrivals(Generic[A, C]):
    def __init__(self, place: Callable[[Sequence[A]], Sequence[C]]) -> None:
        self.place = place
        self._pending: list[tuple[A, asyncio.Future[C]]] = []
        self.num_groups = 0
        self.largest_group = 0

    def add(self, arrival: A) -> asyncio.Future[C]:
        loop = asyncio.get_running_loop()
        if not self._pending:
            loop.call_soon(self._flush)
        future: asyncio.Future[C] = loop.create_future()
        self._pending.append((arrival, future))
        return future

    def _flush(self) -> None:
        group, self._pending = self._pending, []
        live = [(a, f) for a, f in group if not f.cancelled()]  # (a client gone while it waited)
        if not live:
            return
        self.num_groups += 1
        self.largest_group = max(self.largest_group, len(live))
        try:
            choices = self.place([a for a, _ in live])
        except Exception as e:  # every request of the group gets the error (an APIError: its status)
            for _, f in live:
                f.set_exception(copy.copy(e))  # one each: a shared one would gather every traceback
            return
        for (_, f), choice in zip(live, choices):
            f.set_result(choice)
