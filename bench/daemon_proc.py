"""A daemon the benches start as a process: a free port for it, and the wait until its /health
says it serves. Standard library only: bench/gpu_check.py imports it before the kit's wheels are
on the path."""
from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 120.0) -> dict:
    """/health's body once it answers 200; RuntimeError if `proc` exits first, TimeoutError after
    `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the daemon on port {port} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                return json.loads(r.read())
        except OSError:  # not listening yet, or 503 while its engines start
            time.sleep(0.2)
    raise TimeoutError(f"the daemon on port {port} did not become healthy in {timeout:.0f} s")
