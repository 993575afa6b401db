"""Moving KV pages between nodes: the `KVTransport` seam and its Mooncake Transfer Engine twin.

A transport registers memory (a node's KV cache) and writes runs of bytes from local registered
memory into a peer's registered memory, one request's runs as one aggregated batch (MemServe §4:
not one call per block). Peers name each other by `endpoint` (host:port of the transfer engine's
handshake). Each transport measures what its writes achieved per peer (`bandwidth`): the federation's
plans use measured bandwidth, never a nominal one: over TCP, what the kernel delivered on the
sockets to the peer while the link set the pace (`DeliverySamples`), else the writes' bytes over
their time (`LinkStats`).

    transport = MooncakeTransport("10.0.0.2")          # P2P handshake: no etcd
    region = transport.register(kv_cache)              # the peer learns (endpoint, region.address)
    t = transport.submit_write(peer, blocks)           # async; blocks from kv_blocks()
    transport.wait(t, timeout=5.0)                     # or poll status(t) from a step loop

`kv_blocks` turns "these pages of my cache go to those pages of yours" into byte runs, one per
(layer, K|V plane, KV head, page), merged where both sides are adjacent. Over TCP each run costs
about as much as a page of bytes (bench/kv_transport.py), so the page-by-page form is for RDMA;
`gather_pages` / `scatter_pages` stage a request's pages into one contiguous run instead. The two caches may hold a
different number of pages (a prefill node and a decode node size theirs apart).

What DONE means. Over TCP, Mooncake reports a batch complete once its last send returned: the
bytes are in flight to the peer, not yet in its memory. The receiver must not read the pages on
the sender's word alone; it confirms their arrival itself (a checksum, or a notification that
follows the data). And a transfer that FAILED by our timeout may still be writing: its destination
pages are not reusable until `settled(transfer)`.

NIXL (UCX) can be a second implementation of the same ABC.
"""
from __future__ import annotations

import abc
import collections
import errno
import logging
import math
import os
import socket
import threading
import time
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import ClassVar, Sequence

import torch

from tokenflowd.federation.delivery import Delivery, DeliveryMeter

log = logging.getLogger(__name__)

PENDING, DONE, FAILED = "pending", "done", "failed"


class TransferFailed(RuntimeError):
    pass


@dataclass(frozen=True)
class Region:
    address: int
    nbytes: int


@dataclass(frozen=True)
class Block:
    """One contiguous copy: `nbytes` from local address `src` to the peer's address `dst`."""

    src: int
    dst: int
    nbytes: int


@dataclass
class Transfer:
    peer: str
    nbytes: int
    started: float
    state: str = PENDING
    # The implementation's completion: its result is (ok, monotonic time the engine said so).
    done: Future | None = None


@dataclass
class LinkStats:
    """What writes to one peer achieved: in all, and over the transfers that ended in the last
    WINDOW s before the latest (a link whose bandwidth drops, or that fills with other traffic,
    shows it within that window).

    The recent figure is their bytes over the time the link was busy with them: the union of their
    [started, ended] intervals. A layer-wise prefill has many writes in flight at once, so summing
    each write's own duration would count the same second many times over.

    Over TCP this runs ahead of a slow link: a write ends once the kernel holds its bytes (DONE
    above), in socket buffers and the bottleneck's queue, and a prefill node's layer-by-layer
    writes each meet those queues empty and end long before the wire has carried them (225 Mb/s
    measured over a 100 Mb/s link: delivery.py). The transport's figure is then TCP's own
    (`DeliverySamples`) where the link set the pace lately; this one stands elsewhere (RDMA, where
    a write ends once it landed; a TCP link its writes do not fill: see `_figure`)."""

    WINDOW: ClassVar[float] = 3.0  # s

    bytes: int = 0
    seconds: float = 0.0
    failures: int = 0
    peak: float = 0.0  # bytes/s of its fastest transfer: what the wire can do, small transfers aside
    recent: collections.deque = field(default_factory=collections.deque)  # (started, ended, bytes)

    latest: float = -math.inf  # when the latest transfer ended
    last_start: float = -math.inf  # when the latest transfer started

    def add(self, nbytes: int, started: float, ended: float) -> None:
        started = min(started, ended)
        seconds = ended - started
        self.bytes += nbytes
        self.seconds += seconds
        self.peak = max(self.peak, nbytes / max(seconds, 1e-9))
        self.recent.append((started, ended, nbytes))
        self.latest = max(self.latest, ended)
        self.last_start = max(self.last_start, started)
        while self.recent and self.recent[0][1] < self.latest - self.WINDOW:
            self.recent.popleft()

    @property
    def bandwidth(self) -> float | None:
        """Bytes/s of the recent transfers over the time the link was busy with them (None before
        the first)."""
        busy, reach = 0.0, -math.inf
        for started, ended, _ in sorted(self.recent):
            if ended > reach:
                busy += ended - max(started, reach)
                reach = ended
        return sum(b for _, _, b in self.recent) / busy if busy > 0 else None


@dataclass
class DeliverySamples:
    """What TCP delivered on a link in the intervals the link set the pace of (delivery.py): the
    figure is their bytes over their seconds, of those in the last WINDOW s before the latest."""

    WINDOW: ClassVar[float] = LinkStats.WINDOW

    recent: collections.deque = field(default_factory=collections.deque)  # (when it ended, bytes, seconds)
    latest: float = -math.inf

    def add(self, nbytes: int, seconds: float, now: float) -> None:
        self.recent.append((now, nbytes, seconds))
        self.latest = now
        while self.recent[0][0] < now - self.WINDOW:
            self.recent.popleft()

    @property
    def bandwidth(self) -> float | None:
        seconds = sum(s for _, _, s in self.recent)
        return sum(b for _, b, _ in self.recent) / seconds if seconds > 0 else None


def _figure(written: LinkStats | None, delivered: DeliverySamples | None) -> float | None:
    """TCP's figure where the link set the pace within a window of the latest write's start, else
    the writes' own.

    The writes' figure runs ahead of a TCP link that does not set the pace (its kernel takes each
    write at once), and a link that does shows in TCP's figure within a write or two: a plan that
    sends more over the link than it carries corrects itself. A lower bound (the fastest interval's
    bytes) does not: on a fast link the sockets of short transfers come and go between two samples,
    it read 37 Mb/s on a 1 Gb/s link, and a plan that sends less for it never learns otherwise."""
    if delivered is not None and delivered.recent and (
            written is None or delivered.latest >= written.last_start - LinkStats.WINDOW):
        return delivered.bandwidth
    return written.bandwidth if written is not None else None


class KVTransport(abc.ABC):
    def __init__(self) -> None:
        self.links: dict[str, LinkStats] = {}
        self.egress = LinkStats()  # every peer's writes together: the node's way out, busy time counted once
        self.delivered: dict[str, DeliverySamples] = {}  # per peer, where TCP measured the link
        self.delivered_egress = DeliverySamples()  # ... and all peers' hosts together
        self._links_lock = threading.Lock()  # waiter threads account while the engine reads

    @property
    @abc.abstractmethod
    def endpoint(self) -> str:
        """How peers name this transport."""

    @abc.abstractmethod
    def register(self, tensor: torch.Tensor) -> Region:
        """Make a contiguous tensor's memory writable by peers (it must outlive the registration); the
        same memory registered again returns its region."""

    @abc.abstractmethod
    def unregister(self, region: Region) -> None: ...

    @abc.abstractmethod
    def submit_write(self, peer: str, blocks: Sequence[Block]) -> Transfer:
        """Start writing the blocks to the peer as one batch. A peer that cannot be reached is a
        Transfer already FAILED, not an exception."""

    @abc.abstractmethod
    def close(self) -> None: ...

    def watch(self, peer: str) -> None:
        """Writes to `peer` are coming (an implementation may start checking it is alive)."""

    def status(self, transfer: Transfer) -> str:
        """PENDING, DONE or FAILED, without blocking (a step loop polls it)."""
        if transfer.state == PENDING and transfer.done is not None and transfer.done.done():
            ok, ended = transfer.done.result() if transfer.done.exception() is None else (False, time.monotonic())
            transfer.state = DONE if ok else FAILED
            self._account(transfer, ended)
        return transfer.state

    @staticmethod
    def settled(transfer: Transfer) -> bool:
        """The engine is done with the transfer, whatever its state: its pages may be reused."""
        return transfer.done is None or transfer.done.done()

    def wait(self, transfer: Transfer, timeout: float) -> None:
        """Until the transfer is done; TransferFailed if it failed or `timeout` s passed first (it may
        then still be writing: see `settled`)."""
        if transfer.done is not None:
            futures.wait([transfer.done], timeout)
        if self.status(transfer) == PENDING:
            transfer.state = FAILED
            self._account(transfer, time.monotonic())
            raise TransferFailed(f"write to {transfer.peer} still pending after {timeout} s")
        if transfer.state == FAILED:
            raise TransferFailed(f"write of {transfer.nbytes} bytes to {transfer.peer} failed")

    def write(self, peer: str, blocks: Sequence[Block], timeout: float = 30.0) -> None:
        self.wait(self.submit_write(peer, blocks), timeout)

    def bandwidth(self, peer: str) -> float | None:
        """Bytes/s the link to `peer` delivered lately (None before the first write)."""
        with self._links_lock:
            return _figure(self.links.get(peer), self.delivered.get(peer))

    def egress_bandwidth(self) -> float:
        """Bytes/s the writes to all peers together achieved lately (0: none yet). Writes to two
        peers at once share the link: each peer's figure alone is half of it."""
        with self._links_lock:
            return _figure(self.egress, self.delivered_egress) or 0.0

    def bandwidths(self) -> dict[str, float]:
        """Each peer's `bandwidth`, for those measured."""
        with self._links_lock:
            return {peer: bps for peer in self.links.keys() | self.delivered.keys()
                    if (bps := _figure(self.links.get(peer), self.delivered.get(peer)))}

    def _delivering(self, seen: dict[str, Delivery], hosts: dict[str, str], now: float) -> None:
        """What TCP delivered to peers in one interval: peer -> its host's Delivery; `hosts`: peer ->
        its address. A peer's busy interval counts for it; for the egress, an interval in which any
        host was busy counts with every host's bytes (peers on one host share its sockets: once)."""
        with self._links_lock:
            for peer, d in seen.items():
                if d.busy:
                    self.delivered.setdefault(peer, DeliverySamples()).add(d.nbytes, d.seconds, now)
            by_host = {hosts[peer]: d for peer, d in seen.items()}
            if any(d.busy for d in by_host.values()):
                self.delivered_egress.add(sum(d.nbytes for d in by_host.values()),
                                          max(d.seconds for d in by_host.values()), now)

    def _account(self, transfer: Transfer, ended: float) -> None:
        with self._links_lock:
            link = self.links.setdefault(transfer.peer, LinkStats())
            if transfer.state == DONE:
                link.add(transfer.nbytes, transfer.started, ended)
                self.egress.add(transfer.nbytes, transfer.started, ended)
            else:
                link.failures += 1


def port_reuse_warning(path: str = "/proc/sys/net/ipv4/tcp_tw_reuse") -> str | None:
    """Mooncake's TCP transport opens a connection per transfer, and a layer-wise prefill makes one
    transfer per layer per step: without reuse of closed connections' ports, a busy node runs out of
    them in minutes (measured: 27,000 in TIME_WAIT after 4 min of one prefill node's streaming, then
    the transfer engine aborts the process on "connect: Cannot assign requested address")."""
    try:
        with open(path) as f:
            value = f.read().strip()
    except OSError:
        return None
    if value == "1":
        return None
    return (f"net.ipv4.tcp_tw_reuse is {value}: the KV transfer engine's TCP connections (one per transfer) "
            "will exhaust the local ports under load; set it to 1 (sysctl -w net.ipv4.tcp_tw_reuse=1)")


class MooncakeTransport(KVTransport):
    """Mooncake's Transfer Engine (`mooncake-transfer-engine` on GPU clusters,
    `mooncake-transfer-engine-non-cuda` on CPU): TCP here, RDMA where the node has NICs for it
    (`protocol="rdma"`, `device` the NIC). The P2P handshake needs no metadata server.

    The engine's batch status call blocks, spinning, until the batch ends (or its own timeout,
    MC_TRANSFER_TIMEOUT, default 30 s, passes), with the GIL released. A small pool of waiter
    threads for each peer turns it into futures the step loop can poll, so one stalled peer does not
    hold up the others; each waiter first sleeps most of the time the batch would take at the link's best
    measured rate, so the spin is short and a fast batch is not held back.

    NOTE: the engine (0.3.11.post1, TCP) kills its process (SIGSEGV) when a batch is submitted to
    a peer it wrote to before and that has since died or dropped off the network; and its probe
    of a peer behind a dead link blocks until the link returns. So a thread for each peer written
    to lately probes it (`send_probe`, GIL released) every PROBE_INTERVAL s, and a batch goes
    only to a peer whose last probe answered within PROBE_FRESH s; otherwise the transfer is
    FAILED at once. What is left is a peer that dies within a probe interval before a submit.

    While writes to a peer are in the engine, and after, until the kernel has delivered their bytes,
    a meter thread samples what the kernel delivered on the sockets to the peer's host every
    METER_INTERVAL s or two of the path's round trips (delivery.py; one netlink query, which the
    kernel filters while it walks its connection table)."""

    _INVALID = (0, 2**64 - 1, -1)  # batch ids of a batch the engine could not submit (no such peer)
    WAITERS = 4
    PROBE_INTERVAL = 0.05  # s between probes of a peer in use
    PROBE_FRESH = 0.25  # s a probe's answer vouches for the peer
    PROBE_FIRST = 0.02  # s a first write to a peer waits for its first probe (on the step loop)
    WATCH_SECONDS = 60.0  # a peer not written to for that long is no longer probed
    PROBE_BACKOFF = 1.0  # s: the most between probes of a peer that does not answer (each a TCP connect)
    METER_INTERVAL = 0.02  # s between samples of what TCP delivered while KV is on its way
    METER_LONGEST = 1.0  # s: a longer interval between two samples of a host (an idle spell) is not counted
    RESOLVE_RETRY = 5.0  # s before a peer's name that did not resolve is looked up again

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp", device: str = "") -> None:
        super().__init__()
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # the engine's per-batch INFO lines stay out of the journal
        os.environ.setdefault("GLOG_minloglevel", "1")
        from mooncake.engine import TransferEngine  # the federation extra

        self._te = TransferEngine()
        rc = self._te.initialize(host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise RuntimeError(f"Mooncake transfer engine did not start on {host} over {protocol} (code {rc})")
        self._endpoint = f"{host}:{self._te.get_rpc_port()}"
        self._tcp = protocol == "tcp"  # what its writes achieved is then TCP's to tell (delivery.py)
        self._regions: dict[int, tuple[Region, torch.Tensor]] = {}  # the tensor is kept: peers write into it
        self._waiters: dict[str, ThreadPoolExecutor] = {}  # per peer: a stalled one holds up only its own
        self._closed = False
        self._probed: dict[str, tuple[bool, float]] = {}  # peer -> (answered, when)
        self._watched: dict[str, float] = {}  # peer -> last written to
        self._wake = threading.Condition()
        self._probers: dict[str, threading.Thread] = {}
        self._pending: collections.Counter[str] = collections.Counter()  # peer -> its writes in the engine
        self._meter: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def register(self, tensor: torch.Tensor) -> Region:
        if not tensor.is_contiguous():
            raise ValueError("only a contiguous tensor can be registered")
        region = Region(tensor.data_ptr(), tensor.numel() * tensor.element_size())
        known = self._regions.get(region.address)
        if known is not None and known[0] == region:  # both roles' machinery share the cache's one registration
            return region
        if self._te.register_memory(region.address, region.nbytes) != 0:
            raise RuntimeError(f"Mooncake could not register {region.nbytes} bytes")
        self._regions[region.address] = (region, tensor)
        return region

    def unregister(self, region: Region) -> None:
        if self._regions.pop(region.address, None) is not None:
            self._te.unregister_memory(region.address)

    def watch(self, peer: str) -> None:
        """Writes to `peer` are coming: probe it from now on (one prober a peer, so that a dead link
        stalls only its own)."""
        with self._wake:
            self._watched[peer] = time.monotonic()
            if peer not in self._probers:
                self._probers[peer] = threading.Thread(target=self._probe_loop, args=(peer,), daemon=True,
                                                       name=f"mooncake-probe-{peer}")
                self._probers[peer].start()

    def reachable(self, peer: str) -> bool:
        """The peer answered a probe within PROBE_FRESH s. A peer not probed yet gets PROBE_FIRST s
        for its first answer (a probe takes well under a millisecond on a live link)."""
        self.watch(peer)
        with self._wake:
            self._wake.wait_for(lambda: peer in self._probed or self._closed, self.PROBE_FIRST)
            ok, when = self._probed.get(peer, (False, 0.0))
        return ok and time.monotonic() - when < self.PROBE_FRESH

    def _probe_loop(self, peer: str) -> None:
        pause = self.PROBE_INTERVAL
        while True:
            with self._wake:
                if self._closed or time.monotonic() - self._watched[peer] > self.WATCH_SECONDS:
                    del self._probers[peer]
                    self._probed.pop(peer, None)
                    return
            ok = self._te.send_probe(peer) == 0
            with self._wake:
                self._probed[peer] = (ok, time.monotonic())
                self._wake.notify_all()
            # a peer that does not answer (gone, or an old incarnation's port) is probed ever less often
            pause = self.PROBE_INTERVAL if ok else min(2 * pause, self.PROBE_BACKOFF)
            time.sleep(pause)

    def submit_write(self, peer: str, blocks: Sequence[Block]) -> Transfer:
        if self._closed:
            raise RuntimeError("the transport is closed")
        transfer = Transfer(peer, sum(b.nbytes for b in blocks), time.monotonic())
        if not blocks:
            transfer.state = DONE
            return transfer
        if not self.reachable(peer):  # gone, or behind a dead link: never hand it to the engine
            transfer.state = FAILED
            self._account(transfer, time.monotonic())
            return transfer
        batch = self._te.batch_transfer_async_write(peer, [b.src for b in blocks], [b.dst for b in blocks],
                                                    [b.nbytes for b in blocks])
        if batch in self._INVALID:
            transfer.state = FAILED
            self._account(transfer, time.monotonic())
            return transfer
        link = self.links.get(peer)
        expected = transfer.nbytes / (link.peak if link and link.peak else 1e9)  # at the wire's best
        with self._wake:
            self._pending[peer] += 1
            if self._meter is None and self._tcp:
                self._meter = threading.Thread(target=self._meter_loop, daemon=True, name="mooncake-meter")
                self._meter.start()
            self._wake.notify_all()

        def settle() -> tuple[bool, float]:
            try:
                time.sleep(min(expected * 0.8, 1.0))  # most of the batch's time asleep, not spinning
                ok = self._te.get_batch_transfer_status([batch]) == 0
                return ok, time.monotonic()
            finally:
                with self._wake:
                    self._pending[peer] -= 1

        waiter = self._waiters.get(peer)
        if waiter is None:
            waiter = self._waiters[peer] = ThreadPoolExecutor(self.WAITERS, thread_name_prefix=f"mooncake-wait-{peer}")
        try:
            transfer.done = waiter.submit(settle)
        except RuntimeError:  # closed meanwhile
            with self._wake:
                self._pending[peer] -= 1
            raise
        return transfer

    def _meter_loop(self) -> None:
        """Samples what TCP delivered to the peers written to, from their first write until the
        kernel delivered their last bytes (the engine says a write is done well before that).
        Every peer's host is sampled each time, so that their intervals line up in the egress."""
        meter = DeliveryMeter.open()
        if meter is None:
            return
        hosts: dict[str, str] = {}  # peer -> its IP address
        unresolved: dict[str, float] = {}  # peer -> when its name last failed to resolve
        draining: set[str] = set()  # peers the last sample saw bytes still on their way to
        try:
            while True:
                with self._wake:
                    self._wake.wait_for(lambda: self._closed or draining or any(n > 0 for n in self._pending.values()))
                    if self._closed:
                        return
                    peers = draining | {peer for peer, n in self._pending.items() if n > 0}
                    now = time.monotonic()  # a peer not written to for WATCH_SECONDS is sampled no more
                    hosts = {p: a for p, a in hosts.items()
                             if p in peers or now - self._watched.get(p, -math.inf) <= self.WATCH_SECONDS}
                for peer in peers - hosts.keys():
                    if time.monotonic() - unresolved.get(peer, -math.inf) < self.RESOLVE_RETRY:
                        continue
                    if (address := _address(peer)) is None:
                        log.warning("the KV peer %s does not resolve: its link is measured by its writes", peer)
                        unresolved[peer] = time.monotonic()
                    else:
                        hosts[peer] = address
                try:
                    seen = meter.sample(set(hosts.values()))
                except TimeoutError:  # a loaded kernel: the next sample spans the gap
                    continue
                except OSError as e:
                    if e.errno not in (errno.EAGAIN, errno.EINTR):  # refused for good: no point asking again
                        log.warning("TCP's delivery cannot be read (%s): KV links are measured by their writes", e)
                        return
                    seen = {}
                counted = {peer: d for peer, host in hosts.items() if (d := seen.get(host)) and
                           0 < d.seconds <= self.METER_LONGEST}
                if counted:
                    self._delivering(counted, hosts, time.monotonic())
                draining = {peer for peer, host in hosts.items() if (d := seen.get(host)) and d.sending}
                # no more often than twice the longest path's round trip: within one, even an idle
                # link still owes what it was sent (delivery.py)
                time.sleep(min(max(self.METER_INTERVAL, 2 * meter.rtt), self.METER_LONGEST / 2))
        except Exception:  # a bug here must not pass silently, nor take the transport down
            log.exception("the KV link meter stopped: KV links are measured by their writes")
        finally:
            meter.close()

    def close(self) -> None:
        """Waits for the transfers still in the engine (each ends by MC_TRANSFER_TIMEOUT at most)."""
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        for waiter in self._waiters.values():
            waiter.shutdown(wait=True)
        for region, _ in list(self._regions.values()):
            self.unregister(region)


def _address(endpoint: str) -> str | None:
    """The IP address of a transfer engine's `host:port` endpoint (None: it does not resolve)."""
    host = endpoint.rsplit(":", 1)[0].strip("[]").split("%")[0]
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    except OSError:
        return None


@dataclass(frozen=True)
class KVLayout:
    """Where a node's KV cache lives, as a peer needs it to write pages there: each layer's base
    address, its shape (K and V planes first, then pages and KV heads in the backend's order:
    torch [2, kv_heads, num_pages, page_size, d], page_axis 2; flashinfer [2, num_pages, kv_heads,
    page_size, d], page_axis 1) and the element size."""

    bases: tuple[int, ...]
    shape: tuple[int, ...]
    itemsize: int
    page_axis: int = 2

    @classmethod
    def of(cls, layers: Sequence[torch.Tensor], page_axis: int = 2) -> "KVLayout":
        if any(not t.is_contiguous() or t.shape != layers[0].shape or t.dtype != layers[0].dtype for t in layers):
            raise ValueError("KV layers must be contiguous, of one shape and dtype")
        return cls(tuple(t.data_ptr() for t in layers), tuple(layers[0].shape), layers[0].element_size(), page_axis)

    @property
    def num_pages(self) -> int:
        return self.shape[self.page_axis]

    @property
    def page_shape(self) -> tuple[int, ...]:
        """[2, kv_heads, page_size, d]: a page's shape whatever the layout."""
        return self.shape[: self.page_axis] + self.shape[self.page_axis + 1 :]

    @property
    def token_bytes(self) -> int:
        """A token's KV in every layer: 2 (K, V) x layers x kv_heads x d x itemsize."""
        planes, kv_heads, _, d = self.page_shape
        return planes * len(self.bases) * kv_heads * d * self.itemsize

    def page_offset(self, plane: int, head: int, page: int) -> int:
        if not 0 <= page < self.num_pages:
            raise ValueError(f"page {page} outside a cache of {self.num_pages} pages")
        index = [plane, head, head, 0, 0]
        index[self.page_axis] = page
        index[3 - self.page_axis] = head  # the KV-head axis is whichever of 1, 2 the pages are not
        offset, stride = 0, 1
        for i in reversed(range(len(self.shape))):
            offset += index[i] * stride
            stride *= self.shape[i]
        return offset * self.itemsize


def kv_blocks(src: KVLayout, dst: KVLayout, src_pages: Sequence[int], dst_pages: Sequence[int]) -> list[Block]:
    """The byte runs that copy src's pages onto dst's pages, in every layer, plane and KV head,
    adjacent runs merged. The two caches may differ in layout (a page's rows are contiguous in both)."""
    if len(src_pages) != len(dst_pages):
        raise ValueError("as many destination pages as source pages")
    if len(set(dst_pages)) != len(dst_pages):
        raise ValueError("a destination page twice")
    if src.page_shape != dst.page_shape or src.itemsize != dst.itemsize or len(src.bases) != len(dst.bases):
        raise ValueError("the two caches differ in more than their number of pages and layout")
    _, kvh, ps, d = src.page_shape
    page_bytes = ps * d * src.itemsize
    blocks: list[Block] = []
    for s_base, d_base in zip(src.bases, dst.bases):
        for plane in (0, 1):
            for head in range(kvh):
                for sp, dp in zip(src_pages, dst_pages):
                    a = s_base + src.page_offset(plane, head, sp)
                    b = d_base + dst.page_offset(plane, head, dp)
                    last = blocks[-1] if blocks else None
                    if last and last.src + last.nbytes == a and last.dst + last.nbytes == b:
                        blocks[-1] = Block(last.src, last.dst, last.nbytes + page_bytes)
                    else:
                        blocks.append(Block(a, b, page_bytes))
    return blocks
