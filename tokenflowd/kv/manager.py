"""KVCacheManager: the one owner of every request's KV, in every tier (tokenflow.txt §5).

    schedule:  match(req) -> PrefixMatch      once per step per waiting request: the device pages
                                               and, below them, what a load could bring back
               admit / grow / start_load / preempt / free
    step:      issue(t_step, running, loading) write-through and load chunks sized to end in the step
    next step: poll() -> CopyResults           copies that ended: frontiers advance, host pages are
                                               published, loads in place (or failed) are handed back

A request's pages across the tiers (page_size 4; P = preempted):

    token pages      0    1    2    3    4
    block_table     d7   d2   d9   d4   d5        device (pages.py, DeviceTier)
    host_pages      h0   h1   h3                  host (offload/tiers.py HostTier, or NullHostTier)
                    [ written  )[flight)          write frontier at 8 tokens, issued to 12
    on P:  d7 d2 freed at once; d9 freed when its copy ends; d4 d5 (not yet written, computed
           to token 18) written as one eviction job, then freed.
    resume: pages still cached on the device (a prefix hit) are taken as they are; only the
           others are loaded, a chunk a step, and the request rejoins the batch when all are in.

Write modes: write-through copies each full computed page of a running request soon after it is
computed (largest client buffer first: the likeliest to be preempted); write-back copies nothing
until a preemption, then everything the host does not hold; none (a NullHostTier) copies nothing.
A request admitted with its prefix already on the host takes those host pages as its own copy,
so a shared system prompt is written once. Without load–evict overlap a load waits until no
eviction is in flight (the ablation's serialized baseline).

Faults: a copy that fails (copier.py) publishes nothing and moves no frontier; the request's host
copy past its frontier is dropped, so what it lacks is recomputed. A load that fails sends its
request back to the queue without its host copy (it recomputes). Copies already in flight for
that request are then stale: they only let go of their pins.
"""
from __future__ import annotations

import logging
import math
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable, NamedTuple, Protocol

from tokenflowd.kv.copier import LOAD, WRITE, Copier, CopierDead, CopyJob, NullCopier
from tokenflowd.kv.pages import PagePool, cdiv, chain_page_keys
from tokenflowd.kv.tiers import DEVICE, DISK, HOST, REMOTE, KVTier, NullHostTier

log = logging.getLogger(__name__)

WRITE_THROUGH, WRITE_BACK, NO_OFFLOAD = "write-through", "write-back", "none"


class Request(Protocol):
    """What the KV manager reads of a request (engine/request.py's Request is one)."""

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int  # written by admit / load / release
    num_cached_tokens: int  # written by admit
    num_preemptions: int
    key_seed: bytes  # the key chained before token_ids[0] (b"": the sequence's start)

    @property
    def num_tokens(self) -> int: ...

    @property
    def is_finished(self) -> bool: ...
DISK_BANDWIDTH = 1e9  # bytes/s assumed for promotions from the disk tier (page-cache reads)
MAX_COPY_FAILURES = 4  # copies failing in a row: the copier is broken, not one copy (CopierDead)


@dataclass(eq=False, slots=True)
class RequestKV:
    """One request's KV across the tiers. Only KVCacheManager writes it.

    block_table[i] holds token page i on the device; host_pages[i] on the host, with
    len(host_pages) == cdiv(num_offload_issued, page_size) (only its last page can be partial, and a
    partial page is never in a prefix cache)."""

    block_table: list[int] = field(default_factory=list)
    page_hashes: list[bytes] = field(default_factory=list)  # chained keys of full pages, lazily extended
    num_published_pages: int = 0  # leading pages of block_table offered to the device prefix cache
    host_pages: list[int] = field(default_factory=list)
    num_offloaded_tokens: int = 0  # the write frontier: leading tokens whose KV the host holds
    num_offload_issued: int = 0  # leading tokens whose copy to the host is issued (>= the frontier)
    load_queue: list[tuple[int, int]] = field(default_factory=list)  # (device, host) pages not yet issued
    num_loading_pages: int = 0  # loads issued and not yet done
    num_load_tokens: int = 0  # num_computed_tokens once the load is in place
    load_source: str = ""  # the tier the load reads (HOST; DISK hits are promoted to the host first)
    epoch: int = 0  # moves on at each failed copy: copies issued before it carry nothing to trust
    remote_until: float = 0.0  # a REMOTE load: by then (monotonic) its sender can write no more
    recompute: bool = False  # a load of it failed: it is recomputed, never loaded again


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
    evictions: tuple[int, int]  # the device and host pools' eviction counts when it was taken

    @property
    def num_device_pages(self) -> int:
        return len(self.device_pages)


class CopyResults(NamedTuple):
    ready: list[Request]  # loading requests whose pages are all in place
    failed: list[Request]  # loading requests whose load failed: they go back to the queue and recompute


@dataclass
class OffloadStats:
    pages_written: int = 0
    pages_loaded: int = 0
    pages_evicted: int = 0  # written at preemption (not yet on the host when it came)
    pages_freed_at_once: int = 0  # device pages a preemption freed because the host held them
    pages_shared: int = 0  # host prefix pages a request took at admission instead of writing them
    host_full: int = 0  # times a write found no host page
    copies_failed: int = 0
    hit_tokens: int = 0  # prompt tokens a first admission found in the device prefix cache


class _Tag(NamedTuple):
    req: Request
    kv: RequestKV
    page_index: list[int]  # token page of each pair
    end: int  # WRITE: the issued frontier this job completes
    evict: bool  # WRITE: part of a preemption (what a serialized load waits for)
    epoch: int  # the request's epoch at submission
    keys: tuple[bytes, ...]  # WRITE: the full pages' keys counted in _keys_in_flight


class KVCacheManager:
    def __init__(self, device: PagePool, page_size: int, host: KVTier | None = None, copier: Copier | None = None,
                 mode: str = NO_OFFLOAD, load_evict_overlap: bool = True) -> None:
        assert mode in (WRITE_THROUGH, WRITE_BACK, NO_OFFLOAD)
        self.pool = device
        self.page_size = page_size
        self.host = host if host is not None else NullHostTier()
        self.copier = copier if copier is not None else NullCopier()
        self.mode = mode if self.host.num_pages else NO_OFFLOAD
        self.load_evict_overlap = load_evict_overlap
        self.stats = OffloadStats()
        self._kv: dict[str, RequestKV] = {}
        self.num_evicting = 0  # eviction jobs in flight
        self.num_unissued_loads = 0  # pages in loading requests' queues, not yet handed to the copier
        self._keys_in_flight: Counter[bytes] = Counter()  # full pages being written to the host, by key
        self._failures_in_a_row = 0
        self._remote_results: list[tuple[Request, bool, bool]] = []  # remote_done's, for the next poll
        # Pages another node may still write, of requests that ended or gave up on that node's
        # transfer: request -> (pages, monotonic time by which the sender's own timeout has stopped it)
        self._writing: dict[str, tuple[list[int], float]] = {}
        # s after a reservation by which its sender can write no more (federation/streaming.py horizon)
        self.remote_quarantine = 60.0
        # s a settled sender's last bytes may still be on the wire (over TCP, "done" means sent)
        self.remote_grace = 2.0

    @property
    def page_bytes(self) -> int:
        return self.host.page_bytes

    @property
    def can_reload(self) -> bool:
        """Whether a preempted request's KV can come back by a load (there is a host tier)."""
        return self.host.num_pages > 0

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
        st = self._kv.get(req.request_id) or RequestKV()
        ps = self.page_size
        chain_page_keys(req.token_ids, ps, st.page_hashes, None, req.key_seed)
        max_pages = (req.num_tokens - 1) // ps
        pages = self.pool.lookup(st.page_hashes[:max_pages])
        hit = len(pages)
        tokens, disk = min(st.num_offload_issued, req.num_tokens - 1), 0
        if st.recompute:  # its load failed: nothing comes back by a load any more
            tokens = 0
        elif not st.host_pages:  # never offloaded: the host (and disk) prefix cache
            found = self.host.lookup(st.page_hashes[:max_pages])
            tokens, disk = len(found) * ps, found[hit:].count(None)
        to_load = cdiv(tokens, ps) - hit
        unwritten = 0
        if to_load > 0 and st.host_pages:
            unwritten = cdiv(st.num_offload_issued, ps) - st.num_offloaded_tokens // ps
        return self._priced(pages, sum(self.pool.is_evictable(p) for p in pages), tokens if to_load > 0 else 0,
                            max(to_load, 0), disk if to_load > 0 else 0, unwritten)

    def refresh(self, req: Request, m: PrefixMatch) -> PrefixMatch:
        """`m` as it stands now: taken again if a pool evicted since, else with its evictable count
        and I/O times brought up to date (the queues moved)."""
        if m.evictions != (self.pool.num_evictions, self.host.pool.num_evictions):
            return self.match(req)
        return self._priced(m.device_pages, sum(self.pool.is_evictable(p) for p in m.device_pages), m.num_load_tokens,
                            m.num_pages_to_load, m.num_disk_pages, m.num_unwritten_pages)

    def _priced(self, pages: list[int], evictable: int, load_tokens: int, to_load: int, disk: int,
                unwritten: int) -> PrefixMatch:
        ps = self.page_size
        device_tokens = len(pages) * ps
        sources = [Source(DEVICE, device_tokens, 0.0)] if pages else []
        io = None
        if to_load:
            io = self.io_time(to_load, disk, unwritten)
            host_part = self.io_time(to_load - disk, 0, unwritten)
            disk_tokens = min(disk * ps, load_tokens - device_tokens)
            sources.append(Source(HOST, load_tokens - device_tokens - disk_tokens, host_part))
            if disk:
                sources.append(Source(DISK, disk_tokens, io - host_part))
        return PrefixMatch(pages, evictable, load_tokens, to_load, disk, unwritten, io,
                           tuple(sources), (self.pool.num_evictions, self.host.pool.num_evictions))

    # -- device pages -------------------------------------------------------------------------
    def pages_needed(self, req: Request, num_new_tokens: int) -> int:
        return max(0, cdiv(req.num_computed_tokens + num_new_tokens, self.page_size) - len(self.state(req).block_table))

    def admit(self, req: Request, m: PrefixMatch, num_new_tokens: int) -> bool:
        """Take the match's device pages and allocate room for `num_new_tokens` past them, or change
        nothing. With write-through, host pages already holding its prefix become its host copy."""
        st = self.state(req)
        assert not st.block_table and req.num_computed_tokens == 0
        hit = m.device_pages
        fresh = cdiv(len(hit) * self.page_size + num_new_tokens, self.page_size) - len(hit)
        if fresh > self.pool.num_free - m.num_evictable:
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
        if self.mode == WRITE_THROUGH:
            self.stats.pages_shared += self._attach_host_prefix(req, st, promote=False)
        return True

    def grow(self, req: Request, num_new_tokens: int) -> bool:
        """Make the block table cover num_computed_tokens + num_new_tokens, or change nothing."""
        need = self.pages_needed(req, num_new_tokens)
        if need > self.pool.num_free:
            return False
        self.state(req).block_table.extend(self.pool.allocate() for _ in range(need))
        return True

    def commit(self, req: Request) -> None:
        """Publish every page whose tokens are all computed (prompt or output) to the prefix cache."""
        if not self.pool.enable_prefix_caching:
            return
        st = self.state(req)
        num_full = req.num_computed_tokens // self.page_size
        chain_page_keys(req.token_ids, self.page_size, st.page_hashes, req.num_computed_tokens, req.key_seed)
        for i in range(st.num_published_pages, num_full):
            self.pool.register(st.block_table[i], st.page_hashes[i])
        st.num_published_pages = max(st.num_published_pages, num_full)

    def pages_exclusive(self, req: Request) -> int:
        """Of the request's device pages, how many no other request holds (what preempting it frees)."""
        return sum(self.pool.ref_count(p) == 1 for p in self.state(req).block_table)

    # -- preempt, load, free --------------------------------------------------------------------
    def preempt(self, req: Request) -> None:
        """Give up the request's device pages. With a host tier, what the host lacks (the rest of its
        computed KV, partial last page included) is written first as one eviction job: pages below
        the frontier are freed at once, the job's when it ends. Without one, the KV is recomputed."""
        st = self.state(req)
        if self.can_reload:
            pairs, reach = self._write_pairs(req, st, req.num_computed_tokens, len(st.block_table))
            if pairs:
                self._submit(WRITE, req, st, pairs, reach, evict=True)
                st.num_offload_issued = reach
                self.stats.pages_evicted += len(pairs)
            self.stats.pages_freed_at_once += sum(self.pool.ref_count(p) == 1 for p in st.block_table)
        self._release_device(req, st)

    def preempt_io_time(self, req: Request) -> float | None:
        """Seconds a preemption of running `req` costs in copies: write what the host lacks, then
        load it all back; None without a host tier (it would recompute)."""
        if not self.can_reload:
            return None
        st = self.state(req)
        missing = cdiv(req.num_computed_tokens, self.page_size) - st.num_offloaded_tokens // self.page_size
        write = (self.copier.queued_bytes(WRITE) + max(missing, 0) * self.page_bytes) / self.copier.bandwidth[WRITE].value
        return write + self.io_time(len(st.block_table))

    def start_load(self, req: Request, m: PrefixMatch) -> bool:
        """Admit `req` to come back with its first `m.num_load_tokens` tokens computed: device-cached pages
        are taken as they are, the rest allocated and queued to load from its host copy (a request
        that never offloaded first takes the host prefix cache's pages as that copy, promoting disk
        hits). Or change nothing and return False."""
        st = self.state(req)
        assert not st.block_table and req.num_computed_tokens == 0
        if not self.load_evict_overlap and self.num_evicting:
            return False  # serialized: loads wait for the evictions in flight
        ps = self.page_size
        n_pages = cdiv(m.num_load_tokens, ps)
        hit = m.device_pages[:n_pages]
        evictable = sum(self.pool.is_evictable(p) for p in hit)
        if n_pages - len(hit) > self.pool.num_free - evictable:
            return False
        attached = self._attach_host_prefix(req, st, promote=True)
        if len(st.host_pages) < n_pages:  # the prefix cache lost pages (or promotion found no room)
            if attached:
                self._drop_host_copy(st, 0)
            return False
        assert n_pages > len(hit), "nothing to load: admit it as usual"
        for p in hit:
            self.pool.incref(p)
        st.block_table = list(hit) + [self.pool.allocate() for _ in range(n_pages - len(hit))]
        st.load_queue = [(st.block_table[i], st.host_pages[i]) for i in range(len(hit), n_pages)]
        self.num_unissued_loads += len(st.load_queue)
        st.num_load_tokens = m.num_load_tokens
        st.load_source = HOST
        st.num_published_pages = len(hit)
        return True

    def start_remote(self, req: Request, num_tokens: int) -> list[int] | None:
        """Admit `req` with its first `num_tokens` of KV to be written by another node (a decode node
        taking over a prefill node's request, federation/): its device pages are allocated now for
        the sender to write into, and it runs once `remote_done` says they are in place. None (and
        nothing changes) when the pool lacks the pages."""
        st = self.state(req)
        assert not st.block_table and req.num_computed_tokens == 0
        n_pages = cdiv(num_tokens, self.page_size)
        if n_pages > self.pool.num_free:
            return None
        st.block_table = [self.pool.allocate() for _ in range(n_pages)]
        st.num_load_tokens = num_tokens
        st.load_source = REMOTE
        st.remote_until = time.monotonic() + self.remote_quarantine
        return list(st.block_table)

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
        self._drop_host_copy(st, 0)

    def drop(self, req: Request) -> None:
        """`free` for a request that lives on and starts its KV afresh (its tokens changed): copies
        of its old KV still in flight end as a failed request's would, with nothing done for it."""
        st = self._kv.get(req.request_id)
        if st is not None:
            st.epoch += 1
        self.free(req)

    def _release_device(self, req: Request, st: RequestKV) -> None:
        """Release the request's device pages, tail first, so that LRU eviction takes the tails of
        prefixes before their heads; a page a copy still reads stays pinned until it ends."""
        for page in reversed(st.block_table):
            self.pool.decref(page)
        st.block_table = []
        req.num_computed_tokens = st.num_published_pages = 0
        self.num_unissued_loads -= len(st.load_queue)
        st.load_queue = []

    def _drop_host_copy(self, st: RequestKV, keep_pages: int) -> None:
        """Let go of the request's host pages past the first `keep_pages`."""
        for page in reversed(st.host_pages[keep_pages:]):
            self.host.pool.decref(page)
        del st.host_pages[keep_pages:]
        st.num_offload_issued = st.num_offloaded_tokens = min(st.num_offloaded_tokens, keep_pages * self.page_size)

    def _attach_host_prefix(self, req: Request, st: RequestKV, promote: bool) -> int:
        """A request without a host copy takes the host prefix cache's pages of its prefix as its own
        (promoting disk hits to the host when `promote`), so neither a load nor a write repeats
        them. Returns how many pages it took."""
        if st.host_pages:
            return 0
        found = self.host.lookup(st.page_hashes[: (req.num_tokens - 1) // self.page_size])
        if not promote and None in found:
            found = found[: found.index(None)]
        for page in found:  # held first, so that promotions cannot evict them
            if page is not None:
                self.host.pool.incref(page)
        for i, page in enumerate(found):
            if page is None:
                page = self.host.promote(st.page_hashes[i])
                if page is None:  # no room: keep the prefix up to here
                    for p in found[i + 1 :]:
                        if p is not None:
                            self.host.pool.decref(p)
                    break
            st.host_pages.append(page)
        st.num_offloaded_tokens = st.num_offload_issued = len(st.host_pages) * self.page_size
        return len(st.host_pages)

    # -- copies -------------------------------------------------------------------------------
    def _submit(self, lane: str, req: Request, st: RequestKV, pairs: list[tuple[int, int, int]], end: int = 0,
                evict: bool = False) -> None:
        """Copy (token page, device page, host page) triples; every page is pinned until poll sees the end."""
        for _, d, h in pairs:
            self.pool.incref(d)
            self.host.pool.incref(h)
        keys: tuple[bytes, ...] = ()
        if lane == WRITE:  # the full pages it writes, by key: another request waits for them (_share_written)
            chain_page_keys(req.token_ids, self.page_size, st.page_hashes, end, req.key_seed)
            keys = tuple(st.page_hashes[i] for i, _, _ in pairs if (i + 1) * self.page_size <= end)
            self._keys_in_flight.update(keys)
        tag = _Tag(req, st, [i for i, _, _ in pairs], end, evict, st.epoch, keys)
        self.copier.submit(CopyJob(lane, [d for _, d, _ in pairs], [h for _, _, h in pairs],
                                   len(pairs) * self.page_bytes, tag))
        self.num_evicting += evict

    def poll(self) -> CopyResults:
        """Account for the copies that ended."""
        ready, failed = [], []
        self._poll_remote(ready, failed)
        for job in self.copier.poll():
            tag: _Tag = job.tag
            req, st = tag.req, tag.kv
            if job.lane == WRITE:
                self.num_evicting -= tag.evict
                for key in tag.keys:  # only this job's keys: no walk over every key in flight
                    self._keys_in_flight[key] -= 1
                    if not self._keys_in_flight[key]:
                        del self._keys_in_flight[key]
            trusted = tag.epoch == st.epoch  # no copy of this request failed since it was issued
            live = trusted and not req.is_finished
            self._failures_in_a_row = self._failures_in_a_row + 1 if job.error is not None else 0
            if job.error is not None:
                self.stats.copies_failed += 1
                log.error("KV %s of %d pages for %s failed: %s", job.lane, len(job.host_pages), req.request_id,
                          job.error)
                if live:
                    st.epoch += 1  # the copies of it still in flight carry nothing to trust either
                    if st.num_load_tokens:  # a load in progress (or waiting on this write) cannot finish
                        self._release_device(req, st)
                        self._drop_host_copy(st, 0)
                        st.num_loading_pages = st.num_load_tokens = 0
                        st.recompute = True
                        failed.append(req)
                    else:  # keep what was written before it; the rest is recomputed
                        self._drop_host_copy(st, st.num_offloaded_tokens // self.page_size)
            elif job.lane == WRITE:
                self.stats.pages_written += len(job.host_pages)
                if live:
                    st.num_offloaded_tokens = max(st.num_offloaded_tokens, tag.end)
                if trusted:  # the bytes are good even if the request has ended: others may share them
                    self._publish(req, st, tag.page_index, job.host_pages, tag.end)
            else:
                self.stats.pages_loaded += len(job.host_pages)
                if live:
                    st.num_loading_pages -= len(job.host_pages)
                    if not st.load_queue and st.num_loading_pages == 0 and st.num_load_tokens:
                        ready.append(req)
            for d in job.device_pages:
                self.pool.decref(d)
            for h in job.host_pages:
                self.host.pool.decref(h)
        if self._failures_in_a_row >= MAX_COPY_FAILURES:
            raise CopierDead(f"{self._failures_in_a_row} KV copies in a row failed, the last with {job.error}")
        return CopyResults(ready, failed)

    def _publish(self, req: Request, st: RequestKV, page_index: list[int], host_pages: list[int], end: int) -> None:
        """Offer the written full pages to the host prefix cache under their chained keys."""
        if not self.host.pool.enable_prefix_caching:
            return
        chain_page_keys(req.token_ids, self.page_size, st.page_hashes, end, req.key_seed)
        for i, h in zip(page_index, host_pages):
            if (i + 1) * self.page_size <= end:
                self.host.pool.register(h, st.page_hashes[i])

    def _host_page(self, st: RequestKV, i: int) -> int | None:
        """The request's host page for token page i (i <= len(host_pages)), allocating it if new."""
        if i < len(st.host_pages):
            return st.host_pages[i]
        page = self.host.allocate()
        if page is None:
            self.stats.host_full += 1
            return None
        st.host_pages.append(page)
        return page

    def _write_pairs(self, req: Request, st: RequestKV, end_tokens: int, max_pages: int
                     ) -> tuple[list[tuple[int, int, int]], int]:
        """Up to max_pages (token page, device, host) triples from the issued frontier toward
        end_tokens, and the frontier they reach."""
        ps = self.page_size
        pairs = []
        for i in range(st.num_offload_issued // ps, min(cdiv(end_tokens, ps), len(st.block_table))):
            if len(pairs) >= max_pages:
                break
            h = self._host_page(st, i)
            if h is None:
                break
            pairs.append((i, st.block_table[i], h))
        reach = min(end_tokens, (pairs[-1][0] + 1) * ps) if pairs else st.num_offload_issued
        return pairs, reach

    def issue(self, step_seconds: float, running: Iterable[Request], loading: Iterable[Request],
              buffer_of: Callable[[Request], float]) -> None:
        """Before a step: queue the loads and write-through copies that fit in `step_seconds` at each
        lane's measured bandwidth, less what is still queued (synchronous chunked writing)."""
        self._issue_loads(step_seconds, loading)
        if self.mode == WRITE_THROUGH:
            self._issue_writes(step_seconds, running, buffer_of)

    def _budget_pages(self, lane: str, step_seconds: float) -> int:
        if step_seconds == math.inf:
            return sys.maxsize
        room = self.copier.bandwidth[lane].value * step_seconds - self.copier.queued_bytes(lane)
        pages = int(room // self.page_bytes)
        return max(pages, 0 if self.copier.busy(lane) else 1)  # an idle lane always moves a page

    def _issue_writes(self, step_seconds: float, running: Iterable[Request], buffer_of) -> None:
        ps = self.page_size
        behind = [r for r in running if (r.num_computed_tokens // ps) * ps > self.state(r).num_offload_issued]
        budget = self._budget_pages(WRITE, step_seconds)
        for req in sorted(behind, key=buffer_of, reverse=True):  # largest buffer: likeliest preempted
            if budget <= 0:
                break
            st = self.state(req)
            end = (req.num_computed_tokens // ps) * ps
            if not self._share_written(req, st, end):
                continue  # its next page is being written for another request: share it once it lands
            pairs, reach = self._write_pairs(req, st, end, budget)
            if pairs:
                self._submit(WRITE, req, st, pairs, reach)
                st.num_offload_issued = reach
                budget -= len(pairs)

    def _share_written(self, req: Request, st: RequestKV, end_tokens: int) -> bool:
        """Host pages that already hold the request's next full pages (another request sharing its
        prefix wrote them) become its own copy, and the frontier moves past them: nothing is
        written twice. Only at a whole-page frontier with no write of its own in flight. False:
        the next page is being written for another request (wait for it rather than copy it too)."""
        ps = self.page_size
        i = st.num_offloaded_tokens // ps
        if st.num_offload_issued != st.num_offloaded_tokens or st.num_offloaded_tokens % ps or i >= end_tokens // ps:
            return True
        chain_page_keys(req.token_ids, ps, st.page_hashes, end_tokens, req.key_seed)
        start = i
        while i < end_tokens // ps:
            found = self.host.pool.lookup(st.page_hashes[i : i + 1])
            if not found:
                break
            self.host.pool.incref(found[0])
            st.host_pages.append(found[0])
            i += 1
        st.num_offloaded_tokens = st.num_offload_issued = i * ps
        self.stats.pages_shared += i - start
        return i == end_tokens // ps or st.page_hashes[i] not in self._keys_in_flight

    def _issue_loads(self, step_seconds: float, loading: Iterable[Request]) -> None:
        if not self.num_unissued_loads or (not self.load_evict_overlap and self.num_evicting):
            return
        budget = self._budget_pages(LOAD, step_seconds)
        for req in loading:
            if budget <= 0:
                break
            st = self.state(req)
            if st.num_offloaded_tokens < st.num_offload_issued:
                continue  # its eviction is still being written: nothing to read yet
            n = min(budget, len(st.load_queue))
            if n:
                chunk, st.load_queue = st.load_queue[:n], st.load_queue[n:]
                self.num_unissued_loads -= n
                self._submit(LOAD, req, st, [(i, d, h) for i, (d, h) in enumerate(chunk)])
                st.num_loading_pages += n
                budget -= n

    def io_time(self, num_pages: int, num_disk_pages: int = 0, num_unwritten_pages: int = 0) -> float:
        """t_IO: seconds until `num_pages` loaded now would be in place: the load queue first, and
        pages still being written (or on disk) must reach the host before they can be read."""
        bw = self.copier.bandwidth[LOAD].value
        queued = self.copier.queued_bytes(LOAD) + self.num_unissued_loads * self.page_bytes
        t = (queued + num_pages * self.page_bytes) / bw + num_disk_pages * self.page_bytes / DISK_BANDWIDTH
        if num_unwritten_pages:
            t += self.copier.queued_bytes(WRITE) / self.copier.bandwidth[WRITE].value
        return t

    def busy(self) -> bool:
        return self.copier.busy_any()

    def pins(self) -> tuple[Counter, Counter]:
        """(device, host) page -> references the copies in flight hold on it."""
        dev, host = Counter(), Counter()
        for jobs in self.copier.in_flight.values():
            for job in jobs:
                dev.update(job.device_pages)
                host.update(job.host_pages)
        return dev, host

    def wait(self) -> None:
        """Block until every copy in flight has ended; the next poll accounts for them."""
        self.copier.wait()

    def wait_oldest(self) -> None:
        """Block until the oldest copy in flight has ended (nothing to compute until KV is in place)."""
        self.copier.wait_oldest()

    def close(self) -> None:
        self.copier.close()
        self.host.close()
