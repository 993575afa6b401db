"""`tokenflowd serve --api-servers N` (N > 1): the supervisor process, its engines and N API server
processes.

    supervisor (this module; no HTTP)        engines (launcher.py)            API servers (api_server.py)
      launches and restarts engines  ────────► engine i binds its input ◄─────── each front connects
      EngineTable over zmq PUB  ──────────────────────────────────────────────► every front follows it
      launches and restarts fronts             outputs: 0 → supervisor, k → front k (its requests'
      a front gone: AbortFront(k) to engines   deltas; stats, keys and Ready to all)

The fronts share the port (SO_REUSEPORT). Any front can die without the others noticing: the
supervisor aborts its requests in every engine (their pages are freed) and starts it again. Each
start of a front has an epoch; AbortFront names the dead one's, so an AddRequest it sent that
reaches an engine after the abort (the two come over different sockets) is dropped there too.
--max-streams and each API key's max_concurrent are counted by all fronts together
(daemon/api/open_counts.py); --max-connections and --max-waiting-requests are split evenly among the
fronts, as nginx's per-worker limits are, and each front enforces its share.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path

import msgspec
import zmq

from tokenflowd import protocol as p
from tokenflowd.config import EngineConfig, ServerConfig
from tokenflowd.daemon.api.open_counts import OPEN_COUNTS, SharedOpenCounts
from tokenflowd.daemon.engine_handle import EngineHandle
from tokenflowd.daemon.lifecycle import reload_live, report_status
from tokenflowd.daemon.notify import Notifier
from tokenflowd.daemon.supervisor import Supervisor

log = logging.getLogger("tokenflowd.daemon.api_servers")

FRONT_ENV_DROPPED = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")  # systemd talks to the supervisor alone


def server_share(server: ServerConfig, n: int) -> ServerConfig:
    """One front's share of the server-wide bounds it counts alone (--max-streams and each key's
    max_concurrent are counted by all fronts together: daemon/api/open_counts.py)."""
    def share(bound: int | None) -> int | None:
        return None if bound is None else max(1, math.ceil(bound / n))

    return dataclasses.replace(server, max_connections=share(server.max_connections),
                               max_waiting_requests=share(server.max_waiting_requests))


def engine_table(slots: list[EngineHandle], log_level: str) -> p.EngineTable:
    return p.EngineTable([p.EngineState(h.engine_id, h.incarnation, h.state, h.pid, h.num_restarts,
                                        h.consecutive_failures, h.last_failure, h.preemptions_before,
                                        h.policy_params, h.info) for h in slots], log_level)


class ApiServers:
    """Starts the API server processes, publishes the engine table to them, and restarts any that exits."""

    def __init__(self, supervisor: Supervisor, server: ServerConfig, engine: EngineConfig, n: int) -> None:
        self.supervisor = supervisor
        self.server = server
        self.engine = engine
        self.n = n
        self.listening: set[int] = set()
        self.procs: dict[int, asyncio.subprocess.Process] = {}
        self.epochs: dict[int, int] = {}  # front -> how many times it was started before this one
        self._ctx = zmq.Context()
        self._table: zmq.Socket | None = None
        self._reports: zmq.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self._encoder = msgspec.msgpack.Encoder()
        self.metrics_dir: Path | None = None

    async def start(self) -> None:
        rt = self.supervisor.runtime_dir
        assert rt is not None, "start the supervisor first"
        self.metrics_dir = rt / "metrics"
        self.metrics_dir.mkdir()
        SharedOpenCounts.create(rt / OPEN_COUNTS, self.n)
        self._table = self._ctx.socket(zmq.PUB)
        self._table.setsockopt(zmq.LINGER, 0)
        self._table.bind(f"ipc://{rt}/control")
        self._reports = self._ctx.socket(zmq.PULL)
        self._reports.bind(f"ipc://{rt}/fronts")
        loop = asyncio.get_running_loop()
        loop.add_reader(self._reports.getsockopt(zmq.FD), self._read_reports)
        self.supervisor.on_change = self.publish
        self._tasks.append(asyncio.create_task(self._republish(), name="engine-table"))
        for k in range(1, self.n + 1):
            self._tasks.append(asyncio.create_task(self._keep(k), name=f"front{k}"))

    def publish(self) -> None:
        if self._table is not None:
            level = logging.getLevelName(logging.getLogger().level)
            self._table.send(self._encoder.encode(engine_table(self.supervisor.slots, level)), zmq.NOBLOCK)

    async def _republish(self) -> None:
        """Every half heartbeat interval too: a front that just started has missed the changes."""
        while True:
            self.publish()
            await asyncio.sleep(self.server.heartbeat_interval / 2)

    def _read_reports(self) -> None:
        sock = self._reports
        while sock is not None and not sock.closed:
            try:
                msg = msgspec.msgpack.decode(sock.recv(zmq.NOBLOCK), type=p.FrontListening)
            except zmq.Again:
                return
            except msgspec.DecodeError:
                continue
            self.listening.add(msg.front)

    def spec(self, k: int) -> p.ApiServerSpec:
        rt = self.supervisor.runtime_dir
        return p.ApiServerSpec(k, str(rt), self.supervisor.front_addresses[k - 1], f"ipc://{rt}/control",
                               f"ipc://{rt}/fronts", msgspec.to_builtins(server_share(self.server, self.n)),
                               msgspec.to_builtins(self.engine),
                               [msgspec.to_builtins(slot.config) for slot in self.supervisor.slots], self.n,
                               self.epochs.get(k, 0))

    async def _keep(self, k: int) -> None:
        """Run front k; when it exits, abort its requests in every engine and start it again (backoff)."""
        failures = 0
        while not self._stopping:
            env = {key: v for key, v in os.environ.items() if key not in FRONT_ENV_DROPPED}
            env["PROMETHEUS_MULTIPROC_DIR"] = str(self.metrics_dir)
            proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "tokenflowd.daemon.api_server",
                                                        stdin=asyncio.subprocess.PIPE, env=env)
            self.procs[k] = proc
            proc.stdin.write(msgspec.json.encode(self.spec(k)))
            proc.stdin.close()
            started = time.monotonic()
            log.info("front %d started, pid %d", k, proc.pid)
            code = await proc.wait()
            self.listening.discard(k)
            self._front_gone(k, proc.pid)
            self.epochs[k] = self.epochs.get(k, 0) + 1
            if self._stopping:
                return
            failures = 1 if time.monotonic() - started > 60 else failures + 1
            delay = min(self.server.restart_backoff_max, 0.5 * 2 ** (failures - 1))
            log.error("front %d (pid %d) exited with code %s; its requests were aborted; restarting in %.1f s",
                      k, proc.pid, code, delay)
            await asyncio.sleep(delay)

    def _front_gone(self, k: int, pid: int) -> None:
        for slot in self.supervisor.slots:
            if slot.ready:
                self.supervisor.send(slot, p.AbortFront(k, self.epochs.get(k, 0)))
        SharedOpenCounts.clear(self.supervisor.runtime_dir / OPEN_COUNTS, self.n, k)  # its requests' places
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, str(self.metrics_dir))

    async def stop(self) -> None:
        """SIGTERM to every front (each drains its streams), then wait for them."""
        self._stopping = True
        for proc in self.procs.values():
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        deadline = self.server.shutdown_timeout + 10
        for proc in self.procs.values():
            try:
                await asyncio.wait_for(proc.wait(), deadline)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._reports is not None:
            asyncio.get_running_loop().remove_reader(self._reports.getsockopt(zmq.FD))
        self._ctx.destroy(linger=0)


async def run_api_servers(server: ServerConfig, engine: EngineConfig, n: int, reload=None,
                     supervisor_factory=Supervisor) -> None:
    """The supervisor of N API server processes: engines, fronts, systemd notification, signals."""
    supervisor = supervisor_factory(server, engine, num_fronts=n)
    notifier = Notifier()
    notifier.status(f"starting {len(supervisor.slots)} engine(s) and {n} API server processes")
    fronts = ApiServers(supervisor, server, engine, n)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if reload is not None:
        def reloaded() -> None:
            reload_live(reload, server, engine, supervisor, notifier)
            fronts.publish()  # the log level
        loop.add_signal_handler(signal.SIGHUP, reloaded)
    tasks = [asyncio.create_task(notifier.watchdog(), name="watchdog")]
    try:
        await supervisor.start()
        await fronts.start()
        tasks.append(asyncio.create_task(report_status(supervisor, notifier, fronts=fronts), name="status"))
        await stop.wait()
        notifier.stopping("draining the API server processes")
        await fronts.stop()
    finally:
        for t in tasks:
            t.cancel()
        await supervisor.stop()
        notifier.close()
