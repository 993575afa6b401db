"""One engine process: an EngineCore driven by messages from the supervisor over zmq.

    python -m tokenflowd.engine.process '<EngineSpec as JSON>'

The loop, one iteration per model step:

    inputs (non-blocking while work is queued; else wait up to the heartbeat interval)
      → add / abort / set rate / query
      → core.step()
      → one StepOutputs message: every request's new tokens, the engine's counters, and the
        prefix-cache keys published and evicted since the last message (the router's index)

An idle engine still sends a StepOutputs (no deltas) every heartbeat interval: that is its
heartbeat. It exits on Shutdown, or when its parent process goes away (the kernel's parent-death
signal, and a check every loop).
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import math
import os
import sys
import time
from dataclasses import replace
from typing import Callable, Container

import msgspec

from tokenflowd import protocol as p
from tokenflowd.config import EngineConfig, PolicyConfig
from tokenflowd.config.platform import die_with_parent, mps_pipe_directory
from tokenflowd.engine.admission import QueueDelayExceeded
from tokenflowd.engine.core import EngineCore, EngineCoreOutput
from tokenflowd.engine.errors import EngineFailed
from tokenflowd.engine.process.endpoint import EngineEndpoint, SupervisorUnreachable
from tokenflowd.engine.request import InvalidRequestError, Request, SamplingParams
from tokenflowd.federation.engine_hooks import FederationHooks, kv_token_bytes
from tokenflowd.kv.copier import CopierDead
from tokenflowd.pool.engine_hooks import PoolHooks

log = logging.getLogger("tokenflowd.engine")

# ms a stalled engine (requests wait, its last step ran nothing) waits between steps: room comes
# free by a message, a copy landing or a peer unpinning, and spinning meanwhile takes the CPU a
# peer engine on the same cores would use (seen: two stalled engines at 85% CPU each)
STALLED_POLL_MS = 5


class EngineProcess(EngineEndpoint):
    """The engine's loop, with the pool's and the federation's hooks where they are on: the only
    place that wires them into an engine."""

    def __init__(self, spec: p.EngineSpec) -> None:
        super().__init__(spec)
        self.config = msgspec.convert(spec.config, EngineConfig)
        self.pool = PoolHooks(spec, self.config) if self.config.pool_mode != "off" else None
        self.core = EngineCore.from_config(self.config, kv_memory=self.pool.kv_memory if self.pool else None)
        self.config = self.core.config  # as it runs: a fast path that failed its check is replaced
        if self.core.overlap and (self.pool is not None or self.config.role != "both"):
            # NOTE: the pool's per-step attention wrappers and the federation's per-batch sends and
            # per-layer hook read a step's batch as it runs; they are not written for a step in flight.
            log.info("overlap scheduling: off, as the %s hooks run on each step",
                     "pool's" if self.pool is not None else "federation's")
            self.core.overlap = False
        self.core.warm_up()  # before READY: the first user request is as fast as the tenth
        self.core.pool.drain_key_events()  # start recording: the router learns every key from here on
        self.prompt_tokens = 0  # of the requests taken (EngineStats)
        if self.pool is not None:
            self.pool.join(self.core)
            if self.config.pool_placement == "home":  # (the router names requests to compute prefixes)
                self.core.on_batch.append(self._tell_computing)
        self.federation = (FederationHooks(spec, self.config, self.core, self) if self.config.role != "both"
                           else None)

    def _tell_computing(self, batch) -> None:
        """Before a step runs: the fronts hear which requests' prompts it begins (protocol.Computing)."""
        fronts: dict[int, list[str]] = {}
        for rid in self.pool.began(batch):
            fronts.setdefault(self.request_front.get(rid, 0), []).append(rid)
        for front, rids in fronts.items():
            self.reply(rids[0], p.Computing(self.spec.engine_id, self.spec.incarnation, rids), front)

    def run(self) -> None:
        core = self.core
        self.send(p.Ready(self.spec.engine_id, self.spec.incarnation, os.getpid(), self.config.model,
                          core.max_model_len, self.config.page_size, self.config.device, self._stats(),
                          self.config.policy, msgspec.to_builtins(self.config.policy_params), core.fallback,
                          *(self.pool.ready_fields() if self.pool is not None else (0, 0, 0)),
                          kv_token_bytes=kv_token_bytes(core),
                          kv_endpoint=self.federation.transport.endpoint if self.federation is not None else "",
                          attention=core.runner.paths.describe(self.config.device),
                          cuda_graphs=core.runner.graphs is not None, overlap=core.overlap,
                          attention_note=core.attention_note,
                          mps=mps_pipe_directory() if self.config.device.startswith("cuda") else ""))
        heartbeat_ms = int(self.spec.heartbeat_interval * 1000)
        last_sent = time.monotonic()
        trimmed = True  # nothing freed since the heap was last handed back
        with core.lock or contextlib.nullcontext():  # let go of only while waiting (core.py `unlocked`)
            self._loop(heartbeat_ms, last_sent, trimmed)
        if self.pool is not None:
            self.pool.close()
        if self.federation is not None:
            self.federation.close()
        core.close()
        if self.pool is not None:
            self.pool.release_memory()
        self.close()

    def _loop(self, heartbeat_ms: int, last_sent: float, trimmed: bool) -> None:
        core = self.core
        while self.running:
            busy = core.has_unfinished()
            if busy:
                trimmed = False
            elif not trimmed:
                trim_heap()
                trimmed = True
            copying = core.copies_in_flight()  # they pin KV pages: account for them soon, even idle
            idle_ms = heartbeat_ms
            if not busy and not copying:  # wake for held tokens that come due (engine/process/pacing.py)
                now = time.monotonic()
                idle_ms = math.ceil(self.wait_until(now + self.spec.heartbeat_interval, now) * 1000)
            fed = self.federation
            if busy and fed is not None and fed.only_awaiting_kv():  # nothing to run until a prefill node's KV lands
                busy, idle_ms = False, 2
            elif fed is not None and fed.has_writes():  # writes to settle and answer soon
                idle_ms = min(idle_ms, 1)
            if busy and core.stalled():  # admission is blocked: wait a little for what can free room
                busy, idle_ms = False, STALLED_POLL_MS
            with core.unlocked():
                polled = self.inbox.poll(0 if busy else 1 if copying else idle_ms)
            if polled:
                self.drain_inbox()
            deltas = self.take_rejected()
            if fed is not None:
                deltas += [_delta(out) for out in fed.outputs()]
            if self.pool is not None:
                self.pool.before_step()
                for rid in self.pool.take_asking():  # where are their reads now? (answered: pool_reads)
                    self.reply(rid, p.ResolveReads(self.spec.engine_id, self.spec.incarnation, rid))
            if core.has_unfinished():
                outs = core.step()
                if fed is not None:
                    fed.stepped(outs)
                deltas += [_delta(out) for out in outs]
            elif copying or core.kv.num_remote_pending:  # (pages held for a sender come free on time, idle too)
                core.scheduler.poll_copies()
            settled = copying and not core.copies_in_flight()  # the pages they pinned are free: say so
            now = time.monotonic()
            deltas = self.pace(deltas, now)
            last_sent = self.report_step(now, deltas, settled, last_sent)
            if self.orphaned(log):
                break

    def report_step(self, now: float, deltas: list[p.Delta], settled: bool, last_sent: float) -> float:
        """After a step: its message when there is something to say (`deltas`, copies `settled`) or
        the heartbeat is due; then the pool's work between steps, and at once a second message if
        segments went to their homes: this cache let go of them (PoolHooks._hand_off). -> when the
        last message went."""
        if self.must_report(deltas, now, last_sent) or settled:
            self.report(now, deltas)
            last_sent = now
        if self.pool is not None:
            self.pool.after_step(now)
            moved, readers = self.pool.take_moved()
            if moved:
                self.report(now, [], moved, readers)
                last_sent = now
        return last_sent

    def report(self, now: float, deltas: list[p.Delta], moved: list[p.PrefixRun] | None = None,
               readers: list[int] | None = None) -> None:
        """A step message: `deltas`, the prefix cache's key events since the last one, and the
        segments written into their homes since (`moved`), with the peers that read them here."""
        added, removed = self.core.pool.drain_key_events()
        if self.pool is not None:
            self.pool.evicted(removed)
        self.send_step(now, deltas, self._stats(), added, removed, moved, readers)

    def store(self, msg: p.KeepKV | p.KeptKV | p.GiveKV) -> None:
        if self.federation is not None:
            self.federation.store(msg)

    def remote_arrived(self, msg: p.RemoteArrived) -> None:
        if self.federation is not None:
            self.federation.remote_arrived(msg)

    def pool_peers(self, msg: p.PoolPeers) -> None:
        if self.pool is not None:
            self.pool.set_peers(msg)

    def pool_reads(self, msg: p.Reads) -> None:
        if self.pool is not None:
            self.pool.reads(msg)

    def pool_moved(self, msg: p.Moved) -> None:
        if self.pool is not None:
            self.pool.follow(msg)

    def withdraw(self, front: int, keep: Container[str] = ()) -> list[str]:
        if self.pool is None or self.federation is not None:
            return []
        req = self.pool.withdrawable(lambda rid: self.request_front.get(rid, 0) == front and rid not in keep)
        if req is None:
            return []
        self.core.abort(req.request_id)
        self.pool.withdrawn(req.request_id)
        self.prompt_tokens -= req.num_prompt_tokens  # counted where it runs
        return [req.request_id]

    def chain_ends(self, msg: p.ChainEnds) -> None:
        self.core.pool.set_inner(msg.inner, True)
        self.core.pool.set_inner(msg.ends, False)

    def abort(self, request_id: str) -> None:
        self.core.abort(request_id)
        if self.federation is not None:
            self.federation.gone(request_id)

    def cached_keys(self) -> list[bytes]:
        return self.core.pool.cached_keys()

    def reconfigure(self, msg: p.Reconfigure) -> dict:
        super().reconfigure(msg)
        params = msgspec.convert(msg.policy_params, PolicyConfig)
        self.config = replace(self.config, policy_params=params)
        self.core.scheduler.policy.set_params(params)
        log.info("policy %s parameters reloaded: %s", self.config.policy, msg.policy_params)
        return msgspec.to_builtins(params)

    def set_reading_rate(self, msg: p.SetReadingRate) -> None:
        self.core.set_reading_rate(msg.request_id, msg.reading_rate, msg.time)

    def set_read_cursor(self, msg: p.SetReadCursor) -> None:
        self.core.set_read_cursor(msg.request_id, msg.num_read, msg.time)

    def add(self, msg: p.AddRequest) -> str | None:
        s = msg.sampling
        try:
            params = SamplingParams(s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, (),
                                    s.stop_token_ids, s.ignore_eos, s.min_tokens, s.presence_penalty,
                                    s.frequency_penalty, s.repetition_penalty,
                                    s.logprobs if s.logprobs >= 0 else None, s.grammar)
            req = Request(msg.request_id, msg.prompt_token_ids, params, arrival_time=msg.arrival_time,
                          reading_rate=msg.reading_rate, priority=msg.priority)
        except (InvalidRequestError, ValueError) as e:
            return str(e)
        if msg.request_id in self.core.scheduler.requests:
            return f"request id {msg.request_id!r} is already in use"
        if msg.kv_target is not None or msg.remote_kv:
            return self._add_federated(msg, req)
        pinned = self.pool.take_prefix(req, msg.prefix, msg.copy, msg.pending) if self.pool is not None else False
        try:
            self.core.add_request(req, msg.after or None)
        except QueueDelayExceeded as e:
            self._release_pins(msg.request_id, pinned)
            self.shed(msg.request_id, str(e), e.retry_after)
            return None
        except (InvalidRequestError, ValueError) as e:
            self._release_pins(msg.request_id, pinned)
            return str(e)
        self.prompt_tokens += len(msg.prompt_token_ids)
        if self.pool is not None:
            self.pool.added(msg, pinned)
        return None

    def _release_pins(self, request_id: str, pinned: bool) -> None:
        if self.pool is not None:
            self.pool.release_pins(request_id, pinned)

    def _add_federated(self, msg: p.AddRequest, req: Request) -> str | None:
        """A request whose KV goes to another node (msg.kv_target) or comes from one (remote_kv)."""
        rid = msg.request_id
        if self.federation is None:
            if msg.kv_target is not None:
                return "this node does not prefill for others: start it with --role prefill"
            error = "this node takes no KV from others: start it with --role decode"
            self.reply(rid, p.Reserved(self.spec.engine_id, self.spec.incarnation, rid, error=error))
            return error
        error, taken = self.federation.add(msg, req)
        if taken:
            self.prompt_tokens += len(msg.prompt_token_ids)
        return error

    def infos(self, request_ids: list[str] | None) -> list[p.RequestInfo]:
        reqs = self.core.scheduler.requests
        chosen = reqs.values() if request_ids is None else [reqs[r] for r in request_ids if r in reqs]
        now = time.monotonic()
        return [
            p.RequestInfo(
                r.request_id, r.status.value, r.buffer.reading_rate, r.priority, r.arrival_time,
                r.first_token_time, r.prefix_offset + r.num_prompt_tokens, r.num_output_tokens,
                r.prefix_offset + r.num_computed_tokens, r.prompt_cached_tokens, r.num_preemptions,
                r.buffer.buffer(now), r.buffer.stall_time_at(now), r.buffer.num_stalls,
                len(self.core.kv.block_table(r)),
            )
            for r in chosen
        ]

    def _stats(self) -> p.EngineStats:
        sched, pool, kv = self.core.scheduler, self.core.pool, self.core.kv
        host = kv.host.pool
        cost = sched.cost
        queued = [r for r in sched.waiting] + [r for r in sched.running if r.num_computed_tokens < r.num_prompt_tokens]
        return p.EngineStats(
            num_running=len(sched.running), num_waiting=len(sched.waiting),
            kv_pages_used=pool.num_used, kv_pages_cached=pool.num_cached,
            kv_pages_total=pool.num_pages, num_preemptions=sched.num_preemptions,
            num_steps=self.core.stats.num_steps, last_step_time=self.core.stats.last_step_time,
            host_kv_pages_used=host.num_used, host_kv_pages_cached=host.num_cached,
            host_kv_pages_total=kv.host.num_pages,
            kv_pages_written=kv.stats.pages_written, kv_pages_loaded=kv.stats.pages_loaded,
            num_shed=self.core.admission.num_shed if self.core.admission else 0,
            prompt_tokens=self.prompt_tokens,
            hit_tokens=kv.stats.hit_tokens + (self.pool.own_tokens if self.pool is not None else 0),
            peer_tokens=self.pool.peer_tokens if self.pool is not None else 0, kv_remote_pages=kv.num_remote_pending,
            step_base=cost.base, step_per_token=cost.per_token,
            waiting_tokens=sum(r.num_prompt_tokens - r.num_computed_tokens for r in queued),
            **(self.federation.link_figures() if self.federation is not None else {}),
            **(self.pool.stats() if self.pool is not None else {}),
        )


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to hand back this way
        return None


_MALLOC_TRIM = _malloc_trim()


def trim_heap() -> None:
    """Hand the heap's free memory back to the OS when the engine goes idle.

    NOTE: glibc keeps what a process frees in its heap and thread arenas: the model load's
    dequantization buffers and the CPU tensors of steps of ever-changing shapes. malloc_trim(0) on
    the way to idle (cheap, and never on a busy engine) keeps RSS what is in use
    (bench/results/code_figures.md)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _delta(out: EngineCoreOutput) -> p.Delta:
    return p.Delta(
        out.request_id, out.new_token_ids, out.finish_reason.value if out.finish_reason else None, out.error,
        num_cached_tokens=out.num_cached_tokens, num_preemptions=out.num_preemptions, logprobs=out.logprobs,
    )


def main(argv: list[str] | None = None) -> int:
    die_with_parent()  # before the model loads: a supervisor gone meanwhile ends us, not a GPU held for good
    argv = sys.argv[1:] if argv is None else argv
    spec = msgspec.json.decode(argv[0], type=p.EngineSpec)
    logging.basicConfig(level=os.environ.get("TOKENFLOWD_LOG_LEVEL", "WARNING").upper(),
                        format=f"%(asctime)s %(levelname)s engine{spec.engine_id}: %(message)s")
    try:
        EngineProcess(spec).run()
    except SupervisorUnreachable as e:
        log.error("%s; engine %d exits", e, spec.engine_id)
        return 3
    except (EngineFailed, CopierDead) as e:  # the supervisor fails its streams and starts a fresh engine
        log.error("%s; engine %d exits", e, spec.engine_id)
        return 4
    return 0

