"""One engine as the front sees it: its state, the socket requests go in by, and the streams it
serves. Nothing here knows how the engine runs: a local process (launcher.py) today, an engine
on another node (with another transport) later.

    handle.open(ctx, address)    a fresh input socket for a new incarnation
    handle.send(bytes)           never blocks; False when no engine takes it
    handle.deliver(delta)        an engine's output to its stream's callback, in order
    handle.fail_streams(msg)     the engine went away: every open stream ends with an error
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import zmq

from tokenflowd import protocol as p
from tokenflowd.config import EngineConfig

log = logging.getLogger("tokenflowd.daemon.supervisor")


@dataclass(eq=False)
class Stream:
    """One request's channel from its engine to its HTTP handler: `on_delta` is called in the
    supervisor's loop with each delta, in order, the last one with finish_reason set (the
    engine's, or "error" when the engine died). A callback, not a queue: the handler can act on
    a token without a task switch (see daemon/api/generation.py)."""

    request_id: str
    engine: EngineHandle
    num_prompt_tokens: int
    on_delta: Callable[[p.Delta], None]
    add: p.AddRequest | None = None  # as sent (the pool: to name its reads again, or send it elsewhere, while it waits)
    started: bool = False  # a token or the end has arrived: no longer counted as waiting
    keys: list[bytes] | None = None  # the pool: its prompt's page keys, once an idle engine's steal weighed it
    finished: bool = False


@dataclass(eq=False)
class EngineHandle:
    engine_id: int
    config: EngineConfig
    env: dict[str, str]  # what its process runs with (the GPU it gets)
    incarnation: int = 0
    state: str = "starting"  # starting | ready | backoff | stopped
    pid: int | None = None  # while its process runs (None: not started, or exited; the launcher's to set)
    inbox: zmq.Socket | None = None
    info: p.Ready | None = None
    stats: p.EngineStats | None = None
    streams: dict[str, Stream] = field(default_factory=dict)
    num_waiting: int = 0  # streams sent here without a first token yet
    last_heard: float = 0.0
    started_at: float = 0.0
    num_restarts: int = 0
    consecutive_failures: int = 0
    last_failure: str | None = None  # why its engine last went away
    policy_params: dict = field(default_factory=dict)  # what it reported scheduling with (Ready, Reconfigured)
    preemptions_before: int = 0  # preemptions of earlier incarnations, so the counter never goes back

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def load(self) -> int:
        """Requests it holds, running or queued, as this process knows them (no reporting lag)."""
        return len(self.streams)

    @property
    def work(self) -> int:
        """The prompt tokens of the requests it holds (the pool's router balances by it)."""
        return sum(s.num_prompt_tokens for s in self.streams.values())

    @property
    def num_preemptions(self) -> int:
        return self.preemptions_before + (self.stats.num_preemptions if self.stats else 0)

    def open(self, ctx: zmq.Context, address: str, incarnation: int | None = None) -> None:
        """A new incarnation (the next, or `incarnation`): connect to its input socket, which its engine
        binds. Plain PUSH, no high-water mark: a send never blocks, and what is sent before the engine
        binds waits for it (a new incarnation's address is new: nothing reaches a successor by mistake)."""
        self.incarnation = self.incarnation + 1 if incarnation is None else incarnation
        self.state = "starting"
        self.info = self.stats = None
        if self.inbox is not None:
            self.inbox.close(linger=0)
        self.inbox = ctx.socket(zmq.PUSH)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.inbox.setsockopt(zmq.SNDHWM, 0)
        self.inbox.connect(address)

    def send(self, raw: bytes) -> bool:
        """False when the handle has no socket (its engine is gone); else queued for the engine."""
        if self.inbox is None:
            return False
        try:
            self.inbox.send(raw, zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def deliver(self, delta: p.Delta) -> bool:
        """-> whether the delta started its stream (its first token, or its end before one)."""
        stream = self.streams.get(delta.request_id)
        if stream is None:
            return False  # aborted here already
        started = not stream.started and bool(delta.token_ids or delta.finish_reason)
        if started:
            stream.started = True
            self.num_waiting -= 1
        if delta.finish_reason is not None:
            stream.finished = True
            del self.streams[delta.request_id]
        try:
            stream.on_delta(delta)
        except Exception:  # one handler's fault must not cost the other streams their tokens
            log.exception("request %s: its handler failed on a delta", delta.request_id)
        return started

    def fail_streams(self, message: str) -> None:
        for stream in list(self.streams.values()):
            self.deliver(p.Delta(stream.request_id, [], "error", message))

    def retire(self) -> None:
        """Its engine is gone: keep its preemption count, close its socket."""
        if self.stats is not None:
            self.preemptions_before += self.stats.num_preemptions
        self.stats = None
        if self.inbox is not None:
            self.inbox.close(linger=0)
            self.inbox = None
