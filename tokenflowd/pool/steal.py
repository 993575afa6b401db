"""When an idle engine takes a queued request from a busy one (the front's side: daemon/api/front.py;
the engine's: pool/engine_hooks.py; the node simulator's engines alike).

With the pool, where a request runs no longer decides what it reads: its reads are named where the
pool holds its prefix when it nears the front of its queue (pool/ahead.py), wherever it queues. So a
request can move. The router places each one as it arrives, by the load it sees then, and in
overload an engine's queue grows long while a peer empties (prompts of 300 to 20K tokens take very
different times). An engine with nothing queued, a seat free and room in its KV is idle: the
engine with the longest queue gives up the last of its queued requests that has started nothing, and
the idle one takes it, its reads named for where it now runs.

A request that has started (computed a token, been preempted, pinned its reads) stays: moving it
would drop work or pins. The last of the queue goes, as it would wait longest.

The node simulator (a quarter of the A100's KV, four document workloads in overload, seeds 0-3,
tokenflow; bench/results/node_contexts_small_cache_steal.json): throughput over routing's, geometric
mean of 16 runs, 1.06x without stealing and 1.20x with where new segments stay where computed (13 of
16 runs at least routing's), 0.97x and 1.16x where they are written into their homes (6 and 13 of
16); the largest busy-time CV 0.22 → 0.17 and 0.31 → 0.25. Light load: unchanged (1.00x).

Kept in the queue instead, a request whose prefix a request ahead of it on the same engine was still
computing (it would read that there) measured 1.20x against 1.23x (pool-local, the simulator's rng
seeded 0 in both): dropped.
"""
from __future__ import annotations

from typing import Container, Mapping, Protocol, Sequence, TypeVar

# of an engine's KV pages, the part free (or cached) for it to count as idle: a request it takes
# needs room for its prompt
IDLE_FREE = 0.25
# an engine gives up a request only when this many wait in its queue (the one at the head will run
# next there anyway)
MIN_QUEUE = 2


class Queued(Protocol):
    request_id: str
    num_computed_tokens: int
    num_output_tokens: int
    num_preemptions: int
    foreign_token_ids: list[int]  # the prompt's leading tokens it reads where the pool holds them (pinned)


Q = TypeVar("Q", bound=Queued)


def idle(num_waiting: int, num_running: int, max_num_seqs: int, free_pages: int, num_pages: int) -> bool:
    """Whether an engine takes a request from a busy peer: nothing queued, a seat and room free."""
    return num_waiting == 0 and num_running < max_num_seqs and free_pages >= IDLE_FREE * num_pages


def victim(queues: Mapping[int, int], thief: int) -> int | None:
    """Of the engines' queue lengths, the engine that gives `thief` a request: the longest queue
    of at least MIN_QUEUE (the lowest id among equals), or None."""
    best = max((n, -e) for e, n in queues.items() if e != thief) if len(queues) > 1 else None
    return -best[1] if best is not None and best[0] >= MIN_QUEUE else None


def withdrawable(waiting: Sequence[Q], keep: Container[str] = ()) -> Q | None:
    """The request a busy engine gives up, from `waiting` in queue order: the last that has started
    nothing (no token computed or produced, never preempted, no reads pinned) and is not in `keep`."""
    for req in reversed(waiting):
        if not (req.num_computed_tokens or req.num_output_tokens or req.num_preemptions or req.foreign_token_ids
                or req.request_id in keep):
            return req
    return None
