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
