"""The copier seam: moves whole KV pages between the device tier and the host tier, off the compute
path. Its lanes (a thread per direction on a CPU, a CUDA stream per direction on a GPU) are
offload/copier.py's; the simulator's is sim/copier.py.

Two lanes, one per direction, each first-in first-out:

    write  device -> host   (write-through, evictions)
    load   host -> device   (resumes, prefix hits on the host)

On a GPU each lane is its own CUDA stream, ordered after the compute stream by an event recorded
when the copy is submitted, and a job is done when its end event has passed. On a CPU each lane is
a worker thread (torch copies drop the GIL, so they overlap the step the main thread computes).

Layouts (the device's page axis moved to the front, so a page is one index on both sides):

    device: kv_cache.movedim(1 + page_axis, 0) -> [num_pages + 1, layers, *rest]   a strided view
    host:   [num_host_pages, layers, *rest]                                         contiguous;
                                                                                     pinned on a GPU box

Invariants: a job reads and writes only the pages it names; the caller pins every one of them
(a reference in its pool) from submit until `poll` returns the job, so none is freed or handed to
another request while the copy runs. Jobs of one lane complete in submission order.

Faults: a copy that raises ends its job with `error` set (its pages hold nothing to trust, and the
manager publishes none of them); the lane goes on with the next job. A lane that can no longer run
(its worker thread gone, a CUDA error) raises CopierDead from poll and wait: the engine exits and
its supervisor starts a fresh one, instead of waiting forever for a copy that will not end.
"""
from __future__ import annotations

import abc
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

WRITE, LOAD = "write", "load"


class CopierDead(RuntimeError):
    """A copier lane cannot run any more: the engine cannot move KV and must be restarted."""


@dataclass(eq=False)
class CopyJob:
    lane: str  # WRITE (device -> host) or LOAD (host -> device)
    device_pages: list[int]
    host_pages: list[int]  # host_pages[i] pairs with device_pages[i]
    nbytes: int
    tag: Any = None  # the offload manager's bookkeeping for this job
    seconds: float = 0.0  # the copy's own duration, measured where it ran
    done: bool = False
    error: BaseException | None = None  # set when the copy raised: the job ended, its pages hold garbage
    _events: Any = field(default=None, repr=False)


class Bandwidth:
    """Bytes/s of one lane: an exponential average over the jobs it completed, from a prior.

    NOTE: only jobs of at least `min_bytes` count: a small job's time is mostly the fixed cost of
    starting it (a thread wake-up, a kernel launch), and its bytes/s would make the chunked writer
    issue a page a step where hundreds fit."""

    def __init__(self, prior: float, weight: float = 0.2, min_bytes: int = 1 << 20) -> None:
        self.value = prior
        self.weight = weight
        self.min_bytes = min_bytes
        self.samples = 0

    def observe(self, nbytes: int, seconds: float) -> None:
        if seconds <= 0 or nbytes < self.min_bytes:
            return
        bw = nbytes / seconds
        self.value = bw if self.samples == 0 else (1 - self.weight) * self.value + self.weight * bw
        self.samples += 1


class Copier(abc.ABC):
    """Submit jobs; `poll` hands back the finished ones (each exactly once). See the module doc."""

    # Bytes one lane may have in flight when each job stages its pages in a device block (the
    # caller sizes its jobs to it, and the device's budget counts it); None: nothing is staged.
    staging_limit: int | None = None
    # Where the device's steps run on another thread (an overlapping engine on a CPU, engine/core.py):
    # returns the step last launched, a concurrent.futures.Future, which a job waits for before it
    # touches the pages (a job after a step that failed fails too). None: steps and copies are
    # ordered otherwise (a GPU's streams, a step computed in the engine's own thread).
    fence = None

    def __init__(self, device_pages: torch.Tensor | None, host_pages: torch.Tensor | None,
                 prior_bandwidth: float) -> None:
        self.dev = device_pages  # [num_pages + 1, layers, *rest] view of the device KV cache (None: simulated)
        self.host = host_pages  # [num_host_pages, layers, *rest]
        self.bandwidth = {WRITE: Bandwidth(prior_bandwidth), LOAD: Bandwidth(prior_bandwidth)}
        self.in_flight: dict[str, deque[CopyJob]] = {WRITE: deque(), LOAD: deque()}
        self._queued = {WRITE: 0, LOAD: 0}  # bytes submitted and not yet polled, per lane

    def submit(self, job: CopyJob) -> CopyJob:
        self.in_flight[job.lane].append(job)
        self._queued[job.lane] += job.nbytes
        self._start(job)
        return job

    def flush(self) -> None:
        """Start the jobs submitted since the last flush, where a copier holds them to start them
        together (a GPU's one launch per lane per step); the offloader flushes after each step's
        copies are issued, and a copier that holds jobs flushes before it polls or waits."""

    def poll(self) -> list[CopyJob]:
        """Jobs finished since the last call, each lane in submission order."""
        done = []
        for lane, jobs in self.in_flight.items():
            while jobs and self._finished(jobs[0]):
                job = jobs.popleft()
                job.done = True
                self._queued[lane] -= job.nbytes
                if job.error is None:
                    self.bandwidth[lane].observe(job.nbytes, job.seconds)
                done.append(job)
            if jobs:
                self._check_alive(lane)
        return done

    def _check_alive(self, lane: str) -> None:
        """Raise CopierDead if `lane` has jobs it will never finish."""

    def busy(self, lane: str) -> bool:
        return bool(self.in_flight[lane])

    def busy_any(self) -> bool:
        return any(self.in_flight.values())

    def queued_bytes(self, lane: str) -> int:
        return self._queued[lane]

    def wait_oldest(self) -> None:
        """Block until the oldest job in flight has ended (loads first): a step with nothing to
        compute waits here instead of spinning."""
        for lane in (LOAD, WRITE):
            if self.in_flight[lane]:
                self._wait(self.in_flight[lane][0])
                return

    def wait(self) -> None:
        """Block until every submitted job has ended (the next poll hands them back)."""
        for jobs in self.in_flight.values():
            for job in jobs:
                self._wait(job)

    def close(self) -> None:
        self.wait()

    @abc.abstractmethod
    def _start(self, job: CopyJob) -> None: ...

    @abc.abstractmethod
    def _finished(self, job: CopyJob) -> bool: ...

    @abc.abstractmethod
    def _wait(self, job: CopyJob) -> None: ...


class NullCopier(Copier):
    """The copier beside a NullHostTier: nothing is ever submitted to it."""

    def __init__(self) -> None:
        super().__init__(None, None, 1.0)

    def _start(self, job: CopyJob) -> None:
        raise AssertionError("there is no host tier to copy to")

    def _finished(self, job: CopyJob) -> bool:
        return True

    def _wait(self, job: CopyJob) -> None:
        pass
