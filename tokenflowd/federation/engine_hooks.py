"""The federation's part of an engine process (engine/process/loop.py calls it on a prefill or
decode node; a node of role `both` has none).

A prefill or decode node's engine has both roles' parts: its front's role (daemon/api/federation.py)
decides which orders come, and may change.
    prefill:  a request whose KV goes to another node (Sender): each layer written as it ends, the
              answer sent once the writes settle; a store's giver (Giver)
    decode:   a request whose KV comes from another node (Receiver): pages reserved, the first
              token checked once the KV is in place; a store's keeper (Keeper, MemServe's return)
"""
from __future__ import annotations

import logging
import math
import os
import time
from typing import Protocol

from tokenflowd import protocol as p
from tokenflowd.config import EngineConfig
from tokenflowd.engine.admission import QueueDelayExceeded
from tokenflowd.engine.core import EngineCore, EngineCoreOutput
from tokenflowd.engine.request import InvalidRequestError, Request
from tokenflowd.federation.store import Giver, Keeper
from tokenflowd.federation.streaming import Receiver, Sender, layout_of, target_of
from tokenflowd.federation.timing import horizon
from tokenflowd.federation.transport import KVLayout, MooncakeTransport, port_reuse_warning
from tokenflowd.kv.pages import chain_page_keys

log = logging.getLogger("tokenflowd.engine")

LINK_REFRESH = 0.25  # s: the link figures sort their recent transfers; the conductor polls this often


def kv_token_bytes(core: EngineCore) -> int:
    """A token's KV bytes across the layers, as the conductor weighs a transfer (every node reports it)."""
    return KVLayout.of(core.runner.kv_layers, core.runner.attn.page_axis).token_bytes


class Replies(Protocol):
    """What the hooks use of the engine's end of the protocol (engine/process/endpoint.py)."""

    def reply(self, request_id: str, msg: p.FromEngine, front: int | None = None) -> None: ...

    def shed(self, request_id: str, error: str, retry_after: float) -> None: ...


class FederationHooks:
    def __init__(self, spec: p.EngineSpec, config: EngineConfig, core: EngineCore, endpoint: Replies) -> None:
        self.engine, self.incarnation = spec.engine_id, spec.incarnation
        self.config, self.core, self.endpoint = config, core, endpoint
        # the transfer engine's own timeout bounds how long a write it gave up on can still land
        os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(max(1, math.ceil(config.kv_transfer_timeout))))
        self.transport = MooncakeTransport(config.kv_host)
        warning = port_reuse_warning()
        if warning:
            log.warning(warning)
        runner = core.runner
        layers, axis = runner.kv_layers, runner.attn.page_axis
        self.sender = Sender(self.transport, runner.kv_cache, axis, config.page_size, core.pool)
        core.on_batch.append(self._plan_sends)
        self.receiver = Receiver(self.transport, runner.kv_cache, axis)
        core.kv.remote_quarantine = horizon(config.kv_transfer_timeout)
        self.keeper = Keeper(core.pool, layers, axis)  # a reply's KV from a decode node (MemServe)
        self.keeper_layout = KVLayout.of(layers, axis)
        self.giver = Giver(self.transport, core.pool, layers, axis)
        self.giving: dict[str, int] = {}  # store -> the front to answer
        self.remote_outs: list[EngineCoreOutput] = []  # first tokens of requests whose KV came
        self._links_at, self._links = -math.inf, {}  # the link figures last put in the stats
        log.info("federation: %s node, KV transfer engine at %s", config.role, self.transport.endpoint)

    def _plan_sends(self, batch) -> None:
        self.core.runner.layer_hook = (self.sender.after_layer if self.sender.plan(batch, self.core.scheduler.requests)
                                       else None)

    # -- the loop -----------------------------------------------------------------------------
    def only_awaiting_kv(self) -> bool:
        """Nothing can run until a prefill node's KV lands: no request is running, and the last step
        scheduled nothing (those waiting wait for pages the reservations hold)."""
        sched = self.core.scheduler
        return (self.receiver.waiting and not sched.running and not len(self.core.last_batch)
                and not self.core.copies_in_flight())

    def has_writes(self) -> bool:
        """Writes to settle and answer soon: the loop polls often."""
        return bool(self.sender.out or self.giver.given)

    def outputs(self) -> list[EngineCoreOutput]:
        """Prefill role: answers for the requests whose KV writes settled. Decode role: the first
        tokens of requests whose KV is in place (checked), and transfers given up."""
        now = time.monotonic()
        for front, answer in self.sender.poll(self.engine, self.incarnation):
            self.endpoint.reply(answer.request_id, answer, front)
        for sid, ok, crc, n in self.giver.poll():
            self.endpoint.reply(sid, p.Prefilled(self.engine, self.incarnation, sid, ok, checksum=crc, num_pages=n),
                                self.giving.pop(sid, 0))
        self.keeper.poll(now)
        outs, self.remote_outs = self.remote_outs, []
        return outs + self.receiver.poll(self.core, now)

    def stepped(self, outs: list[EngineCoreOutput]) -> None:
        """A step's outputs: a prefill node answers once a request's first token and writes are in."""
        for out in outs:
            self.sender.output(out.request_id, out.new_token_ids, out.finished, out.error, out.num_cached_tokens)

    def gone(self, request_id: str) -> None:
        self.sender.gone(request_id)

    # -- requests ------------------------------------------------------------------------------
    def add(self, msg: p.AddRequest, req: Request) -> tuple[str | None, bool]:
        """A prefill node's request (its KV goes to msg.kv_target), or a decode node's (its KV comes
        from a prefill node: Reserved says where, or that there is no room and it runs here).
        -> (the refusal, or None; whether the engine took it)."""
        rid, reply = msg.request_id, self.endpoint.reply
        if msg.kv_target is not None:
            error = self.sender.add(rid, msg.kv_target, len(msg.prompt_token_ids), msg.front,
                                    msg.kv_deadline or math.inf)
            if error is None:
                try:
                    self.core.add_request(req)
                except QueueDelayExceeded as e:
                    self.sender.out.pop(rid)
                    self.endpoint.shed(rid, str(e), e.retry_after)
                    return None, False
                except (InvalidRequestError, ValueError) as e:
                    error = str(e)
                    self.sender.out.pop(rid)
            if error is None:
                self.sender.out[rid].preemptions = req.num_preemptions
            return error, error is None
        try:
            target = self.receiver.reserve(self.core, req)
            if target is None:  # no room, no seat, or past --max-queue-delay: a local request, queued or shed
                self.core.add_request(req)
        except QueueDelayExceeded as e:
            reply(rid, p.Reserved(self.engine, self.incarnation, rid, error=str(e)))
            self.endpoint.shed(rid, str(e), e.retry_after)
            return None, False
        except (InvalidRequestError, ValueError) as e:
            reply(rid, p.Reserved(self.engine, self.incarnation, rid, error=str(e)))
            return str(e), False
        reply(rid, p.Reserved(self.engine, self.incarnation, rid, target))
        return None, True

    def remote_arrived(self, msg: p.RemoteArrived) -> None:
        out = self.receiver.arrived(self.core, msg, time.monotonic())
        if out is not None:
            self.remote_outs.append(out)

    # -- stores (keep, give, kept) --------------------------------------------------------------
    def store(self, msg: p.KeepKV | p.KeptKV | p.GiveKV) -> None:
        try:
            self._store(msg)
        except Exception as e:  # a bad order costs the order, never the engine
            log.exception("federation: a store message failed")
            if not isinstance(msg, p.KeptKV):
                answer = (p.Reserved(self.engine, self.incarnation, msg.store_id, error=str(e))
                          if isinstance(msg, p.KeepKV) else
                          p.Prefilled(self.engine, self.incarnation, msg.store_id, False, error=str(e)))
                self.endpoint.reply(msg.store_id, answer, msg.front)

    def _store(self, msg: p.KeepKV | p.KeptKV | p.GiveKV) -> None:
        if isinstance(msg, p.KeptKV):
            self.keeper.done(msg.store_id, msg.ok, msg.checksum, msg.num_pages, time.monotonic(), msg.unwritten)
            return
        if any(not 0 <= t < self.core.vocab_size for t in msg.token_ids):
            raise ValueError(f"token ids must be in [0, {self.core.vocab_size})")
        if isinstance(msg, p.GiveKV) and time.monotonic() > msg.deadline:
            raise ValueError("the keeper's deadline for this store has passed")
        keys = chain_page_keys(msg.token_ids, self.config.page_size, [])
        engine, incarnation, reply = self.engine, self.incarnation, self.endpoint.reply
        if isinstance(msg, p.KeepKV):
            until = time.monotonic() + horizon(self.config.kv_transfer_timeout)
            try:
                held, pages = self.keeper.reserve(msg.store_id, keys, until)
            except ValueError as e:
                reply(msg.store_id, p.Reserved(engine, incarnation, msg.store_id, error=str(e)), msg.front)
                return
            target = target_of(self.transport.endpoint, self.keeper_layout, pages) if pages else None
            reply(msg.store_id, p.Reserved(engine, incarnation, msg.store_id, target, held=held), msg.front)
            return
        try:
            sent = self.giver.give(msg.store_id, keys[msg.held:], msg.target.endpoint, layout_of(msg.target),
                                   msg.target.pages)
        except ValueError as e:  # refused before any write
            reply(msg.store_id, p.Prefilled(engine, incarnation, msg.store_id, False, error=str(e), unwritten=True),
                  msg.front)
            return
        if sent:
            self.giving[msg.store_id] = msg.front
        else:  # its cache no longer holds them: nothing written
            reply(msg.store_id, p.Prefilled(engine, incarnation, msg.store_id, False, unwritten=True,
                                            error="the pages are no longer cached here"), msg.front)

    # -- figures -------------------------------------------------------------------------------
    def link_figures(self) -> dict:
        """kv_links and kv_egress for the stats, computed at most every LINK_REFRESH s:
        the stats go out with nearly every step, and a layer-wise prefill ends dozens of writes a
        step, so computing them each time would sort hundreds of intervals on the step loop."""
        now = time.monotonic()
        if now - self._links_at >= LINK_REFRESH:
            self._links_at = now
            self._links = dict(kv_links=self.transport.bandwidths(), kv_egress=self.transport.egress_bandwidth())
        return self._links

    def close(self) -> None:
        self.transport.close()  # waits for the writes in flight, then unregisters the cache
