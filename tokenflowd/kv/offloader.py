"""The offload seam: what the KV manager asks of the traffic between the device tier and the host
tier. offload/traffic.py's HostOffloader is the real one (write-through, write-back, loads, t_IO);
NullOffloader stands where no host tier is configured, so that the manager never branches on it.

The manager calls it at each point of a request's life (kv/manager.py):

    match      reload(req, st, ...)       what a load could restore beyond the device's pages
               io_time(...)               t_IO of such a load, the queues included
    admit      on_admit(req, st)          write-through: host pages already holding the prefix
    preempt    evict(req, st)             write what the host lacks, before the device pages go
    load       take_host_copy / queue_load   the host pages to read, then (device, host) pairs
    release    cancel_loads(st)           loads not yet issued are forgotten
    free       drop_host_copy(st)         let go of the host pages
    step       issue(...), poll()         copies sized to end within a step; those that ended

Invariants: every page a copy reads or writes is pinned (a reference in its pool) from submit
until poll sees the copy end, so none is freed or handed to another request meanwhile. A copy
that fails publishes nothing and moves no frontier; poll hands back a loading request whose load
failed with its host copy dropped and its device pages still held (the manager releases them).
"""
from __future__ import annotations

import abc
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable, NamedTuple

from tokenflowd.config import OFFLOAD_MODES
from tokenflowd.kv.copier import Copier, NullCopier
from tokenflowd.kv.state import Request, RequestKV
from tokenflowd.kv.tiers import KVTier, NullHostTier

NO_OFFLOAD, WRITE_BACK, WRITE_THROUGH = OFFLOAD_MODES  # (--offload's names, spelt once)


class Reload(NamedTuple):
    """What a load could restore of a waiting request, device pages included."""

    num_tokens: int  # leading tokens whose KV the load would restore (0: none)
    num_disk_pages: int  # pages past the device's that must first be read from the disk tier
    num_unwritten_pages: int  # pages of its own host copy whose write is still in flight


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
    hit_tokens: int = 0  # prompt tokens a first admission found in the device prefix cache (the manager's)


class Offloader(abc.ABC):
    """The traffic between the device and the host tier, driven by the KV manager (module doc)."""

    mode: str  # WRITE_THROUGH, WRITE_BACK or NO_OFFLOAD
    host: KVTier
    copier: Copier
    stats: OffloadStats
    num_evicting: int  # eviction jobs in flight

    @property
    def can_reload(self) -> bool:
        """Whether a preempted request's KV can come back by a load (there is a host tier)."""
        return self.host.num_pages > 0

    @property
    def page_bytes(self) -> int:
        return self.host.page_bytes

    @property
    def num_evictions(self) -> int:
        """Pages the host and disk tiers have evicted so far (a prefix match taken before is stale)."""
        disk = getattr(self.host, "disk", None)
        return self.host.pool.num_evictions + (disk.num_evictions if disk is not None else 0)

    @abc.abstractmethod
    def reload(self, req: Request, st: RequestKV, max_pages: int, num_device_pages: int) -> Reload:
        """What a load restores of `req` (at most `max_pages` pages; its first `num_device_pages` are
        on the device): its own host copy if it was preempted, else the host (and disk) prefix cache."""

    @abc.abstractmethod
    def io_time(self, num_pages: int, num_disk_pages: int = 0, num_unwritten_pages: int = 0) -> float:
        """t_IO: seconds until `num_pages` loaded now would be in place."""

    def io_key(self) -> tuple:
        """What io_time reads of the copy queues and the links' bandwidths: while it is equal, every
        load is priced as before (a waiting request's match keeps its t_IO: KVCacheManager.view_matches)."""
        return ()

    @abc.abstractmethod
    def preempt_io_time(self, req: Request, st: RequestKV) -> float | None:
        """Seconds a preemption of running `req` costs in copies; None: it would recompute."""

    @abc.abstractmethod
    def on_admit(self, req: Request, st: RequestKV) -> None:
        """`req` was admitted onto its device pages."""

    @abc.abstractmethod
    def evict(self, req: Request, st: RequestKV) -> None:
        """`req` is preempted: its device pages are released right after this."""

    @abc.abstractmethod
    def take_host_copy(self, req: Request, st: RequestKV, num_pages: int) -> bool:
        """Make sure the request's host copy covers its first `num_pages` pages, or change nothing."""

    @abc.abstractmethod
    def queue_load(self, st: RequestKV, first_page: int) -> None:
        """Queue the loads of block_table[first_page:] from the host copy (issue sends them)."""

    @abc.abstractmethod
    def cancel_loads(self, st: RequestKV) -> None:
        """The request's device pages are released: loads not yet issued are forgotten."""

    @abc.abstractmethod
    def drop_host_copy(self, st: RequestKV, keep_pages: int = 0) -> None:
        """Let go of the request's host pages past the first `keep_pages`."""

    @abc.abstractmethod
    def issue(self, step_seconds: float, running: Iterable[tuple[Request, RequestKV]],
              loading: Iterable[tuple[Request, RequestKV]], buffer_of: Callable[[Request], float]) -> None:
        """Before a step: the loads and writes that fit in `step_seconds` (running and loading
        requests with their KV state; `buffer_of` orders the writes)."""

    @abc.abstractmethod
    def poll(self) -> CopyResults:
        """Account for the copies that ended."""

    def pins(self) -> tuple[Counter, Counter]:
        """(device, host) page -> references the copies in flight hold on it."""
        dev, host = Counter(), Counter()
        for jobs in self.copier.in_flight.values():
            for job in jobs:
                dev.update(job.device_pages)
                host.update(job.host_pages)
        return dev, host

    def busy(self) -> bool:
        return self.copier.busy_any()

    def wait(self) -> None:
        """Block until every copy in flight has ended; the next poll accounts for them."""
        self.copier.wait()

    def wait_oldest(self) -> None:
        """Block until the oldest copy in flight has ended (nothing to compute until KV is in place)."""
        self.copier.wait_oldest()

    def close(self) -> None:
        self.copier.close()
        self.host.close()


class NullOffloader(Offloader):
    """No host tier: nothing is written, nothing loads, and a preempted request recomputes."""

    mode = NO_OFFLOAD

    def __init__(self) -> None:
        self.host = NullHostTier()
        self.copier = NullCopier()
        self.stats = OffloadStats()
        self.num_evicting = 0

    def reload(self, req: Request, st: RequestKV, max_pages: int, num_device_pages: int) -> Reload:
        return Reload(0, 0, 0)

    def io_time(self, num_pages: int, num_disk_pages: int = 0, num_unwritten_pages: int = 0) -> float:
        raise AssertionError("nothing loads without a host tier")

    def preempt_io_time(self, req: Request, st: RequestKV) -> float | None:
        return None

    def on_admit(self, req: Request, st: RequestKV) -> None:
        pass

    def evict(self, req: Request, st: RequestKV) -> None:
        pass

    def take_host_copy(self, req: Request, st: RequestKV, num_pages: int) -> bool:
        return False

    def queue_load(self, st: RequestKV, first_page: int) -> None:
        raise AssertionError("nothing loads without a host tier")

    def cancel_loads(self, st: RequestKV) -> None:
        pass

    def drop_host_copy(self, st: RequestKV, keep_pages: int = 0) -> None:
        pass

    def issue(self, step_seconds: float, running: Iterable[tuple[Request, RequestKV]],
              loading: Iterable[tuple[Request, RequestKV]], buffer_of: Callable[[Request], float]) -> None:
        pass

    def poll(self) -> CopyResults:
        return CopyResults([], [])
