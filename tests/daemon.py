"""A real `tokenflowd serve` in a subprocess, for integration tests."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

import httpx


def exited(pid: int) -> bool:
    """The process has exited (a zombie waiting for its reaper counts: it runs nothing, holds no memory)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_line(proc: subprocess.Popen, within: float = 120.0) -> str:
    """The next line of a text-mode child's stdout, or a failed test after `within` s (a child that
    hangs or dies before it speaks must not hang the suite). Empty when it exited."""
    import select

    ready, _, _ = select.select([proc.stdout], [], [], within)
    if not ready:
        proc.kill()
        raise AssertionError(f"{proc.args[1] if len(proc.args) > 1 else proc.args} said nothing in {within} s")
    return proc.stdout.readline()


def terminate(proc: subprocess.Popen, grace: float = 30.0) -> int:
    """SIGTERM, then SIGKILL after `grace` s; the exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


class Daemon:
    def __init__(self, *args: str, start_timeout: float = 120.0, env: dict[str, str] | None = None,
                 log_path: str | None = None, wait: bool = True, null_engine: bool = False,
                 netns: str | None = None, host: str = "127.0.0.1") -> None:
        """`null_engine`: bench/null_engine.py stands in for the model (tests/null_daemon.py).
        `netns`: run it in that network namespace, serving on `host` (tests/netns.py)."""
        self.port = free_port()
        self.base_url = f"http://{host}:{self.port}"
        entry = [os.path.join(os.path.dirname(__file__), "null_daemon.py")] if null_engine else ["-m", "tokenflowd.cli"]
        cmd = [sys.executable, *entry, "serve", "--port", str(self.port), *args]
        if host != "127.0.0.1":
            cmd += ["--host", host]
        if netns is not None:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        self.log = open(log_path, "w") if log_path else None  # its stdout and stderr; None: inherited
        # a script's sys.path starts at its own folder, not the cwd: the null daemon imports this
        # checkout's package, as `-m tokenflowd.cli` does, and not another one installed
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path,
                                               **(env or {})},
                                     stdout=self.log, stderr=subprocess.STDOUT if self.log else None)
        self.http = httpx.Client(base_url=self.base_url, timeout=60)
        if wait:
            self.wait_healthy(start_timeout)

    def wait_healthy(self, timeout: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tokenflowd exited with {self.proc.returncode}")
            try:
                r = self.http.get("/health")
                if r.status_code == 200:
                    return r.json()
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError("tokenflowd did not become healthy")

    def wait_all_engines(self, timeout: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            h = self.health()
            if all(e["state"] == "ready" for e in h["engines"]):
                return h
            time.sleep(0.2)
        raise TimeoutError(f"engines not all ready: {h}")

    def health(self) -> dict:
        return self.http.get("/health").json()

    def metric(self, name: str, **labels: str) -> float:
        """The sum of a metric's samples matching `labels`."""
        text = self.http.get("/metrics").text
        total, found = 0.0, False
        for line in text.splitlines():
            m = re.match(rf"^{re.escape(name)}(?:\{{(.*)\}})? (\S+)$", line)
            if not m:
                continue
            have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
            if all(have.get(k) == v for k, v in labels.items()):
                total += float(m.group(2))
                found = True
        if not found:
            raise KeyError(f"{name} {labels} not in /metrics")
        return total

    def count(self, name: str, **labels: str) -> float:
        """A counter's sum over `labels`, 0 where no such sample exists yet (a labelled counter's
        series appears at its first increment)."""
        try:
            return self.metric(name, **labels)
        except KeyError:
            return 0.0

    def wait_idle(self, timeout: float = 10.0) -> tuple[float, float]:
        """(requests running or waiting, KV pages used) once both are 0, or as they are after `timeout`:
        a request whose client has just gone is aborted asynchronously."""
        deadline = time.monotonic() + timeout
        while True:
            state = (self.metric("tokenflowd_requests_running") + self.metric("tokenflowd_requests_waiting"),
                     self.metric("tokenflowd_kv_pages_used"))
            if state == (0, 0) or time.monotonic() > deadline:
                return state
            time.sleep(0.1)

    def stop(self) -> int:
        self.http.close()
        terminate(self.proc)
        if self.log:
            self.log.close()
        return self.proc.returncode


def wait_for(condition, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def assert_no_pages_held(node: Daemon, within: float) -> None:
    """No KV page taken, none reserved for remote KV, no request on the node, within `within` s
    (a federated node's quarantined pages free at timing.py's horizon)."""
    deadline = time.monotonic() + within
    while True:
        held = (node.metric("tokenflowd_kv_pages_used"), node.metric("tokenflowd_kv_remote_pages"),
                node.metric("tokenflowd_requests_running") + node.metric("tokenflowd_requests_waiting"))
        if held == (0, 0, 0):
            return
        assert time.monotonic() < deadline, f"{node.base_url} still holds (pages, remote pages, requests) {held}"
        time.sleep(0.25)
