"""What every API server process of the daemon shares, whether it is the supervisor's own (serve.py)
or one of --api-servers N (api_servers.py, api_server.py): the listening HTTP front, SIGHUP's live
reload, the status lines systemd shows, and the collector's freeze after start-up.
"""
from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import resource
import time
from typing import Callable, Protocol

from aiohttp import web

from tokenflowd.config import EngineConfig, ServerConfig
from tokenflowd.daemon.api.app import build_app
from tokenflowd.daemon.api.connections import ConnectionGuard, quiet_malformed_requests
from tokenflowd.daemon.api.front import Front
from tokenflowd.daemon.notify import Notifier
from tokenflowd.daemon.supervisor import Supervisor

log = logging.getLogger("tokenflowd")


Reload = Callable[[], tuple[ServerConfig, EngineConfig]]


class ApiServersListening(Protocol):
    """What report_status reads of --api-servers' fronts (api_servers.py)."""

    n: int
    listening: set


class Listener:
    """The HTTP side of one API server process: the aiohttp app behind a ConnectionGuard on the port
    (shared with the other API server processes through SO_REUSEPORT when `reuse_port`)."""

    def __init__(self, front: Front, backlog: int = 1024, reuse_port: bool = False) -> None:
        self.front = front
        self.server = front.config
        self.backlog = backlog
        self.reuse_port = reuse_port
        self.runner = web.AppRunner(build_app(front), handler_cancellation=True, access_log=None,
                                    keepalive_timeout=self.server.keepalive_timeout)
        self.listener: asyncio.AbstractServer | None = None
        self._expiry: asyncio.Task | None = None

    async def open(self) -> None:
        server, front = self.server, self.front
        await self.runner.setup()
        quiet_malformed_requests()
        refused = front.metrics.connections_refused
        guard = ConnectionGuard(self.runner.server, connection_bound(server), server.header_timeout,
                                lambda reason: refused.labels(reason).inc())
        self.listener = await asyncio.get_running_loop().create_server(
            guard, server.host, server.port, backlog=self.backlog, reuse_port=self.reuse_port or None)
        self._expiry = asyncio.create_task(guard.expire(), name="header-timeouts")
        log.info("tokenflowd listening on http://%s:%d (model %s, %d engine(s), at most %d connections)",
                 server.host, server.port, front.model_name, len(front.supervisor.slots), guard.max_connections)

    async def drain(self) -> None:
        """New requests get 503; open streams get up to shutdown_timeout to finish."""
        self.front.draining = True
        slots = self.front.supervisor.slots
        open_streams = sum(len(slot.streams) for slot in slots)
        log.info("draining: %d open stream(s), up to %g s", open_streams, self.server.shutdown_timeout)
        deadline = time.monotonic() + self.server.shutdown_timeout
        while any(slot.streams for slot in slots) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)

    async def stop_listening(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
        if self.listener is not None:
            self.listener.close()

    async def close(self) -> None:
        await self.runner.cleanup()


CONNECTION_RESERVE = 256  # descriptors kept for engines' sockets, logs and files


def connection_bound(server: ServerConfig) -> int:
    """--max-connections, else what the open-file limit allows (raised to its hard limit first,
    as nginx's worker_rlimit_nofile does) less a reserve: beyond it, accept() would fail with
    EMFILE and the front would spin on it instead of answering 503."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    room = max(64, (soft if soft != resource.RLIM_INFINITY else 1 << 20) - CONNECTION_RESERVE)
    if server.max_connections is None:
        return room
    if server.max_connections > room:
        log.warning("--max-connections %d is above what the open-file limit (%d) allows; the OS will refuse "
                    "connections beyond about %d (raise LimitNOFILE=)", server.max_connections, soft, room)
    return server.max_connections


def reload_live(reload: Reload, server: ServerConfig, engine: EngineConfig, supervisor: Supervisor,
                notifier: Notifier) -> None:
    """SIGHUP: read the configuration again; apply the log level and the policy parameters. A
    configuration that does not validate changes nothing."""
    notifier.send(RELOADING=1, MONOTONIC_USEC=time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000)
    try:
        new_server, new_engine = reload()
    except (ValueError, TypeError) as e:  # a file that does not parse or validate (a wrong type: TypeError)
        log.error("reload failed, configuration unchanged: %s", e)
        notifier.send(READY=1, STATUS=f"reload failed: {e}"[:200])
        return
    logging.getLogger().setLevel(new_server.log_level.upper())
    supervisor.reconfigure(new_server.log_level, new_engine.policy_params)
    fixed = [f"server.{f.name}" for f in dataclasses.fields(server)
             if f.name != "log_level" and getattr(server, f.name) != getattr(new_server, f.name)]
    fixed += [f"engine.{f.name}" for f in dataclasses.fields(engine)
              if f.name != "policy_params" and getattr(engine, f.name) != getattr(new_engine, f.name)]
    if fixed:
        log.warning("reload: %s changed but take effect only on restart", ", ".join(fixed))
    log.info("reloaded: log level %s, policy parameters %s", new_server.log_level.upper(),
             dataclasses.asdict(new_engine.policy_params))
    notifier.send(READY=1, STATUS="configuration reloaded")


async def report_status(supervisor: Supervisor, notifier: Notifier, every: float = 1.0,
                        fronts: ApiServersListening | None = None) -> None:
    """READY=1 when the first engine serves; then a STATUS line whenever the engines' states or
    the streams change, so `systemctl status` shows an engine in backoff instead of a silent spin."""
    ready_sent, last = False, None
    while True:
        slots = supervisor.slots
        num_ready = sum(slot.ready for slot in slots)
        failing = [f"engine {slot.engine_id} restarting ({slot.consecutive_failures} failures in a row: "
                   f"{slot.last_failure})" for slot in slots if slot.consecutive_failures and not slot.ready]
        if fronts is None:
            listening = True
            held = f"{sum(len(slot.streams) for slot in slots)} streams"
        else:  # --api-servers: the streams are the fronts'; READY waits for one to listen
            listening = bool(fronts.listening)
            held = f"{len(fronts.listening)}/{fronts.n} fronts listening"
        status = f"{num_ready}/{len(slots)} engines serving, {held}" + "".join(f"; {f}" for f in failing)
        if num_ready and listening and not ready_sent:
            notifier.ready(status)
            ready_sent, last = True, status
        elif status != last:
            notifier.status(status)
            last = status
        await asyncio.sleep(every)


def freeze_startup_objects() -> None:
    """Move what start-up built (modules, the tokenizer, the app) out of the collector's sight:
    a full collection would otherwise scan ~200k long-lived objects and stall every stream for
    ~100 ms. Garbage made while serving is still collected."""
    gc.collect()
    gc.freeze()
