"""The launcher's watch over an engine process."""
from __future__ import annotations

import asyncio
import sys

import zmq

from tokenflowd.config import EngineConfig, ServerConfig
from tokenflowd.daemon.engine_handle import EngineHandle
from tokenflowd.daemon.launcher import LocalLauncher


def test_watching_an_engine_keeps_no_task_per_check(tmp_path):
    """The watch checks the process every heartbeat interval; a waiter made per check and never
    awaited to its end would pile up, one more task each interval for as long as the engine runs."""
    server = ServerConfig(heartbeat_interval=0.01, heartbeat_timeout=60.0)

    async def run() -> tuple[int, int]:
        ctx = zmq.Context()
        launcher = LocalLauncher(server, ctx, tmp_path, lambda handle, why: None,
                                 lambda spec: [sys.executable, "-c", "import time; time.sleep(30)"])
        handle = EngineHandle(0, EngineConfig(), {})
        await launcher.start(handle)
        await asyncio.sleep(0.1)
        early = len(asyncio.all_tasks())
        await asyncio.sleep(0.5)  # some 50 checks
        late = len(asyncio.all_tasks())
        launcher._procs[0].kill()
        await launcher.stop([handle])
        ctx.destroy(linger=0)
        return early, late

    early, late = asyncio.run(run())
    assert late <= early


def test_an_engine_whose_cleanup_fails_is_restarted_all_the_same(tmp_path, caplog):
    """The launcher restarts an engine that exits even where the supervisor's cleanup after it
    raises (a dead engine's cache removed meanwhile by its resource tracker, once): the error is
    logged and the engine comes back. Before, the error ended the watch: the engine stayed dead and
    its state "ready", and the router went on sending it requests that never had a token."""
    server = ServerConfig(heartbeat_interval=0.01, heartbeat_timeout=60.0, restart_backoff_max=0.05)
    exits: list[str] = []

    def on_exit(handle, why: str) -> None:
        exits.append(why)
        if len(exits) == 1:
            raise FileNotFoundError("the block was gone")

    async def run() -> tuple[int, str]:
        ctx = zmq.Context()
        launcher = LocalLauncher(server, ctx, tmp_path, on_exit, lambda spec: [sys.executable, "-c", "exit(3)"])
        handle = EngineHandle(0, EngineConfig(), {})
        await launcher.start(handle)
        for _ in range(400):  # bounded: 20 s
            if len(exits) >= 2:
                break
            await asyncio.sleep(0.05)
        await launcher.stop([handle])
        ctx.destroy(linger=0)
        return handle.num_restarts, handle.state

    with caplog.at_level("ERROR"):
        restarts, _ = asyncio.run(run())
    assert len(exits) >= 2 and restarts >= 1, (exits, restarts)
    assert "cleaning up after it failed" in caplog.text
