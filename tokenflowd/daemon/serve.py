"""`tokenflowd serve`: the HTTP front and the supervisor in one asyncio process (uvloop).

The port opens first (so /health answers 503 while engines load), then the engines start.
SIGTERM or SIGINT drains: new requests get 503, open streams finish (up to `shutdown_timeout`;
those still open then end with an error event), then the engines are shut down and the process
exits 0. SIGHUP reloads the configuration and applies what may change live (the log level and
the policy parameters); anything else that changed is logged as needing a restart. Under systemd
(Type=notify) it reports READY=1 once an engine serves, STATUS lines as engines come and go,
WATCHDOG=1 from the loop, and STOPPING=1 when it drains (notify.py).
"""
from __future__ import annotations

import asyncio
import logging
import signal
from typing import Callable

import uvloop

from tokenflowd.config import EngineConfig, ServerConfig
from tokenflowd.daemon.api.front import Front
from tokenflowd.daemon.api_servers import run_api_servers
from tokenflowd.daemon.launcher import engine_configs
from tokenflowd.daemon.lifecycle import Listener, Reload, freeze_startup_objects, reload_live, report_status
from tokenflowd.daemon.notify import Notifier
from tokenflowd.daemon.supervisor import Supervisor
from tokenflowd.text.source import load_tokenizer

log = logging.getLogger("tokenflowd")


async def run_server(server: ServerConfig, engine: EngineConfig, reload: Reload | None = None,
                     supervisor_factory: Callable[[ServerConfig, EngineConfig], Supervisor] = Supervisor,
                     backlog: int = 1024) -> None:
    """`supervisor_factory` is a seam for benchmarks and tests (a model-free engine: bench/null_engine.py).
    `backlog`: the listen queue (the kernel caps it at net.core.somaxconn), deep enough for a burst of
    connections."""
    supervisor = supervisor_factory(server, engine)
    notifier = Notifier()
    notifier.status(f"starting {len(supervisor.slots)} engine(s)")
    # The engines load the model while the front reads its tokenizer (the GGUF's metadata takes
    # seconds); a bad --model fails here, and the engines are stopped.
    reading = asyncio.create_task(asyncio.to_thread(load_tokenizer, engine.model))
    try:
        await supervisor.start()
        tokenizer = await reading
    except BaseException:
        reading.cancel()
        await supervisor.stop()
        notifier.close()
        raise
    front = Front(supervisor, tokenizer, server, server.served_model_name or engine.model)
    http = Listener(front, backlog)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks = [asyncio.create_task(notifier.watchdog(), name="watchdog")]
    if reload is not None:
        loop.add_signal_handler(signal.SIGHUP, reload_live, reload, server, engine, supervisor, notifier)
    try:
        await http.open()
        freeze_startup_objects()
        tasks.append(asyncio.create_task(report_status(supervisor, notifier), name="status"))
        await stop.wait()
        open_streams = sum(len(slot.streams) for slot in supervisor.slots)
        notifier.stopping(f"draining {open_streams} open stream(s)")
        await http.drain()
    finally:
        for t in tasks:
            t.cancel()
        await http.stop_listening()
        await supervisor.stop()  # ends what is still open with an error event
        await http.close()
        notifier.close()


def api_servers(server: ServerConfig, engine: EngineConfig) -> int:
    """--api-servers, else one API server process per engine on a GPU box (a front's CPU is what bounds
    the streams it holds), and one on CPU, where the engines need the cores."""
    if server.api_servers is not None:
        return server.api_servers
    if engine.role != "both":  # a federated node's stores, key log and role live in its one front
        return 1
    if engine.device.startswith("cuda"):
        return len(engine_configs(engine, server.engines))
    return 1


async def run(server: ServerConfig, engine: EngineConfig, reload: Reload | None = None,
              supervisor_factory: Callable[..., Supervisor] = Supervisor) -> None:
    """One process for the front and the supervisor, or a supervisor and N API server processes (api_servers.py)."""
    n = api_servers(server, engine)
    if n > 1:
        await run_api_servers(server, engine, n, reload, supervisor_factory)
    else:
        await run_server(server, engine, reload, supervisor_factory)


def serve(server: ServerConfig, engine: EngineConfig, reload: Reload | None = None) -> int:
    uvloop.run(run(server, engine, reload))
    return 0
