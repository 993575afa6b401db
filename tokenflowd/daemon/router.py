"""Picks the engine for a request: the longest prefix-cache match, unless that engine is
much busier than the least busy one.

Each engine reports the keys of the full pages its prefix cache holds (published and evicted
keys ride on its step messages, kept in prefix_index.py); the router computes the request's
chained page keys the same way the engine does and counts how many leading pages an engine has. Load is the number of
requests an engine holds (running + waiting, and those sent but not yet seen in its stats).

    score(e) = cached_prompt_tokens(e) − load_weight · page_size · load(e)

A cached page saves its prefill; a request ahead in the queue costs about a page of waiting at
load_weight 1, so the router gives up a match only for a clearly busier engine. But a prefix that
more than one engine's share of the requests begins with (1/N of them, counts halving every
LEAD_HALF_LIFE seconds: a system prompt every chat reads) cannot be served from one engine of a
balanced node: for such a request an engine holding none takes it from the one the score picks once
that one holds IDLE_SPILL requests. By the score alone a system prompt of 2K tokens (128 pages)
kept every request on its holder until it held 128 more than the idle engine; the idle engine,
once it has computed the prefix, holds it too and shares its requests by load from then on. A
document among several, each under 1/N of the requests, stays with its holder: an idle engine
would compute it again, evict what it holds, and get requests of its own soon enough.

With the node's pool on (`--pool-mode query|read`, pool/), where a prefix lives no longer has to
decide where a request runs: any engine reads any engine's pages. `pick_pooled` takes the engine
with the least work (the prompt tokens its requests hold). Where segments stay where they are computed
(`--pool-placement local`, the default), a request kept where its prefix is reads it without a
round trip per layer and without its holder's attention for it, so there the engine holding most
of the prefix wins among those whose work is within AFFINITY_SLACK times this prompt of the least.
With placement at homes, segments are spread by hash: the leading pages an engine holds say little
of what it holds of the prompt, and preferring them piles requests on the first segment's home.
There ties go to the fewer requests, then to the engine holding the fewest of the prompt's
segments (the request's own reads, its tail and outputs, fall where its prefix's fall least), then
round the engines in turn (`_least`). Then it names, for the prompt's
longest prefix held anywhere, which
engine each segment is read from: the chosen engine's own where
it has it, else the less loaded of two random holders (power of two choices) among those the
request asks anyway (the only holders of its other segments, those picked before), else among all
(`_runs`); a segment no engine holds whole is read in parts where they are
(a request that read its leading pages on a peer and computed the rest holds the rest only), and
nothing past a page no engine holds. A hot segment (a heavy hitter, pool/heat.py) that the chosen
engine reads elsewhere is copied into it, once (`Choice.copies`, AddRequest.copy; PoolMember.copy_in:
the pages' KV, not their computation, into unused pages, while its replicas hold at most 1/N of its
pages: pool/heat.py replica_pages), and read there from then on: a system prompt every request
reads is then read on every engine, not answered by its holder for every engine's every step
(TokenLake §4.3 replicates heavy hitters the same way; `--no-pool-copy` keeps them where they are).

A request queued behind others has its reads named again as it nears the front of its engine's
queue (`reads`, asked by the engine: protocol.ResolveReads): from where the pool holds its prefix
then, which in a burst over a document is where the first request over it computed it meanwhile,
with the hot segments among them its engine copies in (a burst behind one system prompt came
before anything held it, so no copy was named as it came).
With placement at homes, a request whose first page it does not read is one of those an earlier
request was named to compute within PENDING_SECONDS (`Choice.pending`, AddRequest.pending: in a
burst, the first request over a system prompt or a document is computing it; or, come mid-prompt,
its first page not computed yet) waits to ask where its prefix is as it nears the front, even
where its engine would take it at the next step (pool/ahead.py `waits`): the engine computing it
writes it into its homes and lets go of its own copy once it is done, so one taken at once read
nothing there and computed it all again. (Kept where computed, a request behind
the one computing it reads it at its admission all the same; told to wait, a quarter of the A100's
KV, 12 documents at routing's highest rate under the TTFT SLO, seed 3: 832 tokens/s against 891.)
While the request named to compute it is computing it (its engine says so as the step that
begins its prompt starts: protocol.Computing) and has no first token, the one that asks is told
so (`being_computed`, Reads.pending) and keeps waiting, out of its policy's view; the first token (or the
end) of the one computing it tells it where its prefix is then, unasked (`done`, Front.done). An
idle engine's request otherwise computed a document its peer finished a moment later; not while
the one named waits in a queue, for which it would wait longer than computing takes.
An idle engine takes a queued request from a busy one (pool/steal.py): `pick_pooled` with that
engine as the target, its use not counted again, names its reads and homes for where it runs now.

Requests that reach the front together are placed together (`dispatch`, TokenLake §5): the engines
are topped up to an even load, and within that each request goes where it moves the fewest bytes
(its query rows to the other engines holding what it reads, its new segments to their homes), by
minimum-cost bipartite matching; then its reads are named as `pick_pooled` names them.

Placement by home (`--pool-placement home`): each whole segment of the prompt that no engine
holds any page of has a home (the prompt's segments dealt round the node's engines, a group of
one each at a time in the order the group's first key hashes to: pool/homes.py `segment_homes`):
the chosen engine computes it and, where the home is another engine, writes it into the home
once the prompt is computed (`Choice.places`, AddRequest.place; pool/engine_hooks.py
`_hand_off`) and keeps no copy. Segments are spread over the node by hash, never by where a
request happened to run; a copy of a hot one stays where it is made. A hot segment goes to no home
at all: the engine computing it keeps it, as a copy named for it would (a burst behind one system
prompt has every engine's first requests compute it together, hot by the time most are picked;
moved to their homes, its four segments were read there at every step of those requests' decodes
and of every request after them until each engine's copy landed. The node simulator, the A100
preset, TokenLake's point for the system prompt (1,076 req/s): access CV 0.278 against routing's
0.053 with them moved, 0.083 kept).
"""
from __future__ import annotations

import itertools
import math
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Collection, Protocol, Sequence

import numpy as np

from tokenflowd.daemon.prefix_index import PrefixIndex
from tokenflowd.kv.pages import chain_page_keys
from tokenflowd.pool.dispatch import assign, balanced_slots
from tokenflowd.pool.heat import SegmentHeat
from tokenflowd.pool.homes import segment_homes

# The pool's pick with --pool-placement local: an engine holding more of the prefix is preferred
# while its work is within this many of the prompt's own tokens of the least loaded engine's. Chosen
# by TokenLake's measure, the highest rate at which 90% of requests meet the TTFT SLO
# (bench/node_goodput.py, node simulator, a holder's answers costed as its own attention), with
# queued requests that read their prefix where they are staying there (pool/steal.py `stays`). A
# quarter of the A100's KV (two 12K-token documents an engine), four document workloads, seeds 0
# and 2, at routing's highest rate: pool-local met the SLO in 3 of 8 runs at 2, 8 of 8 at 8 and 16;
# its highest rate over routing's, seeds 0-3, went from 0.84x-1.19x at 2 with those requests
# moved (6 of 16 below) to 1.00x-1.30x (none below), and with the full A100 KV, five workloads,
# from 1.00x-1.19x to 1.00x-1.19x (two workloads up a step). A document's holder answers every remote reader's
# attention over it at each step, unseen by the work this weighs: below 8 the pool sent a
# document's questions away from their holder only to have the holder answer them.
AFFINITY_SLACK = 8.0
# Requests the engine the score picks holds from which an engine holding none takes a request whose
# prefix is widely shared (`pick_keys`). 2 engines on a CPU (AMD EPYC, 2 cores, AVX2), 120 chats
# behind a 1,024-token system prompt at Poisson arrivals (bench/pool_daemon.py --contexts
# system-prompt:scale=0.5 --modes off; pool_daemon_workloads.json): before, one engine held every
# chat in flight at each second sampled (load CV 1.00; mean TTFT 13.0 s, 17.8 tokens/s); now 0.36,
# 1.5 s and 21.3 tokens/s, as the pool's 1.6 s and 21.4. Four shared documents: as before (hit
# rate 0.44, 7.2 tokens/s, mean TTFT 23 s); spilled without the share test: 0.37, 6.0 and 40 s.
# Node simulator, 8 engines, seed 0 (bench/node_contexts.py --modes routing): the system prompt at
# a light load went from 3 engines serving to 8 (A100 1,822 -> 2,558 tokens/s, H200 preset 3,942 ->
# 4,872); of the other 34 runs 30 did not move and 4 by 0.99x-1.00x. (The TTFT estimate Mooncake's
# conductor uses, the prefill queued on an engine plus the prompt's uncached part, sent questions
# away from their documents' holders in overload: a quarter of the A100's KV, 16 documents, 32
# questions each, 951 -> 525 tokens/s.)
IDLE_SPILL = 4
LEAD_HALF_LIFE = 60.0  # s: how fast the share of requests a prefix begins counts forgets
# s a hot segment being copied into an engine is not named for copying there again (the copy is
# made as the engine takes the request, and the engine's next report shows it there)
COPY_SECONDS = 5.0
# s after a request is named to compute a prompt's pages from the first page it does not read, during
# which a request whose first unread page is one of those is told it is being computed (`Choice.pending`:
# it asks where it is as it nears the front). Node simulator, 8 engines, 300 requests, segments
# written into their homes, read mode: a burst behind one 2K-token system prompt (A100, 80 req/s,
# seeds 0-3) hit 0.870-0.893 of its prompt tokens where routing hit 0.887-0.893, and as often as
# routing with it; a quarter of the A100's KV, 16 documents at 16 req/s (seeds 0 and 1), 0.61 -> 0.68
# and 1.45x -> 1.70x routing's throughput (all four document workloads at seeds 0-3: 1.43x, hit rate
# 1.65x routing's: bench/results/node_contexts_small_cache_pending.json). Longer than a prefill of
# the longest prompt takes; a request told so needlessly (the one computing it gone) asks again as
# its policy picks it. A record whose request is computing (`computing`) stays until `done`.
PENDING_SECONDS = 10.0


class EngineLoad(Protocol):
    """An engine as the router weighs it: `load`, the requests it holds; and, where known, `work`,
    the prompt tokens of those requests (the pool picks by it first: a few long prompts fill an
    engine's KV as many short ones do not)."""

    engine_id: int

    @property
    def load(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Arrival:
    prompt_token_ids: Sequence[int]
    max_tokens: int  # the output it may produce: rows it queries with, each step
    request_id: str = ""  # (Router.pick_pooled)


@dataclass(frozen=True, slots=True)
class TrafficCost:
    """What moving a request's data between engines costs, in bytes (the engines' Ready says)."""

    query_row_bytes: int  # a query row shipped and answered, all layers
    kv_token_bytes: int  # a token's KV, all layers


@dataclass(frozen=True, slots=True)
class Choice:
    engine_id: int
    cached_pages: int
    # pool: (engine, keys) runs of the prompt's leading pages to read where they are ([]: none)
    runs: list[tuple[int, list[bytes]]] = field(default_factory=list)
    # pool: (engine, keys) runs of the segments it computes that belong elsewhere (their homes)
    places: list[tuple[int, list[bytes]]] = field(default_factory=list)
    # pool: (engine, keys) runs of hot segments it reads there that the chosen engine copies in
    copies: list[tuple[int, list[bytes]]] = field(default_factory=list)
    # pool: the first page it does not read is one an earlier request is computing (PENDING_SECONDS)
    pending: bool = False


def _work(e: EngineLoad, prompt_tokens: int) -> float:
    """An engine's work: the prompt tokens of the requests it holds (one that does not say: this
    prompt per request it holds)."""
    return getattr(e, "work", e.load * prompt_tokens)


class Router:
    def __init__(self, page_size: int, index: PrefixIndex, load_weight: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, copy_hot: bool = True,
                 ties: random.Random | None = None) -> None:
        """`ties`: `pick` breaks ties between engines of the best score at random with it (else to
        the lower id; bench/node_noise.py weighs what that choice alone moves)."""
        self.page_size = page_size
        self.ties = ties
        self.index = index
        self.load_weight = load_weight
        self.heat = SegmentHeat()  # the pool's: which segments are read most
        self.leads = SegmentHeat(LEAD_HALF_LIFE)  # the first page key of each prompt `pick_keys` saw
        self.picks = SegmentHeat(LEAD_HALF_LIFE)  # those prompts, all under one key (their decayed number)
        self.clock = clock
        self.copy_hot = copy_hot  # hot segments an engine reads elsewhere are copied into it (`_copy`)
        self._copying: dict[tuple[bytes, int], float] = {}  # (hot segment, engine) -> since when it is copied there
        # each page a pooled pick named a request to compute -> that request (`_pending`)
        self._computing: dict[bytes, str] = {}
        # request -> (the pages it was named to compute, when), oldest first (`done`, `_expire`)
        self._named: dict[str, tuple[list[bytes], float]] = {}
        self._awaits: dict[str, str] = {}  # request told pending -> the request it waits for (`being_computed`)
        self._waiters: dict[str, dict[str, None]] = {}  # ... and the other way round, in the order they came
        self._wanted: dict[str, list[bytes]] = {}  # request told pending -> the pages it would compute
        self._running: set[str] = set()  # of `_named`, those whose engine has begun their prompt (`computing`)
        self._anonymous = itertools.count()  # names for the picks no later call names (`_pending`)
        self._node: set[int] = set()  # every engine that has served: new segments are dealt round them (`places`)
        self._turns = itertools.count()  # pooled picks with homes: ties between engines go round (`_least`)

    def pick(self, engines: Sequence[EngineLoad], prompt_token_ids: Sequence[int]) -> Choice:
        """`engines` must be non-empty (the serving ones). Ties go to the lower engine id, or to one
        of them at random with `ties`."""
        if len(engines) == 1:
            return Choice(engines[0].engine_id, 0)
        # The last prompt token is always computed, so only pages before it can be hits.
        return self.pick_keys(engines, self.prompt_keys(prompt_token_ids))

    def pick_keys(self, engines: Sequence[EngineLoad], keys: Sequence[bytes]) -> Choice:
        """`pick` for a request whose chained page keys are known (its cached pages counted even
        with one engine)."""
        scored = [((hit - self.load_weight * e.load) * self.page_size, -e.engine_id, hit)
                  for e in engines for hit in (self.index.cached_pages(e.engine_id, keys) if keys else 0,)]
        best = max(scored)
        if self.ties is not None:
            best = self.ties.choice([c for c in scored if c[0] == best[0]])
        shared = bool(keys) and self._widely_shared(keys[0], len(engines))  # (every prompt counted)
        loads = {e.engine_id: e.load for e in engines}
        if shared and loads[-best[1]] >= IDLE_SPILL and (idle := [c for c in scored if loads[-c[1]] == 0]):
            best = max(idle)  # (an idle engine's score is its hit: the one holding most of the prompt)
        return Choice(-best[1], best[2])

    def _widely_shared(self, lead: bytes, num_engines: int) -> bool:
        """Counts a prompt beginning with page key `lead`; whether more than 1/`num_engines` of the
        prompts lately began with it (the module docstring)."""
        now = self.clock()
        self.leads.hit(lead, now)
        self.picks.hit(b"", now)
        return self.leads.count(lead, now) * num_engines > self.picks.count(b"", now)

    def pick_pooled(self, engines: Sequence[EngineLoad], prompt_token_ids: Sequence[int], segment_pages: int = 1,
                    rng: random.Random | None = None, place: bool = True, target: int | None = None,
                    count: bool = True, request_id: str = "") -> Choice:
        """The pool's pick (see the module docstring); `engines` non-empty. A request reads each
        segment (`segment_pages` pages) from one engine that holds all of it; a segment no engine
        holds whole in parts where they are (`_parts`), up to the first page no engine holds. `place`: name
        the homes of the new segments it computes (else they stay where it runs). `target`: the engine
        it runs on, chosen already (`dispatch`, or an idle engine that takes a queued request:
        pool/steal.py). `count`: its use of hot segments counts towards their heat (not again for a
        request that moves). `request_id`: whose pick it is, so that a request that moves, named at
        its first pick to compute its prefix, is not told that it waits for itself ("": a request
        no later call names)."""
        keys = self.prompt_keys(prompt_token_ids)
        self.index.link(keys)
        if target is None:
            target = self._least(engines, keys, len(prompt_token_ids), segment_pages) if place else \
                self._near(engines, keys, len(prompt_token_ids))
        runs, copies = self._runs(engines, keys, segment_pages, rng or random, target, count=count, copy=count)
        own = sum(len(k) for e, k in runs if e == target)
        pending = place and self._pending(keys[sum(len(k) for _, k in runs):], request_id)
        # the homes of every segment, those it is to read too: where its pin of one comes up short
        # (the index hears of a step's evictions at its end), it computes it and writes it there
        places = self.places(keys, 0, max(1, segment_pages), target, [e.engine_id for e in engines]) if place else []
        if all(e == target for e, _ in runs):  # all of it here: the engine's own prefix cache serves it
            return Choice(target, own, [], places, pending=pending)
        return Choice(target, own, runs, places, copies, pending)

    def _pending(self, computed: Sequence[bytes], request_id: str = "") -> bool:
        """Whether the first of the pages a request computes (`computed`, none: it reads all) is one
        another request was named to compute within PENDING_SECONDS and has not finished (`done`):
        that one's first page or any after it, so that one that comes mid-prompt, reading the pages
        computed so far, waits for the rest too. Else it is named this one's pages."""
        self._unawait(request_id)
        if not computed:
            return False
        now = self._expire()
        named = self._computing.get(computed[0])
        if named is not None and (named != request_id or not request_id):
            if request_id:
                self._awaits[request_id] = named
                self._waiters.setdefault(named, {})[request_id] = None
                self._wanted[request_id] = list(computed)
            return True
        if named is None:
            self.done(request_id)  # (the pages it was named before, from a pick before it moved)
            rid = request_id or f"\0{next(self._anonymous)}"  # (never done: it expires)
            self._named[rid] = ([k for k in computed if self._computing.setdefault(k, rid) == rid], now)
        return False

    def _unawait(self, request_id: str) -> None:
        named = self._awaits.pop(request_id, None)
        self._wanted.pop(request_id, None)
        if named is not None:
            waiters = self._waiters[named]
            waiters.pop(request_id, None)
            if not waiters:
                del self._waiters[named]

    def _expire(self) -> float:
        """Forget the records older than PENDING_SECONDS, but those of requests computing now (a
        long prompt on a CPU takes longer: they end with `done`). -> now"""
        now = self.clock()
        old = []
        for rid, (_, named) in self._named.items():  # (oldest first: a record is made once)
            if now - named < PENDING_SECONDS:
                break
            if rid not in self._running:
                old.append(rid)
        for rid in old:
            self._forget(rid)
        return now

    def _forget(self, rid: str) -> list[str]:
        """Drop the record of the pages `rid` was named to compute. -> the requests that waited for it"""
        keys, _ = self._named.pop(rid)
        for key in keys:
            if self._computing.get(key) == rid:
                del self._computing[key]
        waiters = list(self._waiters.pop(rid, {}))
        for waiter in waiters:
            del self._awaits[waiter]
        return waiters

    def being_computed(self, request_id: str) -> bool:
        """Whether the pages `request_id` was told are being computed (`Choice.pending`) are being
        computed now: the request named to compute them has begun its prompt (`computing`), has not
        finished it (`done`), and was named within PENDING_SECONDS. A request told so waits for word
        that it has (protocol.Reads.pending) rather than compute them too; not while that one still
        waits in its queue (H200 preset, 64 documents at routing's highest rate under the TTFT SLO,
        seed 0: requests that waited for one queued 1.6 s met the SLO 0.90 of the time, against 0.97)."""
        if request_id not in self._awaits:
            return False
        self._expire()
        named = self._awaits.get(request_id)
        if named is None:
            return False
        return named in self._running

    def computing(self, request_id: str) -> None:
        """A step begins `request_id`'s prompt (protocol.Computing)."""
        if request_id in self._named:
            self._running.add(request_id)

    def done(self, request_id: str, computed: bool = True) -> list[str]:
        """`request_id` has computed its prompt, or ended (`computed` False: before its first token,
        cut off): the pages it was named to compute are no longer being computed by it (they are
        where the index says, or nowhere), and it waits for none. -> the requests to tell where their
        prefix is now: those that waited for it; where it was cut off, only the first of them, named
        to compute what it would have, the others waiting for that one from then on. Told all at
        once, every one of them computed the prefix side by side: nine requests behind a 2,048-token
        prefix whose first asker disconnected (the daemon on CPU, --engines 2) had their first
        tokens within 31.5 s, against 11.8 s where it did not."""
        self._unawait(request_id)
        self._running.discard(request_id)
        if request_id not in self._named:
            return []
        waiters = self._forget(request_id)
        if computed or not waiters:
            return waiters
        heir, *rest = waiters
        wanted = self._wanted.pop(heir, [])
        self._named[heir] = ([k for k in wanted if self._computing.setdefault(k, heir) == heir], self.clock())
        # it asked near the front of its engine's queue (pool/ahead.py) and waited for this alone: it
        # begins at once, as far as that engine has room
        self._running.add(heir)
        for waiter in rest:
            self._awaits[waiter] = heir
            self._waiters.setdefault(heir, {})[waiter] = None
        return [heir]

    def reads(self, engines: Sequence[EngineLoad], prompt_token_ids: Sequence[int], segment_pages: int, target: int,
              rng: random.Random | None = None) -> tuple[list[tuple[int, list[bytes]]], list[tuple[int, list[bytes]]]]:
        """(the runs a request queued on `target` reads, named as `pick_pooled` names them but from
        where the pool holds its prefix now (the request nears the front of its queue: pool/ahead.py),
        [] where none or all of it is on `target`; the runs of hot segments among them that `target`
        copies in first). Its use of hot segments was counted once, when it came; the copies are
        named here too, as a request that came while its prefix was being computed had nothing to
        copy then: a burst behind one hot system prompt otherwise reads it at its homes only."""
        keys = self.prompt_keys(prompt_token_ids)
        self.index.link(keys)
        runs, copies = self._runs(engines, keys, segment_pages, rng or random, target, count=False, copy=True)
        return ([], []) if all(e == target for e, _ in runs) else (runs, copies)

    def _runs(self, engines: Sequence[EngineLoad], keys: Sequence[bytes], segment_pages: int, rng: random.Random,
              target: int, *, count: bool, copy: bool
              ) -> tuple[list[tuple[int, list[bytes]]], list[tuple[int, list[bytes]]]]:
        """(the (engine, keys) runs of the prompt's leading pages to read where they are, the runs of
        hot segments among them that the target copies in); `count`: the request's use of each
        whole segment of its prompt counts towards its heat; `copy`: it may be the one that copies
        a hot segment in. A segment several engines hold is read at the less loaded of two of those
        the request asks anyway (the only holders of its other segments, and the holders it picked
        before), else of two of them all: it asks no holder more than it must (each is a round trip
        per layer and the rows shipped), and a hot document's replicas share its reads. Before, a
        segment the previous segment's holder held was read there: a request read a hot document's
        replicated segments all where it read the first of them, though its other segments, dealt
        round the engines, had it ask every engine anyway (node simulator, a quarter of the A100's
        KV, documents read with a Zipf skew at 2 req/s, seeds 0-7: access CV by reads 0.124-0.160)."""
        load = {e.engine_id: e.load for e in engines}
        now = self.clock()
        runs: list[tuple[int, list[bytes]]] = []
        copies: list[tuple[int, list[bytes]]] = []
        seg = max(1, segment_pages)
        if count:  # each whole segment it uses, read or computed (one computed now is read by those after it)
            for end in range(seg, len(keys) + 1, seg):
                self.heat.hit(keys[end - 1], now)
        reach: list[tuple[list[bytes], list[int], list[tuple[int, list[bytes]]]]] = []  # (chunk, whole, parts)
        for start in range(0, len(keys), seg):
            chunk = keys[start : start + seg]
            whole = [e for e in load if self.index.cached_pages(e, chunk) == len(chunk)]
            if whole:
                reach.append((chunk, whole, []))
                continue
            parts, whole_read = self._parts(chunk, load, target)
            reach.append((chunk, [], parts))
            if not whole_read:
                break
        # the engines it asks whatever it picks: the only holders of a segment, the holders of parts
        asked = {w[0] for _, w, _ in reach if len(w) == 1} | {e for _, _, parts in reach for e, _ in parts}
        for chunk, whole, parts in reach:
            for engine, part in parts:
                self._extend(runs, engine, part)
            if not whole:
                continue
            if target in whole:
                holder = target
            else:  # the less loaded of two of its holders that the request asks anyway, if any
                some = [e for e in whole if e in asked] or whole
                holder = min(rng.sample(some, 2) if len(some) > 2 else some, key=lambda e: (load[e], e))
            asked.add(holder)
            self._extend(runs, holder, chunk)
            if copy and holder != target and self._copy(chunk[-1], len(load), target, now):
                self._extend(copies, holder, chunk)
        return runs, copies

    def _parts(self, chunk: Sequence[bytes], engines: Collection[int], target: int | None
               ) -> tuple[list[tuple[int, list[bytes]]], bool]:
        """A segment no engine holds whole, read in parts where they are, in order: at each page the
        longest run one engine holds from there (ties: the target, if any, then the lower id). A request that
        read the segment's leading pages on a peer and computed the rest holds the rest only (its own
        pages go to no home: the segment is not one it computed whole), and a request after it over
        the same prompt read up to that peer's part and computed everything after it again, though
        the homes held most of it. -> (the (engine, keys) parts up to the first page no engine
        holds, whether they cover the segment: the read goes on past it only then)."""
        parts: list[tuple[int, list[bytes]]] = []
        start = 0
        while start < len(chunk):
            rest = chunk[start:]
            held = {e: self.index.cached_pages(e, rest) for e in engines}
            best = max(held, key=lambda e: (held[e], e == target, -e))
            if not held[best]:
                return parts, False
            parts.append((best, list(rest[: held[best]])))
            start += held[best]
        return parts, True

    def _replicated(self, key: bytes, engines: int, now: float) -> bool:
        """Whether the pool replicates this segment: a heavy hitter, copied into the engines that read
        it elsewhere (`_copy`) and kept where it is computed (`places`); never with --no-pool-copy."""
        return self.copy_hot and self.heat.is_heavy(key, engines, now)

    def _copy(self, key: bytes, engines: int, target: int, now: float) -> bool:
        """Whether the target copies in this segment that it reads elsewhere: one the pool replicates,
        not being copied there already."""
        if now - self._copying.get((key, target), -math.inf) < COPY_SECONDS:
            return False
        if not self._replicated(key, engines, now):
            return False
        if len(self._copying) > 4096:
            self._copying = {k: t for k, t in self._copying.items() if now - t < COPY_SECONDS}
        self._copying[(key, target)] = now
        return True

    def _near(self, engines: Sequence[EngineLoad], keys: Sequence[bytes], prompt_tokens: int) -> int:
        """The pool's target where segments stay where computed (module docstring): among the
        engines whose work is within AFFINITY_SLACK prompts of the least, the one holding most of
        the prefix."""
        least = min(_work(e, prompt_tokens) for e in engines)
        near = [e for e in engines if _work(e, prompt_tokens) <= least + AFFINITY_SLACK * prompt_tokens]
        return min(near, key=lambda e: (-self.index.cached_pages(e.engine_id, keys), _work(e, prompt_tokens),
                                        e.load, e.engine_id)).engine_id

    def _least(self, engines: Sequence[EngineLoad], keys: Sequence[bytes], prompt_tokens: int,
               segment_pages: int) -> int:
        """The pool's target where segments live at their homes: the engine with the least work,
        then the fewest requests; among those left, the one holding the fewest of the prompt's
        segments, then each in turn. The request's own reads (its prompt's tail, its outputs) fall
        where the reads of its prefix fall least, and a light load's idle engines share the
        requests. Before, ties went to the engine holding most of the prompt's leading pages (the
        first segment's home) and then to the lowest id: at a light load engine 0 ran most of
        what came, and a document's questions ran on its first segment's home (node simulator, a
        quarter of the A100's KV, documents read with a Zipf skew at 2 req/s, seeds 0-3: access CV
        by reads 0.143-0.162).
        """
        turn, n, seg = next(self._turns), len(engines), max(1, segment_pages)
        held = Counter(e for key in keys[seg - 1 :: seg] for e in self.index.holders(key))  # engine -> segments held
        return min(enumerate(engines), key=lambda ie: (_work(ie[1], prompt_tokens), ie[1].load,
                                                       held[ie[1].engine_id], (ie[0] - turn) % n))[1].engine_id

    def prompt_keys(self, prompt_token_ids: Sequence[int]) -> list[bytes]:
        """The chained keys of the prompt's pages that can be hits (all before its last token)."""
        return chain_page_keys(prompt_token_ids, self.page_size, [], max(0, len(prompt_token_ids) - 1))

    def dispatch(self, engines: Sequence[EngineLoad], arrivals: Sequence[Arrival], segment_pages: int,
                 cost: TrafficCost, place: bool = True, rng: random.Random | None = None) -> list[Choice]:
        """The pool's choices for requests that arrive together (TokenLake §5): the engines are
        topped up to an even load (pool/dispatch.py balanced_slots), and within that each request
        goes where the bytes it would move are fewest, by minimum-cost bipartite matching (scipy):
        its query rows to each other engine holding segments it reads, and its new segments to
        their homes elsewhere. Then each one's reads are named as `pick_pooled` does."""
        if len(arrivals) == 1 or len(engines) == 1:
            return [self.pick_pooled(engines, a.prompt_token_ids, segment_pages, rng, place, request_id=a.request_id)
                    for a in arrivals]
        ids = [e.engine_id for e in engines]
        keys = [self.prompt_keys(a.prompt_token_ids) for a in arrivals]
        costs = np.array([self._traffic(k, a, ids, max(1, segment_pages), cost, place)
                          for k, a in zip(keys, arrivals)], dtype=np.float64)
        targets = assign(costs, ids, balanced_slots({e.engine_id: e.load for e in engines}, len(arrivals)))
        return [self.pick_pooled(engines, a.prompt_token_ids, segment_pages, rng, place, target=t,
                                 request_id=a.request_id) for a, t in zip(arrivals, targets)]

    def _traffic(self, keys: Sequence[bytes], arrival: Arrival, engines: list[int], seg: int, cost: TrafficCost,
                 place: bool) -> list[float]:
        """Bytes a request would move on each of `engines`: its query rows (the prompt it computes,
        and its output) to each other engine it reads segments on, and its new segments' KV to
        their homes elsewhere."""
        # per segment read, the engines holding all of it (a segment held whole nowhere: per part, the
        # one holding it, `_parts`); and the pages read
        reads: list[set[int]] = []
        read = 0
        for start in range(0, len(keys) - seg + 1, seg):
            chunk = keys[start : start + seg]
            whole = set(engines)
            for key in chunk:
                whole.intersection_update(self.index.holders(key))
            if not whole:
                parts, whole_read = self._parts(chunk, engines, None)
                if not whole_read:
                    break
                reads += [{engine} for engine, _ in parts]
            else:
                reads.append(whole)
            read += seg
        rows = len(arrival.prompt_token_ids) - read * self.page_size + arrival.max_tokens
        homes = self.places(keys, read, seg, None, engines) if place else []
        out = []
        for engine in engines:
            shipped: set[int] = set()
            current: int | None = None
            for whole in reads:  # as pick_pooled names them: its own, else the previous holder
                if engine in whole:
                    current = engine
                    continue
                current = current if current in whole else min(whole)
                shipped.add(current)
            put = sum(len(chunk) for home, chunk in homes if home != engine) * self.page_size
            out.append(len(shipped) * rows * cost.query_row_bytes + put * cost.kv_token_bytes)
        return out

    def places(self, keys: Sequence[bytes], read: int, seg: int, target: int | None,
                engines: list[int]) -> list[tuple[int, list[bytes]]]:
        """The homes of the whole segments past the `read` pages that the target computes and puts
        at their homes (dealt round the node's engines, the serving ones standing in for any that
        is not: pool/homes.py `segment_homes`; its own are kept; target None: all of them): those no
        engine but the home holds any page of. A segment its home holds (whole or in part) is one
        the read could not reach, the chain cut before it: put there, it costs only the pages the
        home lacks, and the chain is whole at the homes again instead of a second copy staying
        where the request ran. One another engine holds (a copy of a hot segment, a copy a full
        home did not take) stays where it is computed, and so does a hot one (module docstring;
        under --no-pool-copy, no copy_hot, a hot segment is homed as any other)."""
        places: list[tuple[int, list[bytes]]] = []
        first = -(-read // seg) * seg
        if first + seg > len(keys):
            return places
        self._node.update(engines)
        homes = segment_homes(keys[seg - 1 : len(keys) : seg], sorted(self._node), engines)
        now = self.clock()
        for start in range(first, len(keys) - seg + 1, seg):
            chunk = keys[start : start + seg]
            home = homes[start // seg]
            if any(e != home for key in chunk for e in self.index.holders(key)):
                continue
            if self._replicated(chunk[-1], len(engines), now):
                continue  # kept where computed, as a copy would be
            if home != target:
                self._extend(places, home, chunk)
        return places

    @staticmethod
    def _extend(runs: list[tuple[int, list[bytes]]], engine: int, keys: list[bytes]) -> None:
        if runs and runs[-1][0] == engine:
            runs[-1][1].extend(keys)
        else:
            runs.append((engine, list(keys)))
