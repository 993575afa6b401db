"""An engine's place in the node's pool (`--pool-mode query|read`): it serves its pages to peers and
attends to theirs.

    the front: AddRequest.prefix = runs of the prompt's leading pages and the engines holding them
    admit   pin each run on its holder (query.py Pin; this engine's own runs resolved here) → the
            request keeps only the tokens past them (request.py foreign_token_ids, key_seed)
    write   the front names the prompt's new segments whose home (homes.py segment_homes) is a peer
            (AddRequest.place): once the prompt is computed they move into their homes
            (`hand_off`: read mode writes them through the home's mapped cache, query.py
            Reserve/Commit; query mode puts them, query.py Put) and the request reads them there
            from then on; its pages here go, and are no longer cached here (PagePool.unpublish).
            Requests anywhere that read those pages here follow them into the homes (`follow`,
            told by the front: protocol.Moved). No second copy outlives the prompt and its readers
    a step  every layer: own causal attention with LSE, merged with each holder's partial attention
            over its pinned pages (attention.py): query mode ships the rows, read mode maps the
            holder's cache (shared_kv.py on a CPU, cuda_ipc.py on a GPU) and attends in place; a
            holder whose cache cannot be mapped here is queried instead (host staging)
    the end unpin (`sweep`, once a request is gone or recomputes its prefix)
    a peer goes (PoolPeers without it, or a wait on it finds its process gone): the requests that
            read its pages recompute them here (core.py ForeignPrefixLost), its pins here are dropped

Threads: the query service answers peers in its own thread and takes `lock` (the engine's, held by
its loop whenever the loop touches pages) to resolve and release pins and to store puts. The loop never holds `lock`
while it waits on a peer (core.py `unlocked`): two engines pinning on each other would deadlock.
"""
from __future__ import annotations

import logging
import math
import pickle
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

import psutil
import torch
import zmq

from tokenflowd import protocol as p
from tokenflowd.engine.errors import ForeignPrefixLost
from tokenflowd.engine.scheduler import ScheduledBatch
from tokenflowd.kv.pages import OutOfPages, PagePool
from tokenflowd.kv.staging import gather_pages, scatter_pages
from tokenflowd.pool.attention import HolderRows, PeerCache, PooledAttention, QueriedHolder
from tokenflowd.pool.cuda_ipc import DeviceKV, peer_access
from tokenflowd.pool.heat import within_replica_cap
from tokenflowd.pool.names import cache_name, export_path, query_buffers_path, service_address
from tokenflowd.pool.query import PeerGone, QueryClient, QueryService
from tokenflowd.pool.segments import (
    SegmentCosts,
    attend_probe,
    measure_k_comp,
    measure_link,
    pages_per_segment,
    query_payload,
)
from tokenflowd.pool.shared_kv import SharedKV

log = logging.getLogger("tokenflowd.pool")

# A peer alive but silent for this share of the supervisor's heartbeat timeout is taken for gone,
# for one heartbeat timeout (QueryClient.silent_for): by then the supervisor has killed it, or it
# answers again. The requester waits inside its step, sending no heartbeat: waiting as long as the
# supervisor does (30 s, the timeout before), it was killed with the stopped peer (SIGSTOP, 40 s:
# with --engines 2 both engines were restarted and every stream failed).
PEER_WAIT_SHARE = 0.25
MAX_SEGMENT_PAGES = 64  # a segment longer than this would leave most prefixes unpooled
PROBE_PAGES = 256  # k_comp's probe: one query row over this many pages
SHARE_PERIOD = 0.5  # s: the pool's share of the engine is measured over periods this long
MAX_SHARE = 0.9  # the step-time model is slowed by at most 10x
COPY_PIN = "\x00copy"  # what a copy pins its pages under while it reads them (no request's id: those are printable)


@dataclass
class Peer:
    info: p.PoolPeer
    client: QueryClient | None = None
    cache: SharedKV | DeviceKV | None = None
    # read mode: why its cache cannot be mapped here, so it is served through host staging (query
    # mode's path: the rows go to it, the partial attention comes back); "": mapped, or not tried
    staged: str = ""


@dataclass
class ForeignPrefix:
    """What one request reads where it is: per holding engine, the holder's pages pinned for it
    (their order does not matter to attention; read mode and this engine's own runs use them)."""

    pages: dict[int, list[int]] = field(default_factory=dict)
    keys: dict[int, list[bytes]] = field(default_factory=dict)  # the key of each of those pages
    handed: dict[int, int] = field(default_factory=dict)  # of them, pages it computed and handed there
    touched: set[int] = field(default_factory=set)  # peers asked to pin for it (a failed write's too)

    @property
    def num_pages(self) -> int:
        return sum(len(p) for p in self.pages.values())

    def add(self, engine: int, pages: list[int], keys: Sequence[bytes]) -> None:
        """`pages` pinned on `engine`, the leading ones of `keys`."""
        self.pages.setdefault(engine, []).extend(pages)
        self.keys.setdefault(engine, []).extend(keys[: len(pages)])

    def take(self, engine: int, keys: set[bytes]) -> list[int]:
        """Its pages on `engine` of `keys`, which it reads elsewhere from now on (never pages it handed
        there: those are homed there, and only an engine's own copies move). -> those pages."""
        mine, theirs = self.pages[engine], self.keys[engine]
        taken = [page for page, key in zip(mine, theirs) if key in keys]
        left = [(page, key) for page, key in zip(mine, theirs) if key not in keys]
        if left:
            self.pages[engine], self.keys[engine] = [page for page, _ in left], [key for _, key in left]
        else:
            del self.pages[engine], self.keys[engine]
        return taken


class PoolMember:
    def __init__(self, engine: int, incarnation: int, mode: str, runtime_dir: str, backend,
                 kv_layers: Sequence[torch.Tensor], pool: PagePool, lock: threading.Lock, max_rows: int,
                 map_peers: bool = True, read_rows: int = 1, heartbeat_timeout: float = 30.0) -> None:
        """`map_peers`: False where CUDA IPC is off (--no-pool-ipc): read mode queries its peers, and
        query mode's rows go through the host. `read_rows` (--pool-read-rows): read mode, a peer whose
        cache is mapped from another GPU is read in place by a request with at least this many rows
        in a step, and queried for one with fewer. `heartbeat_timeout`: s the supervisor lets an
        engine be silent before it kills it (PEER_WAIT_SHARE)."""
        assert mode in ("query", "read")
        self.map_peers = map_peers
        self.read_rows = read_rows
        # on a GPU: whether this one's kernels reach each other GPU it sees (peers there are mapped
        # only where they do; /health)
        self.peer_access = peer_access() if kv_layers[0].is_cuda and map_peers else {}
        if self.peer_access:
            log.info("pool: peer access from this engine's GPU: %s",
                     ", ".join(f"{gpu} {'on' if on else 'off'}" for gpu, on in self.peer_access.items()))
        self.engine, self.incarnation, self.mode, self.runtime_dir = engine, incarnation, mode, runtime_dir
        self.backend = backend
        self.kv_layers = list(kv_layers)
        self.pool = pool
        self.lock = lock
        self.max_rows = max_rows
        self.heartbeat_timeout = heartbeat_timeout
        self.peers: dict[int, Peer] = {}
        self.foreign: dict[str, ForeignPrefix] = {}  # request id -> what it reads on engines of the pool
        # keys of hot segments the front named to copy in (`copy_in`), held here or copied: a replica,
        # kept where a request of this engine computed them and wrote them into their home too; one
        # evicted here is forgotten (PoolHooks.evicted)
        self.replicas: set[bytes] = set()
        self.stats = {"query_calls": 0, "query_bytes": 0, "query_seconds": 0.0, "put_pages": 0, "stored_pages": 0,
                      "copied_pages": 0, "read_calls": 0}
        self.service = QueryService(service_address(runtime_dir, engine, incarnation), backend, self.kv_layers,
                                    self._resolve, self._release, self._store, reserve=self._reserve,
                                    commit=self._commit, stage=self._give).start()
        self.segment_pages = 0  # set by size_segments
        self.share = 0.0  # of this engine's time, what serving peers took lately (`measure_share`)
        self._share_at = (time.monotonic(), 0.0)  # (when, the service's busy seconds then)

    def size_segments(self, tokens: int = 0, max_pages: int = MAX_SEGMENT_PAGES) -> int:
        """The segment size in pages: `tokens` if given, else the threshold of segments.py with
        k_comp measured on this engine's attention and α, B on its own query path (the path a
        peer's queries take: ipc, and shared memory or, on a GPU, device buffers; in read mode, α
        and B are 0 and ∞)."""
        ps = self.backend.page_size
        if tokens:
            self.segment_pages = tokens // ps
            log.info("pool: segments of %d pages (%d tokens, as configured)", self.segment_pages, tokens)
            return self.segment_pages
        b = self.backend
        k_comp = measure_k_comp(attend_probe(b, PROBE_PAGES), tokens=PROBE_PAGES * ps)
        payload = query_payload(b.num_heads, b.head_dim, torch.empty((), dtype=b.dtype).element_size())
        if self.mode == "read":
            alpha, bandwidth = 0.0, math.inf
        else:
            probe = QueryClient(-1, service_address(self.runtime_dir, self.engine, self.incarnation), 256,
                                b.num_heads, b.head_dim, b.dtype,  # the path a peer's rows take
                                **self._rows_on_gpu(query_buffers_path(self.runtime_dir, -1, 0, self.engine)))
            q = torch.zeros(256, b.num_heads, b.head_dim, dtype=b.dtype, device=self.kv_layers[0].device)
            try:  # request "": no segments, so only the path is timed
                alpha, bandwidth = measure_link(lambda n: probe.query(0, q[:n], [0, n], [""]), payload)
            finally:
                probe.close()
                self.service.release_peer(-1, 0)
        costs = SegmentCosts(alpha, bandwidth, k_comp, payload)
        self.segment_pages = pages_per_segment(costs, ps, max_pages)
        log.info("pool: segments of %d pages (%d tokens): threshold %.0f tokens from alpha %.1f us, B %.2f GB/s, "
                 "k_comp %.1f ns/token", self.segment_pages, self.segment_pages * ps, costs.threshold_tokens(),
                 alpha * 1e6, bandwidth / 1e9, k_comp * 1e9)
        return self.segment_pages

    def measure_share(self, now: float) -> float:
        """The share of this engine's time its query service took serving peers: busy seconds over
        wall time, per period of SHARE_PERIOD, smoothed over the last few (exponentially, by half)."""
        then, busy = self._share_at
        if now - then >= SHARE_PERIOD:
            current = self.service.busy_seconds
            period = min(MAX_SHARE, (current - busy) / (now - then))
            self.share = 0.5 * self.share + 0.5 * period
            self._share_at = (now, current)
        return self.share

    def traffic_bytes(self) -> tuple[int, int]:
        """(a query row shipped and answered, a token's KV), all layers: what the front's dispatch
        weighs (router.py TrafficCost)."""
        b = self.backend
        item = torch.empty((), dtype=b.dtype).element_size()
        layers = len(self.kv_layers)
        row = layers * query_payload(b.num_heads, b.head_dim, item) if self.mode == "query" else 0  # read: none
        return row, layers * 2 * b.num_kv_heads * b.head_dim * item

    def close(self) -> None:
        self.service.close()
        for peer in self.peers.values():
            self._close_peer(peer)
        self.peers.clear()

    # -- the holder's side (the service's thread, and this engine's own runs) -----------------
    def _resolve(self, keys: Sequence[bytes]) -> list[list[int]]:
        with self.lock:
            pages = self.pool.lookup(keys)
            for page in pages:
                self.pool.incref(page)
        return [[page] for page in pages]

    def _release(self, segments: list[list[int]]) -> None:
        with self.lock:
            for pages in reversed(segments):
                for page in pages:
                    self.pool.decref(page)

    def _store(self, keys: list[bytes], kv: torch.Tensor) -> int:
        """A peer puts segments whose home is this engine (`kv`: the wire layout of `stage`): `_keep`.
        -> leading keys held now."""
        t0 = time.perf_counter()
        held, new = self._keep(keys, kv)
        self.stats["stored_pages"] += new
        self.service.busy_seconds += time.perf_counter() - t0
        return held

    def _keep(self, keys: list[bytes], kv: torch.Tensor, first: bool = False) -> tuple[int, int]:
        """Pages of `keys` from `kv` (the wire layout of `stage`, on the host or this device): the keys
        not held yet get pages, their KV and their keys, and stay unreferenced in the prefix cache
        (its LRU decides when they go; `first`: a replica's, taken from unused pages only, and the
        new ones go before any other cached page until read). Stops at the first page it cannot
        get; a copy that fails frees the pages it took. -> (leading keys held now, pages written)."""
        with self.lock:
            taken: list[int] = []  # in key order: pages it holds already (referenced while it allocates, so
            new: list[tuple[int, int]] = []  # not evicted) and new ones, (position in the put, page)
            try:
                for i, key in enumerate(keys):
                    page = self.pool.lookup([key])
                    if page:
                        self.pool.incref(page[0])
                        taken.append(page[0])
                    else:
                        if first and not self.pool.num_unused:  # (the query service may have taken them)
                            break
                        new.append((i, self.pool.allocate()))
                        taken.append(new[-1][1])
            except OutOfPages:
                pass
            held = len(taken)
            try:
                if new:
                    self._write(kv, new)
                for i, page in new:
                    self.pool.register(page, keys[i])
            except Exception:
                held, new = new[0][0], []  # the keys before the first new page
                log.exception("pool: pages from a peer could not be stored")
            finally:
                # the segment's end first into the LRU: eviction takes a prefix from its end, never
                # leaving its later pages cached behind a missing one (an unregistered page is freed)
                for page in reversed(taken):
                    self.pool.decref(page)
                if first:
                    self.pool.evict_first([page for _, page in new])
        return held, len(new)

    def _reserve(self, keys: Sequence[bytes]) -> tuple[list[int], list[bool]]:
        """A peer writes segments whose home is this engine (read mode): per leading key, the page
        holding it already, or a fresh one for the peer to write, referenced until the request's pins
        go; stops at the first it cannot get. -> (pages, fresh)."""
        pages, fresh = [], []
        with self.lock:
            try:
                for key in keys:
                    held = self.pool.lookup([key])
                    if held:
                        self.pool.incref(held[0])
                    pages.append(held[0] if held else self.pool.allocate())
                    fresh.append(not held)
            except OutOfPages:
                pass
        return pages, fresh

    def _commit(self, keys: Sequence[bytes], pages: Sequence[int]) -> int:
        """The peer wrote the fresh pages `_reserve` gave: cached under their keys from now on (a key
        another page took meanwhile keeps that page; this one goes with the request's pins)."""
        with self.lock:
            for key, page in zip(keys, pages):
                self.pool.register(page, key)
            self.stats["stored_pages"] += len(pages)
        return len(pages)

    def _write(self, kv: torch.Tensor, new: list[tuple[int, int]]) -> None:
        src = torch.tensor([i for i, _ in new], device=kv.device)
        scatter_pages(kv.index_select(1, src), self.kv_layers, [page for _, page in new], self.backend.page_axis)
        if self.kv_layers[0].is_cuda:  # registered next: a peer's read on its own stream must find them there
            torch.cuda.current_stream(self.kv_layers[0].device).synchronize()

    def _give(self, pages: Sequence[int]) -> torch.Tensor:
        """A peer copies pages it reads here (a heavy hitter: `copy_in`): their KV, on the host."""
        with self.lock:
            return self.stage(pages)

    # -- placement: this engine's side ---------------------------------------------------------
    def stage(self, pages: Sequence[int], peer_layers: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """Every layer's KV of `pages` in one host tensor, what `put` sends: federation/transport.py's
        wire layout, [layers, pages, 2, kv_heads, page_size, head_dim], whatever the cache's own
        (torch's and flashinfer's differ in where the page axis is). The caller holds `lock`.
        `peer_layers`: a peer's mapped cache instead (`copy_in`), staged on its device, not the host."""
        layers, axis = peer_layers or self.kv_layers, self.backend.page_axis
        first = layers[0]
        page_elements = first.numel() // first.shape[axis]
        out = torch.empty(len(layers) * len(pages) * page_elements, dtype=first.dtype,
                          **({"device": first.device} if peer_layers else {"pin_memory": first.is_cuda}))
        return gather_pages(layers, pages, out, axis)

    def put(self, home: int, keys: list[bytes], kv: torch.Tensor) -> int:
        """Give `home` the segments of `keys` (staged by `stage`). -> leading keys it holds now (0
        when it is gone or fails: they stay here). Call without `lock`: the home may be pinning here."""
        peer = self.peers.get(home)
        if peer is None:
            return 0
        try:
            held = self._client(peer).put(keys, kv)
        except (PeerGone, RuntimeError, OSError, zmq.ZMQError) as e:
            log.warning("pool: a put to engine %d failed (%s); its segments stay here", home, e)
            return 0
        self.stats["put_pages"] += held
        return held

    def copy_in(self, runs: Sequence[p.PrefixRun]) -> int:
        """Hot segments this engine reads on peers, copied into its own cache (a replica, TokenLake
        §4.3; the front names them: AddRequest.copy): the pages it lacks, unreferenced in its prefix
        cache, where its requests read them from now on (`pin` takes its own pages first). Read mode
        copies through the holder's mapped cache (device to device on a GPU), query mode fetches
        them. Best effort: a peer gone leaves the rest where it is.

        A replica is a second copy of what the node holds: it takes unused pages only (a run whose
        pages it lacks outnumber them is not copied), the replicas here hold at most 1/N of this
        engine's pages (pool/heat.py replica_pages: a run that would pass it, counting its pages held
        here already, is neither copied nor made a replica), and its pages go before any other
        cached page until a request reads them, so that it never costs this engine a prefix held
        nowhere else.
        (Node simulator, a quarter of an A100's KV, documents read 32 times each at 16 req/s,
        segments written into their homes, four runs: copies that evicted as any page met the TTFT
        SLO for 0.52, 0.72, 0.41 and 0.84 of requests, hit 0.73, 0.82, 0.74, 0.77; these, 0.64,
        0.85, 0.48, 0.80, hit 0.72, 0.83, 0.82, 0.78.) What is held here once the copy ends is a
        replica (`replicas`). -> pages copied. Call without `lock`."""
        copied = 0
        for run in runs:
            peer = self.peers.get(run.engine)
            if run.engine == self.engine or peer is None:
                continue
            with self.lock:
                have = len(self.pool.lookup(run.keys))
                keys = run.keys[have:]  # (keys are chained: any stretch names its pages)
                if len(keys) > self.pool.num_unused or not self._room_for_replicas(run.keys):
                    continue
                if not keys:
                    self.replicas.update(run.keys)
                    continue
            try:
                client = self._client(peer)
                if self._mapped(peer):
                    pinned = client.pin(COPY_PIN, keys)
                    try:
                        held, kv = len(pinned.pages), self.stage(pinned.pages, self._cache(peer).layers)
                        if kv.is_cuda:  # the gather is queued: the holder may reuse the pages once unpinned
                            torch.cuda.current_stream(kv.device).synchronize()
                    finally:
                        client.unpin(COPY_PIN)
                else:
                    held, kv = client.fetch(keys, len(self.kv_layers), self.kv_layers[0], self.backend.page_axis)
                kept, stored = self._keep(keys[:held], kv, first=True) if held else (0, 0)
            except (PeerGone, RuntimeError, OSError, ValueError, zmq.ZMQError) as e:
                log.warning("pool: copying %d pages from engine %d failed (%s); they are read there", len(keys),
                            run.engine, e)
                continue
            self.replicas.update(run.keys[: have + kept])
            copied += stored
            self.stats["copied_pages"] += stored
        return copied

    def _room_for_replicas(self, keys: Sequence[bytes]) -> bool:
        """Whether `keys` may all be replicas here (pool/heat.py replica_pages, N the engines serving
        now); replicas evicted since this engine's last report are no longer counted. Call with `lock`."""
        engines = len(self.peers) + 1
        if within_replica_cap(self.replicas, keys, self.pool.num_pages, engines):
            return True
        self.replicas.difference_update([key for key in self.replicas if not self.pool.holds(key)])
        return within_replica_cap(self.replicas, keys, self.pool.num_pages, engines)

    def hand_off(self, request_id: str, runs: Sequence[tuple[int, list[bytes], list[int]]]) -> int:
        """Write into the home: the request's leading computed pages here, in runs of (home, keys,
        pages here) in token order, are read where their segments live from now on: a run homed here
        is pinned where it is, a peer's is written into the peer (read mode: through its mapped
        cache; query mode: put) and pinned there. Stops at the first page that cannot be had (a peer
        gone or full). -> leading pages now in the request's foreign prefix, past what it read
        before (the caller lets go of them here). Call without `lock`."""
        prefix = self.foreign.setdefault(request_id, ForeignPrefix())
        done = 0
        for engine, keys, local in runs:
            if engine == self.engine:
                got = [page for seg in self._resolve(keys) for page in seg]
            else:
                prefix.touched.add(engine)
                got = self._write_home(engine, request_id, keys, local)
            if got:
                prefix.add(engine, got, keys)
                prefix.handed[engine] = prefix.handed.get(engine, 0) + len(got)
            done += len(got)
            if len(got) < len(keys):
                break
        if not prefix.pages and not prefix.touched:
            del self.foreign[request_id]
        return done

    def _write_home(self, engine: int, request_id: str, keys: list[bytes], local: list[int]) -> list[int]:
        """`local`'s KV into the home `engine`, pinned there for the request. -> its pages there of the
        leading keys it took."""
        peer = self.peers.get(engine)
        if peer is None:
            return []
        client = self._client(peer)
        try:
            if not self._mapped(peer):  # no mapping: the KV crosses in the put
                held = client.put(keys, self.stage(local))
                self.stats["put_pages"] += held
                return client.pin(request_id, keys[:held]).pages if held else []
            cache = self._cache(peer)
            reserved = client.reserve(request_id, keys)
            fresh = [i for i, f in enumerate(reserved.fresh) if f]
            if fresh:
                axis = self.backend.page_axis
                src = torch.tensor([local[i] for i in fresh], device=self.kv_layers[0].device)
                dst = torch.tensor([reserved.pages[i] for i in fresh], device=src.device)
                for mine, theirs in zip(self.kv_layers, cache.layers):
                    theirs.index_copy_(axis, dst, mine.index_select(axis, src))
                if src.is_cuda:  # the copy is queued on this stream: the home publishes the pages at
                    torch.cuda.current_stream(src.device).synchronize()  # Commit, so they must have landed
                client.commit(request_id, [keys[i] for i in fresh], [reserved.pages[i] for i in fresh])
                self.stats["put_pages"] += len(fresh)
            return reserved.pages
        except (PeerGone, RuntimeError, OSError, ValueError, zmq.ZMQError) as e:
            log.warning("pool: writing %d pages into engine %d failed (%s); they stay here", len(keys), engine, e)
            return []

    def readers(self, pages: Sequence[int]) -> list[int]:
        """The peers that pin any of this engine's `pages` for their requests (they read them here)."""
        return self.service.readers(set(pages))

    def follow(self, holder: int, runs: Sequence[p.PrefixRun]) -> int:
        """`holder` wrote segments into their homes (`runs`: each home and keys; protocol.Moved): the
        requests here that read its pages of them read them at the homes from now on, pinned there
        (where this engine is the home, its own pages), and let go of them on `holder`, whose copy
        then goes once no one reads it. A read follows its segment: else requests that came while a
        document was computed read it where it was computed, a second copy kept for them, apart from
        its homes, for as long as they run. Best effort: what a home does not hold (evicted meanwhile,
        a peer gone) stays read on `holder`. -> pages that moved. Call without `lock`."""
        homes = {key: run.engine for run in runs for key in run.keys}
        moved = 0
        for rid, prefix in list(self.foreign.items()):
            by_home: dict[int, list[bytes]] = {}
            for key in prefix.keys.get(holder, ()):
                home = homes.get(key, holder)
                if home != holder:
                    by_home.setdefault(home, []).append(key)
            for home, keys in by_home.items():
                pages = self._pin_at(rid, home, keys)
                if not pages:
                    continue
                prefix.add(home, pages, keys)
                gone = prefix.take(holder, set(keys[: len(pages)]))
                if holder == self.engine:
                    self._release([gone])
                else:
                    self._unpin(rid, holder, gone)
                moved += len(pages)
        return moved

    def _pin_at(self, request_id: str, engine: int, keys: list[bytes]) -> list[int]:
        """Pin the leading `keys` `engine` holds for the request. -> their pages there ([]: a peer
        gone or failing; the request computes those tokens, or reads them where it did)."""
        if engine == self.engine:
            return [page for seg in self._resolve(keys) for page in seg]
        peer = self.peers.get(engine)
        if peer is None:
            return []
        try:
            pages = self._client(peer).pin(request_id, keys).pages
        except (PeerGone, RuntimeError, zmq.ZMQError) as e:
            log.warning("pool: pin on engine %d failed: %s", engine, e)
            return []
        self._mapped(peer)  # (read mode: mapped now, or staged from here on)
        return pages

    # -- peers ----------------------------------------------------------------------------------
    def set_peers(self, peers: list[p.PoolPeer]) -> list[str]:
        """The engines serving now. -> the requests whose prefix a peer that went away held."""
        now = {peer.engine: peer for peer in peers if peer.engine != self.engine}
        lost = [e for e, known in self.peers.items() if now.get(e) != known.info]
        for e in lost:
            peer = self.peers.pop(e)
            self._close_peer(peer)
            self.service.release_peer(e, peer.info.incarnation)  # its requests' pins here
        for e, info in now.items():
            if e not in self.peers:
                self.peers[e] = Peer(info)
        return self.dependents(lost)

    def _close_peer(self, peer: Peer) -> None:
        if peer.client is not None:
            peer.client.close()
        if peer.cache is not None:
            peer.cache.close()

    def dependents(self, engines: Sequence[int]) -> list[str]:
        gone = set(engines)
        return [rid for rid, f in self.foreign.items() if gone & f.pages.keys()]

    def _client(self, peer: Peer) -> QueryClient:
        if peer.client is None:
            b, info = self.backend, peer.info
            peer.client = QueryClient(self.engine, service_address(self.runtime_dir, info.engine, info.incarnation),
                                      self.max_rows, b.num_heads, b.head_dim, b.dtype,
                                      timeout_ms=int(1000 * PEER_WAIT_SHARE * self.heartbeat_timeout),
                                      silent_for=self.heartbeat_timeout,
                                      alive=lambda pid=info.pid: psutil.pid_exists(pid), holder=f"engine {info.engine}",
                                      incarnation=self.incarnation, **self._rows_on_gpu(
                                          query_buffers_path(self.runtime_dir, self.engine, self.incarnation,
                                                             info.engine)))
        return peer.client

    def _rows_on_gpu(self, export: str) -> dict:
        """A QueryClient's device and export: its rows on this engine's GPU, opened by the holder over
        CUDA IPC (none on a CPU, or with --no-pool-ipc: shared memory)."""
        if not (self.kv_layers[0].is_cuda and self.map_peers):
            return {}
        return {"device": self.kv_layers[0].device, "export": export}

    def _cache(self, peer: Peer) -> SharedKV | DeviceKV:
        if peer.cache is None:
            shape = self.backend.kv_cache_shape(peer.info.num_pages + 1)  # its scratch page too (runner.py)
            info = peer.info
            if self.kv_layers[0].is_cuda:
                peer.cache = DeviceKV.open(export_path(self.runtime_dir, info.engine, info.incarnation),
                                           len(self.kv_layers), shape, self.backend.dtype, self.peer_access)
            else:
                peer.cache = SharedKV.attach(cache_name(self.runtime_dir, info.engine, info.incarnation),
                                             len(self.kv_layers), shape, self.backend.dtype)
        return peer.cache

    def _mapped(self, peer: Peer) -> bool:
        """Read mode with the peer's cache mapped here (opened at the first need); False: query mode,
        or a peer served through host staging because its cache cannot be mapped."""
        if self.mode != "read" or peer.staged:
            return False
        try:
            if not self.map_peers:
                raise ValueError("CUDA IPC is off (--no-pool-ipc)")
            self._cache(peer)
            return True
        except FileNotFoundError as e:
            peer.staged = f"it exports no cache to map ({e.filename or e}: its export failed, or --no-pool-ipc)"
        except (OSError, ValueError, RuntimeError, KeyError, pickle.UnpicklingError) as e:
            peer.staged = str(e) or type(e).__name__
        if peer.staged:
            log.warning("pool: engine %d's cache cannot be mapped here (%s): it is served through host staging",
                        peer.info.engine, peer.staged)
        return False

    def sharing(self) -> tuple[str, dict[int, str]]:
        """How peers' pages are read here: (the path, {peer: why it is staged through the host})."""
        gpu = self.kv_layers[0].is_cuda
        if not self.map_peers:
            path = "host staging (--no-pool-ipc)"
        elif self.mode == "query":
            path = "cuda ipc (query mode)" if gpu else "host staging (query mode)"
        else:
            path = "cuda ipc" if gpu else "shared memory"
        staged = {e: peer.staged or (peer.client.staged if peer.client else "") for e, peer in self.peers.items()}
        return path, {e: why for e, why in staged.items() if why}

    # -- a request --------------------------------------------------------------------------
    def pin(self, request_id: str, runs: list[p.PrefixRun]) -> int:
        """Pin the runs where they are, in order, up to the first page that cannot be had (a run its
        holder no longer holds whole, a peer gone). -> leading pages pinned; 0 for a request that
        holds pins already (the engine's loop calls it without its lock)."""
        if request_id in self.foreign:
            return 0
        prefix = self.foreign[request_id] = ForeignPrefix()  # from the first pin: `release` finds them all
        try:
            for run in runs:
                engine, pages = self._pin_run(request_id, run)
                if pages:
                    prefix.add(engine, pages, run.keys)
                if len(pages) < len(run.keys):
                    break
        except Exception:
            self.release(request_id)
            raise
        if not prefix.pages:
            del self.foreign[request_id]
        return prefix.num_pages

    def count(self, request_id: str) -> tuple[int, int]:
        """(pages read on peers, pages read from this engine's own cache) of an admitted request."""
        prefix = self.foreign.get(request_id)
        if prefix is None:
            return 0, 0
        read = {e: len(pages) - prefix.handed.get(e, 0) for e, pages in prefix.pages.items()}
        own = read.get(self.engine, 0)
        return sum(read.values()) - own, own

    def _pin_run(self, request_id: str, run: p.PrefixRun) -> tuple[int, list[int]]:
        """-> (the engine it is read on, its pages pinned there): this engine's own where it holds the
        whole run (a replica copied in since the front named the run), else the run's holder."""
        here = self._resolve(run.keys)
        if run.engine == self.engine or len(here) == len(run.keys):
            return self.engine, [page for seg in here for page in seg]
        self._release(here)
        return run.engine, self._pin_at(request_id, run.engine, run.keys)

    def release(self, request_id: str) -> None:
        """The request is gone or no longer reads its foreign prefix: drop its pins everywhere."""
        prefix = self.foreign.pop(request_id, None)
        if prefix is None:
            return
        for engine in prefix.pages.keys() | prefix.touched:
            if engine == self.engine:
                self._release([prefix.pages[engine]])
            else:
                self._unpin(request_id, engine)

    def _unpin(self, request_id: str, engine: int, pages: list[int] | None = None) -> None:
        """Drop the request's pins on peer `engine` (`pages`: those only)."""
        peer = self.peers.get(engine)
        if peer is None or peer.client is None or peer.client.dead:
            return  # gone: nothing of it is pinned any more
        try:
            peer.client.unpin(request_id, pages)
        except (PeerGone, RuntimeError, zmq.ZMQError) as e:
            log.warning("pool: unpin on engine %d failed: %s", engine, e)

    def sweep(self, reading: set[str]) -> None:
        """Release every request not in `reading` (those that still read a foreign prefix)."""
        for rid in [rid for rid in self.foreign if rid not in reading]:
            self.release(rid)

    # -- a step -------------------------------------------------------------------------------
    def step_attention(self, attn, batch: ScheduledBatch, query_start: list[int]) -> PooledAttention | None:
        """The step's attention with the partial attention of foreign prefixes merged in, where some
        of its requests read pages held elsewhere in the pool (runner.py StepAttention); else None."""
        if not any(batch.offsets):
            return None
        holders = self.holders(batch, query_start)
        return PooledAttention(attn, holders) if holders else None

    def holders(self, batch: ScheduledBatch, query_start: list[int]) -> list:
        """This step's sources of foreign attention (attention.py): per engine holding pages of its
        requests, its pages attended in place (this engine's own, or a peer's mapped here) or the rows
        sent to it; a peer mapped from another GPU both, each request by its rows (`read_in_place_from`).
        Raises ForeignPrefixLost for requests whose holder is gone."""
        rows: dict[tuple[int, bool], HolderRows] = {}  # (engine, read in place) -> rows
        fewest: dict[int, float] = {}  # engine -> the fewest rows of a request read in place there, this step
        lost: list[str] = []
        for i, rid in enumerate(batch.request_ids):
            prefix = self.foreign.get(rid)
            if prefix is None or not batch.offsets[i]:  # (its prefix recomputed here: unpinned soon)
                continue
            n = query_start[i + 1] - query_start[i]
            for engine, pages in prefix.pages.items():
                if engine != self.engine and engine not in self.peers:
                    lost.append(rid)
                    break
                if engine not in fewest:
                    fewest[engine] = 0 if engine == self.engine else self.read_in_place_from(self.peers[engine])
                here = n >= fewest[engine]
                rows.setdefault((engine, here), HolderRows()).add(rid, query_start[i], query_start[i + 1], pages)
        if lost:
            raise ForeignPrefixLost(lost, "a pool peer holding their prefix is gone")
        sources = []
        for (engine, here), r in rows.items():
            if engine == self.engine:
                sources.append(PeerCache(r, self.backend, self.kv_layers))
            elif here:
                sources.append(PeerCache(r, self.backend, self.peers[engine].cache.layers, self.stats))
            else:
                sources.append(QueriedHolder(r, self._client(self.peers[engine]), self.stats))
        return sources

    def read_in_place_from(self, peer: Peer) -> float:
        """The fewest rows of a request in a step that attend this peer's pages here (fewer are sent
        to it): none (inf) unless read mode has the peer's cache mapped; any (1) where the cache is in
        this engine's memory (a CPU's, or this GPU's); else `read_rows`: reading a peer's pages over
        NVLink or PCIe is slower than reading them where they are, so a decode row's attention over a
        long prefix is the peer's to compute, and a prompt chunk's, bound by its FLOPs, this engine's
        (no round trip, nothing asked of the peer)."""
        if not self._mapped(peer):
            return math.inf
        return 1 if self.same_memory(peer) else self.read_rows

    def same_memory(self, peer: Peer) -> bool:
        """Whether the peer's mapped cache is in this engine's memory: a CPU's, or this GPU's (engines
        sharing one GPU), not another GPU's reached over the link."""
        return peer.cache.layers[0].device == self.kv_layers[0].device
