"""Schemathesis against the daemon's own /openapi.json, every check on: no 5xx, nothing the
schema calls valid refused (bar what tests/fuzz_checks.py lists), nothing it calls invalid taken,
responses and SSE events as the schema says, and no ERROR or traceback in the daemon's log.

The front is the real one; the engine is bench/null_engine.py at 5,000 tokens/s (tests/null_daemon.py),
so that the thousand-odd generations a run makes, up to the 512-token context, take seconds. The
seed is fixed: the same cases on every run."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from daemon import Daemon

TESTS = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_schemathesis_finds_nothing_and_reaches_generation(tmp_path):
    log = tmp_path / "daemon.log"
    d = Daemon("--max-model-len", "512", null_engine=True, env={"NULL_ENGINE_RATE": "5000"}, log_path=str(log))
    try:
        run = subprocess.run(
            [sys.executable, "-m", "schemathesis.cli", "run", f"{d.base_url}/openapi.json", "--checks", "all",
             "--exclude-checks", "positive_data_acceptance", "--max-examples", "50", "--seed", "1", "--no-color"],
            capture_output=True, text=True, timeout=600, cwd=tmp_path,
            env={**os.environ, "SCHEMATHESIS_HOOKS": "fuzz_checks", "PYTHONPATH": str(TESTS)})
        assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
        assert d.metric("tokenflowd_generation_tokens_total") > 0  # it got past validation into generation
    finally:
        d.stop()
    text = log.read_text()
    assert "ERROR" not in text and "Traceback" not in text, text[-3000:]
