"""The hierarchical KV manager (tokenflow.txt §5): write-through, synchronous chunked writing,
preempt with load–evict overlap, resume by loading only what is missing, live t_IO estimates.

    each step:  poll()                 copies that ended: unpin pages, advance write frontiers,
                                       publish host pages, requests whose loads are all in place
                schedule ...           preempt(req) / start_load(req, ...) from the scheduler
                issue(t_step, running) write-through and load chunks sized to end inside the step

A request's pages across the tiers (page_size 4; P = preempted):

    token pages      0    1    2    3    4
    block_table     d7   d2   d9   d4   d5        device (engine/page_pool.py)
    host_pages      h0   h1   h3                  host (tiers.py)
                    [ written  )[flight)          write frontier at 8 tokens, issued to 12
    on P:  d7 d2 freed at once; d9 freed when its copy ends; d4 d5 (not yet written, computed
           to token 18) written as one eviction job, then freed.
    resume: pages still cached on the device (a prefix hit) are taken as they are; only the
           others are loaded, a chunk a step, and the request rejoins the batch when all are in.

Modes: write-through copies each full computed page of a running request soon after it is
computed (largest client buffer first: the likeliest to be preempted); write-back copies nothing
until a preemption, then everything the host does not hold. Without load–evict overlap a load
waits until no eviction is in flight (the ablation's serialized baseline).
"""
from __future__ import annotations

import logging
import math
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, NamedTuple

from tokenflowd.buffer.policy import cdiv
from tokenflowd.engine.page_pool import OutOfPages, PagePool, chain_page_keys
from tokenflowd.engine.request import Request, RequestStatus
from tokenflowd.offload.copier import LOAD, WRITE, Copier, CopyJob
from tokenflowd.offload.tiers import HostTier

log = logging.getLogger(__name__)

WRITE_THROUGH, WRITE_BACK = "write-through", "write-back"
DISK_BANDWIDTH = 1e9  # bytes/s assumed for promotions from the disk tier (page-cache reads)


class _Tag(NamedTuple):
    req: Request
    page_index: list[int]  # token page of each pair
    end: int  # WRITE: the issued frontier this job completes
    evict: bool  # WRITE: part of a preemption (what a serialized load waits for)


@dataclass
class OffloadStats:
    pages_written: int = 0
    pages_loaded: int = 0
    pages_evicted: int = 0  # written at preemption (not yet on the host when it came)
    pages_freed_at_once: int = 0  # device pages a preemption freed because the host held them
    host_full: int = 0  # times a write found no host page


class HostPrefix(NamedTuple):
    """What the host tier can give a waiting request beyond its device prefix hit."""

    num_tokens: int  # leading tokens whose KV comes back by loading (0: nothing to load)
    num_pages_to_load: int
    num_disk_pages: int  # of those, how many must first be read from the disk tier
    num_unwritten_pages: int = 0  # of those, how many are still being written to the host


class OffloadManager:
    def __init__(self, device: PagePool, host: HostTier, copier: Copier, page_size: int, mode: str,
                 load_evict_overlap: bool = True) -> None:
        assert mode in (WRITE_THROUGH, WRITE_BACK)
        self.device = device
        self.host = host
        self.copier = copier
        self.page_size = page_size
        self.mode = mode
        self.load_evict_overlap = load_evict_overlap
        self.loading: list[Request] = []  # admission order
        self.num_evicting = 0  # eviction jobs in flight
        self.stats = OffloadStats()

    @property
    def page_bytes(self) -> int:
        return self.host.page_bytes

    @property
    def num_unissued_loads(self) -> int:
        return sum(len(r.load_queue) for r in self.loading)

    # -- copies -------------------------------------------------------------------------------
    def _submit(self, lane: str, req: Request, pairs: list[tuple[int, int, int]], end: int = 0,
                evict: bool = False) -> None:
        """Copy (token page, device page, host page) triples; every page is pinned until poll sees the end."""
        for _, d, h in pairs:
            self.device.incref(d)
            self.host.pool.incref(h)
        tag = _Tag(req, [i for i, _, _ in pairs], end, evict)
        self.copier.submit(CopyJob(lane, [d for _, d, _ in pairs], [h for _, _, h in pairs],
                                   len(pairs) * self.page_bytes, tag))
        self.num_evicting += evict

    def poll(self) -> list[Request]:
        """Account for the copies that ended; the LOADING requests now fully in place."""
        ready = []
        for job in self.copier.poll():
            tag: _Tag = job.tag
            req = tag.req
            if job.lane == WRITE:
                self.stats.pages_written += len(job.host_pages)
                self.num_evicting -= tag.evict
                if not req.is_finished:
                    req.num_offloaded_tokens = max(req.num_offloaded_tokens, tag.end)
                self._publish(req, tag.page_index, job.host_pages, tag.end)
            else:
                self.stats.pages_loaded += len(job.host_pages)
                req.num_loading_pages -= len(job.host_pages)
                if req.status is RequestStatus.LOADING and not req.load_queue and req.num_loading_pages == 0:
                    ready.append(req)
            for d in job.device_pages:
                self.device.decref(d)
            for h in job.host_pages:
                self.host.pool.decref(h)
        for req in ready:
            self.loading.remove(req)
        return ready

    def _publish(self, req: Request, page_index: list[int], host_pages: list[int], end: int) -> None:
        """Offer the written full pages to the host prefix cache under their chained keys."""
        if not self.host.pool.enable_prefix_caching:
            return
        chain_page_keys(req.token_ids, self.page_size, req.page_hashes, end)
        for i, h in zip(page_index, host_pages):
            if (i + 1) * self.page_size <= end:
                self.host.pool.register(h, req.page_hashes[i])

    def _host_page(self, req: Request, i: int) -> int | None:
        """Request's host page for token page i (i <= len(host_pages)), allocating it if new."""
        if i < len(req.host_pages):
            return req.host_pages[i]
        try:
            page = self.host.pool.allocate()
        except OutOfPages:
            self.stats.host_full += 1
            return None
        req.host_pages.append(page)
        return page

    def _write_pairs(self, req: Request, end_tokens: int, max_pages: int) -> tuple[list[tuple[int, int, int]], int]:
        """Up to max_pages (token page, device, host) triples from the issued frontier toward
        end_tokens, and the frontier they reach."""
        ps = self.page_size
        pairs = []
        for i in range(req.num_offload_issued // ps, min(cdiv(end_tokens, ps), len(req.block_table))):
            if len(pairs) >= max_pages:
                break
            h = self._host_page(req, i)
            if h is None:
                break
            pairs.append((i, req.block_table[i], h))
        reach = min(end_tokens, (pairs[-1][0] + 1) * ps) if pairs else req.num_offload_issued
        return pairs, reach

    # -- the step's chunked writing and loading -------------------------------------------------
    def issue(self, step_seconds: float, running: Iterable[Request], buffer_of) -> None:
        """Before a step: queue the loads and write-through copies that fit in `step_seconds` at each
        lane's measured bandwidth, less what is still queued (synchronous chunked writing)."""
        self._issue_loads(step_seconds)
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
        behind = [r for r in running if (r.num_computed_tokens // ps) * ps > r.num_offload_issued]
        budget = self._budget_pages(WRITE, step_seconds)
        for req in sorted(behind, key=buffer_of, reverse=True):  # largest buffer: likeliest preempted
            if budget <= 0:
                break
            pairs, reach = self._write_pairs(req, (req.num_computed_tokens // ps) * ps, budget)
            if pairs:
                self._submit(WRITE, req, pairs, reach)
                req.num_offload_issued = reach
                budget -= len(pairs)

    def _issue_loads(self, step_seconds: float) -> None:
        if not self.loading or (not self.load_evict_overlap and self.num_evicting):
            return
        budget = self._budget_pages(LOAD, step_seconds)
        for req in self.loading:
            if budget <= 0:
                break
            if req.num_offloaded_tokens < req.num_offload_issued:
                continue  # its eviction is still being written: nothing to read yet
            n = min(budget, len(req.load_queue))
            if n:
                chunk, req.load_queue = req.load_queue[:n], req.load_queue[n:]
                self._submit(LOAD, req, [(i, d, h) for i, (d, h) in enumerate(chunk)])
                req.num_loading_pages += n
                budget -= n

    # -- preempt and resume ---------------------------------------------------------------------
    def preempt(self, req: Request) -> None:
        """Before the request lets go of its device pages: write what the host does not hold yet
        (the rest of its computed KV, partial last page included), as one eviction job. Pages
        below the frontier are then freed at once; the job's pages when it ends."""
        pairs, reach = self._write_pairs(req, req.num_computed_tokens, len(req.block_table))
        if pairs:
            self._submit(WRITE, req, pairs, reach, evict=True)
            req.num_offload_issued = reach
            self.stats.pages_evicted += len(pairs)
        self.stats.pages_freed_at_once += sum(self.device.ref_count(p) == 1 for p in req.block_table)

    def reloadable_tokens(self, req: Request) -> int:
        """Leading tokens a load restores: its own host copy, counting writes still in flight (its
        loads start once they have landed)."""
        return min(req.num_offload_issued, req.num_tokens - 1)

    def host_prefix(self, req: Request, device_hit_pages: int) -> HostPrefix:
        """What loading would restore beyond the device hit (no state changes: the view asks every step)."""
        ps = self.page_size
        tokens = self.reloadable_tokens(req)
        disk = 0
        if not req.host_pages:  # never offloaded: the host (and disk) prefix cache
            max_pages = (req.num_tokens - 1) // ps
            chain_page_keys(req.token_ids, ps, req.page_hashes)
            found = self.host.lookup(req.page_hashes[:max_pages])
            tokens, disk = len(found) * ps, found[device_hit_pages:].count(None)
        to_load = cdiv(tokens, ps) - device_hit_pages
        if to_load <= 0:
            return HostPrefix(0, 0, 0)
        unwritten = cdiv(req.num_offload_issued, ps) - req.num_offloaded_tokens // ps if req.host_pages else 0
        return HostPrefix(tokens, to_load, disk, unwritten)

    def io_time(self, num_pages: int, num_disk_pages: int = 0, num_unwritten_pages: int = 0) -> float:
        """t_IO: seconds until `num_pages` loaded now would be in place: the load queue first, and
        pages still being written (or on disk) must reach the host before they can be read."""
        bw = self.copier.bandwidth[LOAD].value
        queued = self.copier.queued_bytes(LOAD) + self.num_unissued_loads * self.page_bytes
        t = (queued + num_pages * self.page_bytes) / bw + num_disk_pages * self.page_bytes / DISK_BANDWIDTH
        if num_unwritten_pages:
            t += self.copier.queued_bytes(WRITE) / self.copier.bandwidth[WRITE].value
        return t

    def write_time(self, req: Request) -> float:
        """Seconds to write what the host lacks of a running request were it preempted now."""
        missing = cdiv(req.num_computed_tokens, self.page_size) - req.num_offloaded_tokens // self.page_size
        return (self.copier.queued_bytes(WRITE) + max(missing, 0) * self.page_bytes) / self.copier.bandwidth[WRITE].value

    def attach_host_prefix(self, req: Request) -> None:
        """A request that never offloaded takes the host prefix cache's pages as its own host copy
        (promoting disk hits to the host), so neither a load nor a write repeats them."""
        if req.host_pages:
            return
        found = self.host.lookup(req.page_hashes[: (req.num_tokens - 1) // self.page_size])
        for page in found:  # held first, so that promotions cannot evict them
            if page is not None:
                self.host.pool.incref(page)
        for i, page in enumerate(found):
            if page is None:
                page = self.host.promote(req.page_hashes[i])
                if page is None:  # no room: keep the prefix up to here
                    for p in found[i + 1 :]:
                        if p is not None:
                            self.host.pool.decref(p)
                    break
            req.host_pages.append(page)
        req.num_offloaded_tokens = req.num_offload_issued = len(req.host_pages) * self.page_size

    def start_load(self, req: Request, device_hit: list[int], num_tokens: int) -> bool:
        """Admit `req` as LOADING: take its device hit, allocate pages for the rest of its first
        `num_tokens` tokens and queue their loads; or change nothing and return False."""
        if not self.load_evict_overlap and self.num_evicting:
            return False  # serialized: loads wait for the evictions in flight
        ps = self.page_size
        n_pages = cdiv(num_tokens, ps)
        hit = device_hit[:n_pages]
        evictable = sum(self.device.is_evictable(p) for p in hit)
        if n_pages - len(hit) > self.device.num_free - evictable or len(req.host_pages) < n_pages:
            return False
        assert n_pages > len(hit), "nothing to load: admit it as usual"
        for p in hit:
            self.device.incref(p)
        req.block_table = list(hit) + [self.device.allocate() for _ in range(n_pages - len(hit))]
        req.load_queue = [(req.block_table[i], req.host_pages[i]) for i in range(len(hit), n_pages)]
        req.num_load_tokens = num_tokens
        req.num_published_pages = len(hit)
        req.status = RequestStatus.LOADING
        self.loading.append(req)
        return True

    def release(self, req: Request) -> None:
        """The request ends: its host pages go back (cached if keyed); copies in flight keep their pins."""
        for page in reversed(req.host_pages):
            self.host.pool.decref(page)
        req.host_pages = []
        req.num_offloaded_tokens = req.num_offload_issued = 0
        req.load_queue = []
        if req in self.loading:
            self.loading.remove(req)

    def pins(self) -> tuple[Counter, Counter]:
        """(device, host) page -> references the copies in flight hold on it."""
        dev, host = Counter(), Counter()
        for jobs in self.copier.in_flight.values():
            for job in jobs:
                dev.update(job.device_pages)
                host.update(job.host_pages)
        return dev, host

    def wait(self) -> None:
        """Block until every copy in flight has ended; the scheduler's next poll accounts for them."""
        self.copier.wait()

    def close(self) -> None:
        self.copier.close()
        self.host.close()
