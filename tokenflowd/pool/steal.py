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

A request stays where most of its prompt is held that the idle engine does not hold (`stays`):
moved, it would read that part where it is all the same, its holder answering for it at every step
(a decode step's attention over the pages, per request), so the busy engine would be spared little
but the rest of the prompt, and the idle one would add a round trip per layer to each of its steps.
Where the KV is short (a quarter of the A100's, 12K-token documents, two to an engine), moving
those requests kept their holders busy and their queues long: under TokenLake's TTFT SLO, at
routing's highest rate (four document workloads, seeds 0 and 2), pool-local met the SLO in 5 of 8
runs moving them and 8 of 8 keeping them (router.AFFINITY_SLACK 16; 8 of 8 without stealing at
all). A request over a system prompt that every engine holds still moves.

Kept in the queue instead, a request whose prefix a request ahead of it on the same engine was still
computing (it would read that there) measured 1.20x against 1.23x (pool-local, the simulator's rng
seeded 0 in both): dropped.
"""
from __future__ import annotations

from typing import Callable, Container, Mapping, Protocol, Sequence, TypeVar

# of an engine's KV pages, the part free (or cached) for it to count as idle: a request it takes
# needs room for its prompt
IDLE_FREE = 0.25
# a queued request of which at least this share of the prompt is held where it is and not on the idle
# engine stays where it is (`stays`)
STAY_SHARE = 0.5
# of a busy engine's queued requests, the last this many are weighed for staying (the engine gives up
# the last of its queue; each one's page keys are hashed once)
STAY_SCAN = 32
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


def stays(held_here: int, held_there: int, prompt_tokens: int, page_size: int) -> bool:
    """Whether a queued request stays on the busy engine: of its prompt's leading pages, the busy
    engine holds `held_here` and the idle one `held_there`; moved, it would read the difference
    where it is (at least STAY_SHARE of its prompt: it stays)."""
    return (held_here - held_there) * page_size >= STAY_SHARE * prompt_tokens


class Holdings(Protocol):
    """Where the node's pages are, as the router's index knows it (daemon/prefix_index.py)."""

    def cached_pages(self, engine_id: int, keys: Sequence[bytes]) -> int: ...


class Fresh(Protocol):
    request_id: str
    num_prompt_tokens: int


F = TypeVar("F", bound=Fresh)


def staying(fresh: Sequence[F], keys_of: Callable[[F], Sequence[bytes]], index: Holdings, giver: int, thief: int,
            page_size: int) -> list[str]:
    """Of the last STAY_SCAN of `fresh` (requests queued on `giver` that have started nothing, in
    queue order), the ids of those that stay there rather than go to `thief` (`stays`, by the pages
    `index` says each engine holds of the prompt). `keys_of`: a request's prompt page keys (the
    caller keeps them: each prompt is hashed once). The front's (Front._staying) and the node
    simulator's."""
    out = []
    for req in fresh[-STAY_SCAN:]:
        keys = keys_of(req)
        if stays(index.cached_pages(giver, keys), index.cached_pages(thief, keys), req.num_prompt_tokens, page_size):
            out.append(req.request_id)
    return out


def withdrawable(waiting: Sequence[Q], keep: Container[str] = ()) -> Q | None:
    """The request a busy engine gives up, from `waiting` in queue order: the last that has started
    nothing (no token computed or produced, never preempted, no reads pinned) and is not in `keep`."""
    for req in reversed(waiting):
        if not (req.num_computed_tokens or req.num_output_tokens or req.num_preemptions or req.foreign_token_ids
                or req.request_id in keep):
            return req
    return None
