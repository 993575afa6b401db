"""Starts, feeds, watches and restarts the engine processes; routes their outputs to streams.

    Supervisor ──AddRequest/Abort/SetReadingRate/SetReadCursor/Query──► engine i (zmq PUSH, one per incarnation)
               ◄──Ready/StepOutputs/QueryReply─────────────────────── all engines (one zmq PULL)

Each engine slot has an incarnation number: a restarted engine gets a fresh input socket, and
messages from an older incarnation are dropped, so nothing meant for a dead engine reaches its
successor. When an engine exits or stops sending heartbeats, every stream it served ends with an
error delta at once and the slot restarts with exponential backoff.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import msgspec
import zmq

from tokenflowd import protocol as p
from tokenflowd.config import EngineConfig, PolicyConfig, ServerConfig

log = logging.getLogger("tokenflowd.supervisor")

# Engine environment unless the operator's says otherwise.
# NOTE: oneDNN (torch's CPU matmuls) caches a JIT-compiled primitive per GEMM shape, 1,024 of
# them by default, and a step's token count changes the shape: under bursts a CPU engine keeps
# adding shapes it sees once. Two minutes of repeated bursts on the embedded model, engine RSS
# (single runs, noisy): +6.3% at 1,024, +7.4% at 256, +2.0% and +4.0% at 64, +2.2% at 16;
# no slower steps at 64 (mean inter-token latency 67.5 ms vs 73.9 ms at 1,024; 0, no cache,
# was 2.6x slower).
ENGINE_ENV_DEFAULTS = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64"}


@dataclass(eq=False)
class Stream:
    """One request's channel from its engine to its HTTP handler: `on_delta` is called in the
    supervisor's loop with each delta, in order, the last one with finish_reason set (the
    engine's, or "error" when the engine died). A callback, not a queue: the handler can act on
    a token without a task switch (see api/generation.py)."""

    request_id: str
    engine: EngineSlot
    num_prompt_tokens: int
    on_delta: Callable[[p.Delta], None]
    started: bool = False  # a token or the end has arrived: no longer counted as waiting
    finished: bool = False


@dataclass(eq=False)
class EngineSlot:
    engine_id: int
    config: EngineConfig
    env: dict[str, str]
    incarnation: int = 0
    state: str = "starting"  # starting | ready | backoff | stopped
    proc: asyncio.subprocess.Process | None = None
    inbox: zmq.Socket | None = None
    info: p.Ready | None = None
    stats: p.EngineStats | None = None
    streams: dict[str, Stream] = field(default_factory=dict)
    keys: set[bytes] = field(default_factory=set)  # prefix-cache page keys it holds (router index)
    num_waiting: int = 0  # streams sent here without a first token yet
    last_heard: float = 0.0
    started_at: float = 0.0
    num_restarts: int = 0
    consecutive_failures: int = 0
    last_failure: str | None = None  # why its engine last went away
    policy_params: dict = field(default_factory=dict)  # what it reported scheduling with (Ready, Reconfigured)
    preemptions_before: int = 0  # preemptions of earlier incarnations, so the counter never goes back

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def live_pid(self) -> int | None:
        """The engine process's pid while it runs (None: not started, or exited)."""
        return self.proc.pid if self.proc is not None and self.proc.returncode is None else None

    @property
    def load(self) -> int:
        """Requests it holds, running or queued, as this process knows them (no reporting lag)."""
        return len(self.streams)

    @property
    def num_preemptions(self) -> int:
        return self.preemptions_before + (self.stats.num_preemptions if self.stats else 0)


class NoEngineReady(RuntimeError):
    pass


class Supervisor:
    def __init__(self, server: ServerConfig, engine: EngineConfig) -> None:
        self.server = server
        self.engine_config = engine
        self.slots = [
            EngineSlot(i, cfg, env) for i, (cfg, env) in enumerate(_engine_configs(engine, server.engines))
        ]
        self.runtime_dir: Path | None = None
        # Plain sockets: engine inboxes never block on send (no HWM); the shared output socket is
        # read from the loop's reader callback, draining every message that is there per wake-up.
        self._ctx = zmq.Context()
        self._outbox: zmq.Socket | None = None
        self._decoder = msgspec.msgpack.Decoder(p.FromEngine)
        self._encoder = msgspec.msgpack.Encoder()
        self._tasks: list[asyncio.Task] = []
        self._queries: dict[int, asyncio.Future[list[p.RequestInfo]]] = {}
        self._query_ids = itertools.count()
        self._stopping = False

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        base = self.server.runtime_dir
        if base:
            Path(base).mkdir(parents=True, exist_ok=True)
        self.runtime_dir = Path(tempfile.mkdtemp(prefix="tokenflowd-", dir=base))  # mode 0700
        self._outbox = self._ctx.socket(zmq.PULL)
        self._outbox.bind(f"ipc://{self.runtime_dir}/out")
        asyncio.get_running_loop().add_reader(self._outbox.getsockopt(zmq.FD), self._read_outputs)
        for slot in self.slots:
            await self._spawn(slot)
            self._tasks.append(asyncio.create_task(self._watch(slot), name=f"watch-engine{slot.engine_id}"))

    async def stop(self) -> None:
        self._stopping = True
        for slot in self.slots:
            if slot.proc and slot.proc.returncode is None and slot.inbox is not None:
                self._send(slot, p.Shutdown())
        for slot in self.slots:
            if slot.proc and slot.proc.returncode is None:
                try:
                    await asyncio.wait_for(slot.proc.wait(), 10)
                except asyncio.TimeoutError:
                    slot.proc.kill()
                    await slot.proc.wait()
            self._fail_streams(slot, "the server is shutting down")
            slot.state = "stopped"
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._outbox is not None:
            asyncio.get_running_loop().remove_reader(self._outbox.getsockopt(zmq.FD))
        self._ctx.destroy(linger=0)
        if self.runtime_dir:
            for f in self.runtime_dir.iterdir():
                f.unlink(missing_ok=True)
            self.runtime_dir.rmdir()

    async def _spawn(self, slot: EngineSlot) -> None:
        slot.incarnation += 1
        slot.state = "starting"
        slot.info = slot.stats = None
        address = f"ipc://{self.runtime_dir}/in-{slot.engine_id}-{slot.incarnation}"
        slot.inbox = self._ctx.socket(zmq.PUSH)
        slot.inbox.setsockopt(zmq.LINGER, 0)
        slot.inbox.setsockopt(zmq.SNDHWM, 0)
        slot.inbox.bind(address)
        spec = p.EngineSpec(slot.engine_id, slot.incarnation, address, f"ipc://{self.runtime_dir}/out",
                            self.server.heartbeat_interval, msgspec.to_builtins(slot.config),
                            send_timeout=self.server.heartbeat_timeout, supervisor_pid=os.getpid())
        env = {**ENGINE_ENV_DEFAULTS, **os.environ,
               "TOKENFLOWD_LOG_LEVEL": logging.getLevelName(logging.getLogger().level), **slot.env}
        slot.proc = await asyncio.create_subprocess_exec(*self.engine_command(spec), env=env)
        slot.started_at = slot.last_heard = time.monotonic()
        log.info("engine %d (incarnation %d) started, pid %d", slot.engine_id, slot.incarnation, slot.proc.pid)

    def engine_command(self, spec: p.EngineSpec) -> list[str]:
        """The engine process's command line (a benchmark swaps in a model-free engine here)."""
        return [sys.executable, "-m", "tokenflowd.engine.process", msgspec.json.encode(spec).decode()]

    async def _watch(self, slot: EngineSlot) -> None:
        """Restart the slot's engine whenever it exits or goes silent, with exponential backoff."""
        while not self._stopping:
            assert slot.proc is not None
            code = await self._wait_exit_or_silence(slot)
            if self._stopping:
                return
            up = time.monotonic() - slot.started_at
            reason = (f"engine {slot.engine_id} {code}" if isinstance(code, str)
                      else f"engine {slot.engine_id} exited with code {code}")
            log.error("%s after %.1f s; its %d open requests fail", reason, up, len(slot.streams))
            self._fail_streams(slot, f"{reason}; the request was ended, retry it")
            self._retire(slot)
            slot.last_failure = f"{reason} after {up:.1f} s"
            slot.consecutive_failures = 1 if slot.info is not None and up > 60 else slot.consecutive_failures + 1
            delay = min(self.server.restart_backoff_max, 0.5 * 2 ** (slot.consecutive_failures - 1))
            slot.state = "backoff"
            await asyncio.sleep(delay)
            if self._stopping:
                return
            slot.num_restarts += 1
            await self._spawn(slot)

    async def _wait_exit_or_silence(self, slot: EngineSlot) -> int | str:
        """The exit code; or, after killing an engine silent for heartbeat_timeout or not ready
        within engine_start_timeout, why it was killed."""
        assert slot.proc is not None
        while True:
            try:
                return await asyncio.wait_for(asyncio.shield(slot.proc.wait()), self.server.heartbeat_interval)
            except asyncio.TimeoutError:
                pass
            now = time.monotonic()
            if slot.ready and now - slot.last_heard > self.server.heartbeat_timeout:
                why = "stopped sending heartbeats"
            elif slot.state == "starting" and now - slot.started_at > self.server.engine_start_timeout:
                why = f"was not ready within engine_start_timeout ({self.server.engine_start_timeout:g} s)"
            else:
                continue
            with contextlib.suppress(ProcessLookupError):
                slot.proc.send_signal(signal.SIGKILL)
            await slot.proc.wait()
            return why

    def _retire(self, slot: EngineSlot) -> None:
        if slot.stats is not None:
            slot.preemptions_before += slot.stats.num_preemptions
        slot.stats = None
        slot.keys.clear()
        if slot.inbox is not None:
            slot.inbox.close(linger=0)
            slot.inbox = None

    def _fail_streams(self, slot: EngineSlot, message: str) -> None:
        for stream in list(slot.streams.values()):
            self._deliver(slot, p.Delta(stream.request_id, [], "error", message))

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
            log.info("engine %d reconfigured: log level %s, policy parameters %s", msg.engine_id, msg.log_level,
                     msg.policy_params)
        elif isinstance(msg, p.Ready):
            slot.info, slot.stats, slot.state = msg, msg.stats, "ready"
            slot.policy_params = msg.policy_params
            wanted = msgspec.to_builtins(slot.config.policy_params)
            if msg.policy_params and msg.policy_params != wanted:  # a reload came while it started
                self._send(slot, p.Reconfigure(logging.getLevelName(logging.getLogger().level), wanted))
            slot.consecutive_failures = 0
            log.info("engine %d ready (pid %d, %s, context %d)", msg.engine_id, msg.pid, msg.device,
                     msg.max_model_len)
        elif isinstance(msg, p.QueryReply):
            fut = self._queries.pop(msg.query_id, None)
            if fut is not None and not fut.done():
                fut.set_result(msg.requests)

    def _on_step(self, slot: EngineSlot, msg: p.StepOutputs) -> None:
        slot.stats = msg.stats
        slot.keys.difference_update(msg.keys_removed)
        slot.keys.update(msg.keys_added)
        for delta in msg.deltas:
            self._deliver(slot, delta)

    def _deliver(self, slot: EngineSlot, delta: p.Delta) -> None:
        stream = slot.streams.get(delta.request_id)
        if stream is None:
            return  # aborted here already
        if not stream.started and (delta.token_ids or delta.finish_reason):
            stream.started = True
            slot.num_waiting -= 1
        if delta.finish_reason is not None:
            stream.finished = True
            del slot.streams[delta.request_id]
        try:
            stream.on_delta(delta)
        except Exception:  # one handler's fault must not cost the other streams their tokens
            log.exception("request %s: its handler failed on a delta", delta.request_id)

    # -- requests -----------------------------------------------------------------------------
    def submit(self, slot: EngineSlot, add: p.AddRequest, on_delta: Callable[[p.Delta], None]) -> Stream:
        if not slot.ready or slot.inbox is None:
            raise NoEngineReady(f"engine {slot.engine_id} is not serving")
        if add.request_id in slot.streams:
            raise ValueError(f"request id {add.request_id!r} is already in use")
        stream = Stream(add.request_id, slot, len(add.prompt_token_ids), on_delta)
        slot.streams[add.request_id] = stream
        slot.num_waiting += 1
        if not self._send(slot, add):
            del slot.streams[add.request_id]
            slot.num_waiting -= 1
            raise NoEngineReady(f"engine {slot.engine_id} is not serving")
        return stream

    def abort(self, stream: Stream) -> None:
        """The client went away (or a stop string matched): the engine frees its pages at once."""
        slot = stream.engine
        if stream.finished or slot.streams.pop(stream.request_id, None) is None:
            return
        stream.finished = True
        if not stream.started:
            stream.started = True
            slot.num_waiting -= 1
        self._send(slot, p.AbortRequests([stream.request_id]))

    def set_reading_rate(self, stream: Stream, reading_rate: float) -> None:
        slot = stream.engine
        if not stream.finished:
            self._send(slot, p.SetReadingRate(stream.request_id, reading_rate, time.monotonic()))

    def set_read_cursor(self, stream: Stream, num_read: int, now: float) -> None:
        if not stream.finished:
            self._send(stream.engine, p.SetReadCursor(stream.request_id, num_read, now))

    async def query(self, request_ids: list[str] | None = None, timeout: float = 5.0) -> list[p.RequestInfo]:
        """Live request state from every serving engine (all requests when `request_ids` is None)."""
        futures = []
        for slot in self.slots:
            qid = next(self._query_ids)
            if slot.ready and self._send(slot, p.QueryRequests(qid, request_ids)):
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
                self._send(slot, msg)

    def _send(self, slot: EngineSlot, msg: p.ToEngine) -> bool:
        """False when the slot has no live engine to take it (the engine is gone or not yet connected)."""
        if slot.inbox is None:
            return False
        try:
            slot.inbox.send(self._encoder.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    @property
    def num_waiting(self) -> int:
        return sum(s.num_waiting for s in self.slots)


def _engine_configs(config: EngineConfig, engines: int | None) -> list[tuple[EngineConfig, dict[str, str]]]:
    """One (config, environment) per engine: a GPU each on CUDA, a share of the cores on CPU.

    More engines than GPUs share them round-robin, each with its share of
    gpu_memory_utilization; they should run under CUDA MPS (systemd/tokenflowd-mps.service), or
    the GPU time-slices between their contexts."""
    if config.device.startswith("cuda"):
        if config.device != "cuda":  # a device named explicitly: one engine on it
            return [(config, {})]
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = [d.strip() for d in visible.split(",") if d.strip()] if visible else [str(i) for i in range(_cuda_count())]
        if not ids:
            raise ValueError("device cuda was asked for, but no CUDA device is visible")
        n = engines or len(ids)
        placement = [ids[i % len(ids)] for i in range(n)]
        configs = []
        for gpu in placement:
            sharing = placement.count(gpu)
            cfg = config if sharing == 1 else replace(config, gpu_memory_utilization=config.gpu_memory_utilization / sharing)
            configs.append((cfg, {"CUDA_VISIBLE_DEVICES": gpu}))
        if n > len(ids) and not os.environ.get("CUDA_MPS_PIPE_DIRECTORY"):
            log.warning("%d engines share %d GPU(s) without CUDA MPS (CUDA_MPS_PIPE_DIRECTORY is unset): "
                        "their kernels will time-slice instead of running side by side", n, len(ids))
        return configs
    n = engines or 1
    threads = config.num_threads or max(1, (os.cpu_count() or 1) // n)
    return [(replace(config, num_threads=threads), {}) for _ in range(n)]


def _cuda_count() -> int:
    from tokenflowd.engine.platform import cuda_device_count

    return cuda_device_count()
