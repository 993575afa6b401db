"""A node's front in a federated cluster (the conductor, federation/conductor.py, drives it).

    GET  /federation/state?since=N   the node's role, load, step-time model and its prefix-cache
                                     keys (the changes after N, or all of them): the conductor's view
    POST /federation/prefill         a prefill node: compute a prompt, write its KV to a decode node's
                                     pages as each layer ends, answer with the first token

A decode node serves an ordinary OpenAI request that carries `X-Tokenflowd-Prefill-Node: URL` (the
conductor adds it): its engine allocates the prompt's pages (Reserved), this front asks the prefill
node at URL to fill them (/federation/prefill), and hands the answer to the engine (RemoteArrived),
which checks the pages' checksum and decodes. The client's stream is the decode node's own, so it
reads the same as from one node. If the prefill node fails, is unreachable or times out, the
engine computes the prompt itself: no token was sent yet, so the client sees only a later first
token.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import TYPE_CHECKING

import aiohttp
import msgspec
from aiohttp import web

from tokenflowd import protocol as p
from tokenflowd.api.errors import APIError
from tokenflowd.prefix_index import PrefixIndex

if TYPE_CHECKING:
    from tokenflowd.api.app import Front

log = logging.getLogger("tokenflowd.federation")

PREFILL_HEADER = "X-Tokenflowd-Prefill-Node"
HEARTBEAT = 1.0  # s between a prefill node's signs of life while it computes a prompt


class PrefillOrder(msgspec.Struct):
    request_id: str
    prompt_token_ids: list[int]
    sampling: p.Sampling
    target: p.KVTarget


class PrefillAnswer(msgspec.Struct):
    ok: bool
    first_token: int | None = None
    checksum: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    settled: bool = True  # the prefill node writes no more into the target's pages


class KeyLog:
    """The node's prefix-cache keys as a conductor follows them: numbered changes (a key now held
    by some engine of the node, or by none), or the whole set when the changes asked for are no
    longer kept."""

    def __init__(self, index: PrefixIndex, keep: int = 200_000) -> None:
        self.index = index
        self.keep = keep
        self.seq = 0
        self.base = 0  # changes after it are kept
        self.changes: deque[tuple[int, bytes, bool]] = deque()

    def record(self, added: list[bytes] | None, removed: list[bytes] | None) -> None:
        if added is None or removed is None:  # the index was rebuilt: whoever follows starts over
            self.changes.clear()
            self.seq += 1
            self.base = self.seq
            return
        for key in removed:
            if not self.index.holders(key):
                self.seq += 1
                self.changes.append((self.seq, key, False))
        for key in added:
            self.seq += 1
            self.changes.append((self.seq, key, True))
        while len(self.changes) > self.keep:
            self.base = self.changes.popleft()[0]

    def since(self, seq: int) -> dict:
        if seq < self.base or seq > self.seq:
            return {"seq": self.seq, "snapshot": [k.hex() for k in self.index.keys()]}
        start = len(self.changes) - (self.seq - seq)
        return {"seq": self.seq, "changes": [[k.hex(), held] for _, k, held in list(self.changes)[start:]]}


class Federation:
    def __init__(self, front: Front) -> None:
        self.front = front
        self.supervisor = front.supervisor
        self.keys = KeyLog(self.supervisor.index)
        self.supervisor.on_keys = self.keys.record
        self.timeout = self.supervisor.engine_config.kv_transfer_timeout
        self._session: aiohttp.ClientSession | None = None
        self._order_decoder = msgspec.json.Decoder(PrefillOrder)
        self.tasks: set[asyncio.Task] = set()

    @property
    def role(self) -> str:
        return self.supervisor.engine_config.role

    # -- GET /federation/state --------------------------------------------------------------------
    async def state(self, request: web.Request) -> web.Response:
        try:
            since = int(request.query.get("since", "-1"))
        except ValueError:
            raise APIError(400, "since must be an integer", param="since") from None
        engines = []
        for slot in self.supervisor.slots:
            if not slot.ready or slot.stats is None or slot.info is None:
                continue
            st = slot.stats
            engines.append({"engine": slot.engine_id, "running": st.num_running, "waiting": st.num_waiting,
                            "waiting_tokens": st.waiting_tokens, "step_base": st.step_base,
                            "step_per_token": st.step_per_token, "kv_pages_used": st.kv_pages_used,
                            "kv_pages_total": st.kv_pages_total, "kv_remote_pages": st.kv_remote_pages,
                            "max_num_seqs": slot.config.max_num_seqs,
                            "max_num_batched_tokens": slot.config.max_num_batched_tokens,
                            "max_model_len": slot.info.max_model_len})
        cfg = self.supervisor.engine_config
        body = {"role": self.role, "page_size": cfg.page_size, "model": cfg.model, "engines": engines,
                "waiting_requests": self.supervisor.num_waiting, "keys": self.keys.since(since)}
        return web.json_response(body)

    # -- POST /federation/prefill (a prefill node) ---------------------------------------------
    async def prefill(self, request: web.Request) -> web.StreamResponse:
        """The answer (PrefillAnswer, JSON) comes once the KV is written; until then a space every
        HEARTBEAT s says the prefill node is alive (JSON allows leading whitespace), so the decode
        node can tell a long prefill from a dead link by its read timeout."""
        raw = await self.front.read_body(request)
        try:
            order = self._order_decoder.decode(raw)
        except msgspec.DecodeError as e:
            raise APIError(400, f"not a prefill order: {e}") from None
        if self.role != "prefill":
            raise APIError(409, "this node does not prefill for others (--role prefill)", code="wrong_role")
        work = asyncio.ensure_future(self._prefill(order))
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        try:
            await response.prepare(request)
            while not work.done():
                await asyncio.wait([work], timeout=min(HEARTBEAT, self.timeout / 4))
                if not work.done():
                    await response.write(b" ")
        except (ConnectionError, asyncio.CancelledError):  # the decode node is gone: it computes the prompt
            await work  # its writes settle; the answer goes nowhere
            raise
        answer = work.result()
        self.front.metrics.federation.labels("prefill", "ok" if answer.ok else "failed").inc()
        await response.write(msgspec.json.encode(answer))
        await response.write_eof()
        return response

    async def _prefill(self, order: PrefillOrder) -> PrefillAnswer:
        front, sup = self.front, self.supervisor
        try:
            front._admissible()
            choice = front.router.pick(front._ready_slots(), order.prompt_token_ids)
        except APIError as e:
            return PrefillAnswer(False, error=e.message)
        slot = sup.slots[choice.engine_id]
        s = order.sampling
        sampling = msgspec.structs.replace(s, max_tokens=1, min_tokens=min(s.min_tokens, 1))
        rid = f"prefill-{order.request_id}"
        add = p.AddRequest(rid, order.prompt_token_ids, sampling, front.config.default_reading_rate,
                           arrival_time=time.monotonic(), front=sup.front, front_epoch=sup.front_epoch,
                           kv_target=order.target)
        answer = sup.expect(rid)
        failed: asyncio.Future = asyncio.get_running_loop().create_future()

        def on_delta(delta: p.Delta) -> None:
            if delta.finish_reason in ("error", "rejected", "shed", "abort") and not failed.done():
                failed.set_result(delta)

        try:
            sup.submit(slot, add, on_delta)
        except Exception as e:
            sup.forget(rid)
            return PrefillAnswer(False, error=f"not admitted: {e}")
        try:
            await asyncio.wait([answer, failed], return_when=asyncio.FIRST_COMPLETED)
            if not answer.done():  # the engine's answer follows its writes' end
                await asyncio.wait([answer], timeout=1.0 if slot.ready else 0.0)
            if answer.done():
                msg: p.Prefilled = answer.result()
                return PrefillAnswer(msg.ok, msg.first_token, msg.checksum, msg.num_cached_tokens, msg.error)
            delta = failed.result()
            # an engine gone writes no more; one that refused the request never started
            return PrefillAnswer(False, error=delta.error or delta.finish_reason,
                                 settled=not slot.ready or delta.finish_reason in ("rejected", "shed"))
        finally:
            sup.forget(rid)

    # -- a decode node's request -----------------------------------------------------------------
    def decodes_remotely(self, request: web.Request) -> str | None:
        """The prefill node a conductor named for this request, if this node takes KV from others."""
        url = request.headers.get(PREFILL_HEADER)
        if url is None or self.role != "decode":
            return None
        if not url.startswith(("http://", "https://")):
            raise APIError(400, f"{PREFILL_HEADER} must be an http(s) URL", param=PREFILL_HEADER)
        return url.rstrip("/")

    def drive(self, slot, request_id: str, prompt_ids: list[int], sampling: p.Sampling, url: str,
              reserved: asyncio.Future, authorization: str | None) -> None:
        """Have the prefill node at `url` fill the pages the engine reserves (its answer, Reserved),
        with the client's own key (`authorization`; the nodes of a cluster share their keys)."""
        task = asyncio.create_task(self._drive(slot, request_id, prompt_ids, sampling, url, reserved, authorization))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _drive(self, slot, rid: str, prompt_ids: list[int], sampling: p.Sampling, url: str,
                     reserved: asyncio.Future, authorization: str | None) -> None:
        try:
            msg: p.Reserved = await asyncio.wait_for(reserved, self.timeout)
        except asyncio.TimeoutError:  # the engine is gone (its stream ended) or far behind
            return
        finally:
            self.supervisor.forget(rid)
        if msg.target is None:  # no room, or refused: it computes its prompt here, or has ended
            return
        order = PrefillOrder(rid, prompt_ids, sampling, msg.target)
        try:
            session = self._client()
            # silence longer than the transfer timeout (no heartbeat): the prefill node or its link is gone
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.timeout, sock_read=self.timeout)
            headers = {"Content-Type": "application/json", **({"Authorization": authorization} if authorization else {})}
            async with session.post(f"{url}/federation/prefill", data=msgspec.json.encode(order), headers=headers,
                                    timeout=timeout) as r:
                body = (await r.read()).strip()
                if r.status == 200:
                    answer = msgspec.json.decode(body, type=PrefillAnswer)
                else:  # refused before it wrote anything
                    answer = PrefillAnswer(False, error=f"{r.status}: {body[:200]!r}", settled=r.status < 500)
        except (aiohttp.ClientError, asyncio.TimeoutError, msgspec.DecodeError, OSError) as e:
            answer = PrefillAnswer(False, error=f"{type(e).__name__}: {e}", settled=False)
        self.front.metrics.federation.labels("decode", "ok" if answer.ok else "failed").inc()
        if not answer.ok:
            log.warning("prefill of %s at %s failed (%s): computing it here", rid, url, answer.error)
        self.supervisor.send(slot, p.RemoteArrived(rid, answer.first_token if answer.ok else None,
                                                   answer.checksum, answer.settled, answer.num_cached_tokens))

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        return self._session

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        if self._session is not None:
            await self._session.close()
