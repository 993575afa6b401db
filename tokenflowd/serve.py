"""`tokenflowd serve`: the HTTP front and the supervisor in one asyncio process (uvloop).

The port opens first (so /health answers 503 while engines load), then the engines start.
SIGTERM or SIGINT drains: new requests get 503, open streams finish (up to `shutdown_timeout`;
those still open then end with an error event), then the engines are shut down and the process
exits 0. Under systemd (Type=notify) it reports READY=1 once an engine serves, STATUS lines as
engines come and go, WATCHDOG=1 from the loop, and STOPPING=1 when it drains (notify.py).
"""
from __future__ import annotations

import asyncio
import gc
import logging
import signal
import time
from typing import Callable

import uvloop
from aiohttp import web

from tokenflowd.api.app import Front, build_app
from tokenflowd.config import EngineConfig, ServerConfig
from tokenflowd.engine.loader import load_tokenizer
from tokenflowd.notify import Notifier
from tokenflowd.supervisor import Supervisor

log = logging.getLogger("tokenflowd")


async def run_server(server: ServerConfig, engine: EngineConfig,
                     supervisor_factory: Callable[[ServerConfig, EngineConfig], Supervisor] = Supervisor,
                     backlog: int = 128) -> None:
    """`supervisor_factory` and `backlog` (the listen queue) are seams for benchmarks (bench/front_capacity.py)."""
    tokenizer = await asyncio.to_thread(load_tokenizer, engine.model)  # fails fast on a bad --model
    supervisor = supervisor_factory(server, engine)
    front = Front(supervisor, tokenizer, server, server.served_model_name or engine.model)
    runner = web.AppRunner(build_app(front), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, server.host, server.port, backlog=backlog)
    await site.start()
    log.info("tokenflowd listening on http://%s:%d (model %s, %d engine(s))", server.host, server.port,
                front.model_name, len(supervisor.slots))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    notifier = Notifier()
    tasks = [asyncio.create_task(notifier.watchdog(), name="watchdog")]
    try:
        notifier.status(f"starting {len(supervisor.slots)} engine(s)")
        await supervisor.start()
        freeze_startup_objects()
        tasks.append(asyncio.create_task(report_status(supervisor, notifier), name="status"))
        await stop.wait()
        front.draining = True
        open_streams = sum(len(slot.streams) for slot in supervisor.slots)
        log.info("draining: %d open stream(s), up to %g s", open_streams, server.shutdown_timeout)
        notifier.stopping(f"draining {open_streams} open stream(s)")
        deadline = time.monotonic() + server.shutdown_timeout
        while any(slot.streams for slot in supervisor.slots) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
    finally:
        for t in tasks:
            t.cancel()
        await supervisor.stop()  # ends what is still open with an error event
        await runner.cleanup()
        notifier.close()


async def report_status(supervisor: Supervisor, notifier: Notifier, every: float = 1.0) -> None:
    """READY=1 when the first engine serves; then a STATUS line whenever the engines' states or
    the streams change, so `systemctl status` shows an engine in backoff instead of a silent spin."""
    ready_sent, last = False, None
    while True:
        slots = supervisor.slots
        num_ready = sum(slot.ready for slot in slots)
        streams = sum(len(slot.streams) for slot in slots)
        failing = [f"engine {slot.engine_id} {slot.state}" for slot in slots if slot.state == "backoff"]
        status = f"{num_ready}/{len(slots)} engines serving, {streams} streams" + "".join(f"; {f}" for f in failing)
        if num_ready and not ready_sent:
            notifier.ready(status)
            ready_sent, last = True, status
        elif status != last and ready_sent:
            notifier.status(status)
            last = status
        await asyncio.sleep(every)


def freeze_startup_objects() -> None:
    """Move what start-up built (modules, the tokenizer, the app) out of the collector's sight:
    a full collection would otherwise scan ~200k long-lived objects and stall every stream for
    ~100 ms. Garbage made while serving is still collected."""
    gc.collect()
    gc.freeze()


def serve(server: ServerConfig, engine: EngineConfig) -> int:
    uvloop.run(run_server(server, engine))
    return 0
