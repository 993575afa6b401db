"""The pool's query path (TokenLake §3.3–3.4) on one host: an engine ships a layer's query rows to
the engine that holds prefix segments and gets back partial outputs with their log-sum-exp, which
it merges with its own attention (engine/attention/partial.py). Prefix KV does not move to be read;
it moves once, when its prompt is computed, into its home: in query mode a `Put` carries it (one zmq frame of
its KV); in read mode the requester `Reserve`s pages on the home, writes them through the home's
mapped cache (shared_kv.py) and `Commit`s them. A heavy hitter an engine reads elsewhere is copied
into it once (a replica): query mode `Fetch`es it, its KV in one frame of the reply; read mode copies
it through the holder's mapped cache.

    requester                                      holder (a thread beside its engine)
    QueryClient.query(layer, q, segments) ──zmq──► QueryService: pages of the pinned segments,
      q rows in the requester's q_buf (shm)          backend.attend_pages(q, its layer's cache)
      (o, lse) read from its out_buf (shm)  ◄──zmq── (o, lse) written into the requester's out_buf

Buffers are POSIX shared memory (multiprocessing.shared_memory), one q_buf/out_buf pair per
(requester, holder), made by the requester, so only a small control message crosses zmq per query. On a
GPU the pair is one device block of the requester's, exported over CUDA IPC (cuda_ipc.py; its file
in the runtime directory): a holder on the same GPU, or on one with peer access to it, opens it and
attends from it and into it, so the rows stay on the devices. A holder that cannot open it (a GPU
without peer access, IPC refused) answers why
(`Done.staged`), and the requester moves its buffers to shared memory: host staging.

Pins. Before the first layer, the requester pins the segments a request reads (`pin`; a second
pin of the same request adds to the first): the holder
resolves their keys to its pages and holds a reference for that request, so no eviction can reuse
them while queries run; `unpin` (the request ended; of some pages only: they moved, and it reads
them where they went) or `release_peer` (the requester died: the supervisor says so) drops them, and the requester's mapped blocks with them. Keys the holder no
longer has are reported, and the requester computes those tokens itself. A holder that does not
answer within the timeout is PeerGone for that call; the channel stays usable, and the late answer
is dropped by its sequence number. A holder whose process is gone (`alive` says so; checked every
20 ms of a wait) is PeerGone at once, and the channel is dead. Pins are keyed by the
requester's engine and incarnation: `release_peer` of an incarnation leaves its successor's alone.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import pickle
import threading
import time
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from typing import Callable, Sequence

import msgspec
import torch
import zmq

from tokenflowd.engine.attention.base import PageQuery
from tokenflowd.pool import cuda_ipc
from tokenflowd.pool.names import attach_untracked

log = logging.getLogger("tokenflowd.pool")


# -- messages ---------------------------------------------------------------------------------
# Every message to a holder names its requester (`peer`, and its incarnation: a restarted requester's
# pins are not its predecessor's) and carries a sequence number that the reply echoes: a reply to
# an earlier message (one the requester stopped waiting for) is told apart and dropped.
class Pin(msgspec.Struct, tag=True):
    peer: int
    request_id: str
    keys: list[bytes]
    incarnation: int = 0
    seq: int = 0


class Unpin(msgspec.Struct, tag=True):
    peer: int
    request_id: str
    incarnation: int = 0
    seq: int = 0
    # these of the request's pages only (they moved: it reads them elsewhere from now on); None: all
    pages: list[int] | None = None


class ReleasePeer(msgspec.Struct, tag=True):
    peer: int
    upto: int = 0  # the gone requester's incarnation: its pins and its earlier ones' go
    incarnation: int = 0
    seq: int = 0


class Query(msgspec.Struct, tag=True):
    peer: int
    buffer: str  # the requester's shared memory block, or its device block's export (on_gpu)
    buffer_rows: int  # the rows it was made for
    layer: int
    rows: int
    query_start: list[int]
    # per request of query_start: its pinned segments are what it reads; a request with no pins is
    # an error (they were lost), except the empty id: no segments (the empty state), on purpose
    request_ids: list[str]
    on_gpu: bool = False  # the buffers are on the requester's GPU (QueryBuffers.on_device)
    incarnation: int = 0
    seq: int = 0


class Put(msgspec.Struct, tag=True):
    """Segments whose home is the holder, computed by the requester: their pages' KV of every layer
    follows as one more frame, [layers, len(keys), 2, kv_heads, page_size, head_dim] whatever either
    engine's cache layout (member.py `stage`)."""

    peer: int
    keys: list[bytes]
    incarnation: int = 0
    seq: int = 0


class Reserve(msgspec.Struct, tag=True):
    """Segments whose home is the holder, being computed by the requester for a request (write into
    the home, read mode): the holder pins, for that request, its pages of the keys it holds already
    and fresh pages for the others, which the requester writes through the mapped cache."""

    peer: int
    request_id: str
    keys: list[bytes]
    incarnation: int = 0
    seq: int = 0


class Commit(msgspec.Struct, tag=True):
    """The requester wrote the reserved fresh `pages` of `keys`: the holder caches them under their
    keys (those still pinned for `request_id`: a page released meanwhile may be another's now)."""

    peer: int
    request_id: str
    keys: list[bytes]
    pages: list[int]
    incarnation: int = 0
    seq: int = 0


class Fetch(msgspec.Struct, tag=True):
    """Segments the requester copies into its own cache (a heavy hitter it reads here: a replica,
    TokenLake §4.3): the holder sends the KV of the leading keys it holds, as `Put` carries it."""

    peer: int
    keys: list[bytes]
    incarnation: int = 0
    seq: int = 0


class Fetched(msgspec.Struct, tag=True):
    held: int  # leading keys of a Fetch the holder had: their KV follows as one more frame (none if 0)
    seq: int = 0


class Reserved(msgspec.Struct, tag=True):
    pages: list[int]  # the holder's pages of the leading keys it could take, pinned for the request
    fresh: list[bool]  # per page: taken fresh (the requester writes it), else held already
    seq: int = 0


class Stored(msgspec.Struct, tag=True):
    held: int  # leading keys of a Put the holder holds now (stored, or held already)
    seq: int = 0


class Pinned(msgspec.Struct, tag=True):
    held: int  # leading keys the holder has and pinned for the request
    pages: list[int] = []  # the holder's pages of them (read mode attends to them in place)
    seq: int = 0


class Done(msgspec.Struct, tag=True):
    error: str = ""
    # a Query whose device buffers the holder cannot open: why (nothing was computed; the requester
    # stages through the host from then on)
    staged: str = ""
    seq: int = 0


_ENCODER = msgspec.msgpack.Encoder()
_TO_HOLDER = msgspec.msgpack.Decoder(Pin | Unpin | ReleasePeer | Query | Put | Reserve | Commit | Fetch)
_TO_PEER = msgspec.msgpack.Decoder(Pinned | Stored | Reserved | Fetched | Done)


# -- buffers ----------------------------------------------------------------------------------
@dataclass
class QueryBuffers:
    """q [rows, heads, d], o [rows, heads, d] (the cache's dtype) and lse [rows, heads] fp32 in one
    block: shared memory (`create`), or on the requester's GPU, exported over CUDA IPC to `path`
    (`on_device`: the holder opens it, `open_device`, and a query's rows never cross the host)."""

    shm: shared_memory.SharedMemory | None
    max_rows: int
    heads: int
    head_dim: int
    dtype: torch.dtype
    owner: bool = False
    raw: torch.Tensor | None = None  # the device block (None: the shared memory's)
    path: str = ""  # where a device block is exported
    q: torch.Tensor = field(init=False)
    o: torch.Tensor = field(init=False)
    lse: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        item = torch.empty((), dtype=self.dtype).element_size()
        plane = self.max_rows * self.heads * self.head_dim * item
        raw = self.raw if self.raw is not None else torch.frombuffer(self.shm.buf, dtype=torch.uint8)
        shape = (self.max_rows, self.heads, self.head_dim)
        self.q = raw[:plane].view(self.dtype).view(shape)
        self.o = raw[plane : 2 * plane].view(self.dtype).view(shape)
        self.lse = raw[2 * plane : 2 * plane + self.max_rows * self.heads * 4].view(torch.float32).view(
            self.max_rows, self.heads)

    @property
    def name(self) -> str:
        """What a Query names the block by: the shared memory's name, or a device block's export."""
        return self.path if self.raw is not None else self.shm.name

    @property
    def on_gpu(self) -> bool:
        return self.raw is not None

    def sync(self) -> None:
        """A block on a GPU: wait for what this thread's stream queued on it (another process reads it next)."""
        if self.raw is not None and self.raw.is_cuda:
            torch.cuda.current_stream(self.raw.device).synchronize()

    @staticmethod
    def nbytes(max_rows: int, heads: int, head_dim: int, dtype: torch.dtype) -> int:
        item = torch.empty((), dtype=dtype).element_size()
        return 2 * max_rows * heads * head_dim * item + max_rows * heads * 4

    @classmethod
    def create(cls, max_rows: int, heads: int, head_dim: int, dtype: torch.dtype) -> "QueryBuffers":
        shm = shared_memory.SharedMemory(create=True, size=cls.nbytes(max_rows, heads, head_dim, dtype))
        return cls(shm, max_rows, heads, head_dim, dtype, owner=True)

    @classmethod
    def attach(cls, name: str, max_rows: int, heads: int, head_dim: int, dtype: torch.dtype) -> "QueryBuffers":
        return cls(attach_untracked(name), max_rows, heads, head_dim, dtype)  # the requester unlinks it

    @classmethod
    def on_device(cls, max_rows: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                  path: str) -> "QueryBuffers":
        """The requester's block on its GPU, exported to `path` (cuda_ipc.export)."""
        raw = torch.zeros(cls.nbytes(max_rows, heads, head_dim, dtype), dtype=torch.uint8, device=device)
        cuda_ipc.export(raw, path)
        return cls(None, max_rows, heads, head_dim, dtype, owner=True, raw=raw, path=path)

    @classmethod
    def open_device(cls, path: str, max_rows: int, heads: int, head_dim: int, dtype: torch.dtype) -> "QueryBuffers":
        """A requester's device block, opened by its holder. ValueError where it is on a GPU out of
        reach (cuda_ipc.open_export)."""
        raw = cuda_ipc.open_export(path)
        if raw.dtype != torch.uint8 or raw.numel() != cls.nbytes(max_rows, heads, head_dim, dtype):
            raise ValueError(f"its query buffers are {raw.numel()} {raw.dtype}, not the "
                             f"{cls.nbytes(max_rows, heads, head_dim, dtype)} bytes of {max_rows} rows")
        return cls(None, max_rows, heads, head_dim, dtype, raw=raw, path=path)

    def close(self) -> None:
        """Unmap (and, for the maker, unlink) the block. Every view of it (q, o, lse, and what a
        query returned) is dead from here on: torch does not hold the mapping."""
        if self.raw is not None:
            self.raw = None
            if self.owner:
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
            return
        self.shm.close()
        if self.owner:
            self.shm.unlink()


# -- the holder -------------------------------------------------------------------------------
class QueryService:
    """Serves peers' queries over this engine's segments, in a thread of the engine's process.

    `resolve(keys)` -> this engine's pages of the longest leading run of `keys` it holds, each
    with a reference taken; `release(pages)` drops those references; `store(keys, kv)` keeps a
    peer's put segments (-> leading keys held); `reserve(keys)` -> (pages, fresh) of the leading
    keys it can take, held or fresh, each referenced; `commit(keys, pages)` caches written fresh
    pages; `stage(pages)` -> their KV in `Put`'s layout, on the host. They run in the service's
    thread: the engine passes callables that are safe there (its page pool's lock)."""

    def __init__(self, address: str, backend, kv_layers: Sequence[torch.Tensor],
                 resolve: Callable[[Sequence[bytes]], list[list[int]]],
                 release: Callable[[list[list[int]]], None],
                 store: Callable[[list[bytes], torch.Tensor], int] | None = None,
                 ctx: zmq.Context | None = None,
                 reserve: Callable[[Sequence[bytes]], tuple[list[int], list[bool]]] | None = None,
                 commit: Callable[[Sequence[bytes], Sequence[int]], int] | None = None,
                 stage: Callable[[Sequence[int]], torch.Tensor] | None = None) -> None:
        self.backend = backend
        self.kv_layers = list(kv_layers)
        self.resolve, self.release, self.store = resolve, release, store
        self.reserve, self.commit, self.stage = reserve, commit, stage
        self.pins: dict[tuple[int, int, str], list[list[int]]] = {}  # (peer, incarnation, request) -> pages per segment
        self._lock = threading.Lock()  # the pins and buffers: the service's thread and release_peer
        self._buffers: dict[str, tuple[int, int, QueryBuffers]] = {}  # block -> (its peer, incarnation, mapping)
        self._ctx = ctx or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.linger = 0
        self._sock.bind(address)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pool-query", daemon=True)
        # serving peers (their queries' attention here; puts' stores, timed by the engine's `store`):
        # what this engine's steps share their device with
        self.busy_seconds = 0.0

    def start(self) -> "QueryService":
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join()  # it polls every 100 ms: the buffers are not unmapped under a query
        for pages in self.pins.values():
            self.release(pages)
        self.pins.clear()
        for _, _, buf in self._buffers.values():
            buf.close()
        self._sock.close(0)

    @property
    def pinned_pages(self) -> int:
        return sum(len(seg) for segs in list(self.pins.values()) for seg in segs)

    @property
    def pinned_requests(self) -> int:
        return len(self.pins)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            frames = self._sock.recv_multipart()
            if len(frames) not in (2, 3):
                log.warning("pool query service: a message of %d frames dropped", len(frames))
                continue
            ident, raw, *payload = frames
            seq = 0
            try:
                msg = _TO_HOLDER.decode(raw)
                seq = msg.seq
                if isinstance(msg, Put) != bool(payload):
                    raise ValueError("a put carries its KV in one frame, and nothing else does")
                with self._lock:
                    if isinstance(msg, Fetch):
                        reply, kv = self._fetch(msg)
                    else:
                        reply, kv = self._put(msg, payload[0]) if payload else self._handle(msg), None
            except Exception as e:  # a bad query must not take the engine's service down
                log.warning("pool query failed: %s: %s", type(e).__name__, e)
                reply, kv = Done(error=f"{type(e).__name__}: {e}"), None
            reply.seq = seq
            if kv is None:
                self._sock.send_multipart([ident, _ENCODER.encode(reply)])
            else:
                self._sock.send_multipart([ident, _ENCODER.encode(reply), memoryview(kv.view(torch.uint8).numpy())],
                                          copy=False)

    def _fetch(self, msg: Fetch) -> tuple[Fetched, torch.Tensor | None]:
        if self.stage is None:
            raise ValueError("this engine gives no copies")
        t0 = time.perf_counter()
        segments = self.resolve(msg.keys)
        try:
            kv = self.stage([page for seg in segments for page in seg]) if segments else None
        finally:
            self.release(segments)
        self.busy_seconds += time.perf_counter() - t0
        return Fetched(held=len(segments)), kv

    def _put(self, msg: Put, payload: bytes) -> Stored:
        if self.store is None:
            raise ValueError("this engine takes no puts")
        layer = self.kv_layers[0]
        axis = self.backend.page_axis
        shape = (len(self.kv_layers), len(msg.keys), *layer.shape[:axis], *layer.shape[axis + 1 :])
        if len(payload) != math.prod(shape) * layer.element_size():
            raise ValueError(f"a put of {len(msg.keys)} pages carries {len(payload)} bytes")
        kv = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(layer.dtype).view(shape)
        return Stored(held=self.store(msg.keys, kv))

    def _handle(self, msg) -> Pinned | Reserved | Done:
        if isinstance(msg, Query):
            return self._query(msg)
        if isinstance(msg, Reserve):
            if self.reserve is None:
                raise ValueError("this engine takes no writes")
            pages, fresh = self.reserve(msg.keys)
            if pages:
                self.pins.setdefault((msg.peer, msg.incarnation, msg.request_id), []).extend([p] for p in pages)
            return Reserved(pages=pages, fresh=fresh)
        if isinstance(msg, Commit):
            if self.commit is None:
                raise ValueError("this engine takes no writes")
            pinned = {p for seg in self.pins.get((msg.peer, msg.incarnation, msg.request_id), ()) for p in seg}
            kept = [(k, p) for k, p in zip(msg.keys, msg.pages) if p in pinned]
            self.commit([k for k, _ in kept], [p for _, p in kept])
            return Done()
        if isinstance(msg, Pin):
            pages = self.resolve(msg.keys)
            if pages:
                self.pins.setdefault((msg.peer, msg.incarnation, msg.request_id), []).extend(pages)
            return Pinned(held=len(pages), pages=[p for seg in pages for p in seg])
        if isinstance(msg, Unpin):
            pin = (msg.peer, msg.incarnation, msg.request_id)
            if msg.pages is None or pin not in self.pins:
                pages = self.pins.pop(pin, None)
                if pages is not None:
                    self.release(pages)
                return Done()
            drop = set(msg.pages)
            kept = [[page for page in seg if page not in drop] for seg in self.pins[pin]]
            self.release([[page for page in seg if page in drop] for seg in self.pins[pin]])
            self.pins[pin] = [seg for seg in kept if seg]
            if not self.pins[pin]:
                del self.pins[pin]
            return Done()
        if isinstance(msg, ReleasePeer):
            self._release_peer(msg.peer, msg.upto)
            return Done()
        return Done(error=f"unknown message {type(msg).__name__}")

    def readers(self, pages: set[int]) -> list[int]:
        """The peers whose pins hold any of `pages` (any thread)."""
        with self._lock:
            return sorted({pin[0] for pin, segs in self.pins.items() if any(p in pages for seg in segs for p in seg)})

    def release_peer(self, peer: int, incarnation: int) -> None:
        """The requester `peer`'s incarnation is gone: drop its pins and buffers, and those of its
        earlier incarnations (any thread)."""
        with self._lock:
            self._release_peer(peer, incarnation)

    def _release_peer(self, peer: int, incarnation: int) -> None:
        for key in [k for k in self.pins if k[0] == peer and k[1] <= incarnation]:
            self.release(self.pins.pop(key))
        for name in [n for n, (p, i, _) in self._buffers.items() if p == peer and i <= incarnation]:
            self._buffers.pop(name)[2].close()

    def _query(self, msg: Query) -> Done:
        if msg.buffer not in self._buffers:
            b = self.backend
            if msg.on_gpu:
                try:
                    buf = QueryBuffers.open_device(msg.buffer, msg.buffer_rows, b.num_heads, b.head_dim, b.dtype)
                except (OSError, ValueError, RuntimeError, KeyError, AssertionError, pickle.UnpicklingError) as e:
                    why = str(e) or type(e).__name__
                    return Done(staged=f"its query buffers cannot be opened over CUDA IPC here: {why}")
            else:
                buf = QueryBuffers.attach(msg.buffer, msg.buffer_rows, b.num_heads, b.head_dim, b.dtype)
            self._buffers[msg.buffer] = (msg.peer, msg.incarnation, buf)
        buf = self._buffers[msg.buffer][2]
        lost = [rid for rid in msg.request_ids if rid and (msg.peer, msg.incarnation, rid) not in self.pins]
        if lost:
            return Done(error=f"no pins for {len(lost)} requests (first {lost[0]!r}): they were released")
        pages = [[p for seg in self.pins.get((msg.peer, msg.incarnation, rid), []) for p in seg]
                 for rid in msg.request_ids]
        t0 = time.perf_counter()
        q = buf.q[: msg.rows].to(self.backend.device)  # staged through the host unless the block is on the GPU
        o, lse = self.backend.attend_pages(q, self.kv_layers[msg.layer], PageQuery(msg.query_start, pages))
        buf.o[: msg.rows].copy_(o)
        buf.lse[: msg.rows].copy_(lse)
        buf.sync()  # written before the requester, told so, reads them on its own stream
        self.busy_seconds += time.perf_counter() - t0
        return Done()


# -- the requester ----------------------------------------------------------------------------
class PeerGone(ConnectionError):
    """The holder's process is gone (or stopped answering): its pins and segments are lost."""


class QueryClient:
    """One requester's channel to one holder. Not thread-safe: the engine's step loop owns it.
    `peer`, `incarnation`: the requester's own (the holder keys its pins by them); `alive()`:
    whether the holder's process still exists (None: only the timeout tells; checked every 20 ms of
    a wait); `holder`: its name in errors. A wait that times out is PeerGone, but the channel stays
    usable (the late answer is dropped by its sequence number); once `alive()` says no, it is dead.
    `silent_for`: s after a wait timed out during which every call is PeerGone at once, without
    asking (a holder alive but stopped: each of a step's calls waiting the timeout in turn kept the
    requester's step, and its heartbeats, waiting as long as the stopped one was silent).
    `device`, `export`: a CUDA device and a file to export its query buffers to: they live on the
    GPU and the holder opens them over CUDA IPC (a holder that cannot: `staged` says why, and the
    buffers move to shared memory); else they are shared memory."""

    def __init__(self, peer: int, address: str, max_rows: int, heads: int, head_dim: int, dtype: torch.dtype,
                 ctx: zmq.Context | None = None, timeout_ms: int = 10_000,
                 alive: Callable[[], bool] | None = None, holder: str = "", incarnation: int = 0,
                 device: torch.device | None = None, export: str = "", silent_for: float = 0.0) -> None:
        self.peer = peer
        self.incarnation = incarnation
        self.holder = holder or address  # for messages
        self.max_rows = max_rows
        self.staged = ""  # why the query buffers are not on the GPU though asked to be
        self.buffers = QueryBuffers.create(max_rows, heads, head_dim, dtype)
        if device is not None and export:
            try:
                self.buffers.close()
                self.buffers = QueryBuffers.on_device(max_rows, heads, head_dim, dtype, device, export)
            except (RuntimeError, OSError) as e:
                self.staged = f"query buffers cannot be exported over CUDA IPC: {e}"
                self.buffers = QueryBuffers.create(max_rows, heads, head_dim, dtype)
        self._ctx = ctx or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.linger = 0
        self._sock.connect(address)
        self.timeout_ms = timeout_ms
        self.alive = alive
        self.dead = False
        self.silent_for = silent_for
        self.silent_until = 0.0  # (monotonic) until then it is taken for gone: it did not answer
        self._seq = 0
        self._rows = 0  # of the query in flight (submit → collect)
        self._asked: tuple = ()  # the query in flight, sent again through the host if its holder asks

    def close(self) -> None:
        self._sock.close(0)
        self.buffers.close()

    def _send(self, msg, payload: memoryview | None = None) -> None:
        if self.dead:
            raise PeerGone(f"pool holder {self.holder} is gone (found earlier)")
        if time.monotonic() < self.silent_until:
            raise PeerGone(f"pool holder {self.holder} did not answer a call within {self.timeout_ms} ms: taken "
                           f"for gone for {self.silent_for:g} s")
        self._seq += 1
        msg.incarnation, msg.seq = self.incarnation, self._seq
        if payload is None:
            self._sock.send(_ENCODER.encode(msg))
        else:
            self._sock.send_multipart([_ENCODER.encode(msg), payload], copy=False)

    def _recv(self, what: str) -> Pinned | Stored | Reserved | Fetched | Done:
        reply, _ = self._recv_frames(what)
        return reply

    def _recv_frames(self, what: str) -> tuple[Pinned | Stored | Reserved | Fetched | Done, bytes | None]:
        """The reply to the last message sent, and the frame that follows it (a Fetched's KV)."""
        deadline = time.monotonic() + self.timeout_ms / 1000
        while True:
            while not self._sock.poll(20):
                if self.alive is not None and not self.alive():
                    self.dead = True
                    raise PeerGone(f"pool holder {self.holder} is gone (its process exited) before answering {what}")
                if time.monotonic() > deadline:
                    self.silent_until = time.monotonic() + self.silent_for
                    raise PeerGone(f"pool holder {self.holder} did not answer {what} within {self.timeout_ms} ms")
            raw, *payload = self._sock.recv_multipart()
            reply = _TO_PEER.decode(raw)
            if reply.seq == self._seq:
                break  # else the answer to a message given up on earlier: dropped
        if isinstance(reply, Done) and reply.error:
            raise RuntimeError(f"pool peer: {reply.error}")
        return reply, payload[0] if payload else None

    def _call(self, msg, payload: memoryview | None = None) -> Pinned | Stored | Reserved | Done:
        self._send(msg, payload)
        return self._recv(type(msg).__name__)

    def pin(self, request_id: str, keys: list[bytes]) -> Pinned:
        """Pin a request's segments on the holder: how many leading ones it holds, and their pages."""
        return self._call(Pin(self.peer, request_id, keys))  # type: ignore[return-value]

    def put(self, keys: list[bytes], kv: torch.Tensor) -> int:
        """Give the holder segments whose home it is: `kv` [layers, len(keys), 2, kv_heads, page_size,
        head_dim], on the host. -> leading keys it holds now."""
        raw = kv.contiguous().view(torch.uint8).numpy()
        return self._call(Put(self.peer, keys), memoryview(raw)).held  # type: ignore[union-attr]

    def fetch(self, keys: list[bytes], num_layers: int, like: torch.Tensor,
              page_axis: int) -> tuple[int, torch.Tensor | None]:
        """The KV of the leading `keys` the holder has, in `Put`'s layout for `num_layers` cache
        layers like `like` (on the host). -> (how many it had, their KV; None if none)."""
        self._send(Fetch(self.peer, keys))
        reply, payload = self._recv_frames("Fetch")
        if not isinstance(reply, Fetched) or not reply.held:
            return 0, None
        shape = (num_layers, reply.held, *like.shape[:page_axis], *like.shape[page_axis + 1 :])
        if payload is None or len(payload) != math.prod(shape) * like.element_size():
            raise RuntimeError(f"pool peer: a copy of {reply.held} pages came with "
                               f"{0 if payload is None else len(payload)} bytes")
        return reply.held, torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(like.dtype).view(shape)

    def reserve(self, request_id: str, keys: list[bytes]) -> Reserved:
        """Pages on the holder for a request's new segments whose home it is, pinned for it: those of
        the leading keys it could take, each held already or fresh (to be written, then `commit`)."""
        return self._call(Reserve(self.peer, request_id, keys))  # type: ignore[return-value]

    def commit(self, request_id: str, keys: list[bytes], pages: list[int]) -> None:
        """The fresh pages `reserve` gave the request, written: the holder caches them under `keys`."""
        self._call(Commit(self.peer, request_id, keys, pages))

    def unpin(self, request_id: str, pages: list[int] | None = None) -> None:
        """Drop the request's pins on the holder; `pages`: those pages only (the rest stay pinned)."""
        self._call(Unpin(self.peer, request_id, pages=pages))

    def release_peer(self, peer: int, incarnation: int = 0) -> None:
        self._call(ReleasePeer(peer, incarnation))

    def submit(self, layer: int, q: torch.Tensor, query_start: list[int], request_ids: list[str]) -> None:
        """Send a query: partial attention of q's rows over the holder's pinned segments of each
        request. `collect` takes its answer; nothing else may be sent in between."""
        rows = q.shape[0]
        if rows > self.max_rows:
            raise ValueError(f"{rows} query rows exceed the pool buffer's {self.max_rows}")
        b = self.buffers
        b.q[:rows].copy_(q)
        b.sync()  # the rows are in the block before the holder reads them
        self._send(Query(self.peer, b.name, self.max_rows, layer, rows, query_start, request_ids, on_gpu=b.on_gpu))
        self._rows = rows
        self._asked = (layer, q, query_start, request_ids)

    def collect(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(o, lse) of the query submitted: views of the shared buffer, valid until the next query."""
        reply = self._recv("Query")
        if isinstance(reply, Done) and reply.staged:  # the holder cannot open the device block: nothing computed
            log.warning("pool: %s: %s; its queries are staged through the host", self.holder, reply.staged)
            self.staged = reply.staged
            b = self.buffers
            self.buffers = QueryBuffers.create(b.max_rows, b.heads, b.head_dim, b.dtype)
            b.close()
            self.submit(*self._asked)
            self._recv("Query")
        return self.buffers.o[: self._rows], self.buffers.lse[: self._rows]

    def query(self, layer: int, q: torch.Tensor, query_start: list[int],
              request_ids: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """submit, then collect."""
        self.submit(layer, q, query_start, request_ids)
        return self.collect()
