"""The daemon as a systemd service: sd_notify on a test NOTIFY_SOCKET, API keys, and the SIGTERM
drain (10 open streams finish, new requests and /health get 503, exit 0). One daemon, in order:
the drain ends it."""
from __future__ import annotations

import asyncio
import json
import shutil
import signal
import socket
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
from daemon import Daemon

from tokenflowd.daemon.api.auth import key_matches, load_api_keys
from tokenflowd.daemon.notify import Notifier

MODEL = "smollm2-135m"
KEYS = {"env": "k-env-1", "file": "k-file"}


class NotifySocket:
    """What systemd's end of NOTIFY_SOCKET sees: every datagram, with the time it came. A thread
    reads as systemd does (a unix datagram queue holds only ~10 unread messages)."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="tfd-notify-"))  # short: AF_UNIX paths are ≤ 107 bytes
        self.path = str(self.dir / "notify")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.1)
        self.messages: list[tuple[float, dict[str, str]]] = []
        self._closed = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while not self._closed:
            try:
                data = self.sock.recv(4096)
            except (TimeoutError, OSError):
                continue
            fields = dict(line.split("=", 1) for line in data.decode().splitlines())
            self.messages.append((time.monotonic(), fields))

    def poll(self) -> list[tuple[float, dict[str, str]]]:
        return list(self.messages)

    def wait_for(self, key: str, timeout: float = 30.0) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for t, fields in self.poll():
                if key in fields:
                    return t
            time.sleep(0.05)
        raise TimeoutError(f"no {key} in {[m for _, m in self.poll()][-5:]}")

    def count(self, key: str) -> int:
        return sum(key in fields for _, fields in self.poll())

    def close(self) -> None:
        self._closed = True
        self._reader.join()
        self.sock.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def notify():
    n = NotifySocket()
    yield n
    n.close()


CONFIG = """
[server]
log_level = "INFO"
[engine]
policy = "tokenflow"
[policy]
schedule_interval = {interval}
"""


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("etc") / "tokenflowd.toml"
    path.write_text(CONFIG.format(interval=0.5))
    return path


def start_daemon(notify: NotifySocket, config_file: Path, tmp_path_factory) -> Daemon:
    key_file = tmp_path_factory.mktemp("keys") / "keys"
    key_file.write_text(f"# keys of the test\n\n{KEYS['file']}\n")
    return Daemon("--config", str(config_file), "--dtype", "float32", "--quantization", "none", "--kv-cache-memory", "64MiB",
                  "--api-key-file", str(key_file), "--shutdown-timeout", "60",
                  log_path=str(tmp_path_factory.mktemp("log") / "daemon.log"),
                  env={"NOTIFY_SOCKET": notify.path, "WATCHDOG_USEC": "200000",
                       "TOKENFLOWD_API_KEY": f"{KEYS['env']},k2"})


@pytest.fixture(scope="module")
def daemon(notify, config_file, tmp_path_factory):
    d = start_daemon(notify, config_file, tmp_path_factory)
    yield d
    d.stop()


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# -- units --------------------------------------------------------------------------------------
def test_api_keys_load_from_file_and_environment(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# comment\n a \n\nb\n")
    assert load_api_keys(str(f), {"TOKENFLOWD_API_KEY": "c, d,"}) == (b"c", b"d", b"a", b"b")
    assert load_api_keys(None, {}) == ()
    with pytest.raises(ValueError, match="cannot read"):
        load_api_keys(str(tmp_path / "missing"), {})
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ValueError, match="holds no key"):
        load_api_keys(str(tmp_path / "empty"), {})
    assert key_matches(b"b", (b"a", b"b")) and not key_matches(b"x", (b"a", b"b")) and not key_matches(b"a", ())


def test_notifier_without_socket_does_nothing_and_reads_the_watchdog_period():
    n = Notifier({})
    assert not n.enabled and n.watchdog_interval is None
    n.ready("x")  # no socket: no error
    assert Notifier({"NOTIFY_SOCKET": "@abstract", "WATCHDOG_USEC": "3000000"}).watchdog_interval == 1.5
    assert Notifier({"NOTIFY_SOCKET": "@abstract"}).address == "\0abstract"
    # another process's watchdog is not ours
    assert Notifier({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "1000", "WATCHDOG_PID": "1"}).watchdog_interval is None


# -- the real daemon ----------------------------------------------------------------------------
def test_an_engine_that_dies_at_start_is_retried_with_backoff_and_reported(tmp_path):
    notify = NotifySocket()
    # 1 KiB of KV cache holds no page: the engine loads the model, then exits with an error
    d = Daemon("--kv-cache-memory", "1KiB", "--dtype", "float32", "--quantization", "none", env={"NOTIFY_SOCKET": notify.path}, wait=False)
    try:
        deadline = time.monotonic() + 90
        health = {}
        while time.monotonic() < deadline:
            try:
                r = d.http.get("/health")
                health = r.json()
                if health["engines"][0]["consecutive_failures"] >= 2:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        engine = health["engines"][0]
        assert r.status_code == 503 and health["status"] == "unhealthy"
        assert engine["consecutive_failures"] >= 2 and engine["restarts"] >= 1
        assert "exited with code 1" in engine["last_failure"]
        assert d.proc.poll() is None  # it keeps trying, with backoff, and says so
        statuses = [f["STATUS"] for _, f in notify.poll() if "STATUS" in f]
        assert any("engine 0 restarting" in s and "exited with code 1" in s for s in statuses), statuses
        assert not any("READY" in f for _, f in notify.poll())
    finally:
        assert d.stop() == 0
        notify.close()


def test_ready_after_an_engine_serves_then_watchdog_pings(daemon, notify):
    ready_at = notify.wait_for("READY")
    # the READY that says an engine serves (a reload, when another test ran first, also sends one)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not any(
            f.get("READY") == "1" and "1/1 engines serving" in f.get("STATUS", "") for _, f in notify.poll()):
        time.sleep(0.05)
    ready = [f for _, f in notify.poll() if "READY" in f and "1/1 engines serving" in f.get("STATUS", "")][0]
    assert ready["READY"] == "1" and "1/1 engines serving" in ready["STATUS"]
    assert daemon.http.get("/health").status_code == 200
    before = notify.count("WATCHDOG")
    time.sleep(1.0)
    pings = notify.count("WATCHDOG") - before
    assert 5 <= pings <= 15  # every 0.1 s (half of WATCHDOG_USEC)
    assert not any("STOPPING" in f for _, f in notify.poll())
    assert ready_at > 0


def test_api_keys_none_wrong_right(daemon):
    http = daemon.http
    r = http.get("/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"
    assert r.headers["WWW-Authenticate"] == "Bearer"
    r = http.get("/v1/models", headers=auth("wrong"))
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = http.post("/v1/completions", headers=auth("wrong"), json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 401
    for key in (KEYS["env"], "k2", KEYS["file"]):
        r = http.get("/v1/models", headers=auth(key))
        assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL
    assert http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200  # probes stay open
    engine_pid = daemon.health()["engines"][0]["pid"]
    with open(f"/proc/{engine_pid}/environ", "rb") as f:
        assert b"TOKENFLOWD_API_KEY" not in f.read()  # the keys stay in the front


def test_sighup_reloads_policy_parameters_and_refuses_a_bad_file(daemon, notify, config_file):
    def params():
        return daemon.health()["engines"][0]["policy_params"]

    assert params()["schedule_interval"] == 0.5 and daemon.health()["engines"][0]["policy"] == "tokenflow"
    config_file.write_text(CONFIG.format(interval=0.9).replace('"INFO"', '"DEBUG"'))
    daemon.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while params()["schedule_interval"] != 0.9 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert params()["schedule_interval"] == 0.9  # the engine reports what it now schedules with
    notify.wait_for("RELOADING", timeout=5)
    # A file that does not validate changes nothing, and the daemon serves on.
    config_file.write_text(CONFIG.format(interval=-1))
    daemon.proc.send_signal(signal.SIGHUP)
    time.sleep(0.5)
    assert daemon.proc.poll() is None and daemon.http.get("/health").status_code == 200
    assert params()["schedule_interval"] == 0.9
    assert any("reload failed" in f.get("STATUS", "") for _, f in notify.poll())


async def _stream(base_url: str, started: asyncio.Event, counter: list[int], n: int) -> tuple[int, str | None, bool]:
    body = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": n, "ignore_eos": True, "stream": True,
            "reading_rate": 10.0}
    tokens, finish, done = 0, None, False
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as c:
        async with c.stream("POST", "/v1/completions", json=body, headers=auth(KEYS["env"])) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                if tokens == 0:
                    counter[0] += 1
                    if counter[0] == 10:
                        started.set()
                tokens += 1
                finish = chunk["choices"][0]["finish_reason"] or finish
    return tokens, finish, done


def test_sigterm_drains_open_streams_then_exits_0(tmp_path_factory):
    """A daemon of its own: it ends this one (the module's serves the other tests in any order)."""
    notify = NotifySocket()
    config_file = tmp_path_factory.mktemp("etc") / "tokenflowd.toml"
    config_file.write_text(CONFIG.format(interval=0.5))
    daemon = start_daemon(notify, config_file, tmp_path_factory)
    try:
        _drain(daemon, notify)
    finally:
        daemon.stop()
        notify.close()


def _drain(daemon: Daemon, notify: NotifySocket) -> None:
    n = 40

    async def scenario():
        started, counter = asyncio.Event(), [0]
        streams = [asyncio.create_task(_stream(daemon.base_url, started, counter, n)) for _ in range(10)]
        await asyncio.wait_for(started.wait(), 60)
        daemon.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        async with httpx.AsyncClient(base_url=daemon.base_url, timeout=30) as c:
            for _ in range(100):  # the signal lands within a few ms
                h = await c.get("/health")
                if h.status_code == 503:
                    break
                await asyncio.sleep(0.02)
            assert h.status_code == 503 and h.json()["status"] == "draining"
            r = await c.post("/v1/completions", headers=auth(KEYS["env"]),
                             json={"model": MODEL, "prompt": "late", "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"
            assert "draining" in r.json()["error"]["message"] and r.headers["Retry-After"] == "1"
        results = await asyncio.gather(*streams)
        return results, time.monotonic() - t0

    results, drain = asyncio.run(scenario())
    assert all(r[0] >= n - 1 and r[1] == "length" and r[2] for r in results), results  # every stream complete
    assert daemon.proc.wait(60) == 0
    notify.wait_for("STOPPING")
    stopping = [f for _, f in notify.poll() if "STOPPING" in f][0]
    assert "draining 10 open stream(s)" in stopping["STATUS"]
    # one structured line a request on stdout
    lines = [ln for ln in Path(daemon.log.name).read_text().splitlines() if "tokenflowd.requests: request " in ln]
    fields = [dict(kv.split("=", 1) for kv in ln.split("request ", 1)[1].split()) for ln in lines]
    drained = [f for f in fields if f["outcome"] == "length" and f["output_tokens"] == str(n)]
    assert len(drained) == 10, lines[-12:]
    for f in drained:
        assert float(f["reading_rate"]) == 10.0 and float(f["ttft"]) > 0 and f["preemptions"] == "0"
        assert f["engine"] == "0" and int(f["prompt_tokens"]) > 0
    print(f"drain with 10 open streams of {n} tokens: {drain:.2f} s to the last stream's end")


def test_api_servers_report_ready_once_a_front_listens_and_drain_on_sigterm(tmp_path):
    """--api-servers 2: the supervisor process talks to systemd (the fronts do not), READY says the
    fronts listen, and SIGTERM drains the streams of both fronts before it exits 0."""
    notify = NotifySocket()
    d = Daemon("--api-servers", "2", "--shutdown-timeout", "60", null_engine=True, log_path=str(tmp_path / "log"),
               env={"NOTIFY_SOCKET": notify.path, "WATCHDOG_USEC": "200000", "NULL_ENGINE_RATE": "20"})
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(
                f.get("READY") == "1" and "fronts listening" in f.get("STATUS", "") for _, f in notify.poll()):
            time.sleep(0.05)
        ready = [f for _, f in notify.poll() if f.get("READY") == "1"]
        assert len(ready) == 1 and "1/1 engines serving" in ready[0]["STATUS"], ready

        async def scenario():
            limits = httpx.Limits(max_connections=20, max_keepalive_connections=0)  # spread over both fronts
            async with httpx.AsyncClient(base_url=d.base_url, timeout=60, limits=limits) as c:
                opened: list[int] = []
                all_open = asyncio.Event()

                async def one() -> int:
                    n, first = 0, True
                    async with c.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                                         "max_tokens": 40, "stream": True}) as r:
                        async for line in r.aiter_lines():
                            if first and line.startswith("data: "):
                                first = False
                                opened.append(1)
                                if len(opened) == 10:
                                    all_open.set()
                            n += line.count(" the")
                    return n
                streams = [asyncio.create_task(one()) for _ in range(10)]
                # every stream has its first event from a front (a loaded machine takes its time): then
                # SIGTERM, which must let them all end
                await asyncio.wait_for(all_open.wait(), 60)
                d.proc.send_signal(signal.SIGTERM)
                return await asyncio.gather(*streams)

        assert asyncio.run(scenario()) == [40] * 10  # every stream complete
        assert d.proc.wait(60) == 0
        notify.wait_for("STOPPING")
    finally:
        d.stop()
        notify.close()
