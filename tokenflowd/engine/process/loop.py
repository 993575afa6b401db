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
import threading
import time
from collections import deque
from dataclasses import replace
from typing import Callable

import msgspec
import torch

from tokenflowd import protocol as p
from tokenflowd.config import EngineConfig, PolicyConfig
from tokenflowd.engine.admission import QueueDelayExceeded
from tokenflowd.engine.core import EngineCore, EngineCoreOutput
from tokenflowd.engine.errors import EngineFailed
from tokenflowd.config.platform import die_with_parent
from tokenflowd.engine.process.endpoint import EngineEndpoint, SupervisorUnreachable
from tokenflowd.engine.request import InvalidRequestError, Request, SamplingParams
from tokenflowd.federation.store import Giver, Keeper
from tokenflowd.federation.transport import KVLayout
from tokenflowd.federation.streaming import Receiver, Sender, layout_of, target_of
from tokenflowd.federation.timing import horizon
from tokenflowd.kv.copier import CopierDead
from tokenflowd.kv.pages import chain_page_keys
from tokenflowd.pool.member import PoolMember
from tokenflowd.pool.names import cache_name
from tokenflowd.pool.shared_kv import SharedKV

log = logging.getLogger("tokenflowd.engine")


class EngineProcess(EngineEndpoint):
    def __init__(self, spec: p.EngineSpec) -> None:
        super().__init__(spec)
        self.config = msgspec.convert(spec.config, EngineConfig)
        self.shared_cache: SharedKV | None = None
        pooled = self.config.pool_mode != "off"
        # read mode: peers map this engine's cache, so it lives in shared memory
        read = self.config.pool_mode == "read"
        self.core = EngineCore.from_config(self.config, kv_memory=self._shared_cache if read else None)
        self.config = self.core.config  # as it runs: a fast path that failed its check is replaced
        self.core.warm_up()  # before READY: the first user request is as fast as the tenth
        self.core.pool.drain_key_events()  # start recording: the router learns every key from here on
        self.member: PoolMember | None = None
        self.places: dict[str, list[p.PrefixRun]] = {}  # request -> its new segments that belong on peers
        # (when, keys): segments their homes took, cached here until the homes have told the front
        self.placed: deque[tuple[float, list[bytes]]] = deque()
        self.prompt_tokens = 0  # of the requests taken (EngineStats), and of them those read where
        self.peer_tokens = self.own_pool_tokens = 0  # peers hold them, or from its own cache through the pool
        if pooled:
            self.core.lock = threading.Lock()
            runner = self.core.runner
            self.member = PoolMember(
                spec.engine_id, spec.incarnation, self.config.pool_mode, spec.runtime_dir, runner.attn,
                runner.kv_layers, self.core.pool, self.core.lock, self.config.max_num_batched_tokens)
            log.info("pool: %s mode, serving %d pages to peers", self.config.pool_mode, runner.num_pages)
            self.member.size_segments(self.config.pool_segment_tokens)
            runner.step_attention.append(self.member.step_attention)
        # federation/: the prefill role's, and the decode role's. A prefill or decode node's engine
        # has both: its front's role (daemon/api/federation.py) decides which orders come, and may change.
        self.sender: Sender | None = None
        self._links_at, self._links = -math.inf, {}  # the link figures last put in the stats (_link_figures)
        self.receiver: Receiver | None = None
        self.remote_outs: list[EngineCoreOutput] = []  # first tokens of requests whose KV came
        if self.config.role != "both":
            self._join_federation()

    def _join_federation(self) -> None:
        from tokenflowd.federation.transport import MooncakeTransport, port_reuse_warning

        # the transfer engine's own timeout bounds how long a write it gave up on can still land
        os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(max(1, math.ceil(self.config.kv_transfer_timeout))))
        transport = MooncakeTransport(self.config.kv_host)
        warning = port_reuse_warning()
        if warning:
            log.warning(warning)
        runner, core = self.core.runner, self.core
        self.sender = Sender(transport, runner.kv_cache, runner.attn.page_axis, self.config.page_size, core.pool)
        core.on_batch = self._plan_sends
        self.receiver = Receiver(transport, runner.kv_cache, runner.attn.page_axis)
        core.kv.remote_quarantine = horizon(self.config.kv_transfer_timeout)
        self.transport = transport
        layers, axis = runner.kv_layers, runner.attn.page_axis
        self.keeper = Keeper(core.pool, layers, axis)  # a reply's KV from a decode node (MemServe)
        self.keeper_layout = KVLayout.of(layers, axis)
        self.giver = Giver(transport, core.pool, layers, axis)
        self.giving: dict[str, int] = {}  # store -> the front to answer
        log.info("federation: %s node, KV transfer engine at %s", self.config.role, transport.endpoint)

    def _plan_sends(self, batch) -> None:
        self.core.runner.layer_hook = (self.sender.after_layer if self.sender.plan(batch, self.core.scheduler.requests)
                                       else None)

    def _shared_cache(self, shape: tuple[int, ...], dtype) -> torch.Tensor:
        """The KV cache in shared memory, where the pool's peers can map it (read mode)."""
        if self.shared_cache is not None:  # a runner built again (engine/self_check.py's fallback)
            self.shared_cache.close()
        name = cache_name(self.spec.runtime_dir, self.spec.engine_id, self.spec.incarnation)
        self.shared_cache = SharedKV.create(name, shape[0], shape[1:], dtype)
        return self.shared_cache.whole()

    def run(self) -> None:
        core = self.core
        self.send(p.Ready(self.spec.engine_id, self.spec.incarnation, os.getpid(), self.config.model,
                          core.max_model_len, self.config.page_size, self.config.device, self._stats(),
                          self.config.policy, msgspec.to_builtins(self.config.policy_params), core.fallback,
                          *self._pool_ready(),
                          kv_token_bytes=KVLayout.of(core.runner.kv_layers, core.runner.attn.page_axis).token_bytes,
                          kv_endpoint=self.transport.endpoint if self.config.role != "both" else ""))
        heartbeat_ms = int(self.spec.heartbeat_interval * 1000)
        last_sent = time.monotonic()
        trimmed = True  # nothing freed since the heap was last handed back
        with core.lock or contextlib.nullcontext():  # let go of only while waiting (core.py `unlocked`)
            self._loop(heartbeat_ms, last_sent, trimmed)
        if self.member is not None:
            self.member.close()
        if self.config.role != "both":
            self.transport.close()  # waits for the writes in flight, then unregisters the cache
        core.close()
        if self.shared_cache is not None:
            self.shared_cache.close()
        self.close()

    def _pool_ready(self) -> tuple[int, int, int]:
        """Ready's pool fields: the segment size and what dispatch weighs (0s: the pool is off)."""
        if self.member is None:
            return 0, 0, 0
        return self.member.segment_pages, *self.member.traffic_bytes()

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
            if busy and self._only_awaiting_kv():  # nothing to compute until a prefill node's KV lands
                busy, idle_ms = False, 2
            elif (self.sender is not None and self.sender.out) or (self.config.role != "both" and self.giver.given):
                # writes to settle and answer soon
                idle_ms = min(idle_ms, 1)
            with core.unlocked():
                polled = self.inbox.poll(0 if busy else 1 if copying else idle_ms)
            if polled:
                self.drain_inbox()
            deltas = self.take_rejected()
            if self.sender is not None or self.receiver is not None:
                deltas += self._federation_outputs()
            if self.member is not None:
                core.scheduler.pool_share = self.member.measure_share(time.monotonic())
            if core.has_unfinished():
                outs = core.step()
                if self.sender is not None:
                    for out in outs:
                        self.sender.output(out.request_id, out.new_token_ids, out.finished, out.error,
                                           out.num_cached_tokens)
                deltas += [_delta(out) for out in outs]
            elif copying or core.kv.num_remote_pending:  # (pages held for a sender come free on time, idle too)
                core.scheduler.poll_copies()
            settled = copying and not core.copies_in_flight()  # the pages they pinned are free: say so
            now = time.monotonic()
            deltas = self.pace(deltas, now)
            if self.must_report(deltas, now, last_sent) or settled:
                added, removed = core.pool.drain_key_events()
                self.send_step(now, deltas, self._stats(), added, removed)
                last_sent = now
            if self.member is not None:
                self._sweep_pins()
                if self.places:
                    self._place()
                self._unpublish_placed(now)
            if self.orphaned(log):
                break

    def _only_awaiting_kv(self) -> bool:
        """Nothing can run until a prefill node's KV lands: no request is running, and the last step
        scheduled nothing (those waiting wait for pages the reservations hold)."""
        sched = self.core.scheduler
        return (self.receiver is not None and self.receiver.waiting and not sched.running
                and not len(self.core.last_batch) and not self.core.copies_in_flight())

    def _federation_outputs(self) -> list[p.Delta]:
        """Prefill role: answers for the requests whose KV writes settled. Decode role: the first
        tokens of requests whose KV is in place (checked), and transfers given up."""
        now = time.monotonic()
        if self.sender is not None:
            for front, answer in self.sender.poll(self.spec.engine_id, self.spec.incarnation):
                self.reply(answer.request_id, answer, front)
        for sid, ok, crc, n in self.giver.poll() if self.config.role != "both" else ():
            self.reply(sid, p.Prefilled(self.spec.engine_id, self.spec.incarnation, sid, ok, checksum=crc,
                                        num_pages=n), self.giving.pop(sid, 0))
        if self.config.role != "both":
            self.keeper.poll(now)
        outs, self.remote_outs = self.remote_outs, []
        if self.receiver is not None:
            outs += self.receiver.poll(self.core, now)
        return [_delta(out) for out in outs]

    def store(self, msg: p.KeepKV | p.KeptKV | p.GiveKV) -> None:
        if self.config.role == "both":
            return
        try:
            self._store(msg)
        except Exception as e:  # a bad order costs the order, never the engine
            log.exception("federation: a store message failed")
            if not isinstance(msg, p.KeptKV):
                answer = (p.Reserved(self.spec.engine_id, self.spec.incarnation, msg.store_id, error=str(e))
                          if isinstance(msg, p.KeepKV) else
                          p.Prefilled(self.spec.engine_id, self.spec.incarnation, msg.store_id, False, error=str(e)))
                self.reply(msg.store_id, answer, msg.front)

    def _store(self, msg: p.KeepKV | p.KeptKV | p.GiveKV) -> None:
        if isinstance(msg, p.KeptKV):
            self.keeper.done(msg.store_id, msg.ok, msg.checksum, msg.num_pages, time.monotonic(), msg.unwritten)
            return
        if any(not 0 <= t < self.core.vocab_size for t in msg.token_ids):
            raise ValueError(f"token ids must be in [0, {self.core.vocab_size})")
        if isinstance(msg, p.GiveKV) and time.monotonic() > msg.deadline:
            raise ValueError("the keeper's deadline for this store has passed")
        keys = chain_page_keys(msg.token_ids, self.config.page_size, [])
        engine, incarnation = self.spec.engine_id, self.spec.incarnation
        if isinstance(msg, p.KeepKV):
            until = time.monotonic() + horizon(self.config.kv_transfer_timeout)
            try:
                held, pages = self.keeper.reserve(msg.store_id, keys, until)
            except ValueError as e:
                self.reply(msg.store_id, p.Reserved(engine, incarnation, msg.store_id, error=str(e)), msg.front)
                return
            target = target_of(self.transport.endpoint, self.keeper_layout, pages) if pages else None
            self.reply(msg.store_id, p.Reserved(engine, incarnation, msg.store_id, target, held=held), msg.front)
            return
        try:
            sent = self.giver.give(msg.store_id, keys[msg.held:], msg.target.endpoint, layout_of(msg.target),
                                   msg.target.pages)
        except ValueError as e:  # refused before any write
            self.reply(msg.store_id, p.Prefilled(engine, incarnation, msg.store_id, False, error=str(e),
                                                 unwritten=True), msg.front)
            return
        if sent:
            self.giving[msg.store_id] = msg.front
        else:  # its cache no longer holds them: nothing written
            self.reply(msg.store_id, p.Prefilled(engine, incarnation, msg.store_id, False, unwritten=True,
                                                 error="the pages are no longer cached here"), msg.front)

    def remote_arrived(self, msg: p.RemoteArrived) -> None:
        if self.receiver is None:
            return
        out = self.receiver.arrived(self.core, msg, time.monotonic())
        if out is not None:
            self.remote_outs.append(out)

    def _sweep_pins(self) -> None:
        """Unpin the foreign prefixes of requests that ended or recompute theirs."""
        member, reqs = self.member, self.core.scheduler.requests
        if any(rid not in reqs or not reqs[rid].foreign_token_ids for rid in member.foreign):
            reading = {rid for rid, r in reqs.items() if r.foreign_token_ids}
            with self.core.unlocked():
                member.sweep(reading)

    def _place(self) -> None:
        """Put the new segments of requests whose prompts are computed at their homes; what a home
        took stops being cached here once the home's report has reached the front (two heartbeats:
        until then the front would find it nowhere). The rest stays: a home gone or full."""
        reqs = self.core.scheduler.requests
        for rid in list(self.places):
            req = reqs.get(rid)
            if req is not None and req.num_computed_tokens < req.num_prompt_tokens:
                continue  # (a request gone has published what it computed)
            for run in self.places.pop(rid):
                try:
                    self._put(run)
                except Exception:  # a placement that fails costs a copy, never the engine
                    log.exception("pool: placing a segment on engine %d failed; it stays here", run.engine)

    def _put(self, run: p.PrefixRun) -> None:
        pages = self.core.pool.lookup(run.keys)
        if not pages:
            return
        keys = run.keys[: len(pages)]
        kv = self.member.stage(pages)
        with self.core.unlocked():
            held = self.member.put(run.engine, keys, kv)
        if held:
            self.placed.append((time.monotonic() + 2 * self.spec.heartbeat_interval, keys[:held]))

    def _unpublish_placed(self, now: float) -> None:
        while self.placed and self.placed[0][0] <= now:
            self.core.pool.unpublish(self.placed.popleft()[1])

    def pool_peers(self, msg: p.PoolPeers) -> None:
        if self.member is None:
            return
        with self.core.unlocked():
            lost = self.member.set_peers(msg.peers)
        for rid in lost:
            req = self.core.scheduler.requests.get(rid)
            if req is not None:
                self.core.scheduler.take_foreign_prefix(req)
        if lost:
            log.warning("pool: a peer is gone; %d requests recompute their prefix here", len(lost))

    def abort(self, request_id: str) -> None:
        self.core.abort(request_id)
        if self.sender is not None:
            self.sender.gone(request_id)

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
                                    s.stop_token_ids, s.ignore_eos, s.min_tokens)
            req = Request(msg.request_id, msg.prompt_token_ids, params, arrival_time=msg.arrival_time,
                          reading_rate=msg.reading_rate, priority=msg.priority)
        except (InvalidRequestError, ValueError) as e:
            return str(e)
        if msg.request_id in self.core.scheduler.requests:
            return f"request id {msg.request_id!r} is already in use"
        if msg.kv_target is not None or msg.remote_kv:
            return self._add_federated(msg, req)
        pinned = self._take_prefix(req, msg.prefix)
        try:
            self.core.add_request(req)
        except QueueDelayExceeded as e:
            self._release_pins(msg.request_id, pinned)
            self.shed(msg.request_id, str(e), e.retry_after)
            return None
        except (InvalidRequestError, ValueError) as e:
            self._release_pins(msg.request_id, pinned)
            return str(e)
        self.prompt_tokens += len(msg.prompt_token_ids)
        if msg.place and self.member is not None:
            self.places[msg.request_id] = msg.place
        if pinned:
            peer, own = self.member.count(msg.request_id)
            self.peer_tokens += peer * self.config.page_size
            self.own_pool_tokens += own * self.config.page_size
        return None

    def _add_federated(self, msg: p.AddRequest, req: Request) -> str | None:
        """A prefill node's request (its KV goes to msg.kv_target), or a decode node's (its KV comes
        from a prefill node: Reserved says where, or that there is no room and it runs here)."""
        rid = msg.request_id
        if msg.kv_target is not None:
            if self.sender is None:
                return "this node does not prefill for others: start it with --role prefill"
            error = self.sender.add(rid, msg.kv_target, len(msg.prompt_token_ids), msg.front,
                                    msg.kv_deadline or math.inf)
            if error is None:
                try:
                    self.core.add_request(req)
                except QueueDelayExceeded as e:
                    self.sender.out.pop(rid)
                    self.shed(rid, str(e), e.retry_after)
                    return None
                except (InvalidRequestError, ValueError) as e:
                    error = str(e)
                    self.sender.out.pop(rid)
            if error is None:
                self.sender.out[rid].preemptions = req.num_preemptions
                self.prompt_tokens += len(msg.prompt_token_ids)
            return error
        if self.receiver is None:
            self.reply(rid, p.Reserved(self.spec.engine_id, self.spec.incarnation, rid,
                                       error="this node takes no KV from others: start it with --role decode"))
            return "this node takes no KV from others: start it with --role decode"
        try:
            target = self.receiver.reserve(self.core, req)
            if target is None:  # no room, no seat, or past --max-queue-delay: a local request, queued or shed
                self.core.add_request(req)
        except QueueDelayExceeded as e:
            self.reply(rid, p.Reserved(self.spec.engine_id, self.spec.incarnation, rid, error=str(e)))
            self.shed(rid, str(e), e.retry_after)
            return None
        except (InvalidRequestError, ValueError) as e:
            self.reply(rid, p.Reserved(self.spec.engine_id, self.spec.incarnation, rid, error=str(e)))
            return str(e)
        self.prompt_tokens += len(msg.prompt_token_ids)
        self.reply(rid, p.Reserved(self.spec.engine_id, self.spec.incarnation, rid, target))
        return None

    def _take_prefix(self, req: Request, runs: list[p.PrefixRun]) -> bool:
        """Pin the prompt's leading pages where the pool holds them; the request keeps the rest.
        -> whether it pinned any (for this request: what a failed add releases)."""
        if self.member is None or not runs:
            return False
        ps = self.config.page_size
        with self.core.unlocked():
            pages = self.member.pin(req.request_id, runs)
        if not pages:
            return False
        if pages * ps > req.num_prompt_tokens - 1:  # the last prompt token is always computed here
            self._release_pins(req.request_id, True)
            return False
        keys = [k for run in runs for k in run.keys]
        req.set_foreign_prefix(pages * ps, keys[pages - 1])
        return True

    def _release_pins(self, request_id: str, pinned: bool) -> None:
        if pinned:
            with self.core.unlocked():
                self.member.release(request_id)

    def infos(self, request_ids: list[str] | None) -> list[p.RequestInfo]:
        reqs = self.core.scheduler.requests
        chosen = reqs.values() if request_ids is None else [reqs[r] for r in request_ids if r in reqs]
        now = time.monotonic()
        return [
            p.RequestInfo(
                r.request_id, r.status.value, r.buffer.reading_rate, r.priority, r.arrival_time,
                r.first_token_time, r.prefix_offset + r.num_prompt_tokens, r.num_output_tokens,
                r.prefix_offset + r.num_computed_tokens, r.prefix_offset + r.num_cached_tokens, r.num_preemptions,
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
            prompt_tokens=self.prompt_tokens, hit_tokens=kv.stats.hit_tokens + self.own_pool_tokens,
            peer_tokens=self.peer_tokens, kv_remote_pages=kv.num_remote_pending,
            step_base=cost.base, step_per_token=cost.per_token,
            waiting_tokens=sum(r.num_prompt_tokens - r.num_computed_tokens for r in queued),
            **self._link_figures(),
            **(self._pool_stats() if self.member is not None else {}),
        )

    LINK_REFRESH = 0.25  # s: the link figures sort their recent transfers; the conductor polls this often

    def _link_figures(self) -> dict:
        """kv_links and kv_egress for the stats, computed at most every LINK_REFRESH s:
        the stats go out with nearly every step, and a layer-wise prefill ends dozens of writes a
        step, so computing them each time would sort hundreds of intervals on the step loop."""
        if self.receiver is None:
            return {}
        now = time.monotonic()
        if now - self._links_at >= self.LINK_REFRESH:
            self._links_at = now
            self._links = dict(kv_links=self.transport.bandwidths(), kv_egress=self.transport.egress_bandwidth())
        return self._links

    def _pool_stats(self) -> dict:
        m = self.member.stats
        return dict(pool_queries=m["query_calls"], pool_query_bytes=m["query_bytes"],
                    pool_query_seconds=m["query_seconds"], pool_pins=self.member.service.pinned_pages,
                    pool_put_pages=m["put_pages"], pool_stored_pages=m["stored_pages"],
                    pool_share=self.member.share)


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to hand back this way
        return None


_MALLOC_TRIM = _malloc_trim()


def trim_heap() -> None:
    """Hand the heap's free memory back to the OS when the engine goes idle.

    NOTE: glibc keeps what a process frees in its heap and thread arenas: the model load's
    dequantization buffers and the CPU tensors of steps of ever-changing shapes. On the embedded
    model the first trim hands back ~55 MiB of the engine's ~720 MiB. malloc_trim(0) on the way
    to idle (well under a millisecond here; never on a busy engine) keeps RSS what is in use."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _delta(out: EngineCoreOutput) -> p.Delta:
    return p.Delta(
        out.request_id, out.new_token_ids, out.finish_reason.value if out.finish_reason else None, out.error,
        num_cached_tokens=out.num_cached_tokens, num_preemptions=out.num_preemptions,
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

