"""One API server process of `tokenflowd serve --api-servers N` (N > 1): the HTTP front over every engine.

    python -m tokenflowd.daemon.api_server      (an ApiServerSpec as JSON on stdin; api_servers.py starts it)

It shares the listening port with the other API server processes (SO_REUSEPORT: the kernel spreads
connections over them), talks to every engine itself (its requests go to an engine's input
socket; their deltas come back on this process's own output of that engine), and learns from the
supervisor which engines exist, in which incarnation and state (EngineTable over zmq PUB). An
engine restarted under it is a new incarnation: the streams of the old one end with an error,
as with one process. Metrics go to prometheus-client's multiprocess files, so /metrics on any
front counts every front's requests. SIGTERM drains it; it dies with the supervisor.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Awaitable, Callable

import aiohttp
import msgspec
import uvloop
import zmq
from aiohttp import web

from tokenflowd import protocol as p
from tokenflowd.config import EngineConfig, ServerConfig
from tokenflowd.config.platform import die_with_parent
from tokenflowd.daemon.engine_handle import EngineHandle
from tokenflowd.daemon.launcher import engine_input_address
from tokenflowd.daemon.supervisor import Supervisor

log = logging.getLogger("tokenflowd.front")


class ApiServerSupervisor(Supervisor):
    """The engines as one API server process sees them: it launches none, and follows the supervisor's
    EngineTable for their incarnations and states."""

    tells_readers = False  # (the supervisor does)

    def __init__(self, server: ServerConfig, engine: EngineConfig, spec: p.ApiServerSpec) -> None:
        super().__init__(server, engine, placement=[(msgspec.convert(c, EngineConfig), {}) for c in spec.engines])
        self.front, self.front_epoch = spec.front, spec.epoch
        self.spec = spec
        self._control: zmq.Socket | None = None
        self._table_decoder = msgspec.msgpack.Decoder(p.EngineTable)
        self.tables = 0  # tables received (the first one makes the engines known)

    async def start(self) -> None:
        self.runtime_dir = Path(self.spec.runtime_dir)
        loop = asyncio.get_running_loop()
        self._outbox = self._ctx.socket(zmq.PULL)
        self._outbox.bind(self.spec.input_address)
        loop.add_reader(self._outbox.getsockopt(zmq.FD), self._read_outputs)
        self._control = self._ctx.socket(zmq.SUB)
        self._control.setsockopt(zmq.SUBSCRIBE, b"")
        self._control.connect(self.spec.control_address)
        loop.add_reader(self._control.getsockopt(zmq.FD), self._read_control)

    async def stop(self) -> None:
        loop = asyncio.get_running_loop()
        for sock in (self._outbox, self._control):
            if sock is not None:
                loop.remove_reader(sock.getsockopt(zmq.FD))
        for handle in self.slots:
            handle.fail_streams("the server is shutting down")
            handle.state = "stopped"
        self._ctx.destroy(linger=0)

    def _read_control(self) -> None:
        sock = self._control
        while sock is not None and not sock.closed:
            try:
                raw = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self.apply(self._table_decoder.decode(raw))
            except Exception:
                log.exception("dropped an engine table from the supervisor")

    def apply(self, table: p.EngineTable) -> None:
        """Follow the supervisor: a new incarnation gets a fresh input socket (the old one's streams
        end), an engine that left `ready` fails its streams, the rest is copied for /health."""
        self.tables += 1
        level = table.log_level.upper()
        if logging.getLevelName(logging.getLogger().level) != level:
            logging.getLogger().setLevel(level)
        for st in table.engines:
            handle = self.slots[st.engine_id]
            if st.incarnation != handle.incarnation:
                self._engine_replaced(handle, f"engine {st.engine_id} was restarted ({st.last_failure or 'gone'}); "
                                              "the request was ended, retry it")
                if st.incarnation:
                    handle.open(self._ctx, engine_input_address(self.runtime_dir, st.engine_id, st.incarnation),
                                st.incarnation)
                    # what its prefix cache already holds (a front restarted beside a running engine);
                    # queued until the engine reads its input
                    self.send(handle, p.QueryKeys(self.front))
            elif handle.ready and st.state != "ready":
                self._engine_replaced(handle, f"engine {st.engine_id} {st.last_failure or 'stopped'}; the request "
                                              "was ended, retry it")
            handle.state = st.state
            handle.pid = st.pid
            handle.num_restarts = st.num_restarts
            handle.consecutive_failures = st.consecutive_failures
            handle.last_failure = st.last_failure
            handle.preemptions_before = st.preemptions_before
            handle.policy_params = st.policy_params
            if st.info is not None and handle.info is None:
                handle.info = st.info
                handle.stats = handle.stats or st.info.stats

    def _engine_replaced(self, handle: EngineHandle, message: str) -> None:
        handle.fail_streams(message)
        handle.stats = None
        handle.info = None
        self.index.forget(handle.engine_id)
        self.drop_moved(handle.engine_id)
        self._send_chain_ends()
        if self.on_keys is not None:
            self.on_keys(None, None)

    def _on_message(self, msg: p.FromEngine) -> None:
        slot = self.slots[msg.engine_id]
        if msg.incarnation != slot.incarnation:
            return  # from an incarnation this front has not heard of yet, or one already gone
        if isinstance(msg, p.Ready):  # the table brings it too; whichever comes first
            slot.info, slot.stats = msg, msg.stats
            return
        if isinstance(msg, p.Reconfigured):
            slot.policy_params = msg.policy_params
            return
        super()._on_message(msg)


class CursorRelay:
    """A read cursor (POST /v1/requests/{id}/read) that reaches a front which does not serve the
    request is passed, as it came (its API key included), to the front that does: the engines say
    which one, and each front also serves its app on a unix socket in the private runtime directory."""

    def __init__(self, supervisor: ApiServerSupervisor, read_body: Callable[[web.Request], Awaitable[bytes]],
                 timeout: float) -> None:
        self.supervisor = supervisor
        self.read_body = read_body  # the front's own, with its body deadline (408)
        self.timeout = timeout
        self._sessions: dict[int, aiohttp.ClientSession] = {}

    @staticmethod
    def socket_path(runtime_dir: str, front: int) -> str:
        return f"{runtime_dir}/front-{front}.sock"

    async def __call__(self, request_id: str, request: web.Request) -> web.Response | None:
        from tokenflowd.daemon.api.routes import RELAYED

        infos = await self.supervisor.query([request_id])
        owner = next((i.front for i in infos if i.request_id == request_id), 0)
        if owner in (0, self.supervisor.front):
            return None
        session = self._sessions.get(owner)
        if session is None:
            path = self.socket_path(self.supervisor.spec.runtime_dir, owner)
            session = self._sessions[owner] = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=path), timeout=aiohttp.ClientTimeout(total=self.timeout))
        body = await self.read_body(request)
        headers = {k: v for k, v in request.headers.items() if k in ("Authorization", "Content-Type")}
        try:
            async with session.post(f"http://front{owner}{request.path}", data=body,
                                    headers={**headers, RELAYED: "1"}) as r:
                return web.Response(body=await r.read(), status=r.status, content_type=r.content_type)
        except (aiohttp.ClientError, TimeoutError):  # that front just went away: the request with it
            return None

    async def close(self) -> None:
        for session in self._sessions.values():
            await session.close()


async def run_api_server(spec: p.ApiServerSpec) -> None:
    from tokenflowd.daemon.api.front import Front
    from tokenflowd.daemon.api.open_counts import OPEN_COUNTS, SharedOpenCounts
    from tokenflowd.daemon.lifecycle import Listener, freeze_startup_objects
    from tokenflowd.text.source import load_tokenizer

    server = msgspec.convert(spec.server, ServerConfig)
    engine = msgspec.convert(spec.engine, EngineConfig)
    supervisor = ApiServerSupervisor(server, engine, spec)
    await supervisor.start()
    tokenizer = await asyncio.to_thread(load_tokenizer, engine.model)
    counts = SharedOpenCounts(Path(spec.runtime_dir) / OPEN_COUNTS, spec.fronts, spec.front)
    front = Front(supervisor, tokenizer, server, server.served_model_name or engine.model, counts)
    relay = front.relay = CursorRelay(supervisor, front.read_body, timeout=10.0)
    http = Listener(front, reuse_port=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, lambda: None)  # a terminal's Ctrl-C reaches the supervisor too
    ctx = zmq.Context.instance()
    report = ctx.socket(zmq.PUSH)
    report.setsockopt(zmq.LINGER, 0)
    report.connect(spec.report_address)
    inner: asyncio.AbstractServer | None = None
    try:
        await http.open()
        path = Path(CursorRelay.socket_path(spec.runtime_dir, spec.front))
        path.unlink(missing_ok=True)  # left by this front's predecessor
        inner = await loop.create_unix_server(http.runner.server, str(path))
        report.send(msgspec.msgpack.encode(p.FrontListening(spec.front, os.getpid())), zmq.NOBLOCK)
        freeze_startup_objects()
        await stop.wait()
        await http.drain()
    finally:
        report.close(linger=0)
        await relay.close()
        if inner is not None:
            inner.close()
        await http.stop_listening()
        await supervisor.stop()
        await http.close()


def main() -> int:
    die_with_parent()
    spec = msgspec.json.decode(sys.stdin.buffer.read(), type=p.ApiServerSpec)
    level = spec.server.get("log_level", "INFO").upper()
    logging.basicConfig(level=level, format=f"%(asctime)s %(levelname)s front{spec.front} %(name)s: %(message)s",
                        stream=sys.stdout)
    uvloop.run(run_api_server(spec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
