"""The front's side of the engines: feeds them requests, routes their outputs to streams.

    Supervisor ──AddRequest/Abort/SetReadingRate/SetReadCursor/Query──► engine i (zmq PUSH, one per incarnation)
               ◄──Ready/StepOutputs/QueryReply─────────────────────── all engines (one zmq PULL)
    (and the pool's: Reads and Withdraw out, ResolveReads and Withdrawn in)

    engine_handle.py   EngineHandle: one engine's state, input socket and streams
    launcher.py        LocalLauncher: spawns, watches and restarts the engine processes
    prefix_index.py    PrefixIndex: the page keys each engine's prefix cache holds (for the router)

Each engine has an incarnation number: a restarted engine gets a fresh input socket, and
messages from an older incarnation are dropped, so nothing meant for a dead engine reaches its
successor. When an engine exits or stops sending heartbeats, every stream it served ends with an
error delta at once and the engine restarts with exponential backoff.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import msgspec
import zmq

from tokenflowd import protocol as p
from tokenflowd.config import EngineConfig, PolicyConfig, ServerConfig
from tokenflowd.daemon.engine_handle import EngineHandle, Stream
from tokenflowd.daemon.launcher import LocalLauncher, engine_configs
from tokenflowd.daemon.prefix_index import PrefixIndex
from tokenflowd.pool.names import cache_name, export_path, query_buffers_of, sweep_stale, unlink

log = logging.getLogger("tokenflowd.daemon.supervisor")


class NoEngineReady(RuntimeError):
    pass


class Supervisor:
    front = 0  # this process's output at every engine (0: the supervisor's own)
    front_epoch = 0  # which start of that front this is (AbortFront)
    # the pool: this process tells engines where segments their requests read went (Moved); every
    # front hears the same step messages, and the supervisor alone tells them
    tells_readers = True

    def __init__(self, server: ServerConfig, engine: EngineConfig, num_fronts: int = 0,
                 placement: list[tuple[EngineConfig, dict[str, str]]] | None = None) -> None:
        """`num_fronts`: the API server processes of --api-servers N > 1 (api_servers.py), each an
        output of every engine.
        `placement`: each engine's config and environment (default: launcher.engine_configs)."""
        self.server = server
        self.engine_config = engine
        self.num_fronts = num_fronts
        self.front_addresses: list[str] = []
        self.on_change: Callable[[], None] = lambda: None  # an engine came, went or was reconfigured
        # the index changed: (keys added, keys removed), or (None, None) when it was rebuilt
        self.on_keys: Callable[[list[bytes] | None, list[bytes] | None], None] | None = None
        # the pool: a queued request asks where its prefix is now (the front that routes answers)
        self.on_resolve: Callable[[EngineHandle, Stream], None] | None = None
        # a request's first token came (its prompt is computed, its pages in the index: told with the
        # engine's next message, `_on_step`) or it ended
        self.on_started: Callable[[str], None] | None = None
        self._started: dict[int, list[str]] = {}  # engine -> its last message's first tokens (`_on_step`)
        self.on_computing: Callable[[str], None] | None = None  # a step begins a request's prompt (p.Computing)
        # the pool: an engine reported its state (StepOutputs: an idle one may take a queued request),
        # and an engine gave queued requests back (Withdrawn)
        self.on_report: Callable[[EngineHandle], None] | None = None
        self.on_withdrawn: Callable[[EngineHandle, p.Withdrawn], None] | None = None
        self.slots = [
            EngineHandle(i, cfg, env)
            for i, (cfg, env) in enumerate(placement or engine_configs(engine, server.engines))
        ]
        self.index = PrefixIndex()  # which page keys each engine holds (the router's)
        # pool: keys a sender said it wrote into a home that the home has not reported holding yet,
        # (home, key) -> when they leave the index unless it has (`_moved_keys`), soonest first
        self._moved: dict[tuple[int, bytes], float] = {}
        self.runtime_dir: Path | None = None
        self.launcher: LocalLauncher | None = None
        # Plain sockets: engine inboxes never block on send (no HWM); the shared output socket is
        # read from the loop's reader callback, draining every message that is there per wake-up.
        self._ctx = zmq.Context()
        self._outbox: zmq.Socket | None = None
        self._decoder = msgspec.msgpack.Decoder(p.FromEngine)
        self._encoder = msgspec.msgpack.Encoder()
        self._queries: dict[int, asyncio.Future[list[p.RequestInfo]]] = {}
        self._query_ids = itertools.count()
        # federation: request id -> the engine's Reserved (decode role) or Prefilled (prefill role)
        self._answers: dict[str, asyncio.Future] = {}

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        base = self.server.runtime_dir
        if base:
            Path(base).mkdir(parents=True, exist_ok=True)
        self.runtime_dir = Path(tempfile.mkdtemp(prefix="tokenflowd-", dir=base))  # mode 0700
        if self.engine_config.pool_mode == "read":
            stale = sweep_stale(str(self.runtime_dir.parent))
            if stale:
                log.warning("removed %d shared KV caches left by daemons that are gone: %s", len(stale), stale[:3])
        self.front_addresses = [f"ipc://{self.runtime_dir}/out-f{k}" for k in range(1, self.num_fronts + 1)]
        self._outbox = self._ctx.socket(zmq.PULL)
        self._outbox.bind(f"ipc://{self.runtime_dir}/out")
        asyncio.get_running_loop().add_reader(self._outbox.getsockopt(zmq.FD), self._read_outputs)
        self.launcher = LocalLauncher(self.server, self._ctx, self.runtime_dir, self._engine_gone, self.engine_command,
                                      self.front_addresses)
        for handle in self.slots:
            await self.launcher.start(handle)

    async def stop(self) -> None:
        for handle in self.slots:
            if handle.pid is not None:
                self.send(handle, p.Shutdown())
        if self.launcher is not None:
            await self.launcher.stop(self.slots)
        for handle in self.slots:
            handle.fail_streams("the server is shutting down")
            handle.state = "stopped"
            if self.engine_config.pool_mode != "off" and self.runtime_dir is not None:  # one killed at stop
                unlink(cache_name(str(self.runtime_dir), handle.engine_id, handle.incarnation))
        if self._outbox is not None:
            asyncio.get_running_loop().remove_reader(self._outbox.getsockopt(zmq.FD))
        self._ctx.destroy(linger=0)
        if self.runtime_dir:
            shutil.rmtree(self.runtime_dir, ignore_errors=True)

    def engine_command(self, spec: p.EngineSpec) -> list[str]:
        """The engine process's command line (a benchmark swaps in a model-free engine here)."""
        return [sys.executable, "-m", "tokenflowd.engine.process", msgspec.json.encode(spec).decode()]

    def _engine_gone(self, handle: EngineHandle, message: str) -> None:
        """Its process exited or was killed: its streams end with `message`, its cache is gone (and
        with the pool on, the peers that read its pages learn so at once)."""
        handle.fail_streams(message)
        if self.engine_config.pool_mode != "off" and self.runtime_dir is not None:
            try:
                unlink(cache_name(str(self.runtime_dir), handle.engine_id, handle.incarnation))
            except OSError as e:  # (what follows must run: the router must not name it again)
                log.warning("engine %d: its KV cache's shared memory could not be removed: %s", handle.engine_id, e)
            for path in (export_path(str(self.runtime_dir), handle.engine_id, handle.incarnation),
                         *query_buffers_of(str(self.runtime_dir), handle.engine_id, handle.incarnation)):
                with contextlib.suppress(OSError):  # (a GPU's exports name memory that died with it)
                    os.remove(path)
        handle.retire()
        self.index.forget(handle.engine_id)
        self.drop_moved(handle.engine_id)
        self._send_chain_ends()  # what followed its pages elsewhere is orphaned
        if self.on_keys is not None:
            self.on_keys(None, None)
        self._announce_pool(gone=handle)
        self.on_change()

    def _announce_pool(self, gone: EngineHandle | None = None) -> None:
        """Tell every serving engine which engines serve (the pool's peers), when one comes or goes."""
        if self.engine_config.pool_mode == "off" or self.launcher is None:
            return
        ready = [slot for slot in self.slots if slot.ready and slot.info is not None and slot is not gone]
        peers = p.PoolPeers([p.PoolPeer(s.engine_id, s.incarnation, s.info.pid, s.info.stats.kv_pages_total)
                             for s in ready])
        for slot in ready:
            self.send(slot, peers)

    # -- engine outputs -----------------------------------------------------------------------
    def _read_outputs(self, budget: int = 64) -> None:
        """Handle the messages waiting on the output socket. Its file descriptor is edge-triggered,
        so this reads until none is left; after `budget` messages it yields to the loop and goes
        on in a later callback, so HTTP requests are not starved."""
        sock = self._outbox
        if sock is None or sock.closed:
            return
        for _ in range(budget):
            try:
                raw = sock.recv(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            try:
                self._on_message(self._decoder.decode(raw))
            except Exception:  # one bad message must not stop every stream's delivery
                log.exception("dropped a message from an engine")
        asyncio.get_running_loop().call_soon(self._read_outputs)

    def _on_message(self, msg: p.FromEngine) -> None:
        slot = self.slots[msg.engine_id]
        if msg.incarnation != slot.incarnation or slot.state not in ("starting", "ready"):
            return  # from an engine already given up on
        slot.last_heard = time.monotonic()
        if isinstance(msg, p.StepOutputs):
            self._on_step(slot, msg)
        elif isinstance(msg, p.Reconfigured):
            slot.policy_params = msg.policy_params
            self.on_change()
            log.info("engine %d reconfigured: log level %s, policy parameters %s", msg.engine_id, msg.log_level,
                     msg.policy_params)
        elif isinstance(msg, p.Ready):
            slot.info, slot.stats, slot.state = msg, msg.stats, "ready"
            slot.policy_params = msg.policy_params
            wanted = msgspec.to_builtins(slot.config.policy_params)
            if msg.policy_params and msg.policy_params != wanted:  # a reload came while it started
                self.send(slot, p.Reconfigure(logging.getLevelName(logging.getLogger().level), wanted))
            slot.consecutive_failures = 0
            self._announce_pool()
            self.on_change()
            log.info("engine %d ready (pid %d, %s, context %d)", msg.engine_id, msg.pid, msg.device,
                     msg.max_model_len)
        elif isinstance(msg, p.KeySnapshot):
            self.index.replace(msg.engine_id, msg.keys)
            self.drop_moved(msg.engine_id)  # its own word on all it holds
            self._send_chain_ends()
            if self.on_keys is not None:
                self.on_keys(None, None)
        elif isinstance(msg, p.QueryReply):
            fut = self._queries.pop(msg.query_id, None)
            if fut is not None and not fut.done():
                fut.set_result(msg.requests)
        elif isinstance(msg, p.ResolveReads):
            stream = slot.streams.get(msg.request_id)  # (none: not this front's, or ended)
            if stream is not None and self.on_resolve is not None:
                self.on_resolve(slot, stream)
        elif isinstance(msg, p.Withdrawn):
            if self.on_withdrawn is not None:
                self.on_withdrawn(slot, msg)
        elif isinstance(msg, p.Computing):
            if self.on_computing is not None:
                for rid in msg.request_ids:
                    self.on_computing(rid)
        elif isinstance(msg, (p.Reserved, p.Prefilled)):
            fut = self._answers.pop(msg.request_id, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)

    def _on_step(self, slot: EngineHandle, msg: p.StepOutputs) -> None:
        slot.stats = msg.stats
        if msg.keys_moved or self._moved:
            self._moved_keys(slot.engine_id, msg, time.monotonic())
        if msg.moved_readers and self.tells_readers:
            self._tell_readers(slot.engine_id, msg)
        self.index.update(slot.engine_id, msg.keys_added, msg.keys_removed)
        self._send_chain_ends()
        if self.on_keys is not None and (msg.keys_added or msg.keys_removed):
            self.on_keys(msg.keys_added, msg.keys_removed)
        # A first token is told once the engine's next message is in: the step's message goes before the
        # engine writes the prompt's last segments into their homes, and the next says where they went
        # (EngineProcess.report_step). Told at once, a request that waited for that prompt heard where
        # its prefix was without those segments, and computed them again (test_pool_write_home.py).
        started = self._started.pop(slot.engine_id, ())
        new = [delta.request_id for delta in msg.deltas if slot.deliver(delta)]
        if self.on_started is not None:
            for rid in started:
                self.on_started(rid)
            if new:
                self._started[slot.engine_id] = new
        if self.on_report is not None:
            self.on_report(slot)

    # -- requests -----------------------------------------------------------------------------
    def submit(self, slot: EngineHandle, add: p.AddRequest, on_delta: Callable[[p.Delta], None]) -> Stream:
        if not slot.ready or slot.inbox is None:
            raise NoEngineReady(f"engine {slot.engine_id} is not serving")
        if add.request_id in slot.streams:
            raise ValueError(f"request id {add.request_id!r} is already in use")
        stream = Stream(add.request_id, slot, len(add.prompt_token_ids), on_delta, add)
        slot.streams[add.request_id] = stream
        slot.num_waiting += 1
        if not self.send(slot, add):
            del slot.streams[add.request_id]
            slot.num_waiting -= 1
            raise NoEngineReady(f"engine {slot.engine_id} is not serving")
        return stream

    def move(self, stream: Stream, slot: EngineHandle, add: p.AddRequest) -> bool:
        """A queued request its engine gave back (Withdrawn: it sent nothing of it) goes to `slot`
        (another engine, or the same one again) as `add`; its stream follows. False: `slot` is not
        serving (the stream is where it was)."""
        old = stream.engine
        if not slot.ready or slot.inbox is None or (slot is not old and add.request_id in slot.streams):
            return False
        if not self.send(slot, add):
            return False
        stream.add = add
        if slot is not old:
            del old.streams[stream.request_id]
            old.num_waiting -= 1
            stream.engine = slot
            slot.streams[add.request_id] = stream
            slot.num_waiting += 1
        return True

    def expect(self, request_id: str) -> asyncio.Future:
        """The engine's federation answer about `request_id` (Reserved or Prefilled), once it comes;
        registered before the request is sent. `forget` it if it will not be awaited."""
        if request_id in self._answers:
            raise ValueError(f"request id {request_id!r} is already awaited")
        fut = self._answers[request_id] = asyncio.get_running_loop().create_future()
        return fut

    def forget(self, request_id: str) -> None:
        self._answers.pop(request_id, None)

    def abort(self, stream: Stream) -> None:
        """The client went away (or a stop string matched): the engine frees its pages at once."""
        slot = stream.engine
        if stream.finished or slot.streams.pop(stream.request_id, None) is None:
            return
        stream.finished = True
        if not stream.started:
            stream.started = True
            slot.num_waiting -= 1
        self.send(slot, p.AbortRequests([stream.request_id]))

    def set_reading_rate(self, stream: Stream, reading_rate: float) -> None:
        slot = stream.engine
        if not stream.finished:
            self.send(slot, p.SetReadingRate(stream.request_id, reading_rate, time.monotonic()))

    def set_read_cursor(self, stream: Stream, num_read: int, now: float) -> None:
        if not stream.finished:
            self.send(stream.engine, p.SetReadCursor(stream.request_id, num_read, now))

    async def query(self, request_ids: list[str] | None = None, timeout: float = 5.0) -> list[p.RequestInfo]:
        """Live request state from every serving engine (all requests when `request_ids` is None)."""
        futures = []
        for slot in self.slots:
            qid = next(self._query_ids)
            if slot.ready and self.send(slot, p.QueryRequests(qid, request_ids, self.front)):
                fut = asyncio.get_running_loop().create_future()
                self._queries[qid] = fut
                futures.append((qid, fut))
        infos: list[p.RequestInfo] = []
        for qid, fut in futures:
            try:
                infos += await asyncio.wait_for(fut, timeout)
            except asyncio.TimeoutError:
                self._queries.pop(qid, None)
        return infos

    def reconfigure(self, log_level: str, policy_params: PolicyConfig) -> None:
        """Hand what may change live to every engine; a restarted engine starts with it too."""
        self.engine_config = replace(self.engine_config, policy_params=policy_params)
        msg = p.Reconfigure(log_level.upper(), msgspec.to_builtins(policy_params))
        for slot in self.slots:
            slot.config = replace(slot.config, policy_params=policy_params)
            if slot.state in ("starting", "ready") and slot.inbox is not None:
                self.send(slot, msg)

    def _moved_keys(self, engine_id: int, msg: p.StepOutputs, now: float) -> None:
        """Segments the sender wrote into their homes (StepOutputs.keys_moved) are held there from
        now, before the sender's own removals apply, so no chain is cut in between and no reader is
        named the sender's copy. The home's own reports have the last word: a key it has not
        reported holding within two heartbeats leaves the index again (it was evicted there, or the
        home restarted, before this word arrived: engines' messages reach the front in no fixed order)."""
        for key in msg.keys_added:  # the home's own word
            self._moved.pop((engine_id, key), None)
        for key in msg.keys_removed:
            self._moved.pop((engine_id, key), None)
        while self._moved:
            (home, key), when = next(iter(self._moved.items()))
            if when > now:
                break
            del self._moved[(home, key)]
            self.index.update(home, [], [key])
        until = now + 2 * self.server.heartbeat_interval
        for run in msg.keys_moved:
            home = self.slots[run.engine] if 0 <= run.engine < len(self.slots) else None
            if home is None or not home.ready:
                continue
            fresh = [key for key in run.keys if run.engine not in self.index.holders(key)]
            self.index.update(run.engine, fresh, [])
            for key in fresh:  # (appended: the dict stays in the order the keys leave)
                self._moved.pop((run.engine, key), None)
                self._moved[(run.engine, key)] = until

    def _tell_readers(self, holder: int, msg: p.StepOutputs) -> None:
        """The engines whose requests read segments `holder` wrote into their homes (its pages of
        them, kept for them) read them at the homes from now on (protocol.Moved, PoolMember.follow)."""
        moved = p.Moved(holder, msg.keys_moved)
        for engine_id in msg.moved_readers:
            slot = self.slots[engine_id] if 0 <= engine_id < len(self.slots) else None
            if slot is not None and slot.ready and slot.inbox is not None:
                self.send(slot, moved)

    def drop_moved(self, home: int) -> None:
        """Forget the moves to `home` its own reports have not confirmed yet: it is gone, or has just
        said all it holds (a snapshot), so they must not leave the index later on their own."""
        if self._moved:
            self._moved = {hk: when for hk, when in self._moved.items() if hk[0] != home}

    def _send_chain_ends(self) -> None:
        """The index's word on where the pool's chains end, to the engines holding those keys
        (nothing without the pool: only its picks link keys)."""
        for engine_id, (inner, ends) in self.index.drain_marks().items():
            slot = self.slots[engine_id] if engine_id < len(self.slots) else None
            if slot is not None and slot.state == "ready" and slot.inbox is not None:
                self.send(slot, p.ChainEnds(inner, ends))

    def send(self, slot: EngineHandle, msg: p.ToEngine) -> bool:
        """False when the slot has no socket (its engine is gone)."""
        return slot.send(self._encoder.encode(msg))

    @property
    def num_waiting(self) -> int:
        return sum(s.num_waiting for s in self.slots)
