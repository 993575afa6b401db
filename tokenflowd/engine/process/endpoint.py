"""The engine's end of the supervisor protocol: sockets, message decoding and dispatch.

    inbox     one PULL socket the engine binds; the supervisor and every API server process connect
    outputs   0: the supervisor (a PUSH that must not drop: a send that waits out send_timeout ends
              the engine); 1..N: the API server processes of --api-servers N (sends that never block:
              a front that is gone or slow loses messages, not the engine's loop)

A streamed request's deltas are paced first (engine/process/pacing.py: a client far ahead gets its tokens
in batches). A request's deltas go to the output of the front that sent it (AddRequest.front); Ready,
Reconfigured and each step's stats and prefix-cache keys go to every output; a query's reply to
the output that asked. AbortFront aborts every request of a front that went away. Withdraw (the
pool's idle peer takes a queued request) gives one back to the front that asks, answered Withdrawn.

An engine process (engine/process/loop.py) and the benchmark's model-free engine (bench/null_engine.py)
differ only in what they do with a request; both subclass this and implement the hooks. Imports
no torch, so a model-free engine stays light.
"""
from __future__ import annotations

import abc
import logging
import os
from typing import Container

import msgspec
import zmq

from tokenflowd import protocol as p
from tokenflowd.engine.process.pacing import DeltaPacer


class SupervisorUnreachable(RuntimeError):
    """A message to the supervisor waited out EngineSpec.send_timeout: the engine must exit."""


class EngineEndpoint(abc.ABC):
    def __init__(self, spec: p.EngineSpec) -> None:
        self.spec = spec
        # the supervisor's pid as it gave it: a parent that died before this process looked would
        # otherwise leave the reaper's pid here, and the orphan check would never fire
        self.parent_pid = spec.supervisor_pid or os.getppid()
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.bind(spec.input_address)
        self.outbox = self.ctx.socket(zmq.PUSH)
        self.outbox.setsockopt(zmq.LINGER, 1000)
        self.outbox.setsockopt(zmq.SNDTIMEO, max(1, int(spec.send_timeout * 1000)))  # never block the loop for good
        self.outbox.connect(spec.output_address)
        self.fronts: list[zmq.Socket] = []  # outputs 1..N
        for address in spec.front_addresses:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 100_000)  # about a minute of steps for a front that is restarting
            sock.connect(address)
            self.fronts.append(sock)
        self.request_front: dict[str, int] = {}  # with API server processes: the output of each live request
        self.gone_fronts: dict[int, int] = {}  # front -> its last start known gone (AbortFront.epoch)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(p.ToEngine)
        self.running = True
        self._rejected: list[p.Delta] = []  # adds refused since the last message
        self._aborted = False  # an abort freed pages since the last message: report promptly
        self.pacer = DeltaPacer()

    # -- what an engine does with requests ----------------------------------------------------
    @abc.abstractmethod
    def add(self, msg: p.AddRequest) -> str | None:
        """Take the request; return why it is refused, or None. (Load shed instead: call `shed`.)"""

    @abc.abstractmethod
    def abort(self, request_id: str) -> None: ...

    @abc.abstractmethod
    def set_reading_rate(self, msg: p.SetReadingRate) -> None: ...

    @abc.abstractmethod
    def set_read_cursor(self, msg: p.SetReadCursor) -> None: ...

    @abc.abstractmethod
    def infos(self, request_ids: list[str] | None) -> list[p.RequestInfo]: ...

    def cached_keys(self) -> list[bytes]:
        """Every page key the prefix cache holds (none without one)."""
        return []

    def pool_peers(self, msg: p.PoolPeers) -> None:
        """The pool's engines changed (an engine without the pool ignores it)."""

    def chain_ends(self, msg: p.ChainEnds) -> None:
        """Where the node's chains end moved: the prefix cache's eviction order follows it."""

    def pool_reads(self, msg: p.Reads) -> None:
        """Where the pool holds a queued request's prefix now, as its front names it (pool/engine_hooks.py)."""

    def pool_moved(self, msg: p.Moved) -> None:
        """A peer wrote segments whose pages requests here read on it into their homes (pool/member.py follow)."""

    def withdraw(self, front: int, keep: Container[str] = ()) -> list[str]:
        """The pool: give back the last request of `front` queued here that has started nothing and
        is not in `keep` (pool/steal.py) -> its id, or none. (An engine without the pool gives back none.)"""
        return []

    def remote_arrived(self, msg: p.RemoteArrived) -> None:
        """A prefill node answered for a request this decode node reserved pages for (federation/)."""

    def store(self, msg: p.KeepKV | p.KeptKV | p.GiveKV) -> None:
        """Pages into or out of the prefix cache for another node (federation/store.py)."""

    def reply(self, request_id: str, msg: p.FromEngine, front: int | None = None) -> None:
        """A message about one request, to the front that serves it (`front`, if it has ended)."""
        front = self.request_front.get(request_id, 0) if front is None else front
        if front and front <= len(self.fronts):
            self._send_front(front, self.encoder.encode(msg))
        else:
            self.send(msg)

    def reconfigure(self, msg: p.Reconfigure) -> dict:
        """Apply what may change live; return the policy parameters now in force (none here)."""
        logging.getLogger().setLevel(msg.log_level.upper())
        return {}

    # -- the protocol -------------------------------------------------------------------------
    def drain_inbox(self) -> None:
        while True:
            try:
                raw = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(self.decoder.decode(raw))

    def _handle(self, msg: p.ToEngine) -> None:
        if isinstance(msg, p.AddRequest):
            if msg.front and msg.front_epoch <= self.gone_fronts.get(msg.front, -1):
                return  # sent by an API server process that died before it arrived: nobody reads its deltas
            if self.fronts:
                self.request_front[msg.request_id] = msg.front
            error = self.add(msg)
            if error is not None:
                self._rejected.append(p.Delta(msg.request_id, [], "rejected", error))
            else:
                self.pacer.track(msg.request_id, msg.reading_rate, msg.coalesce)
        elif isinstance(msg, p.AbortRequests):
            for rid in msg.request_ids:
                self.abort(rid)
                self.request_front.pop(rid, None)
                self.pacer.forget(rid)
            self._aborted = True
        elif isinstance(msg, p.AbortFront):
            self.gone_fronts[msg.front] = max(msg.epoch, self.gone_fronts.get(msg.front, -1))
            gone = [rid for rid, front in self.request_front.items() if front == msg.front]
            for rid in gone:
                self.abort(rid)
                del self.request_front[rid]
                self.pacer.forget(rid)
            self._aborted = self._aborted or bool(gone)
        elif isinstance(msg, p.SetReadingRate):
            self.set_reading_rate(msg)
            self.pacer.set_rate(msg.request_id, msg.reading_rate, msg.time)
        elif isinstance(msg, p.SetReadCursor):
            self.set_read_cursor(msg)
            self.pacer.set_read(msg.request_id, msg.num_read, msg.time)
        elif isinstance(msg, p.QueryRequests):
            infos = self.infos(msg.request_ids)
            for info in infos:
                info.front = self.request_front.get(info.request_id, 0)
            reply = p.QueryReply(self.spec.engine_id, self.spec.incarnation, msg.query_id, infos)
            if msg.front and msg.front <= len(self.fronts):
                self._send_front(msg.front, self.encoder.encode(reply))
            else:
                self.send(reply)
        elif isinstance(msg, p.QueryKeys):
            snapshot = p.KeySnapshot(self.spec.engine_id, self.spec.incarnation, self.cached_keys())
            if msg.front and msg.front <= len(self.fronts):
                self._send_front(msg.front, self.encoder.encode(snapshot))
        elif isinstance(msg, p.PoolPeers):
            self.pool_peers(msg)
        elif isinstance(msg, p.ChainEnds):
            self.chain_ends(msg)
        elif isinstance(msg, p.Reads):
            self.pool_reads(msg)
        elif isinstance(msg, p.Moved):
            self.pool_moved(msg)
        elif isinstance(msg, p.Withdraw):
            gone = self.withdraw(msg.front, set(msg.keep))
            for rid in gone:
                self.request_front.pop(rid, None)
                self.pacer.forget(rid)
            self._aborted = self._aborted or bool(gone)
            answer = self.encoder.encode(p.Withdrawn(self.spec.engine_id, self.spec.incarnation, gone))
            if msg.front and msg.front <= len(self.fronts):
                self._send_front(msg.front, answer)
            else:
                self._to_supervisor(answer)
        elif isinstance(msg, p.RemoteArrived):
            self.remote_arrived(msg)
        elif isinstance(msg, (p.KeepKV, p.KeptKV, p.GiveKV)):
            self.store(msg)
        elif isinstance(msg, p.Shutdown):
            self.running = False
        elif isinstance(msg, p.Reconfigure):
            params = self.reconfigure(msg)
            self.send(p.Reconfigured(self.spec.engine_id, self.spec.incarnation, msg.log_level, params))

    def shed(self, request_id: str, error: str, retry_after: float) -> None:
        """Refuse an add for load, not for what it asks (the front answers 429 with Retry-After)."""
        self._rejected.append(p.Delta(request_id, [], "shed", error, retry_after=retry_after))

    def take_rejected(self) -> list[p.Delta]:
        """Refusals to report in the next message (a new list the caller may extend)."""
        rejected, self._rejected = self._rejected, []
        return rejected

    def pace(self, deltas: list[p.Delta], now: float) -> list[p.Delta]:
        """The deltas to send now: those of clients far ahead are held a while (engine/process/pacing.py),
        and held ones that are due join them. Call with every iteration's deltas, none too."""
        return self.pacer.pace(deltas, now)

    def wait_until(self, deadline: float, now: float) -> float:
        """Seconds to wait for input before `deadline`, or before held tokens are due if sooner."""
        due = self.pacer.next_release()
        return max(0.0, (deadline if due is None else min(deadline, due)) - now)

    def must_report(self, deltas: list[p.Delta], now: float, last_sent: float) -> bool:
        """Something to say, or the heartbeat is due."""
        report = bool(deltas) or self._aborted or now - last_sent >= self.spec.heartbeat_interval
        self._aborted = False
        return report

    def orphaned(self, log: logging.Logger) -> bool:
        """The supervisor is gone (this process was re-parented): time to exit. Checked every loop
        (one getppid); on Linux the kernel's parent-death signal usually ends the engine first."""
        if os.getppid() == self.parent_pid:
            return False
        log.warning("supervisor is gone; engine %d exits", self.spec.engine_id)
        return True

    def send(self, msg: p.FromEngine) -> None:
        """To every output (Ready, Reconfigured; a query's reply when there are no API server processes)."""
        raw = self.encoder.encode(msg)
        self._to_supervisor(raw)
        for front in range(1, len(self.fronts) + 1):
            self._send_front(front, raw)

    def send_step(self, now: float, deltas: list[p.Delta], stats: p.EngineStats, keys_added: list[bytes] | None = None,
                  keys_removed: list[bytes] | None = None, keys_moved: list[p.PrefixRun] | None = None,
                  moved_readers: list[int] | None = None) -> None:
        """One StepOutputs to each output, with the deltas of its own requests (an output with none gets
        the same bytes as every other such output: encoded once)."""
        spec = self.spec

        def step(own: list[p.Delta]) -> p.StepOutputs:
            return p.StepOutputs(spec.engine_id, spec.incarnation, now, own, stats, keys_added or [], keys_removed or [],
                                 keys_moved or [], moved_readers or [])

        if not self.fronts:
            self.send(step(deltas))
            return
        mine: list[list[p.Delta]] = [[] for _ in range(len(self.fronts) + 1)]
        where = self.request_front
        for delta in deltas:
            front = where.get(delta.request_id, 0)
            if delta.finish_reason is not None:
                where.pop(delta.request_id, None)
            mine[front if front < len(mine) else 0].append(delta)
        empty: bytes | None = None

        def encoded(own: list[p.Delta]) -> bytes:
            nonlocal empty
            if own:
                return self.encoder.encode(step(own))
            if empty is None:
                empty = self.encoder.encode(step([]))
            return empty

        self._to_supervisor(encoded(mine[0]))
        for front in range(1, len(mine)):
            self._send_front(front, encoded(mine[front]))

    def _to_supervisor(self, raw: bytes) -> None:
        try:
            self.outbox.send(raw)
        except zmq.Again:
            raise SupervisorUnreachable(f"the supervisor took no message for {self.spec.send_timeout:g} s") from None

    def _send_front(self, front: int, raw: bytes) -> None:
        try:
            self.fronts[front - 1].send(raw, zmq.NOBLOCK)
        except zmq.Again:  # a front gone or far behind: it loses this message, the engine goes on
            pass

    def close(self) -> None:
        self.ctx.destroy(linger=1000)
