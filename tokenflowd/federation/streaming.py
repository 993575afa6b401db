"""A request's KV crossing nodes, inside the engine process (prefill and decode roles).

    prefill node (Sender)                                   decode node (Receiver)
                                                            AddRequest(remote_kv) -> pages allocated,
                                                              Reserved(KVTarget) to its front
    AddRequest(kv_target) -> the prompt runs; after each
      layer of each step, that layer's finished pages go
      to the target as one batch (layer-wise prefill,
      Mooncake §5); the first token is sampled
    once every write is settled: Prefilled(ok, token,       RemoteArrived(token, crc) -> the pages'
      crc32 of the pages) to its front                        crc32 checked (bytes may still be in
                                                              flight: retried until a deadline), then
                                                              the request decodes with the token

The fronts carry Reserved/Prefilled/RemoteArrived between the nodes (daemon/api/federation.py). A page is
sent once, when it is full (the prompt's last page when the prompt ends), so no two writes of a
transfer touch the same bytes. The sender holds a reference on the pages it sends until the
transport has settled their writes: a page freed early could be handed to another request while
still read. A request preempted on the prefill node fails its transfer (the decode node computes the
prompt itself) rather than resend what it already wrote.
"""
from __future__ import annotations

import logging
import math
import time
import zlib
from dataclasses import dataclass, field
from typing import Sequence

import torch

from tokenflowd import protocol as p
from tokenflowd.federation.transport import DONE, FAILED, KVLayout, KVTransport, Transfer, kv_blocks
from tokenflowd.kv.staging import gather_pages

log = logging.getLogger(__name__)

VERIFY_SECONDS = 5.0  # after the sender's word, how long bytes may still be in flight over TCP


def checksum(layers: Sequence[torch.Tensor], pages: Sequence[int], page_axis: int) -> int:
    """crc32 of the pages of every layer, staged in the wire layout (the same on any cache layout),
    one layer at a time: a request's whole KV is never copied at once."""
    crc = 0
    if not pages:
        return crc
    page_elems = layers[0].numel() // layers[0].shape[page_axis]
    out = torch.empty(len(pages) * page_elems, dtype=layers[0].dtype, device=layers[0].device)
    for layer in layers:
        staged = gather_pages([layer], pages, out, page_axis).cpu().contiguous()
        crc = zlib.crc32(staged.view(-1).view(torch.uint8).numpy(), crc)
    return crc


def target_of(endpoint: str, layout: KVLayout, pages: list[int]) -> p.KVTarget:
    return p.KVTarget(endpoint, list(layout.bases), list(layout.shape), layout.itemsize, layout.page_axis, pages)


def layout_of(target: p.KVTarget) -> KVLayout:
    return KVLayout(tuple(target.bases), tuple(target.shape), target.itemsize, target.page_axis)


@dataclass
class _Outgoing:
    target: p.KVTarget
    layout: KVLayout
    num_tokens: int
    front: int
    preemptions: int
    sent: int = 0  # leading pages of the prompt already sent
    pinned: list[int] = field(default_factory=list)  # our pages their writes read
    transfers: list[Transfer] = field(default_factory=list)
    deadline: float = math.inf  # no batch starts after it (the decode node frees its pages some time later)
    first_token: int | None = None
    num_cached_tokens: int = 0
    ended: bool = False
    error: str | None = None


class Sender:
    """The prefill node's half. `plan(batch)` before a step, `after_layer` from inside it (the
    runner's layer hook), `finished` with the step's outputs, `poll()` for the answers due."""

    def __init__(self, transport: KVTransport, kv_cache: torch.Tensor, page_axis: int, page_size: int, pool) -> None:
        self.transport = transport
        self.region = transport.register(kv_cache)
        self.layers = list(kv_cache.unbind(0))
        self.layout = KVLayout.of(self.layers, page_axis)
        self.page_size = page_size
        self.pool = pool
        self.out: dict[str, _Outgoing] = {}
        self._step: list[tuple[_Outgoing, list[int], list[int]]] = []  # this step's (request, our pages, theirs)
        self._cuda = kv_cache.is_cuda

    def add(self, request_id: str, target: p.KVTarget, num_tokens: int, front: int,
            deadline: float = math.inf) -> str | None:
        """`deadline` (monotonic s): past it no write starts, so the target's pages, which the
        decode node frees a known time after it gives up, are never written once they are another's."""
        if request_id in self.out:
            return f"request id {request_id!r} is already being sent"
        layout = layout_of(target)
        if layout.page_shape != self.layout.page_shape or layout.itemsize != self.layout.itemsize \
                or len(layout.bases) != len(self.layout.bases):
            return "the decode node's KV cache has another shape (another model or dtype)"
        if len(target.pages) != -(-num_tokens // self.page_size):
            return f"the target has {len(target.pages)} pages for a prompt of {num_tokens} tokens"
        self.out[request_id] = _Outgoing(target, layout, num_tokens, front, 0, deadline=deadline)
        self.transport.watch(target.endpoint)  # its probe answers before the first layer is sent
        return None

    def plan(self, batch, requests: dict) -> bool:
        """Which pages each streamed request of `batch` finishes this step. -> whether any is sent."""
        self._step = []
        if not self.out:  # nothing streamed (a decode node's steps)
            return False
        now = time.monotonic()
        for rid, start, n, table in zip(batch.request_ids, batch.positions, batch.num_tokens, batch.block_tables):
            o = self.out.get(rid)
            if o is None or o.ended or o.error:
                continue
            req = requests.get(rid)
            if req is not None and req.num_preemptions != o.preemptions:
                o.error = "preempted on the prefill node"
                continue
            if now > o.deadline:
                o.error = "the decode node's deadline passed"
                continue
            end = start + n
            full = -(-o.num_tokens // self.page_size) if end >= o.num_tokens else end // self.page_size
            if full <= o.sent:
                continue
            ours = list(table[o.sent:full])
            for page in ours:
                self.pool.incref(page)
            o.pinned += ours
            self._step.append((o, ours, list(o.target.pages[o.sent:full])))
            o.sent = full
        return bool(self._step)

    def after_layer(self, layer: int) -> None:
        if self._cuda:  # the layer's kernels must have written the cache before the NIC reads it
            torch.cuda.current_stream().synchronize()
        src = KVLayout((self.layout.bases[layer],), self.layout.shape, self.layout.itemsize, self.layout.page_axis)
        for o, ours, theirs in self._step:
            if o.error:  # an earlier layer's write failed: the rest is not worth sending
                continue
            dst = KVLayout((o.layout.bases[layer],), o.layout.shape, o.layout.itemsize, o.layout.page_axis)
            t = self.transport.submit_write(o.target.endpoint, kv_blocks(src, dst, ours, theirs))
            o.transfers.append(t)
            if t.state == FAILED:
                o.error = "a KV write failed (the decode node is unreachable)"

    def output(self, request_id: str, token_ids: list[int], finished: bool, error: str | None,
               num_cached_tokens: int) -> None:
        o = self.out.get(request_id)
        if o is None:
            return
        if token_ids and o.first_token is None:
            o.first_token = token_ids[0]
            o.num_cached_tokens = num_cached_tokens
        if finished:
            o.ended = True
            o.error = o.error or error

    def gone(self, request_id: str) -> None:
        """Aborted or refused here."""
        o = self.out.get(request_id)
        if o is not None:
            o.ended, o.error = True, o.error or "aborted on the prefill node"

    def poll(self, engine_id: int, incarnation: int) -> list[tuple[int, p.Prefilled]]:
        """(front, answer) for each request whose writes are all settled since it ended."""
        answers = []
        for rid, o in list(self.out.items()):
            if not o.ended or not all(self.transport.settled(t) for t in o.transfers):
                continue
            states = [self.transport.status(t) for t in o.transfers]
            ok = (o.error is None and o.first_token is not None and o.sent * self.page_size >= o.num_tokens
                  and all(s == DONE for s in states))
            crc = checksum(self.layers, o.pinned, self.layout.page_axis) if ok else 0
            error = None if ok else (o.error or ("a KV write failed" if FAILED in states else "not all KV was sent"))
            for page in reversed(o.pinned):
                self.pool.decref(page)
            del self.out[rid]
            answers.append((o.front, p.Prefilled(engine_id, incarnation, rid, ok, o.first_token if ok else None,
                                                 crc, o.num_cached_tokens, error)))
        return answers


@dataclass
class _Incoming:
    pages: list[int]
    first_token: int | None = None
    checksum: int = 0
    verify_until: float = 0.0  # answered: the bytes must match by then
    next_check: float = 0.0
    num_cached_tokens: int = 0  # the prefill node's prefix hit


class Receiver:
    """The decode node's half: reserve pages, then check what arrived before the request decodes.
    The front answers for every reservation (RemoteArrived, daemon/api/federation.py): with the prefill
    node's word, or a failure once that node has been silent for the transfer timeout, or has not
    answered in its own bounded wait. Pages given up on wait out the sender's horizon in the KV
    manager (federation/timing.py)."""

    def __init__(self, transport: KVTransport, kv_cache: torch.Tensor, page_axis: int) -> None:
        self.transport = transport
        self.region = transport.register(kv_cache)
        self.layers = list(kv_cache.unbind(0))
        self.layout = KVLayout.of(self.layers, page_axis)
        self.incoming: dict[str, _Incoming] = {}

    def reserve(self, core, req) -> p.KVTarget | None:
        pages = core.add_remote(req, req.num_prompt_tokens)
        if pages is None:
            return None
        self.incoming[req.request_id] = _Incoming(pages)
        return target_of(self.transport.endpoint, self.layout, pages)

    def arrived(self, core, msg: p.RemoteArrived, now: float):
        """The prefill node's answer. -> the first token's output, if it is admitted at once."""
        inc = self.incoming.get(msg.request_id)
        if inc is None or msg.request_id not in core.scheduler.requests:  # it ended meanwhile
            self.incoming.pop(msg.request_id, None)
            if msg.settled:  # its pages waited only for the sender to stop
                core.kv.remote_settled(msg.request_id)
            return None
        if msg.first_token is None:
            del self.incoming[msg.request_id]
            core.remote_arrived(msg.request_id, None, msg.settled)
            return None
        inc.first_token, inc.checksum, inc.verify_until = msg.first_token, msg.checksum, now + VERIFY_SECONDS
        inc.num_cached_tokens = msg.num_cached_tokens
        return self._verify(core, msg.request_id, inc, now)

    def poll(self, core, now: float) -> list:
        """Answers whose bytes arrive late. -> first-token outputs."""
        outs = []
        for rid, inc in list(self.incoming.items()):
            if rid not in core.scheduler.requests:  # aborted: the manager keeps its pages quarantined
                del self.incoming[rid]
            elif inc.first_token is not None and now >= inc.next_check:
                out = self._verify(core, rid, inc, now)
                if out is not None:
                    outs.append(out)
        return outs

    def _verify(self, core, rid: str, inc: _Incoming, now: float):
        if checksum(self.layers, inc.pages, self.layout.page_axis) == inc.checksum:
            del self.incoming[rid]
            return core.remote_arrived(rid, inc.first_token, num_cached_tokens=inc.num_cached_tokens)
        inc.next_check = now + 0.1
        if now >= inc.verify_until:  # some bytes may yet land: the pages wait out the sender's horizon
            log.warning("the KV of %s did not arrive intact: computing it here", rid)
            del self.incoming[rid]
            core.remote_arrived(rid, None, settled=False)
        return None

    @property
    def waiting(self) -> bool:
        return bool(self.incoming)
