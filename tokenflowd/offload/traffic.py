"""HostOffloader: the traffic between the device tier and the host tier (tokenflow.txt §5), behind
kv/offloader.py's seam; the KV manager (kv/manager.py) drives it.

    step:      issue(t_step, running, loading) write-through and load chunks sized to end in the step
    next step: poll() -> CopyResults           copies that ended: frontiers advance, host pages are
                                               published, loads in place (or failed) are handed back

A request's pages on the device and the host (page_size 4; P = preempted):

    token pages      0    1    2    3    4
    block_table     d7   d2   d9   d4   d5        device (kv/pages.py, DeviceTier)
    host_pages      h0   h1   h3                  host (tiers.py HostTier)
                    [ written  )[flight)          write frontier at 8 tokens, issued to 12
    on P:  d7 d2 freed at once; d9 freed when its copy ends; d4 d5 (not yet written, computed
           to token 18) written as one eviction job, then freed.
    resume: pages still cached on the device (a prefix hit) are taken as they are; only the
           others are loaded, a chunk a step, and the request rejoins the batch when all are in.

Write modes: write-through copies each full computed page of a running request soon after it is
computed (largest client buffer first: the likeliest to be preempted); write-back copies nothing
until a preemption, then everything the host does not hold. A request admitted with its prefix
already on the host takes those host pages as its own copy, so a shared system prompt is written
once. Without load–evict overlap a load waits until no eviction is in flight (the ablation's
serialized baseline).

Faults: a copy that fails (kv/copier.py) publishes nothing and moves no frontier; the request's
host copy past its frontier is dropped, so what it lacks is recomputed. A load that fails sends
its request back to the queue without its host copy (it recomputes). Copies already in flight for
that request are then stale: they only let go of their pins.
"""
from __future__ import annotations

import logging
import math
import sys
from collections import Counter
from typing import Callable, Iterable, NamedTuple

from tokenflowd.kv.copier import LOAD, WRITE, Copier, CopierDead, CopyJob
from tokenflowd.kv.offloader import NO_OFFLOAD, WRITE_BACK, WRITE_THROUGH, CopyResults, Offloader, OffloadStats, Reload
from tokenflowd.kv.pages import PagePool, cdiv, chain_page_keys
from tokenflowd.kv.state import Request, RequestKV
from tokenflowd.kv.tiers import KVTier

log = logging.getLogger(__name__)

DISK_BANDWIDTH = 1e9  # bytes/s assumed for promotions from the disk tier (page-cache reads)
MAX_COPY_FAILURES = 4  # copies failing in a row: the copier is broken, not one copy (CopierDead)


class _Tag(NamedTuple):
    req: Request
    kv: RequestKV
    page_index: list[int]  # token page of each pair
    end: int  # WRITE: the issued frontier this job completes
    evict: bool  # WRITE: part of a preemption (what a serialized load waits for)
    epoch: int  # the request's epoch at submission
    keys: tuple[bytes, ...]  # WRITE: the full pages' keys counted in _keys_in_flight


class HostOffloader(Offloader):
    """Write-through or write-back to `host` over `copier`; `device` is the pool whose pages the
    copies pin."""

    def __init__(self, device: PagePool, page_size: int, host: KVTier, copier: Copier, mode: str = WRITE_THROUGH,
                 load_evict_overlap: bool = True) -> None:
        assert mode in (WRITE_THROUGH, WRITE_BACK, NO_OFFLOAD)
        self.pool = device
        self.page_size = page_size
        self.host = host
        self.copier = copier
        self.mode = mode if host.num_pages else NO_OFFLOAD
        self.load_evict_overlap = load_evict_overlap
        self.stats = OffloadStats()
        self.num_evicting = 0
        self.num_unissued_loads = 0  # pages in loading requests' queues, not yet handed to the copier
        self._keys_in_flight: Counter[bytes] = Counter()  # full pages being written to the host, by key
        self._failures_in_a_row = 0

    # -- what a load could restore, and when ----------------------------------------------------
    def reload(self, req: Request, st: RequestKV, max_pages: int, num_device_pages: int) -> Reload:
        ps = self.page_size
        if st.recompute:  # its load failed: nothing comes back by a load any more
            return Reload(0, 0, 0)
        if not st.host_pages:  # never offloaded: the host (and disk) prefix cache
            found = self.host.lookup(st.page_hashes[:max_pages])
            return Reload(len(found) * ps, found[num_device_pages:].count(None), 0)
        unwritten = cdiv(st.num_offload_issued, ps) - st.num_offloaded_tokens // ps
        return Reload(min(st.num_offload_issued, req.num_tokens - 1), 0, unwritten)

    def io_time(self, num_pages: int, num_disk_pages: int = 0, num_unwritten_pages: int = 0) -> float:
        """t_IO: seconds until `num_pages` loaded now would be in place: the load queue first, and
        pages still being written (or on disk) must reach the host before they can be read."""
        bw = self.copier.bandwidth[LOAD].value
        queued = self.copier.queued_bytes(LOAD) + self.num_unissued_loads * self.page_bytes
        t = (queued + num_pages * self.page_bytes) / bw + num_disk_pages * self.page_bytes / DISK_BANDWIDTH
        if num_unwritten_pages:
            t += self.copier.queued_bytes(WRITE) / self.copier.bandwidth[WRITE].value
        return t

    def io_key(self) -> tuple:
        c = self.copier
        return (c.queued_bytes(LOAD), self.num_unissued_loads, c.bandwidth[LOAD].value, c.queued_bytes(WRITE),
                c.bandwidth[WRITE].value)

    def preempt_io_time(self, req: Request, st: RequestKV) -> float | None:
        """Write what the host lacks, then load it all back; None without a host tier."""
        if not self.can_reload:
            return None
        missing = cdiv(req.num_computed_tokens, self.page_size) - st.num_offloaded_tokens // self.page_size
        write = (self.copier.queued_bytes(WRITE) + max(missing, 0) * self.page_bytes) / self.copier.bandwidth[WRITE].value
        return write + self.io_time(len(st.block_table))

    # -- admit, preempt, load, free ---------------------------------------------------------------
    def on_admit(self, req: Request, st: RequestKV) -> None:
        """With write-through, host pages already holding its prefix become its host copy."""
        if self.mode == WRITE_THROUGH:
            self.stats.pages_shared += self._attach_host_prefix(req, st, promote=False)

    def evict(self, req: Request, st: RequestKV) -> None:
        """What the host lacks (the rest of its computed KV, partial last page included) is written
        as one eviction job: pages below the frontier are freed at once, the job's when it ends."""
        if not self.can_reload:
            return
        pairs, reach = self._write_pairs(req, st, req.num_computed_tokens, len(st.block_table))
        if pairs:
            self._submit(WRITE, req, st, pairs, reach, evict=True)
            st.num_offload_issued = reach
            self.stats.pages_evicted += len(pairs)
        self.stats.pages_freed_at_once += self.pool.num_held_alone(st.block_table)

    def take_host_copy(self, req: Request, st: RequestKV, num_pages: int) -> bool:
        """A request that never offloaded first takes the host prefix cache's pages as its copy,
        promoting disk hits. False (nothing changed) if that copy is short, or if loads must wait
        for the evictions in flight (no load–evict overlap)."""
        if not self.load_evict_overlap and self.num_evicting:
            return False
        attached = self._attach_host_prefix(req, st, promote=True)
        if len(st.host_pages) < num_pages:  # the prefix cache lost pages (or promotion found no room)
            if attached:
                self.drop_host_copy(st, 0)
            return False
        return True

    def queue_load(self, st: RequestKV, first_page: int) -> None:
        st.load_queue = [(st.block_table[i], st.host_pages[i]) for i in range(first_page, len(st.block_table))]
        self.num_unissued_loads += len(st.load_queue)

    def cancel_loads(self, st: RequestKV) -> None:
        self.num_unissued_loads -= len(st.load_queue)
        st.load_queue = []

    def drop_host_copy(self, st: RequestKV, keep_pages: int = 0) -> None:
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
        """Copy (token page, device page, host page) triples, in jobs of at most the copier's staging
        limit; every page is pinned until poll sees its job end. A write job completes the frontier
        up to its last page (`end` for the last job)."""
        limit = self.copier.staging_limit
        per_job = max(1, limit // self.page_bytes) if limit is not None else len(pairs)
        for k in range(0, len(pairs), per_job):
            chunk = pairs[k : k + per_job]
            last = k + per_job >= len(pairs)
            self._submit_job(lane, req, st, chunk, end if last else (chunk[-1][0] + 1) * self.page_size, evict)

    def _submit_job(self, lane: str, req: Request, st: RequestKV, pairs: list[tuple[int, int, int]], end: int,
                    evict: bool) -> None:
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
        """Account for the copies that ended. A failed load's request comes back in `failed` with
        its device pages still held: the manager releases them."""
        ready, failed = [], []
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
                        self.drop_host_copy(st, 0)
                        st.num_loading_pages = 0
                        st.recompute = True
                        failed.append(req)
                    else:  # keep what was written before it; the rest is recomputed
                        self.drop_host_copy(st, st.num_offloaded_tokens // self.page_size)
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

    def issue(self, step_seconds: float, running: Iterable[tuple[Request, RequestKV]],
              loading: Iterable[tuple[Request, RequestKV]], buffer_of: Callable[[Request], float]) -> None:
        """Before a step: queue the loads and write-through copies that fit in `step_seconds` at each
        lane's measured bandwidth, less what is still queued (synchronous chunked writing)."""
        self._issue_loads(step_seconds, loading)
        if self.mode == WRITE_THROUGH:
            self._issue_writes(step_seconds, running, buffer_of)
        self.copier.flush()  # the step's jobs, with the evictions its scheduling queued, start together

    def _budget_pages(self, lane: str, step_seconds: float) -> int:
        """Pages `lane` may take on now: what its bandwidth moves in `step_seconds`, within the
        copier's staging limit, less what is still queued."""
        room = math.inf if step_seconds == math.inf else self.copier.bandwidth[lane].value * step_seconds
        if self.copier.staging_limit is not None:
            room = min(room, self.copier.staging_limit)
        if room == math.inf:
            return sys.maxsize
        pages = int((room - self.copier.queued_bytes(lane)) // self.page_bytes)
        return max(pages, 0 if self.copier.busy(lane) else 1)  # an idle lane always moves a page

    def _issue_writes(self, step_seconds: float, running: Iterable[tuple[Request, RequestKV]],
                      buffer_of: Callable[[Request], float]) -> None:
        ps = self.page_size
        behind = [(r, st) for r, st in running if (r.num_computed_tokens // ps) * ps > st.num_offload_issued]
        budget = self._budget_pages(WRITE, step_seconds)
        for req, st in sorted(behind, key=lambda pair: buffer_of(pair[0]), reverse=True):  # likeliest preempted
            if budget <= 0:
                break
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

    def _issue_loads(self, step_seconds: float, loading: Iterable[tuple[Request, RequestKV]]) -> None:
        if not self.num_unissued_loads or (not self.load_evict_overlap and self.num_evicting):
            return
        budget = self._budget_pages(LOAD, step_seconds)
        for req, st in loading:
            if budget <= 0:
                break
            if st.num_offloaded_tokens < st.num_offload_issued:
                continue  # its eviction is still being written: nothing to read yet
            n = min(budget, len(st.load_queue))
            if n:
                chunk, st.load_queue = st.load_queue[:n], st.load_queue[n:]
                self.num_unissued_loads -= n
                self._submit(LOAD, req, st, [(i, d, h) for i, (d, h) in enumerate(chunk)])
                st.num_loading_pages += n
                budget -= n
