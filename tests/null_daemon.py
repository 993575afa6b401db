"""`tokenflowd serve` with bench/null_engine.py as its engine: the real front (run_server, the
supervisor, aiohttp) over a model-free engine that emits one token per 1/NULL_ENGINE_RATE s per
request. For tests of the front's own limits, where a model would only add minutes.

    python tests/null_daemon.py serve --port P [serve flags]
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import msgspec
import uvloop

from tokenflowd import protocol as p
from tokenflowd.cli import build_parser, serve_configs
from tokenflowd.daemon.serve import run
from tokenflowd.daemon.supervisor import Supervisor

NULL_ENGINE = Path(__file__).resolve().parent.parent / "bench" / "null_engine.py"


class NullSupervisor(Supervisor):
    def engine_command(self, spec: p.EngineSpec) -> list[str]:
        return [sys.executable, str(NULL_ENGINE), msgspec.json.encode(spec).decode()]


def main() -> int:
    a = build_parser().parse_args(sys.argv[1:])
    server, engine = serve_configs(a)
    logging.basicConfig(level=server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvloop.run(run(server, engine, supervisor_factory=NullSupervisor))
    return 0


if __name__ == "__main__":
    sys.exit(main())
