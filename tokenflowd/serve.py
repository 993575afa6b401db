"""`tokenflowd serve`: the HTTP front and the supervisor in one asyncio process (uvloop).

The port opens first (so /health answers 503 while engines load), then the engines start.
SIGTERM or SIGINT drains: new requests get 503, open streams finish (up to `shutdown_timeout`),
then the engines are shut down.
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
from tokenflowd.supervisor import Supervisor

log = logging.getLogger("tokenflowd")


async def run_server(server: ServerConfig, engine: EngineConfig, shutdown_timeout: float = 30.0,
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
    try:
        await supervisor.start()
        freeze_startup_objects()
        await stop.wait()
        front.draining = True
        deadline = time.monotonic() + shutdown_timeout
        while any(slot.streams for slot in supervisor.slots) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
    finally:
        await supervisor.stop()  # ends what is still open with an error event
        await runner.cleanup()


def freeze_startup_objects() -> None:
    """Move what start-up built (modules, the tokenizer, the app) out of the collector's sight:
    a full collection would otherwise scan ~200k long-lived objects and stall every stream for
    ~100 ms. Garbage made while serving is still collected."""
    gc.collect()
    gc.freeze()


def serve(server: ServerConfig, engine: EngineConfig) -> int:
    uvloop.run(run_server(server, engine))
    return 0
