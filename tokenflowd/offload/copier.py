"""The copier's lanes, one per direction, each first-in first-out (the seam, its invariants and
its faults: kv/copier.py): on a GPU a CUDA stream per lane, ordered after the compute stream by
an event recorded at submission, a job done once its end event has passed; on a CPU a worker
thread per lane (torch copies drop the GIL, so they overlap the step the main thread computes).
"""
from __future__ import annotations

import queue
import threading
import time
import weakref

import torch

from tokenflowd.kv.copier import LOAD, WRITE, Copier, CopierDead, CopyJob

LANE_CHECK_INTERVAL = 1.0  # s between checks that a lane's worker is alive while waiting on it


def copy_pages(dev: torch.Tensor, host: torch.Tensor, job: CopyJob) -> None:
    """The copy itself on a CPU, straight between the tiers (one pass over the bytes): one strided
    copy per run of pages consecutive on both sides (torch spreads it over its threads), else one
    gather (write) or scatter (load) per run of consecutive host pages."""
    for i, j, h in _runs(job.host_pages):
        d = job.device_pages[i:j]
        if d == list(range(d[0], d[0] + j - i)):
            if job.lane == WRITE:
                host[h : h + j - i].copy_(dev[d[0] : d[0] + j - i])
            else:
                dev[d[0] : d[0] + j - i].copy_(host[h : h + j - i])
            continue
        idx = torch.tensor(d, dtype=torch.int64)
        if job.lane == WRITE:
            torch.index_select(dev, 0, idx, out=host[h : h + j - i])
        else:
            dev.index_copy_(0, idx, host[h : h + j - i])


class ThreadCopier(Copier):
    """CPU: one worker thread per lane.

    NOTE: the threads hold the copier only weakly and stop when it is collected: an engine dropped
    without close() (tests, the in-process API) must not keep its KV tensors alive through them."""

    def __init__(self, device_pages: torch.Tensor, host_pages: torch.Tensor, prior_bandwidth: float = 4e9) -> None:
        super().__init__(device_pages, host_pages, prior_bandwidth)
        self._queues = {lane: queue.SimpleQueue() for lane in (WRITE, LOAD)}
        me = weakref.ref(self)
        self._threads = [threading.Thread(target=_worker, args=(q, me), name=f"kv-{lane}", daemon=True)
                         for lane, q in self._queues.items()]
        for t in self._threads:
            t.start()
        self._stop = weakref.finalize(self, _stop_workers, list(self._queues.values()))

    def _run(self, job: CopyJob) -> None:
        copy_pages(self.dev, self.host, job)

    def _start(self, job: CopyJob) -> None:
        job._events = threading.Event()
        job._after = self.fence() if self.fence is not None else None  # the step that writes its pages
        self._queues[job.lane].put(job)

    def _finished(self, job: CopyJob) -> bool:
        return job._events.is_set()

    def _wait(self, job: CopyJob) -> None:
        while not job._events.wait(LANE_CHECK_INTERVAL):
            self._check_alive(job.lane)

    def _check_alive(self, lane: str) -> None:
        thread = self._threads[0 if lane == WRITE else 1]
        if not thread.is_alive():
            raise CopierDead(f"the KV {lane} lane's worker thread has exited with copies still queued")

    def close(self) -> None:
        for lane, jobs in self.in_flight.items():
            if jobs:
                self._check_alive(lane)
        super().close()
        self._stop()
        for t in self._threads:
            t.join()


def _worker(q: queue.SimpleQueue, copier_ref: "weakref.ref[ThreadCopier]") -> None:
    while True:
        job = q.get()
        copier = copier_ref()
        if job is None or copier is None:
            return
        if job._after is not None:  # the step whose KV it copies, or whose pages it fills, ends first
            job.error = job._after.exception()
        t0 = time.perf_counter()
        try:
            if job.error is None:
                copier._run(job)
        except Exception as e:  # the job fails; the lane goes on with the next one
            job.error = e
        job.seconds = time.perf_counter() - t0
        job._events.set()
        del copier, job


def _stop_workers(queues: list[queue.SimpleQueue]) -> None:
    for q in queues:
        q.put(None)


class CudaCopier(Copier):
    """GPU: one CUDA stream per lane, each ordered after the compute stream at launch.

    The jobs a step submits (write-through chunks of several requests, evictions, loads) are held
    and launched together at flush: one launch per lane per step, not one per job. A launch copies
    each run of pages consecutive on both sides with one copy (the device side is strided across
    layers: torch packs it on the copy stream and moves it with one cudaMemcpyAsync). A launch of
    more than `max_run_copies` runs gathers instead: the device pages' index goes up from
    page-locked memory, one index_select packs them into a block, and each run of consecutive host
    pages moves with one copy (a load: the reverse, then one index_copy_). Every copy is
    non-blocking; the jobs of a launch share its events, and each takes its share of its time.

    A lane holds at most `staging_limit` bytes of gather blocks at a time (the engine's KV budget
    counts both lanes').

    NOTE: without the limit, a step with nothing to compute issued every queued load at once,
    each job with its own device block: gigabytes no budget had counted."""

    staging_limit = 512 << 20
    max_run_copies = 8

    def __init__(self, device_pages: torch.Tensor, host_pages: torch.Tensor, prior_bandwidth: float = 20e9) -> None:
        super().__init__(device_pages, host_pages, prior_bandwidth)
        self.device = device_pages.device
        self._streams = {lane: torch.cuda.Stream(self.device) for lane in (WRITE, LOAD)}
        self._held: dict[str, list[CopyJob]] = {WRITE: [], LOAD: []}
        self.num_launches = 0  # tests read it: launches, not jobs

    def _start(self, job: CopyJob) -> None:
        job._events = None
        self._held[job.lane].append(job)

    def flush(self) -> None:
        for lane, jobs in self._held.items():
            if not jobs:
                continue
            self._held[lane] = []
            try:
                self._launch(lane, jobs)
            except RuntimeError as e:  # a CUDA error is sticky: nothing on this device can be trusted
                raise CopierDead(f"the KV {lane} lane could not start a copy: {e}") from e

    def _launch(self, lane: str, jobs: list[CopyJob]) -> None:
        stream = self._streams[lane]
        stream.wait_stream(torch.cuda.current_stream(self.device))  # after the step that wrote the pages
        device_pages = [d for job in jobs for d in job.device_pages]
        host_pages = [h for job in jobs for h in job.host_pages]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        keep: list[torch.Tensor] = []  # blocks and indices live until the launch is done
        with torch.cuda.stream(stream):
            start.record(stream)
            runs = pair_runs(device_pages, host_pages)
            if len(runs) <= self.max_run_copies:
                for i, j in runs:
                    d, h, n = device_pages[i], host_pages[i], j - i
                    if lane == WRITE:
                        self.host[h : h + n].copy_(self.dev[d : d + n], non_blocking=True)
                    else:
                        self.dev[d : d + n].copy_(self.host[h : h + n], non_blocking=True)
            else:
                page_bytes = self.dev[0].numel() * self.dev.element_size()
                per = max(1, self.staging_limit // page_bytes)
                for k in range(0, len(device_pages), per):
                    keep += self._gather(lane, device_pages[k : k + per], host_pages[k : k + per])
            end.record(stream)
        self.num_launches += 1
        total = len(device_pages) or 1
        for job in jobs:
            job._events = (start, end, keep, len(job.device_pages) / total)

    def _gather(self, lane: str, device_pages: list[int], host_pages: list[int]) -> list[torch.Tensor]:
        staged = torch.empty(len(device_pages), dtype=torch.int64, pin_memory=True)
        staged.numpy()[:] = device_pages
        idx = staged.to(self.device, non_blocking=True)
        if lane == WRITE:
            block = self.dev.index_select(0, idx)  # [n, layers, *rest] contiguous, on the copy stream
            for i, j, h in _runs(host_pages):
                self.host[h : h + j - i].copy_(block[i:j], non_blocking=True)
        else:
            block = torch.empty((len(idx), *self.dev.shape[1:]), dtype=self.dev.dtype, device=self.device)
            for i, j, h in _runs(host_pages):
                block[i:j].copy_(self.host[h : h + j - i], non_blocking=True)
            self.dev.index_copy_(0, idx, block)
        return [block, idx]

    def _finished(self, job: CopyJob) -> bool:
        if job._events is None:
            self.flush()
        start, end, _, share = job._events
        try:
            if not end.query():
                return False
        except RuntimeError as e:  # the copy's CUDA error, surfacing here
            raise CopierDead(f"the KV {job.lane} lane failed: {e}") from e
        job.seconds = start.elapsed_time(end) / 1e3 * share
        return True

    def _wait(self, job: CopyJob) -> None:
        if job._events is None:
            self.flush()
        try:
            job._events[1].synchronize()
        except RuntimeError as e:
            raise CopierDead(f"the KV {job.lane} lane failed: {e}") from e


def pair_runs(device_pages: list[int], host_pages: list[int]) -> list[tuple[int, int]]:
    """(i, j) of each maximal run where device_pages[i:j] and host_pages[i:j] both go up by one."""
    runs, i = [], 0
    for k in range(1, len(device_pages) + 1):
        if (k == len(device_pages) or device_pages[k] != device_pages[k - 1] + 1
                or host_pages[k] != host_pages[k - 1] + 1):
            runs.append((i, k))
            i = k
    return runs


def _runs(host_pages: list[int]) -> list[tuple[int, int, int]]:
    """(i, j, first host page) for each maximal run host_pages[i:j] of consecutive pages."""
    runs, i = [], 0
    for k in range(1, len(host_pages) + 1):
        if k == len(host_pages) or host_pages[k] != host_pages[k - 1] + 1:
            runs.append((i, k, host_pages[i]))
            i = k
    return runs


def make_copier(device_pages: torch.Tensor, host_pages: torch.Tensor) -> Copier:
    if device_pages.device.type == "cuda":
        return CudaCopier(device_pages, host_pages)
    return ThreadCopier(device_pages, host_pages)
