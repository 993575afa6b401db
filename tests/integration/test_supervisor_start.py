"""An engine that hangs in start-up is killed after engine_start_timeout and started again."""
from __future__ import annotations

import asyncio
import sys
import time

from daemon import exited

from tokenflowd import protocol as p
from tokenflowd.config import EngineConfig, ServerConfig
from tokenflowd.daemon.supervisor import Supervisor


class Hanging(Supervisor):
    """Its engines never say READY: they sleep (as one stuck loading weights would)."""

    def engine_command(self, spec: p.EngineSpec) -> list[str]:
        return [sys.executable, "-c", "import time; time.sleep(600)"]


def test_an_engine_stuck_in_start_up_is_killed_and_retried(tmp_path):
    server = ServerConfig(engines=1, engine_start_timeout=0.5, heartbeat_interval=0.05, restart_backoff_max=0.1,
                          runtime_dir=str(tmp_path))
    sup = Hanging(server, EngineConfig())

    async def run() -> tuple[int, str | None, int]:
        await sup.start()
        slot = sup.slots[0]
        first = slot.pid
        deadline = time.monotonic() + 30
        while slot.num_restarts < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        restarts, failure = slot.num_restarts, slot.last_failure
        await sup.stop()
        return restarts, failure, first

    restarts, failure, first = asyncio.run(run())
    assert restarts >= 2, failure
    assert "was not ready within engine_start_timeout (0.5 s)" in failure
    assert exited(first)  # the first one was killed, not left behind
