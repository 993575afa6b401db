"""KVCacheManager: the one owner of every request's KV, in every tier (tokenflow.txt §5).

    schedule:  match(req) -> PrefixMatch      once per step per waiting request: the device pages
                                               and, below them, what a load could bring back
               admit / grow / start_load / preempt / free
    step:      issue(t_step, running, loading) write-through and load chunks sized to end in the step
    next step: poll() -> CopyResults           copies that ended, and other nodes' writes that ended

The manager owns the device half of a request's KV (block table, page keys, the device prefix
cache) and the pages other nodes write (federation/). The host half, and every copy between the
two, is its offloader's (kv/offloader.py, the seam; offload/traffic.py, the traffic): the
manager tells it what happens to a request, and never copies a page itself.

Faults: a load that fails sends its request back to the queue without its host copy (it
recomputes); a transfer from another node that fails does the same, in fresh device pages.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable, NamedTuple

from tokenflowd.kv.copier import Copier
from tokenflowd.kv.offloader import CopyResults, NullOffloader, Offloader, OffloadStats
from tokenflowd.kv.pages import PagePool, cdiv, chain_page_keys
from tokenflowd.kv.state import Request, RequestKV
from tokenflowd.kv.tiers import DEVICE, DISK, HOST, REMOTE, KVTier


class Source(NamedTuple):
    """One run of a prefix match's pages: the tier they come from, and what bringing them costs."""

    tier: str
    num_tokens: int
    io_time: float  # seconds until they would be on the device (0 for the device itself)


@dataclass(slots=True)
class PrefixMatch:
    """What every tier can give a waiting request, taken once per step (match) and checked again
    (refresh) when the scheduler acts on it. `sources` lists, in token order, the device's pages
    and then what a load would bring back (host, or disk through the host)."""

    device_pages: list[int]
    num_evictable: int  # of device_pages, how many sit unreferenced in the LRU (admission takes them off it)
    num_load_tokens: int  # leading tokens whose KV a load restores, device pages included (0: no load)
    num_pages_to_load: int
    num_disk_pages: int  # of those, how many must first be read from the disk tier
    num_unwritten_pages: int  # of those, how many are still being written to the host
    io_time: float | None  # t_IO of the load; None: nothing to load
    sources: tuple[Source, ...]
    # the device pool's eviction count when it was taken, and the host's (with its disk): stale once
    # one of its device pages is dropped after the first (PagePool.dropped_since), or, with a load,
    # once the host tier evicts anything
    evictions: tuple[int, int]

    @property
    def num_device_pages(self) -> int:
        return len(self.device_pages)


class KVCacheManager:
    def __init__(self, device: PagePool, page_size: int, offloader: Offloader | None = None) -> None:
        self.pool = device
        self.page_size = page_size
        self.offloader = offloader if offloader is not None else NullOffloader()
        self._kv: dict[str, RequestKV] = {}
        self._remote_results: list[tuple[Request, bool, bool]] = []  # remote_done's, for the next poll
        # Pages another node may still write, of requests that ended or gave up on that node's
        # transfer: request -> (pages, monotonic time by which the sender's own timeout has stopped it)
        self._writing: dict[str, tuple[list[int], float]] = {}
        # s after a reservation by which its sender can write no more (federation/streaming.py horizon)
        self.remote_quarantine = 60.0
        # s a settled sender's last bytes may still be on the wire (over TCP, "done" means sent)
        self.remote_grace = 2.0

    # the offloader's, as the engine and its tests read them
    @property
    def host(self) -> KVTier:
        return self.offloader.host

    @property
    def copier(self) -> Copier:
        return self.offloader.copier

    @property
    def mode(self) -> str:
        return self.offloader.mode

    @property
    def stats(self) -> OffloadStats:
        return self.offloader.stats

    def reset_stats(self) -> None:
        self.offloader.stats = OffloadStats()

    @property
    def page_bytes(self) -> int:
        return self.offloader.page_bytes

    @property
    def can_reload(self) -> bool:
        """Whether a preempted request's KV can come back by a load (there is a host tier)."""
        return self.offloader.can_reload

    def track(self, req: Request) -> None:
        """Keep KV state for `req` from now until `free` (its page keys are computed once). A fresh
        state: nothing of an earlier request under the same id carries over."""
        self._kv[req.request_id] = RequestKV()

    def state(self, req: Request) -> RequestKV:
        st = self._kv.get(req.request_id)
        if st is None:
            st = self._kv[req.request_id] = RequestKV()
        return st

    def num_host_tokens(self, req: Request) -> int:
        """Leading tokens of `req` its own host copy holds (0 if it has none)."""
        st = self._kv.get(req.request_id)
        return st.num_offloaded_tokens if st is not None else 0

    def block_table(self, req: Request) -> list[int]:
        return self.state(req).block_table

    def num_reloadable_tokens(self, req: Request) -> int:
        """Leading tokens of `req` its own host copy restores (writes in flight included)."""
        return min(self.state(req).num_offload_issued, req.num_tokens - 1)

    # -- prefix match -------------------------------------------------------------------------
    def match(self, req: Request) -> PrefixMatch:
        """Walk the tiers once: the longest run of full device pages covering at most num_tokens - 1
        tokens (the last token is always computed, so that the step admitting it can sample), and
        what loading would restore beyond it: its own host copy if it was preempted, else the host
        (and disk) prefix cache. Changes nothing (a request not tracked, such as one load
        shedding weighs before it is queued, is matched without keeping its keys)."""
        return self._match(req, self._kv.get(req.request_id) or RequestKV())[0]

    def _match(self, req: Request, st: RequestKV) -> tuple[PrefixMatch, int]:
        """match(), and the host tier's run in pages (its prefix cache's; 0 for an own host copy)."""
        ps = self.page_size
        chain_page_keys(req.token_ids, ps, st.page_hashes, None, req.key_seed)
        max_pages = (req.num_tokens - 1) // ps
        pages = self.pool.lookup(st.page_hashes[:max_pages])
        evictable = self.pool.num_unreferenced(pages)
        reload = self.offloader.reload(req, st, max_pages, len(pages))
        host_run = 0 if st.host_pages else reload.num_tokens // ps
        to_load = cdiv(reload.num_tokens, ps) - len(pages)
        if to_load <= 0:
            return self._priced(pages, evictable, 0, 0, 0, 0), host_run
        return self._priced(pages, evictable, reload.num_tokens, to_load, reload.num_disk_pages,
                            reload.num_unwritten_pages), host_run

    def view_matches(self, reqs: Iterable[Request]) -> list[PrefixMatch]:
        """match() of each tracked waiting request, for the scheduler's view, which takes one for
        every visible waiting request every step: its last one (the same object) while nothing it
        read has moved, else a new walk. What it read: the request's tokens and host copy; its own
        device pages, none of them evicted since (`stale`), nor, where it loads, any host page; that
        no device page became evictable or stopped being so (else its evictable count is taken again,
        and a match with the same count kept); that neither the device nor the host tier has since
        published the key that would lengthen its run. A load's t_IO is priced anew once the copy
        queues or the links' bandwidths have moved (Offloader.io_key). Four H200 bursts
        (bench/sim_vs_h200.py's) took 211,287 walks for 427,568 view matches while any eviction
        anywhere made every match stale, and priced 198,935 loads again while any step did."""
        pool, host, ps = self.pool, self.offloader.host, self.page_size
        evictions, lru = (pool.num_evictions, self.offloader.num_evictions), pool.num_lru_changes
        io = self.offloader.io_key()
        out = []
        for req in reqs:
            st = self._kv.get(req.request_id)
            if st is None:
                out.append(self.match(req))
                continue
            num_tokens = len(req.token_ids)
            own = (num_tokens, req.key_seed, st.recompute, len(st.host_pages), st.num_offload_issued,
                   st.num_offloaded_tokens)
            last = st.view_match
            if last is not None and last[1] == own and (last[4] == evictions or not self.stale(last[0], last[4])):
                m, host_run = last[0], last[3]
                keys, max_pages, device_run = st.page_hashes, (num_tokens - 1) // ps, len(last[0].device_pages)
                if not ((device_run < max_pages and pool.holds(keys[device_run]))
                        or (host_run < max_pages and not st.host_pages and host.lookup(keys[host_run:host_run + 1]))):
                    evictable = m.num_evictable if last[2] == lru else pool.num_unreferenced(m.device_pages)
                    if evictable != m.num_evictable or (m.io_time is not None and last[5] != io):
                        m = self._priced(m.device_pages, evictable, m.num_load_tokens, m.num_pages_to_load,
                                         m.num_disk_pages, m.num_unwritten_pages)
                    if m is not last[0] or last[2] != lru or last[4] != evictions or last[5] != io:
                        st.view_match = (m, own, lru, host_run, evictions, io)
                    out.append(m)
                    continue
            m, host_run = self._match(req, st)
            st.view_match = (m, own, lru, host_run, evictions, io)
            out.append(m)
        return out

    def stale(self, m: PrefixMatch, since: tuple[int, int] | None = None) -> bool:
        """Whether `m` may name pages gone: one of its device pages was evicted (or unpublished)
        since it was taken (or since the pools' eviction counts were `since`, where it was checked
        then), or it loads and the host tier evicted since."""
        device, host = m.evictions if since is None else since
        return (self.pool.dropped_since(m.device_pages, device)
                or (m.num_load_tokens > 0 and host != self.offloader.num_evictions))

    def refresh(self, req: Request, m: PrefixMatch) -> PrefixMatch:
        """`m` as it stands now: taken again if it is stale, else with its evictable count and I/O
        times brought up to date (the queues moved)."""
        if self.stale(m):
            return self.match(req)
        return self._priced(m.device_pages, self.pool.num_unreferenced(m.device_pages), m.num_load_tokens,
                            m.num_pages_to_load, m.num_disk_pages, m.num_unwritten_pages)

    def _priced(self, pages: list[int], evictable: int, load_tokens: int, to_load: int, disk: int,
                unwritten: int) -> PrefixMatch:
        ps = self.page_size
        device_tokens = len(pages) * ps
        sources = [Source(DEVICE, device_tokens, 0.0)] if pages else []
        io = None
        if to_load:
            io = self.offloader.io_time(to_load, disk, unwritten)
            host_part = self.offloader.io_time(to_load - disk, 0, unwritten)
            disk_tokens = min(disk * ps, load_tokens - device_tokens)
            sources.append(Source(HOST, load_tokens - device_tokens - disk_tokens, host_part))
            if disk:
                sources.append(Source(DISK, disk_tokens, io - host_part))
        return PrefixMatch(pages, evictable, load_tokens, to_load, disk, unwritten, io,
                           tuple(sources), (self.pool.num_evictions, self.offloader.num_evictions))

    # -- device pages -------------------------------------------------------------------------
    def pages_needed(self, req: Request, num_new_tokens: int) -> int:
        return max(0, cdiv(req.num_computed_tokens + num_new_tokens, self.page_size) - len(self.state(req).block_table))

    def admit(self, req: Request, m: PrefixMatch, num_new_tokens: int, keep_free: int = 0) -> bool:
        """Take the match's device pages and allocate room for `num_new_tokens` past them, or change
        nothing; `keep_free`: pages that must stay free after it (kept for requests ahead of it).
        With write-through, host pages already holding its prefix become its host copy."""
        st = self.state(req)
        assert not st.block_table and req.num_computed_tokens == 0
        hit = m.device_pages
        fresh = cdiv(len(hit) * self.page_size + num_new_tokens, self.page_size) - len(hit)
        if fresh + keep_free > self.pool.num_free - m.num_evictable:
            return False
        for page in hit:
            self.pool.incref(page)
        st.block_table = list(hit)
        req.num_computed_tokens = len(hit) * self.page_size
        if req.num_preemptions == 0:  # a resumed request's hit on its own pages is no saving
            req.num_cached_tokens = req.num_computed_tokens
            self.stats.hit_tokens += req.num_computed_tokens
        st.num_published_pages = len(hit)
        ok = self.grow(req, num_new_tokens)
        assert ok, "admission checked the room"
        self.offloader.on_admit(req, st)
        return True

    def grow(self, req: Request, num_new_tokens: int) -> bool:
        """Make the block table cover num_computed_tokens + num_new_tokens, or change nothing."""
        need = self.pages_needed(req, num_new_tokens)
        if need > self.pool.num_free:
            return False
        self.state(req).block_table.extend(self.pool.allocate() for _ in range(need))
        return True

    def commit(self, req: Request, num_tokens: int | None = None) -> None:
        """Publish every page whose tokens are all computed (prompt or output) to the prefix cache;
        `num_tokens`: only those among the first so many (the rest are not in place yet)."""
        if not self.pool.enable_prefix_caching:
            return
        st = self.state(req)
        n = req.num_computed_tokens if num_tokens is None else min(num_tokens, req.num_computed_tokens)
        num_full = n // self.page_size
        chain_page_keys(req.token_ids, self.page_size, st.page_hashes, n, req.key_seed)
        for i in range(st.num_published_pages, num_full):
            self.pool.register(st.block_table[i], st.page_hashes[i])
        st.num_published_pages = max(st.num_published_pages, num_full)

    def hand_off(self, req: Request, num_pages: int) -> list[int]:
        """The request's first `num_pages` device pages (computed and published) leave it: the pool
        holds them for it elsewhere from now on (pool/engine_hooks.py, write into the home), and the
        caller drops their references (-> the pages). Its host copy is let go of (its tokens move
        along: write-through starts again on what it keeps; copies in flight carry nothing)."""
        st = self.state(req)
        assert 0 < num_pages <= st.num_published_pages and not st.num_load_tokens
        pages = st.block_table[:num_pages]
        del st.block_table[:num_pages]
        del st.page_hashes[:num_pages]
        st.num_published_pages -= num_pages
        if st.host_pages or st.num_offload_issued or st.load_queue:
            st.epoch += 1
            self.offloader.cancel_loads(st)
            self.offloader.drop_host_copy(st, 0)
        return pages

    def pages_exclusive(self, req: Request) -> int:
        """Of the request's device pages, how many no other request holds (what preempting it frees)."""
        return self.pool.num_held_alone(self.state(req).block_table)

    # -- preempt, load, free --------------------------------------------------------------------
    def preempt(self, req: Request) -> None:
        """Give up the request's device pages. With a host tier, what the host lacks is written
        first (the offloader's eviction): pages it already holds are freed at once, the others when
        their copy ends. Without one, the KV is recomputed."""
        st = self.state(req)
        self.offloader.evict(req, st)
        self._release_device(req, st)

    def preempt_io_time(self, req: Request) -> float | None:
        """Seconds a preemption of running `req` costs in copies: write what the host lacks, then
        load it all back; None without a host tier (it would recompute)."""
        return self.offloader.preempt_io_time(req, self.state(req))

    def start_load(self, req: Request, m: PrefixMatch) -> bool:
        """Admit `req` to come back with its first `m.num_load_tokens` tokens computed: device-cached pages
        are taken as they are, the rest allocated and queued to load from its host copy (a request
        that never offloaded first takes the host prefix cache's pages as that copy, promoting disk
        hits). Or change nothing and return False.

        It also takes the page its next token goes to (`_next_page`)."""
        st = self.state(req)
        assert not st.block_table and req.num_computed_tokens == 0
        n_pages = cdiv(m.num_load_tokens, self.page_size)
        ahead = self._next_page(m.num_load_tokens)
        hit = m.device_pages[:n_pages]
        evictable = sum(self.pool.is_evictable(p) for p in hit)
        if n_pages - len(hit) + ahead > self.pool.num_free - evictable:
            return False
        if not self.offloader.take_host_copy(req, st, n_pages):
            return False
        assert n_pages > len(hit), "nothing to load: admit it as usual"
        for p in hit:
            self.pool.incref(p)
        st.block_table = list(hit) + [self.pool.allocate() for _ in range(n_pages - len(hit))]
        self.offloader.queue_load(st, len(hit))
        st.block_table.extend(self.pool.allocate() for _ in range(ahead))  # nothing to load into it
        st.num_load_tokens = m.num_load_tokens
        st.load_source = HOST
        st.num_published_pages = len(hit)
        return True

    def _next_page(self, num_tokens: int) -> int:
        """1 when KV of `num_tokens` tokens ends on a page boundary: the page its next token goes to,
        which a request whose KV arrives (a load, another node's write) takes with it. Arriving KV
        holds its pages while it crosses, and a request that got it with nowhere to put its next
        token would wait for, or be preempted by, the arrivals behind it, and round again."""
        return cdiv(num_tokens + 1, self.page_size) - cdiv(num_tokens, self.page_size)

    def start_remote(self, req: Request, num_tokens: int) -> list[int] | None:
        """Admit `req` with its first `num_tokens` of KV to be written by another node (a decode node
        taking over a prefill node's request, federation/): its device pages are allocated now for
        the sender to write into, and it runs once `remote_done` says they are in place. None (and
        nothing changes) when the pool lacks the pages."""
        st = self.state(req)
        assert not st.block_table and req.num_computed_tokens == 0
        n_pages = cdiv(num_tokens, self.page_size)
        taken = n_pages + self._next_page(num_tokens)
        if taken > self.pool.num_free:
            return None
        st.block_table = [self.pool.allocate() for _ in range(taken)]
        st.num_load_tokens = num_tokens
        st.load_source = REMOTE
        st.remote_until = time.monotonic() + self.remote_quarantine
        return st.block_table[:n_pages]  # the sender's; the next token's page is not written

    def remote_done(self, req: Request, ok: bool, settled: bool = True) -> None:
        """The sender's pages are in place (ok), or will never be (a failed transfer). `settled`:
        the sender can write no more (it said so: transport.py `settled`); otherwise (it is gone, or
        it timed out on us) its pages stay taken until `remote_quarantine` s after the reservation
        (federation/timing.py horizon), before they go to anyone else. `poll` reports the request."""
        self._remote_results.append((req, ok, settled))

    def _quarantine(self, request_id: str, pages: list[int], settled: bool, until: float = 0.0) -> None:
        """Free `pages` once the sender's last bytes cannot land: `remote_grace` s from now if it is
        `settled`, else at its horizon `until` (now, if that has passed)."""
        if not pages:
            return
        now = time.monotonic()
        if settled:
            until = now + self.remote_grace
        if until <= now:
            self._free_pages(pages)
        else:
            self._writing[request_id] = (pages, until)

    def _free_pages(self, pages: list[int]) -> None:
        for page in reversed(pages):
            self.pool.decref(page)

    def _poll_remote(self, ready: list, failed: list) -> None:
        results, self._remote_results = self._remote_results, []
        for req, ok, settled in results:
            written = self._writing.get(req.request_id)
            if written is not None:  # it ended while they were written: free once the sender stops
                if settled:
                    del self._writing[req.request_id]
                    self._quarantine(req.request_id, written[0], True)
                continue
            st = self._kv.get(req.request_id)
            if st is None or req.is_finished or st.load_source != REMOTE or not st.num_load_tokens:
                continue
            if ok:
                ready.append(req)
            else:  # it computes its prompt here instead, in fresh pages
                self._quarantine(req.request_id, st.block_table, settled, st.remote_until)
                st.block_table = []
                self._release_device(req, st)
                st.num_load_tokens = 0
                st.load_source = ""
                failed.append(req)
        if self._writing:
            now = time.monotonic()
            for rid in [rid for rid, (_, until) in self._writing.items() if until <= now]:
                self._free_pages(self._writing.pop(rid)[0])

    def remote_settled(self, request_id: str) -> None:
        """The sender of an ended request's KV can write no more: its quarantined pages are free."""
        written = self._writing.pop(request_id, None)
        if written is not None:
            self._quarantine(request_id, written[0], True)

    @property
    def num_remote_pending(self) -> int:
        """Pages held for transfers from other nodes that are not settled (quarantine included)."""
        return sum(len(pages) for pages, _ in self._writing.values())

    def finish_load(self, req: Request) -> None:
        """Its pages are in place: it runs with its loaded tokens computed."""
        st = self.state(req)
        req.num_computed_tokens, st.num_load_tokens = st.num_load_tokens, 0
        self.commit(req)

    def free(self, req: Request) -> None:
        """The request ends: release its pages in every tier (copies in flight keep their pins; pages
        another node may still be writing stay taken until its transfer is done, `remote_done`)."""
        st = self._kv.pop(req.request_id, None)
        if st is None:
            return
        if st.load_source == REMOTE and st.num_load_tokens:  # the sender may still be writing them
            self._quarantine(req.request_id, st.block_table, False, st.remote_until)
            st.block_table = []
        self._release_device(req, st)
        self.offloader.drop_host_copy(st, 0)

    def drop(self, req: Request) -> None:
        """`free` for a request that lives on and starts its KV afresh (its tokens changed): copies
        of its old KV still in flight end as a failed request's would, with nothing done for it."""
        st = self._kv.get(req.request_id)
        if st is not None:
            st.epoch += 1  # the offloader's copies issued before carry nothing to trust
        self.free(req)

    def _release_device(self, req: Request, st: RequestKV) -> None:
        """Release the request's device pages, tail first, so that LRU eviction takes the tails of
        prefixes before their heads; a page a copy still reads stays pinned until it ends."""
        for page in reversed(st.block_table):
            self.pool.decref(page)
        st.block_table = []
        req.num_computed_tokens = st.num_published_pages = 0
        self.offloader.cancel_loads(st)

    # -- copies -------------------------------------------------------------------------------
    def issue(self, step_seconds: float, running: Iterable[Request], loading: Iterable[Request],
              buffer_of: Callable[[Request], float]) -> None:
        """Before a step: the offloader queues the loads and write-through copies that fit in
        `step_seconds` (chunked writing, largest client buffer first)."""
        # generators: an offloader with nothing to issue (none, or no load queued) never walks them
        self.offloader.issue(step_seconds, ((r, self.state(r)) for r in running),
                             ((r, self.state(r)) for r in loading), buffer_of)

    def poll(self) -> CopyResults:
        """Account for the copies, and the other nodes' writes, that ended."""
        ready, failed = [], []
        self._poll_remote(ready, failed)
        copies = self.offloader.poll()
        for req in copies.failed:  # its load cannot finish: it recomputes, in fresh pages
            st = self.state(req)
            self._release_device(req, st)
            st.num_load_tokens = 0
        return CopyResults(ready + copies.ready, failed + copies.failed)

    def busy(self) -> bool:
        return self.offloader.busy()

    def pins(self) -> tuple[Counter, Counter]:
        """(device, host) page -> references the copies in flight hold on it."""
        return self.offloader.pins()

    def wait(self) -> None:
        """Block until every copy in flight has ended; the next poll accounts for them."""
        self.offloader.wait()

    def wait_oldest(self) -> None:
        """Block until the oldest copy in flight has ended (nothing to compute until KV is in place)."""
        self.offloader.wait_oldest()

    def close(self) -> None:
        self.offloader.close()
