"""Runs each engine as a child process of this one: spawns it, watches it, restarts it.

    start(handle)   open the handle's input socket for a new incarnation, spawn its process
    watch           until the process exits, or goes silent (no heartbeat for heartbeat_timeout,
                    no READY within engine_start_timeout; then it is killed); on_exit(handle,
                    why) fails its streams; after an exponential backoff, a fresh incarnation
    stop(handles)   wait for each process to exit (the supervisor asked them to), kill the rest

The handle (engine_handle.py) is what the front talks to; this is only how a local engine runs.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import msgspec
import zmq

from tokenflowd import protocol as p
from tokenflowd.config import EngineConfig, ServerConfig
from tokenflowd.config.platform import mps_pipe_directory
from tokenflowd.daemon.engine_handle import EngineHandle

log = logging.getLogger("tokenflowd.daemon.supervisor")

# Engine environment unless the operator's says otherwise.
# NOTE: oneDNN (torch's CPU matmuls) caches a JIT-compiled primitive per GEMM shape, 1,024 of
# them by default, and a step's token count changes the shape: under bursts a CPU engine keeps
# adding shapes it sees once, and its RSS grows. At 64 it grew least, with no slower steps; with
# no cache at all the steps were much slower (bench/results/code_figures.md).
ENGINE_ENV_DEFAULTS = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64"}
FRONT_SECRETS = ("TOKENFLOWD_API_KEY", "TOKENFLOWD_NODE_KEY")  # the front's alone: an engine never sees a key


def engine_environment(own: dict[str, str]) -> dict[str, str]:
    """An engine process's environment: the front's, less its secrets, with the engine defaults under
    it and the engine's own (its GPU) over it."""
    inherited = {k: v for k, v in os.environ.items() if k not in FRONT_SECRETS}
    return {**ENGINE_ENV_DEFAULTS, **inherited,
            "TOKENFLOWD_LOG_LEVEL": logging.getLevelName(logging.getLogger().level), **own}


class LocalLauncher:
    def __init__(self, server: ServerConfig, ctx: zmq.Context, runtime_dir: Path,
                 on_exit: Callable[[EngineHandle, str], None], command: Callable[[p.EngineSpec], list[str]],
                 front_addresses: list[str] | None = None) -> None:
        self.server = server
        self._ctx = ctx
        self.runtime_dir = runtime_dir
        self._on_exit = on_exit
        self._command = command
        self._front_addresses = front_addresses or []
        self._procs: dict[int, asyncio.subprocess.Process] = {}
        self._tasks: list[asyncio.Task] = []
        self._stopping = False

    async def start(self, handle: EngineHandle) -> None:
        await self._spawn(handle)
        self._tasks.append(asyncio.create_task(self._watch(handle), name=f"watch-engine{handle.engine_id}"))

    def running(self, handle: EngineHandle) -> bool:
        proc = self._procs.get(handle.engine_id)
        return proc is not None and proc.returncode is None

    async def stop(self, handles: list[EngineHandle], timeout: float = 10.0) -> None:
        """Wait for every engine process to exit (killing those that take longer than `timeout`)."""
        self._stopping = True
        for handle in handles:
            proc = self._procs.get(handle.engine_id)
            if proc is not None and proc.returncode is None:
                try:
                    await asyncio.wait_for(proc.wait(), timeout)
                except asyncio.TimeoutError:
                    proc.kill()
                    await proc.wait()
            handle.pid = None
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _spawn(self, handle: EngineHandle) -> None:
        address = engine_input_address(self.runtime_dir, handle.engine_id, handle.incarnation + 1)
        handle.open(self._ctx, address)  # the next incarnation: messages of older ones are dropped
        spec = p.EngineSpec(handle.engine_id, handle.incarnation, address, f"ipc://{self.runtime_dir}/out",
                            self.server.heartbeat_interval, msgspec.to_builtins(handle.config),
                            send_timeout=self.server.heartbeat_timeout, supervisor_pid=os.getpid(),
                            front_addresses=self._front_addresses, runtime_dir=str(self.runtime_dir))
        proc = self._procs[handle.engine_id] = await asyncio.create_subprocess_exec(
            *self._command(spec), env=engine_environment(handle.env))
        handle.pid = proc.pid
        handle.started_at = handle.last_heard = time.monotonic()
        log.info("engine %d (incarnation %d) started, pid %d", handle.engine_id, handle.incarnation, proc.pid)

    async def _watch(self, handle: EngineHandle) -> None:
        """Restart the handle's engine whenever it exits or goes silent, with exponential backoff."""
        while not self._stopping:
            code = await self._wait_exit_or_silence(handle)
            handle.pid = None
            if self._stopping:
                return
            up = time.monotonic() - handle.started_at
            reason = (f"engine {handle.engine_id} {code}" if isinstance(code, str)
                      else f"engine {handle.engine_id} exited with code {code}")
            log.error("%s after %.1f s; its %d open requests fail", reason, up, len(handle.streams))
            try:
                self._on_exit(handle, f"{reason}; the request was ended, retry it")
            except Exception:  # the engine is restarted whatever its cleanup met: else it stays dead, named ready
                log.exception("engine %d: cleaning up after it failed", handle.engine_id)
            handle.last_failure = f"{reason} after {up:.1f} s"
            handle.consecutive_failures = 1 if handle.info is not None and up > 60 else handle.consecutive_failures + 1
            delay = min(self.server.restart_backoff_max, 0.5 * 2 ** (handle.consecutive_failures - 1))
            handle.state = "backoff"
            await asyncio.sleep(delay)
            if self._stopping:
                return
            handle.num_restarts += 1
            await self._spawn(handle)

    async def _wait_exit_or_silence(self, handle: EngineHandle) -> int | str:
        """The exit code; or, after killing an engine silent for heartbeat_timeout or not ready
        within engine_start_timeout, why it was killed."""
        proc = self._procs[handle.engine_id]
        exited = asyncio.ensure_future(proc.wait())  # one waiter for the process's life (one per check leaked a task)
        while True:
            done, _ = await asyncio.wait({exited}, timeout=self.server.heartbeat_interval)
            if done:
                return exited.result()
            now = time.monotonic()
            if handle.ready and now - handle.last_heard > self.server.heartbeat_timeout:
                why = "stopped sending heartbeats"
            elif handle.state == "starting" and now - handle.started_at > self.server.engine_start_timeout:
                why = f"was not ready within engine_start_timeout ({self.server.engine_start_timeout:g} s)"
            else:
                continue
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGKILL)
            await proc.wait()
            return why


def engine_input_address(runtime_dir: Path, engine_id: int, incarnation: int) -> str:
    """Where an engine's incarnation binds its input socket (the supervisor and every front connect)."""
    return f"ipc://{runtime_dir}/in-{engine_id}-{incarnation}"


UNIT_MPS_PIPE = "/run/tokenflowd-mps/pipe"  # systemd/tokenflowd-mps.service's pipe directory


def engine_configs(config: EngineConfig, engines: int | None) -> list[tuple[EngineConfig, dict[str, str]]]:
    """One (config, environment) per engine: a GPU each on CUDA, a share of the cores on CPU.

    More engines than GPUs share them round-robin, each with its share of
    gpu_memory_utilization; they should run under CUDA MPS (systemd/tokenflowd-mps.service), or
    the GPU time-slices between their contexts. With the node's pool on and CUDA IPC (the default),
    an engine sees the other GPUs too, after its own (its cuda:0), so that it can map the caches of
    peers there where its GPU has peer access to theirs (pool/cuda_ipc.py); it allocates on its own."""
    if config.device.startswith("cuda"):
        if config.device != "cuda":  # a device named explicitly: one engine on it
            return [(config, {})]
        ids = visible_gpus()
        if not ids:
            raise ValueError("device cuda was asked for, but no CUDA device is visible")
        n = engines or len(ids)
        placement = [ids[i % len(ids)] for i in range(n)]
        mps = {}
        if n > len(ids):  # engines share GPUs: under the MPS control daemon where one runs
            pipe = mps_pipe_directory()
            if not pipe and not os.environ.get("CUDA_MPS_PIPE_DIRECTORY") and \
                    os.path.exists(os.path.join(UNIT_MPS_PIPE, "control")):
                pipe = UNIT_MPS_PIPE  # systemd/tokenflowd-mps.service's, with the variable left unset
                mps = {"CUDA_MPS_PIPE_DIRECTORY": pipe}
            if pipe:
                log.info("%d engines share %d GPU(s) under CUDA MPS (%s)", n, len(ids), pipe)
            else:
                log.warning("%d engines share %d GPU(s) without CUDA MPS (no control daemon's pipe found): "
                            "their kernels will time-slice instead of running side by side", n, len(ids))
        used = list(dict.fromkeys(placement))
        peers_seen = config.pool_mode != "off" and config.pool_ipc
        configs = []
        for gpu in placement:
            sharing = placement.count(gpu)
            cfg = replace(config, gpu_memory_utilization=config.gpu_memory_utilization / sharing, engines_on_node=n)
            seen = [gpu, *(other for other in used if other != gpu)] if peers_seen else [gpu]
            configs.append((cfg, {"CUDA_VISIBLE_DEVICES": ",".join(seen), **mps}))
        return configs
    n = engines or 1
    threads = config.num_threads or max(1, (os.cpu_count() or 1) // n)
    return [(replace(config, num_threads=threads, engines_on_node=n), {}) for _ in range(n)]


def visible_gpus() -> list[str]:
    """The GPUs this process may place engines on, as CUDA_VISIBLE_DEVICES names them (all, unset)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return [d.strip() for d in visible.split(",") if d.strip()] if visible else [str(i) for i in range(_cuda_count())]


def _cuda_count() -> int:
    from tokenflowd.config.platform import cuda_device_count

    return cuda_device_count()
