"""When a queued request pins the prefix it reads where the pool holds it (pool/engine_hooks.py, and
the node simulator's engines alike).

A pin keeps the holder from evicting those pages. A request that pins them as it arrives and then
waits holds its peers' memory for as long as it waits, and in overload it waits long: with short KV
(the node simulator, a quarter of an A100's KV an engine, 16 documents of 6K tokens, 16 req/s) an
engine's memory was at times mostly pages pinned by requests queued on its peers (1,312 of 1,774
pages in one probe), its own queue could not be admitted, and the stuck engines gave 33-171 of 300
requests' pins back (`_unblock`), each then computing its whole prompt. Pinned near the front: 4-27.

So a request pins once it is near the front of its engine's queue: among its first PIN_AHEAD, or
while the prompts queued up to it would fit in the pages the engine can give now (an engine with
room pins a whole burst as it comes, since its next step may admit all of it). Until then its reads
wait with it (the router's runs), and what their holders evict meanwhile it computes. It is not
admitted before it has pinned them (Scheduler.held): one the step would admit past the window waits
a step (Scheduler.held_back), and the next step's pins reach it. (They reached only the window
before: the buffer-aware policy admits out of queue order, and a request it picked past the window
stopped its engine's admissions until the queue ahead of it drained. Node simulator, a quarter of
the A100's KV, 16 documents of 12K tokens, 32 questions each, 13.45 req/s, seed 2, the pool placed
as routing places and reading nothing: 0.78 of requests met the TTFT SLO, 0.975 now, routing 0.963.)
Until pinned it counts its whole prompt, so where --max-queue-delay predicts its TTFT
(engine/admission.py) the prediction counts the tokens it will read as ones to compute.

Near the front is not yet admitted: the buffer-aware policy can leave the head of a queue waiting
for seconds. A request whose front found nothing of its prefix anywhere when it neared the front
(the first request over its document still computing it) asks again when its engine's policy
picks it, and every ASK_EVERY until then (`asks_again`, `later`): by then the first one may have
finished. It was answered empty and computed its whole prompt, though admitted after the
document was computed: node simulator, the H200 preset, 64 documents at routing's highest rate
under the TTFT SLO, segments written into their homes, 121 such readers, hit rate 0.61 against
routing's 0.75; asking again when picked, 0.78, and requests within the SLO 0.57 -> 0.97. It asks
every ASK_EVERY as well because a request its policy cannot admit with its whole prompt (it fits
only once it reads its prefix) is never picked before it has found that prefix: a quarter of the
A100's KV, 16 documents of 12K tokens, seed 1, such requests waited 9-11 s.

A request told as it came that an earlier request is computing the rest of its prefix
(AddRequest.pending: from its first page, or, come mid-prompt, from the first page not computed
yet; it pins nothing as it comes) and told so again as it asks (Reads.pending: that request has
not had its first token yet) keeps waiting, out of its policy's view (`ToldPending`,
Scheduler.waiting_on), until the one computing it is done (its pages are then where the index
says) or gone, or PENDING_SECONDS pass (daemon/router.py): the front then tells it where its
prefix is unasked (Front.done), and it asks again ASK_EVERY after each answer in case that word is
lost. In the view, the policy picked it and gave it the step's budget, and the engine ran nothing:
node simulator, the A100's whole KV, 16 documents at 8 req/s, seed 0, an engine whose head waited
so ran nothing for 0.5 s, the requests behind it gave their pins back (`_unblock`) and computed
their 18-32K-token documents again, and decoded over those copies (that engine's own steps read
1.7x the KV of any other engine's). Out of the view: 546 -> 637 tokens/s with segments written into their homes,
hit rate 0.754 -> 0.831, access CV 0.218 -> 0.044. Asking twice and then computing, an idle engine's request
computed a whole document again that its peer finished a moment later: node simulator, 8K tokens
computed in one step, first token 1.029 s where waiting gave 0.824 s. Come mid-prompt, it read the
part computed and computed the rest (a quarter of the A100's KV, the four document workloads in
overload, seeds 0-3: see the README's pool table).
"""
from __future__ import annotations

from typing import Callable, Container, Iterable, Mapping, Protocol, Sequence

# Only the head pins regardless of room. A queued request's pins hold pages on its holders (its own
# engine or peers) that are in no running request's table there: neither free nor held, so each
# holder's buffer-aware policy counts that much less capacity and preempts. Node simulator, a
# quarter of the A100's KV, four document workloads, tokenflow: pinning among the first 4, at
# routing's highest rates under TokenLake's TTFT SLO, pool-local preempted 125 times to routing's 52
# (active=16, seed 1) and met the SLO for 0.72-0.89 of requests where routing met it for 0.94-0.98
# (four runs); only the head, 0.92-0.99. In overload (16 req/s, seeds 0-3, 16 runs) its throughput
# went from 1.20x routing's (0.93x-1.64x) to 1.33x (1.00x-1.63x), its hit rate from 1.47x to 1.64x
# (bench/results/node_contexts_small_cache_pin1.json). (Before tokenflow's admission counted shared
# pages once and the holder's answers were costed as its attention: 0.82x, 0.83x, 0.82x and 0.76x
# routing's throughput pinning among the first 2, 4, 8 and 16.) Since a pass no longer displaces
# running requests for a new one it cannot make room for, still only the head: in overload, the
# four document workloads × seeds 0-3, 1.61x / 1.59x routing's throughput (query / read mode)
# against 1.46x / 1.52x among the first 4 (node_contexts_small_cache_displace.json, _pin4.json).
PIN_AHEAD = 1

# s between the asks of a request whose prefix another request is computing (Reads.pending). Its
# front tells it once that request is done, so this is only for a word that never comes: the
# request computing it on another front's router, or the record gone meanwhile.
ASK_EVERY = 0.5


class Queued(Protocol):
    request_id: str
    num_tokens: int  # its tokens to hold on its engine (prompt, or what is left of it, and output)


class ToldPending:
    """Scheduler.waiting_on of a pool engine: its queued requests told that the request computing
    their prefix has not finished (Reads.pending) and not answered otherwise since, the ones
    `again_at` holds and `later` does not (answered empty, a request asks again when its policy
    picks it: that one stays in the policy's view)."""

    __slots__ = ("again_at", "later")

    def __init__(self, again_at: Mapping[str, float], later: Container[str]) -> None:
        self.again_at, self.later = again_at, later

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.again_at and request_id not in self.later

    def __bool__(self) -> bool:
        return bool(self.again_at)


def pins_now(position: int, pages_to_here: int, free_pages: int) -> bool:
    """Whether the request at `position` of its engine's queue (0: the head) pins its reads now;
    `pages_to_here`: the pages of the queued requests up to it and its own."""
    return position < PIN_AHEAD or pages_to_here <= free_pages


def pages_of(req: Queued, page_size: int) -> int:
    return -(-req.num_tokens // page_size)


def pins_on_arrival(waiting: Sequence[Queued], req: Queued, free_pages: int, page_size: int,
                    pending: bool = False) -> bool:
    """Whether `req`, joining the end of `waiting`, pins its reads as it comes: not where the rest of
    its prefix is being computed (`pending`): it came mid-prompt, and pins all of it once computed."""
    pages = sum(pages_of(r, page_size) for r in waiting) + pages_of(req, page_size)
    return not pending and pins_now(len(waiting), pages, free_pages)


def waits(waiting: Sequence[Queued], req: Queued, free_pages: int, page_size: int, pending: bool = False) -> bool:
    """Whether `req`, joining the end of `waiting`, waits for its turn (others are queued ahead of it,
    or its pages do not fit those free) rather than going in at the next step, or waits for what it
    does not read to be computed (`pending`: an earlier request is computing it, router.py
    PENDING_SECONDS). One that found nothing to read as it came asks again when it is due: by then
    a request ahead of it may have computed its prefix. One that goes straight in does not hold its
    step for the answer; one whose prefix is being computed does, or it computes it all again (the
    engine computing it writes it into its homes and lets go of its own copy once done)."""
    return bool(waiting) or pages_of(req, page_size) > free_pages or pending


def asks_again(found: bool, wanted: bool, holds: Callable[[], bool]) -> bool:
    """Whether a queued request, told where its prefix is now, waits to ask again when its engine's
    policy picks it or ASK_EVERY later: its front `found` nothing anywhere, the policy has not
    picked it yet (`wanted`), and its engine's own cache has none of it (`holds`, asked last, as it
    walks the cache's tiers: the admission reads what it holds there anyway)."""
    return not (found or wanted or holds())


def due(waiting: Iterable[Queued], deferred: Container[str], free_pages: int, page_size: int,
        wanted: Container[str] = (), later: Container[str] = (), again_at: Mapping[str, float] | None = None,
        now: float = 0.0) -> list:
    """The requests of `waiting` (in queue order) whose reads wait in `deferred` and that ask where
    they are now: near the front, or `wanted`, the scheduler's last plan would have admitted them
    (Scheduler.held_back: its policy takes requests out of queue order, and one it picks is due
    whatever its place). One to ask again at `again_at` (s, on the clock of `now`) is not due before:
    one of `later` (answered empty: `asks_again`) is due before only when wanted; one told its prefix
    is being computed (Reads.pending) not even then."""
    again_at = again_at or {}
    out, pages, near = [], 0, True
    for position, req in enumerate(waiting):
        pages += pages_of(req, page_size)
        near = near and pins_now(position, pages, free_pages)
        if not near and not wanted:
            break
        rid = req.request_id
        if rid not in deferred:
            continue
        in_time = again_at.get(rid, now) <= now  # (none set: now)
        if rid in later:  # answered empty: wanted, it asks at once
            asks = rid in wanted or (near and in_time)
        else:  # told pending (or never asked): not before its time, wanted or not
            asks = (near or rid in wanted) and in_time
        if asks:
            out.append(req)
    return out
