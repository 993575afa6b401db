"""The pool's part of an engine process (engine/process/loop.py calls it where --pool-mode is on).

    before the core:  kv_memory          read mode: the KV cache in shared memory, for peers to map
    after the core:   join(core)         the member: its query service, its step-attention wrapper
    each request:     take_prefix        pin the prompt's leading pages where the pool holds them,
                                         if it joins near the queue's front (pool/ahead.py; else
                                         its reads wait, and it pins them once it is)
                      added              count the tokens peers (or this cache) hold; note its new
                                         segments that belong on other engines
    each iteration:   before_step        queued requests near the front ask their front where their
                                         reads are now (take_asking: ResolveReads); the engine's
                                         share of the node's traffic, for the scheduler
                      after_step         unpin ended requests' foreign prefixes; move the new
                                         segments of prompts computed into their homes (write into
                                         the home); stop caching what the homes took; an engine
                                         stuck with nothing to run gives its waiting requests' pins
                                         back
    messages:         reads              the front's answer: pin the reads it names
                      follow             a peer wrote pages requests here read on it into their
                                         homes (Moved): read them there from now on
                      withdrawable       an idle peer takes a queued request (pool/steal.py,
                      withdrawn          protocol.Withdraw): which one, and forgetting it here
                      set_peers          a peer gone: its readers recompute their prefix here
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import torch

from tokenflowd import protocol as p
from tokenflowd.config import EngineConfig
from tokenflowd.engine.core import EngineCore
from tokenflowd.engine.request import Request, RequestStatus
from tokenflowd.pool.ahead import ASK_EVERY, ToldPending, asks_again, due, pins_on_arrival, waits
from tokenflowd.pool.hand_off import by_segment, tail_end
from tokenflowd.pool.member import PoolMember
from tokenflowd.pool import cuda_ipc
from tokenflowd.pool.names import cache_name, export_path
from tokenflowd.pool.shared_kv import SharedKV
from tokenflowd.pool.steal import MIN_QUEUE, withdrawable
from tokenflowd.pool.stuck import STUCK_SECONDS, StuckTimer

log = logging.getLogger("tokenflowd.engine")

# s a queued request waits for its front to name its reads again (ResolveReads) before it pins the
# runs it came with; an answer takes a round trip through the front's event loop (milliseconds)
RESOLVE_SECONDS = 2.0


class PoolHooks:
    def __init__(self, spec: p.EngineSpec, config: EngineConfig) -> None:
        self.spec = spec
        self.config = config
        self.shared_cache: SharedKV | None = None
        self.member: PoolMember | None = None
        self.core: EngineCore | None = None
        # request -> the keys of its new segments' pages that belong on peers, with their homes, not
        # handed there yet; and the last key of each of those segments
        self.homes: dict[str, dict[bytes, int]] = {}
        self.ends: dict[str, set[bytes]] = {}
        self.kept: dict[str, tuple[int, list[bytes]]] = {}  # request -> (home, keys) of its tail segment (tail_end)
        # segments homes took since the last step message, by home (StepOutputs.keys_moved), and the
        # peers that read them here (StepOutputs.moved_readers)
        self.moved: list[p.PrefixRun] = []
        self.readers: set[int] = set()
        self.followed = 0  # pages of this engine's requests' reads that moved to where their segments went
        self.deferred: dict[str, list[p.PrefixRun]] = {}  # queued request -> the reads it pins near the front
        self.asked: dict[str, float] = {}  # deferred request -> when it asked its front where its reads are now
        self.asking: list[str] = []  # ... and those to ask with this iteration (the loop sends ResolveReads)
        self.later: set[str] = set()  # deferred requests answered empty: they ask again when wanted, or at again_at
        # those, and deferred requests told their prefix is being computed (Reads.pending) -> when they ask again
        self.again_at: dict[str, float] = {}
        self.computing: set[str] = set()  # requests whose prompts a step began computing, told to the front
        self.resolved = 0  # requests that pinned reads their front named again near the queue's front
        self.peer_tokens = self.own_tokens = 0  # prompt tokens read where peers hold them, or from this cache
        self.stuck = StuckTimer()  # since when this engine has run nothing while requests wait
        self.unblocked = 0  # waiting requests that gave their pins back to unblock the node
        self.pinned_queued = 0  # requests whose reads waited (`deferred`) and were pinned near the front

    @property
    def kv_memory(self):
        """What EngineCore.from_config takes as `kv_memory`: shared memory in read mode on a CPU, else
        None (on a GPU the cache is allocated as usual and exported over CUDA IPC in `join`)."""
        return self._shared_cache if self.config.pool_mode == "read" and self.config.device == "cpu" else None

    def _shared_cache(self, shape: tuple[int, ...], dtype) -> torch.Tensor:
        """The KV cache in shared memory, where the pool's peers can map it (read mode)."""
        if self.shared_cache is not None:  # a runner built again (engine/self_check.py's fallback)
            self.shared_cache.close()
        name = cache_name(self.spec.runtime_dir, self.spec.engine_id, self.spec.incarnation)
        self.shared_cache = SharedKV.create(name, shape[0], shape[1:], dtype)
        return self.shared_cache.whole()

    def join(self, core: EngineCore) -> None:
        """Serve this engine's pages to its peers, and let its steps read theirs."""
        self.core, self.config = core, core.config  # (as it runs: a fast path that failed may be replaced)
        core.lock = threading.Lock()  # the query service reads the cache between steps (core.py `unlocked`)
        runner, config = core.runner, self.config
        if config.pool_mode == "read" and runner.kv_cache.is_cuda and config.pool_ipc:
            try:
                cuda_ipc.export(runner.kv_cache, export_path(self.spec.runtime_dir, self.spec.engine_id,
                                                             self.spec.incarnation))
            except (RuntimeError, OSError) as e:  # peers find no export and query it instead
                log.warning("pool: the KV cache cannot be exported over CUDA IPC (%s): peers query it", e)
        self.member = PoolMember(
            self.spec.engine_id, self.spec.incarnation, config.pool_mode, self.spec.runtime_dir, runner.attn,
            runner.kv_layers, core.pool, core.lock, config.max_num_batched_tokens,
            map_peers=config.pool_ipc or not runner.kv_cache.is_cuda, read_rows=config.pool_read_rows,
            heartbeat_timeout=self.spec.send_timeout)  # (the launcher gives it the supervisor's heartbeat timeout)
        log.info("pool: %s mode, serving %d pages to peers", config.pool_mode, runner.num_pages)
        self.member.size_segments(config.pool_segment_tokens)
        core.scheduler.held = self.deferred  # not admitted before their reads are pinned (`_pin_due`)
        core.scheduler.waiting_on = ToldPending(self.again_at, self.later)  # out of the policy's view
        runner.step_attention.append(self.member.step_attention)

    def ready_fields(self) -> tuple[int, int, int]:
        """Ready's pool fields: the segment size and what dispatch weighs."""
        return self.member.segment_pages, *self.member.traffic_bytes()

    def take_prefix(self, req: Request, runs: list[p.PrefixRun], copies: list[p.PrefixRun] = (),
                    pending: bool = False) -> bool:
        """Copy in the hot segments of `copies` first (a replica here: PoolMember.copy_in). Then pin the
        prompt's leading pages where the pool holds them (this engine's own first), if the request
        joins the queue near its front (pool/ahead.py); the request keeps the rest. Else, or where
        nothing could be pinned (the prefix not computed yet: a request before it may be computing
        it) and it waits for its turn, or what it does not read is being computed (`pending`,
        AddRequest.pending: `waits`), it waits for `_pin_due` and, near the front, asks where its
        reads are then. -> whether it pinned any (for this request: what a failed add releases)."""
        self._copy_in(copies)
        self.deferred.pop(req.request_id, None)
        self.later.discard(req.request_id)
        self.again_at.pop(req.request_id, None)
        waiting, free, ps = self.core.scheduler.waiting, self.core.pool.num_free, self.config.page_size
        pinned = bool(runs) and pins_on_arrival(waiting, req, free, ps, pending) and self._pin(req, runs, queued=False)
        if not pinned and req.num_prompt_tokens > ps and waits(waiting, req, free, ps, pending) and (
                runs or self.member.peers):
            self.deferred[req.request_id] = runs  # (an engine alone in its pool has nothing to ask about)
        return pinned

    def _pin(self, req: Request, runs: list[p.PrefixRun], queued: bool) -> bool:
        """Pin `runs` for `req` and make what was pinned its foreign prefix (`queued`: it waits in
        the scheduler's queue already). -> whether it pinned any."""
        ps = self.config.page_size
        with self.core.unlocked():
            pages = self.member.pin(req.request_id, runs)
        if not pages:
            return False
        if pages * ps > req.num_prompt_tokens - 1:  # the last prompt token is always computed here
            self.release_pins(req.request_id, True)
            return False
        keys = [k for run in runs for k in run.keys]
        if queued:
            self.core.scheduler.give_foreign_prefix(req, pages * ps, keys[pages - 1])
        else:
            req.set_foreign_prefix(pages * ps, keys[pages - 1])
        return True

    def _pin_due(self) -> None:
        """Queued requests whose reads wait name them again once they are near the front (pool/ahead.py):
        each asks its front where the pool holds its prefix now (ResolveReads; `reads` pins what it
        answers; one answered that nothing holds any of it asks again when the policy picks it or
        ASK_EVERY later, one answered that it is being computed when told it is done or ASK_EVERY later),
        and pins the runs it came with if no answer comes within RESOLVE_SECONDS. One
        admitted without them (its own prefix cache serves what it holds) or gone forgets them.
        What the holders evicted meanwhile it computes."""
        sched = self.core.scheduler
        for rid in list(self.deferred):
            req = sched.requests.get(rid)
            if req is None or req.status is not RequestStatus.WAITING or req.num_computed_tokens:
                del self.deferred[rid]
                self.asked.pop(rid, None)
                self.later.discard(rid)
                self.again_at.pop(rid, None)
        now = time.monotonic()
        for req in due(sched.waiting, self.deferred, self.core.pool.num_free, self.config.page_size,
                       sched.held_back, self.later, self.again_at, now):
            rid = req.request_id
            asked = self.asked.get(rid)
            if asked is None:
                self.asked[rid] = now
                self.asking.append(rid)
            elif now - asked > RESOLVE_SECONDS:  # its front is gone or far behind
                log.warning("pool: no word from the front on request %s's reads for %.1f s; it reads "
                            "where its prefix was when it came", rid, now - asked)
                del self.asked[rid]
                self.later.discard(rid)
                self._pin_queued(req, self.deferred.pop(rid))

    def began(self, batch) -> list[str]:
        """The requests of `batch` (scheduled, not run yet) whose prompts it begins computing, each
        once (protocol.Computing: one told its prefix is being computed waits only while the
        request named to compute it is computing it, not while that one waits in a queue)."""
        reqs = self.core.scheduler.requests
        self.computing.intersection_update(reqs)
        new = [rid for rid, position in zip(batch.request_ids, batch.positions)
               if rid not in self.computing and rid in reqs and position < reqs[rid].num_prompt_tokens]
        self.computing.update(new)
        return new

    def take_asking(self) -> list[str]:
        asking, self.asking = self.asking, []
        return asking

    def reads(self, msg: p.Reads) -> None:
        """The front's answer to ResolveReads: copy in the hot segments it names and pin the runs it
        names, if the request still waits. One told that the request computing its prefix has not
        finished yet (`pending`) waits, out of its policy's view, for the front's word once it has (sent
        unasked), or asks again ASK_EVERY later; one told that nothing holds any of its prefix,
        which its policy has not picked yet, asks again when it does or ASK_EVERY later
        (pool/ahead.py `asks_again`): the request computing it may be done then."""
        rid = msg.request_id
        awaited = self.asked.pop(rid, None) is not None or rid in self.again_at  # (told unasked: Front.done)
        if not awaited or rid not in self.deferred:
            self._copy_in(msg.copy)  # (the front named it once: later readers read it here)
            return  # answered already (its arrival runs pinned), or admitted, or gone
        sched = self.core.scheduler
        req = sched.requests.get(rid)
        waiting = req is not None and req.status is RequestStatus.WAITING and not req.num_computed_tokens
        if waiting and msg.pending:
            self.again_at[rid] = time.monotonic() + ASK_EVERY
            self.later.discard(rid)
            return
        self.again_at.pop(rid, None)
        if waiting and asks_again(bool(msg.prefix), rid in sched.held_back, lambda: self._holds(req)):
            self.later.add(rid)
            self.again_at[rid] = time.monotonic() + ASK_EVERY
            return
        del self.deferred[rid]
        self.later.discard(rid)
        self._copy_in(msg.copy)
        if waiting and self._pin_queued(req, msg.prefix):
            self.resolved += 1

    def _copy_in(self, copies: list[p.PrefixRun]) -> None:
        if copies:
            with self.core.unlocked():
                self.member.copy_in(copies)

    def _holds(self, req: Request) -> bool:
        """Whether this engine's own cache (device, or a host tier it would load from) holds some
        of the request's prefix."""
        m = self.core.kv.match(req)
        return bool(m.device_pages or m.num_load_tokens)

    def _pin_queued(self, req: Request, runs: list[p.PrefixRun]) -> bool:
        if not runs or not self._pin(req, runs, queued=True):
            return False
        self.pinned_queued += 1
        self._count(req.request_id)
        return True

    def withdrawable(self, mine: Callable[[str], bool]) -> Request | None:
        """The request this engine gives an idle peer (pool/steal.py), of those `mine` accepts: not
        one whose other choices (n > 1) wait here for its first token, nor one asking its front where
        its reads are (it is near the front); None while fewer than MIN_QUEUE wait."""
        sched = self.core.scheduler
        if len(sched.waiting) < MIN_QUEUE:
            return None
        keep = {*self.core.leaders, *self.asked, *(r.request_id for r in sched.waiting if not mine(r.request_id))}
        return withdrawable(sched.waiting, keep)

    def withdrawn(self, request_id: str) -> None:
        """It went to a peer (its pages are let go of already): forget its reads and its homes."""
        self.release_pins(request_id, False)
        self.homes.pop(request_id, None)
        self.ends.pop(request_id, None)
        self.kept.pop(request_id, None)

    def release_pins(self, request_id: str, pinned: bool) -> None:
        self.deferred.pop(request_id, None)
        self.asked.pop(request_id, None)
        self.later.discard(request_id)
        self.again_at.pop(request_id, None)
        if pinned:
            with self.core.unlocked():
                self.member.release(request_id)

    def added(self, msg: p.AddRequest, pinned: bool) -> None:
        """The engine took `msg`'s request."""
        if msg.place:
            seg = self.member.segment_pages
            self.homes[msg.request_id] = {k: run.engine for run in msg.place for k in run.keys}
            self.ends[msg.request_id] = {run.keys[j] for run in msg.place for j in range(seg - 1, len(run.keys), seg)}
        if pinned:
            self._count(msg.request_id)

    def _count(self, request_id: str) -> None:
        """The tokens a request that pinned its reads takes from peers and from this cache."""
        peer, own = self.member.count(request_id)
        self.peer_tokens += peer * self.config.page_size
        self.own_tokens += own * self.config.page_size

    def before_step(self) -> None:
        if self.deferred:
            self._pin_due()
        self.core.scheduler.pool_share = self.member.measure_share(time.monotonic())

    def evicted(self, keys: list[bytes]) -> None:
        """Keys no longer cached here (kv/pages.py drain_key_events): no longer replicas, but those
        cached here again since (copied back in before the report)."""
        if keys and self.member.replicas:
            pool = self.core.pool
            self.member.replicas.difference_update([key for key in keys if not pool.holds(key)])

    def after_step(self, now: float) -> None:
        self._unblock(now)
        self._sweep_pins()
        if self.homes or self.kept:
            self._hand_off()

    def take_moved(self) -> tuple[list[p.PrefixRun], list[int]]:
        """(the segments homes took since the last call, the peers that read them here), for the step
        message (StepOutputs.keys_moved, moved_readers)."""
        moved, readers = self.moved, sorted(self.readers)
        if moved:  # (most steps move nothing: no new list for them)
            self.moved = []
            self.readers.clear()
        return moved, readers

    def follow(self, msg: p.Moved) -> None:
        """A peer wrote segments into their homes, and requests here read its pages of them: they
        read them at the homes from now on (PoolMember.follow)."""
        with self.core.unlocked():
            self.followed += self.member.follow(msg.holder, msg.runs)

    def _unblock(self, now: float) -> None:
        """Pins are taken as a request nears the front of the queue (pool/ahead.py), and a waiting
        request holds them. Engines whose waiting requests pin each other's pages can leave each
        other no room to admit anything:
        seen with --engines 2 in query mode on shared documents, every stream stalled and both
        engines idle. An engine that has run nothing for STUCK_SECONDS while requests wait gives
        its waiting requests' pins back (here and on peers): they compute those tokens here, and
        the pages they held come free for whoever can run."""
        sched = self.core.scheduler
        stuck = not (sched.running or sched.loading or len(self.core.last_batch)) and bool(sched.waiting)
        if not self.stuck.expired(now, stuck):
            return
        pinned = [r for r in sched.waiting if r.foreign_token_ids]
        for req in pinned:
            peer, own = self.member.count(req.request_id)  # counted when it came: it computes them now
            self.peer_tokens -= peer * self.config.page_size
            self.own_tokens -= own * self.config.page_size
            sched.take_foreign_prefix(req)
        if pinned:
            self.unblocked += len(pinned)
            log.warning("pool: nothing could run for %.1f s with %d requests waiting; %d of them give their "
                        "pins back and compute their prefix here", STUCK_SECONDS, len(sched.waiting), len(pinned))

    def _sweep_pins(self) -> None:
        """Unpin the foreign prefixes of requests that ended or recompute theirs."""
        member, reqs = self.member, self.core.scheduler.requests
        if any(rid not in reqs or not reqs[rid].foreign_token_ids for rid in member.foreign):
            reading = {rid for rid, r in reqs.items() if r.foreign_token_ids}
            with self.core.unlocked():
                member.sweep(reading)

    def _hand_off(self) -> None:
        """Write into the home: once a running request's prompt is computed (or each whole segment
        as soon as it is, where pool/hand_off.py `by_segment` says so: --pool-hand-off), its new
        segments whose home is a peer move there, and it reads them there from then on (with the
        pages before them: its own segments stay in this cache, pinned where they are, so that what
        it reads stays one leading run). Its pages of them here go: no second copy outlives its
        prompt.
        What a home gone or full did not take stays here, as the request's own, and is not tried
        again. The prompt's last whole segment, the one the request's tail follows, waits here for
        the request's end (pool/hand_off.py `tail_end`, `_hand_off_tail`). What the homes took
        stops being cached here at once, but a hot segment the front named to copy in: a replica of
        it stays (PoolMember.replicas). The step's message says
        where it went (`take_moved`, sent at once: EngineProcess.report_step), with the keys this
        cache let go, so the front neither finds it nowhere in between nor names new readers a
        copy here that is about to go (the homes' own reports have the last word:
        Supervisor._moved_keys). It names the peers whose requests read these pages here (named
        before the move): the supervisor tells them (Moved) and they read them at the homes from
        then on, as this engine's own other readers of them do at once (PoolMember.follow); the
        pages here go once no one reads them. (The keys stayed cached here until the homes' own reports had
        reached the front, two heartbeats, and readers named in between pinned this copy and read
        it here, apart from its homes, for as long as they ran. The node simulator with that second
        modelled, sim/node.py NodeConfig.let_go_after, a quarter of the A100's KV, the four
        document workloads at seeds 0-3: hit rate 0.73 against 0.82 at a light load, access CV
        0.28 against 0.19; in overload 1.07x routing's throughput against 1.22x; at routing's
        highest rate within TokenLake's SLO, 0.71 of requests within it against 0.86.)

        Segment by segment, the engine needs room for a segment of a long prompt, not the whole
        prompt, before the homes take it: where KV is short, computing a whole document here first
        evicts as much of this cache as the document is long, only to let those pages go once it
        moves (the node simulator, a quarter of the A100's KV, 16 documents of 12K tokens at a light
        load: hit rate 0.883 segment by segment against 0.595 at the prompt's end and routing's
        0.660). But every chunk of the prompt after a segment moved attends to it where it now
        lives, through the pool's path (its query rows shipped, or the holder's pages gathered and
        merged by LSE): where the prompt fits with room to spare that only costs (the H200 preset,
        documents in overload: 0.71x routing's throughput segment by segment, 1.03x at the prompt's
        end; on a 2-core CPU, --engines 2, 2.7-4.4x the query bytes in query mode and 2.2-2.4x read
        mode's mean TTFT, bench/results/pool_daemon_hand_off.json). Hence `auto`, the default."""
        reqs, kv, ps, me = self.core.scheduler.requests, self.core.kv, self.config.page_size, self.spec.engine_id
        for rid in [rid for rid in self.kept if rid not in reqs]:
            self._hand_off_tail(rid, *self.kept.pop(rid))
        for rid in list(self.homes):
            req = reqs.get(rid)
            if req is None or req.is_finished:
                del self.homes[rid], self.ends[rid]
                continue
            whole = req.num_computed_tokens >= req.num_prompt_tokens
            if req.status is not RequestStatus.RUNNING or (not whole and not by_segment(
                    self.config.pool_hand_off, req.num_prompt_tokens, self.core.pool.num_pages * ps)):
                continue
            st = kv.state(req)
            homes, ends = self.homes[rid], self.ends[rid]
            seg = self.member.segment_pages
            tail = tail_end(req.num_prompt_tokens, ps, seg)  # (that segment waits for the request's end)
            computed = min(st.num_published_pages, max(tail - 1, 0))
            n = max((i + 1 for i, key in enumerate(st.page_hashes[:computed]) if key in ends), default=0)
            last = st.page_hashes[tail - 1] if whole and 0 < tail <= len(st.page_hashes) else None
            if last in ends and homes[last] != me:
                self.kept[rid] = (homes[last], st.page_hashes[tail - seg:tail])
            if whole and not n:
                del self.homes[rid], self.ends[rid]
            if not n:
                continue
            keys, pages = st.page_hashes[:n], st.block_table[:n]
            runs: list[tuple[int, list[bytes], list[int]]] = []
            for key, page in zip(keys, pages):
                home = homes.get(key, me)
                if runs and runs[-1][0] == home:
                    runs[-1][1].append(key)
                    runs[-1][2].append(page)
                else:
                    runs.append((home, [key], [page]))
            with self.core.unlocked():
                got = self.member.hand_off(rid, runs)
            for key in keys:
                homes.pop(key, None)
                ends.discard(key)
            if whole or not ends:
                del self.homes[rid], self.ends[rid]
            if not got:
                continue
            for page in reversed(kv.hand_off(req, got)):  # tail first, as a request's release
                self.core.pool.decref(page)
            req.extend_foreign_prefix(got * ps, keys[got - 1])
            self._went(runs, got)

    def _hand_off_tail(self, request_id: str, home: int, keys: list[bytes]) -> None:
        """A finished request's last whole segment, kept in this cache while it ran (pool/hand_off.py
        `tail_end`), written into its home as far as this cache still holds it (pinned there for the
        request while it is written, then let go of). What the home did not take stays here."""
        pool = self.core.pool
        pages = pool.lookup(keys)
        if not pages:
            return
        for page in pages:  # (held while the engine's lock is let go of: no peer's put evicts them)
            pool.incref(page)
        runs = [(home, keys[:len(pages)], pages)]
        try:
            with self.core.unlocked():
                got = self.member.hand_off(request_id, runs)
                self.member.release(request_id)
        finally:
            for page in reversed(pages):
                pool.decref(page)
        if got:
            self._went(runs, got)

    def _went(self, runs: list[tuple[int, list[bytes], list[int]]], got: int) -> None:
        """The leading `got` pages of `runs` (home, keys, pages here) are at their homes now: those
        homed on peers stop being cached here (but replicas), and the step's message says where they
        went, with the peers that read them here; this engine's own other readers follow at once."""
        taken, replicas, moved, gone = 0, self.member.replicas, [], []
        for home, run, local in runs:
            run = run[: got - taken]
            taken += len(run)
            if home != self.spec.engine_id and run:
                moved.append(p.PrefixRun(home, run))
                gone += local[: len(run)]
                self.core.pool.unpublish([key for key in run if key not in replicas])
        if not moved:
            return
        self.moved += moved
        # (unlocked: the query service takes its own lock, then the engine's)
        with self.core.unlocked():
            self.readers.update(self.member.readers(gone))  # told where they went (Moved)
            if len(self.member.foreign) > 1:  # this engine's other readers of them follow at once
                self.followed += self.member.follow(self.spec.engine_id, moved)

    def set_peers(self, msg: p.PoolPeers) -> None:
        with self.core.unlocked():
            lost = self.member.set_peers(msg.peers)
        for rid in lost:
            req = self.core.scheduler.requests.get(rid)
            if req is not None:
                self.core.scheduler.take_foreign_prefix(req)
        if lost:
            log.warning("pool: a peer is gone; %d requests recompute their prefix here", len(lost))

    def stats(self) -> dict:
        m = self.member.stats
        path, staged = self.member.sharing()
        return dict(pool_queries=m["query_calls"], pool_query_bytes=m["query_bytes"],
                    pool_query_seconds=m["query_seconds"], pool_reads=m["read_calls"],
                    pool_pins=self.member.service.pinned_pages,
                    pool_put_pages=m["put_pages"], pool_stored_pages=m["stored_pages"],
                    pool_copied_pages=m["copied_pages"],
                    pool_share=self.member.share, pool_unblocked=self.unblocked,
                    pool_pinned_queued=self.pinned_queued, pool_resolved=self.resolved,
                    pool_followed=self.followed, pool_path=path,
                    pool_staged=staged, pool_peer_access=self.member.peer_access)

    def close(self) -> None:
        if self.member is not None:
            self.member.close()

    def release_memory(self) -> None:
        """After the core has closed: the shared cache goes last (peers may have mapped it)."""
        if self.shared_cache is not None:
            self.shared_cache.close()
