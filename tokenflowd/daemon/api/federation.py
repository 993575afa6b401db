"""A node's front in a federated cluster (the conductor, federation/conductor/service.py, drives it).

    GET  /federation/state?since=N   the node's role, load, step-time model and its prefix-cache
                                     keys (the changes after N, or all of them), a token's KV bytes,
                                     its transfer engines and the bandwidth its writes achieved to each
                                     peer's: the conductor's view
    POST /federation/prefill         a prefill node: compute a prompt (after pulling a longer prefix of
                                     it from another prefill node, if the order names one), write its KV
                                     to a decode node's pages as each layer ends, answer with the first
                                     token
    POST /federation/abort           a prefill node: the decode node's client has gone
    POST /federation/keep            a prefill node: pages for the whole pages of some tokens after
                                     those its cache holds (a store's keeper, federation/store.py)
    POST /federation/give            a prefill or decode node: write its cached pages of them there
                                     (a store's giver); answers once the writes have settled
    POST /federation/kept            the giver's writes have settled: the keeper publishes what arrived
    POST /federation/role            a prefill or decode node takes the other role, once it has no
                                     work of its old role under way (PrfaaS's long-term re-planning)

With API keys configured, /federation/* takes only keys of [auth] role "node" (daemon/api/auth.py), and a
node calls its peers with its own (TOKENFLOWD_NODE_KEY). Every URL a node calls comes from its
--federation-peers: the prefill node a decode node's request names, and the source of a pull.

A decode node serves an ordinary OpenAI request that carries `X-Tokenflowd-Prefill-Node: URL` (the
conductor adds it): its engine allocates the prompt's pages (Reserved), this front asks the prefill
node at URL to fill them (/federation/prefill), and hands the answer to the engine (RemoteArrived),
which checks the pages' checksum and decodes. The client's stream is the decode node's own, so it
reads the same as from one node. If the prefill node fails, is unreachable or times out, the
engine computes the prompt itself: no token was sent yet, so the client sees only a later first
token.

Whole pages move between two nodes' prefix caches by one sequence (`_move`: keep, give, kept), in
two directions:
- MemServe's return: when a federated request ends, the decode node gives the conversation's whole
  pages to the prefill node, where the next turn starts.
- A prefill node's pull (Mooncake's Algorithm 1, its transfer branch): when the conductor places a
  prompt on a prefill node that holds less of it than another, it names that other node too
  (`X-Tokenflowd-Prefix-Node`); the decode node passes it in the order (`pull_from`), and the prefill
  node, before it computes the prompt, reserves pages for the prompt's whole pages it lacks, has the
  other node give them, and publishes what arrived intact, so its prefill hits them. The copy stays
  in its prefix cache: hot prefixes replicate by use. A pull that fails, or outlasts the transfer
  timeout, leaves the prompt to compute (the order's heartbeats go on meanwhile); pages reserved for
  it wait out their horizon, unless the giver refused before writing anything (they are free at
  once). A source that is not among the decode node's, or the prefill node's, --federation-peers is
  not pulled from.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from typing import Protocol

import aiohttp
import msgspec
from aiohttp import web

from tokenflowd import protocol as p
from tokenflowd.config import ServerConfig
from tokenflowd.daemon.api.auth import node_key
from tokenflowd.daemon.api.metrics import Metrics
from tokenflowd.daemon.prefix_index import PrefixIndex
from tokenflowd.daemon.router import Router
from tokenflowd.daemon.supervisor import Supervisor
from tokenflowd.federation.congestion import Retransmits
from tokenflowd.federation.peers import Peers, normal_url
from tokenflowd.federation.timing import MARGIN, horizon, send_window
from tokenflowd.federation.wire import (
    HEARTBEAT,
    PREFILL_HEADER,
    PREFIX_HEADER,
    GiveAnswer,
    GiveOrder,
    KeepAnswer,
    KeepOrder,
    KeptReport,
    PrefillAnswer,
    PrefillOrder,
)
from tokenflowd.openai_api.errors import APIError
from tokenflowd.text.tokenizer import Tokenizer

log = logging.getLogger("tokenflowd.federation")

class _Refused(Exception):
    """The other node answered a store's step with an error (`status`: a 4xx did nothing there)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


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


class NodeFront(Protocol):
    """What the federation endpoints use of the node's front (app.py's Front is one)."""

    config: ServerConfig
    metrics: Metrics
    router: Router
    supervisor: Supervisor
    tokenizer: Tokenizer

    async def read_body(self, request: web.Request) -> bytes: ...

    def admissible(self) -> None: ...  # raises APIError (503, 429) when no request can be taken now

    def max_model_len(self) -> int: ...

    def ready_slots(self) -> list: ...


class Federation:
    def __init__(self, front: NodeFront) -> None:
        self.front = front
        self.supervisor = front.supervisor
        self.keys = KeyLog(self.supervisor.index)
        self.supervisor.on_keys = self.keys.record
        self.timeout = self.supervisor.engine_config.kv_transfer_timeout
        self.peers = Peers(self.supervisor.engine_config.federation_peers)
        self._session: aiohttp.ClientSession | None = None
        self._order_decoder = msgspec.json.Decoder(PrefillOrder)
        self.tasks: dict[str, asyncio.Task] = {}  # a decode node's orders out, by request
        self.asked: dict[str, str] = {}  # ... those sent, and to which prefill node
        key = node_key()  # what this node sends to its peers' /federation/* (daemon/api/auth.py)
        self.auth = {"Authorization": f"Bearer {key}"} if key else {}
        self.aborts: set[asyncio.Task] = set()
        self.orders: dict[str, object] = {}  # a prefill node's orders under way: request -> its stream
        self.keeping: dict[str, tuple] = {}  # a prefill node's stores under way: store -> (its engine, horizon)
        self.pulling: dict[str, asyncio.Task] = {}  # a prefill node's orders pulling a prefix first
        self.called_off: set[str] = set()  # ... whose decode node gave up meanwhile

        self.role = self.supervisor.engine_config.role  # prefill and decode may trade (POST /federation/role)
        self.retransmits = Retransmits()  # TCP's congestion signal on this node's egress
        self.decoding: set[str] = set()  # a decode node's streams whose prompt a prefill node computed

    # -- POST /federation/role ----------------------------------------------------------------------
    async def set_role(self, request: web.Request) -> web.Response:
        """{"role": "prefill" | "decode"}: the node takes the other role's orders from now on (PrfaaS's
        long-term re-planning; the conductor drains it first). Refused (409, code "draining") while
        work of the old role is under way: prefill orders, or streams decoded from a prefill node's
        KV. Its engines have both roles' machinery: nothing restarts, no page moves."""
        try:
            role = msgspec.json.decode(await self.front.read_body(request), type=dict)["role"]
        except (msgspec.DecodeError, UnicodeDecodeError, KeyError, TypeError):
            raise APIError(400, 'send {"role": "prefill" | "decode"}') from None
        if role not in ("prefill", "decode"):
            raise APIError(400, f"role must be prefill or decode, got {role!r}", param="role")
        if self.role == "both":
            raise APIError(409, "a node of role both has no transfer engine: it cannot take another role",
                           code="wrong_role")
        if role == self.role:
            return web.json_response({"role": role, "changed": False})
        if role == "decode" and not self.peers.urls:
            raise APIError(409, "a decode node takes KV only from the nodes of --federation-peers, and this node "
                                "has none", code="no_peers")
        busy = len(self.orders) + len(self.pulling) if self.role == "prefill" else len(self.tasks) + len(self.decoding)
        if busy:
            raise APIError(409, f"draining: {busy} {self.role} request(s) under way; ask again when they have ended",
                           code="draining", headers={"Retry-After": "1"})
        log.info("federation: role %s -> %s", self.role, role)
        self.role = role
        return web.json_response({"role": role, "changed": True})

    # -- GET /federation/state --------------------------------------------------------------------
    async def state(self, request: web.Request) -> web.Response:
        try:
            since = int(request.query.get("since", "-1"))
        except ValueError:
            raise APIError(400, "since must be an integer", param="since") from None
        engines, endpoints, links, egress = [], [], {}, []
        for slot in self.supervisor.slots:
            if not slot.ready or slot.stats is None or slot.info is None:
                continue
            st = slot.stats
            if slot.info.kv_endpoint:
                endpoints.append(slot.info.kv_endpoint)
            for peer, bps in st.kv_links.items():
                links.setdefault(peer, []).append(bps)
            if st.kv_egress > 0:
                egress.append(st.kv_egress)
            engines.append({"engine": slot.engine_id, "running": st.num_running, "waiting": st.num_waiting,
                            "waiting_tokens": st.waiting_tokens, "step_base": st.step_base,
                            "step_per_token": st.step_per_token, "kv_pages_used": st.kv_pages_used,
                            "kv_pages_total": st.kv_pages_total, "kv_remote_pages": st.kv_remote_pages,
                            "max_num_seqs": slot.config.max_num_seqs,
                            "max_num_batched_tokens": slot.config.max_num_batched_tokens,
                            "max_model_len": slot.info.max_model_len})
        cfg = self.supervisor.engine_config
        body = {"role": self.role, "page_size": cfg.page_size, "model": cfg.model, "engines": engines,
                "waiting_requests": self.supervisor.num_waiting, "keys": self.keys.since(since),
                # what a prefix fetch between nodes costs: a token's KV, and the bandwidth each peer
                # transfer engine got from this node's engines (the mean over those that wrote there)
                "kv_token_bytes": max((s.info.kv_token_bytes for s in self.supervisor.slots if s.info), default=0),
                "kv_endpoints": endpoints, "links": {peer: sum(b) / len(b) for peer, b in links.items()},
                # what its writes to every peer together achieved (0: none yet): the mean of its engines',
                # each of which, over TCP, counts every socket of the node to the peers' hosts, its
                # other engines' too (federation/delivery.py), so that a shared NIC is counted once
                "egress": sum(egress) / len(egress) if egress else 0.0,
                "tcp_retransmits": self.retransmits.share()}  # federation/congestion.py; None: not measured
        return web.json_response(body)

    # -- POST /federation/prefill (a prefill node) ---------------------------------------------
    async def prefill(self, request: web.Request) -> web.StreamResponse:
        """The answer (PrefillAnswer, JSON) comes once the KV is written; until then a space every
        HEARTBEAT s says the prefill node is alive (JSON allows leading whitespace), so the decode
        node can tell a long prefill from a dead link by its read timeout."""
        raw = await self.front.read_body(request)
        try:
            order = self._order_decoder.decode(raw)
        except (msgspec.DecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"not a prefill order: {e}") from None
        if self.role != "prefill":
            raise APIError(409, "this node does not prefill for others (--role prefill)", code="wrong_role")
        if order.target is None:
            raise APIError(400, "a prefill order needs its target", param="target")
        work = asyncio.ensure_future(self._prefill(order))
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        try:
            await response.prepare(request)
            while not work.done():
                await asyncio.wait([work], timeout=min(HEARTBEAT, self.timeout / 4))
                if not work.done():
                    await response.write(b" ")
        except (ConnectionError, asyncio.CancelledError):  # the decode node gave up: stop the prefill
            work.cancel()
            raise
        answer = work.result()
        self.front.metrics.federation.labels("prefill", "ok" if answer.ok else "failed").inc()
        await response.write(msgspec.json.encode(answer))
        await response.write_eof()
        return response

    async def _prefill(self, order: PrefillOrder) -> PrefillAnswer:
        front, sup = self.front, self.supervisor
        received = time.monotonic()  # the send window runs from here, a pull's time included
        try:
            front.admissible()
            choice = front.router.pick(front.ready_slots(), order.prompt_token_ids)
        except APIError as e:
            return PrefillAnswer(False, error=e.message)
        slot = sup.slots[choice.engine_id]
        source = self.peers.named(order.pull_from) if order.pull_from is not None else None
        if order.pull_from is not None and source is None:
            log.warning("not pulling from %s: it is not among this node's --federation-peers", order.pull_from)
        if source is not None:
            rid = order.request_id
            pull = self.pulling[rid] = asyncio.ensure_future(self._pull(slot, order.prompt_token_ids, source))
            try:
                await asyncio.shield(pull)  # abort cancels the pull alone; this order's own cancel stops both
            except asyncio.CancelledError:
                if rid not in self.called_off:
                    pull.cancel()
                    raise
            finally:
                self.pulling.pop(rid, None)
            if rid in self.called_off:  # nothing was written to the decode node's pages
                self.called_off.discard(rid)
                return PrefillAnswer(False, error="called off by the decode node")
        s = order.sampling
        sampling = msgspec.structs.replace(s, max_tokens=1, min_tokens=min(s.min_tokens, 1))
        rid = f"prefill-{order.request_id}"
        now = time.monotonic()
        add = p.AddRequest(rid, order.prompt_token_ids, sampling, order.reading_rate or front.config.default_reading_rate,
                           order.priority, arrival_time=now, front=sup.front, front_epoch=sup.front_epoch,
                           kv_target=order.target, kv_deadline=received + max(0.0, order.send_window))
        try:
            answer = sup.expect(rid)
        except ValueError as e:
            return PrefillAnswer(False, error=str(e))
        ended: asyncio.Future = asyncio.get_running_loop().create_future()

        def on_delta(delta: p.Delta) -> None:
            if delta.finish_reason is not None and not ended.done():
                ended.set_result(delta)

        try:
            stream = sup.submit(slot, add, on_delta)
        except Exception as e:
            sup.forget(rid)
            return PrefillAnswer(False, error=f"not admitted: {e}")
        self.orders[order.request_id] = stream
        try:
            await asyncio.wait([answer, ended], return_when=asyncio.FIRST_COMPLETED)
            if not answer.done():
                # The engine answers once its writes have settled, each within the transfer timeout;
                # an engine that died after the stream ended never does.
                await asyncio.wait([answer], timeout=self.timeout + MARGIN if slot.ready else 0.0)
            if answer.done():
                msg: p.Prefilled = answer.result()
                return PrefillAnswer(msg.ok, msg.first_token, msg.checksum, msg.num_cached_tokens, msg.error)
            delta = ended.result()
            refused = delta.finish_reason in ("rejected", "shed")  # it never started
            return PrefillAnswer(False, error=delta.error or f"no answer after {delta.finish_reason}", settled=refused)
        except asyncio.CancelledError:
            sup.abort(stream)  # its writes stop (Sender.gone); the engine's answer goes nowhere
            raise
        finally:
            sup.forget(rid)
            self.orders.pop(order.request_id, None)

    # -- POST /federation/abort (a prefill node) -------------------------------------------------
    async def abort(self, request: web.Request) -> web.Response:
        """The decode node's client has gone: stop computing and writing (the order's own call then
        answers, so the decode node learns when its pages are safe)."""
        try:
            rid = msgspec.json.decode(await self.front.read_body(request), type=dict)["request_id"]
        except (msgspec.DecodeError, UnicodeDecodeError, KeyError, TypeError):
            raise APIError(400, 'send {"request_id": ...}') from None
        stream = self.orders.get(rid)
        if stream is not None:
            self.supervisor.abort(stream)
        elif rid in self.pulling:  # it has not started: it will not (its reserved pages wait out their horizon)
            self.called_off.add(rid)
            self.pulling[rid].cancel()
        return web.json_response({"aborted": stream is not None or rid in self.called_off})

    # -- a decode node's request -----------------------------------------------------------------
    def decodes_remotely(self, request: web.Request) -> str | None:
        """The prefill node a conductor named for this request, if this node takes KV from others."""
        if self.role != "decode":
            return None
        return self.peer(request, PREFILL_HEADER)

    def peer(self, request: web.Request, header: str) -> str | None:
        """The node `header` names (its URL as --federation-peers spells it), or None when the request
        has no such header. A URL not listed is refused (403) before anything is reserved or sent: the
        header is the client's word, and this node's calls and KV must not go where a client chooses."""
        url = request.headers.get(header)
        if url is None:
            return None
        if normal_url(url) is None:
            raise APIError(400, f"{header} must be the http(s) base URL of a node", param=header)
        listed = self.peers.named(url)
        if listed is None:
            raise APIError(403, f"{header} names {url!r}, which is not among this node's --federation-peers: it "
                                "exchanges KV only with the nodes listed there", param=header, code="unlisted_peer")
        return listed

    def pulls_from(self, request: web.Request) -> str | None:
        """The node whose longer prefix of the prompt the prefill node is to pull first (the
        conductor's choice), for a request this node decodes remotely. The pull only saves work: a
        source not among --federation-peers is dropped (and logged), and the request is served."""
        if self.decodes_remotely(request) is None:
            return None
        try:
            return self.peer(request, PREFIX_HEADER)
        except APIError as e:
            if e.status != 403:
                raise
            log.warning("%s: no pull", e.message)
            return None

    def drive(self, slot, request_id: str, order: PrefillOrder, url: str, reserved: asyncio.Future) -> None:
        """Have the prefill node at `url` fill the pages the engine reserves (its answer, Reserved;
        `order` without its target yet), asked with this node's key. `cancel(request_id)` when the
        client has gone."""
        task = asyncio.create_task(self._drive(slot, request_id, order, url, reserved))
        self.tasks[request_id] = task
        task.add_done_callback(lambda _: self.tasks.pop(request_id, None))

    def cancel(self, request_id: str) -> None:
        """The request ended: a prefill still under way is called off (the prefill node aborts it;
        its answer, which still comes, says when the pages are safe)."""
        url = self.asked.get(request_id)
        if url is not None and request_id in self.tasks:
            task = asyncio.create_task(self._abort(url, request_id))
            self.aborts.add(task)
            task.add_done_callback(self.aborts.discard)

    async def _abort(self, url: str, request_id: str) -> None:
        try:
            async with self._client().post(f"{url}/federation/abort", json={"request_id": request_id},
                                           headers=self.auth,
                                           timeout=aiohttp.ClientTimeout(total=self.timeout)) as r:
                await r.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            pass  # unreachable: its pages wait out the horizon

    async def _drive(self, slot, rid: str, order: PrefillOrder, url: str, reserved: asyncio.Future) -> None:
        try:
            msg: p.Reserved = await asyncio.wait_for(reserved, self.timeout)
        except asyncio.TimeoutError:  # the engine is gone or far behind: whatever it reserved is free
            self.supervisor.send(slot, p.RemoteArrived(rid, None, settled=True))
            return
        finally:
            self.supervisor.forget(rid)
        if msg.target is None:  # no room, or refused: it computes its prompt here, or has ended
            return
        order = msgspec.structs.replace(order, target=msg.target, send_window=send_window(self.timeout))
        self.asked[rid] = url
        try:
            session = self._client()
            # silence longer than the transfer timeout (no heartbeat): the prefill node or its link is gone
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.timeout, sock_read=self.timeout)
            headers = {"Content-Type": "application/json", **self.auth}
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
        self.asked.pop(rid, None)
        self.supervisor.send(slot, p.RemoteArrived(rid, answer.first_token if answer.ok else None,
                                                   answer.checksum, answer.settled, answer.num_cached_tokens))

    # -- whole pages into another node's prefix cache (federation/store.py) ----------------------
    # Two moves share one sequence (`_move`), each side either this node's engine (_Here) or another
    # node's front (_There):
    #   MemServe's return   keeper: the prefill node (_There)   giver: the decode node's engine (_Here)
    #   a prefill's pull    keeper: the prefill node's engine   giver: the prefill node holding the
    #                       (_Here)                             longer prefix (_There)
    async def keep(self, request: web.Request) -> web.Response:
        """POST /federation/keep {"store_id", "token_ids"} (a prefill node): pages for the whole pages
        of `token_ids` after those its cache holds. -> {"held", "target"} (target null: none)."""
        try:
            body = msgspec.json.decode(await self.front.read_body(request), type=KeepOrder)
        except (msgspec.DecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"not a keep order: {e}") from None
        if self.role != "prefill":
            raise APIError(409, "only a prefill node keeps others' KV", code="wrong_role")
        self._check_token_ids(body.token_ids)
        slot = self.supervisor.slots[self.front.router.pick(self.front.ready_slots(), body.token_ids).engine_id]
        answer = await self._reserve(slot, body)
        return web.Response(body=msgspec.json.encode(answer), content_type="application/json")

    async def give(self, request: web.Request) -> web.Response:
        """POST /federation/give {"store_id", "token_ids", "held", "target"} (a prefill or decode node):
        its engine that holds them writes its cached pages of `token_ids` after the first `held` into
        the target, as one batch. -> {"ok", "checksum", "num_pages"} once the writes have settled."""
        try:
            body = msgspec.json.decode(await self.front.read_body(request), type=GiveOrder)
        except (msgspec.DecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"not a give order: {e}") from None
        if self.role == "both":
            raise APIError(409, "a node of role both has no KV transfer engine to give with", code="wrong_role")
        self._check_token_ids(body.token_ids)
        if body.held < 0:
            raise APIError(400, "held must be 0 or more", param="held")
        slot = self.supervisor.slots[self.front.router.pick(self.front.ready_slots(), body.token_ids).engine_id]
        try:
            answer = await self._give(slot, body)
        except asyncio.TimeoutError:  # its writes may still be under way: the keeper holds its pages to their horizon
            raise APIError(503, "the engine did not answer") from None
        return web.Response(body=msgspec.json.encode(answer), content_type="application/json")

    async def kept(self, request: web.Request) -> web.Response:
        """POST /federation/kept {"store_id", "ok", "checksum"}: the giver's writes have settled."""
        try:
            body = msgspec.json.decode(await self.front.read_body(request), type=KeptReport)
        except (msgspec.DecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"not a report: {e}") from None
        return web.json_response({"known": self._report(body)})

    def give_back(self, slot, token_ids: list[int], url: str) -> None:
        """A decode node: the ended request's whole pages go to the prefill node at `url` (MemServe)."""
        task = asyncio.create_task(self._move(token_ids, _There(self, url), _Here(self, slot), "return"))
        self.aborts.add(task)
        task.add_done_callback(self.aborts.discard)

    async def _pull(self, slot, prompt: list[int], url: str) -> None:
        """A prefill node, before it computes `prompt` on engine `slot`: the whole pages of it that the
        node at `url` holds and this engine lacks come into this engine's prefix cache, where they stay
        (Algorithm 1's transfer branch: hot prefixes replicate by use). Within one transfer timeout;
        a pull that fails leaves the prompt to compute."""
        if not url.startswith(("http://", "https://")):
            return
        # the last token is always computed (kv/manager.py `match`): only pages before it can hit
        try:
            await asyncio.wait_for(self._move(prompt[:-1], _Here(self, slot), _There(self, url), "pull"),
                                   self.timeout)
        except asyncio.TimeoutError:  # the pages it reserved wait out their horizon (no write lands after it)
            log.info("the pull from %s took over %s s: computing the prompt", url, self.timeout)
            self.front.metrics.federation.labels("pull", "failed").inc()
        except asyncio.CancelledError:  # called off, or the order's own end: a pull that did not happen
            self.front.metrics.federation.labels("pull", "failed").inc()
            raise

    async def _move(self, token_ids: list[int], keeper: _Here | _There, giver: _Here | _There, side: str) -> bool:
        """One store: the keeper reserves pages for the whole pages of `token_ids` after those it holds,
        the giver writes its cached pages of them there as one batch, and once those writes have
        settled (never before: a write said done may still be landing) the keeper publishes what
        arrived with a matching crc32. A store the keeper is never told of, or told failed, holds its
        pages until its horizon (timing.py). Counted by `side` (return, pull) when there was
        something to move. -> the giver wrote them."""
        sid = uuid.uuid4().hex
        try:
            kept = await keeper.keep(sid, token_ids)
            if kept.target is None:  # it holds them all, or has no room
                return False
            try:
                given = await giver.give(GiveOrder(sid, token_ids, kept.held, kept.target))
            except (_Refused, APIError, aiohttp.ClientConnectorError) as e:
                # refused, or never reached: nothing was written (a 5xx or a timeout may hide writes)
                unwritten = (isinstance(e, aiohttp.ClientConnectorError) or 400 <= getattr(e, "status", 0) < 500)
                given = GiveAnswer(False, error=repr(e), unwritten=unwritten)
            # the keeper frees pages nothing was written to at once, others at their horizon
            await keeper.kept(KeptReport(sid, given.ok, given.checksum, given.num_pages,
                                         unwritten=not given.ok and given.unwritten))
        except (_Refused, APIError, aiohttp.ClientError, asyncio.TimeoutError, msgspec.DecodeError, OSError) as e:
            log.info("%s of %d tokens (%s -> %s) failed: %r", side, len(token_ids), giver, keeper, e)
            given = GiveAnswer(False, error=repr(e))
        self.front.metrics.federation.labels(side, "ok" if given.ok else "failed").inc()
        return given.ok

    def _check_token_ids(self, token_ids: list[int]) -> None:
        vocab = self.front.tokenizer.vocab_size
        if not 0 < len(token_ids) <= self.front.max_model_len() or any(not 0 <= t < vocab for t in token_ids):
            raise APIError(400, f"token_ids must be 1 to {self.front.max_model_len()} ids in [0, {vocab})")

    async def _reserve(self, slot, order: KeepOrder) -> KeepAnswer:
        """The keeper's step on engine `slot`: pages for the whole pages of the order's tokens after
        those it holds (KeepKV). APIError: refused."""
        try:
            answer = self.supervisor.expect(order.store_id)
        except ValueError as e:
            raise APIError(409, str(e)) from None
        try:
            if not self.supervisor.send(slot, p.KeepKV(order.store_id, order.token_ids, self.supervisor.front)):
                raise APIError(503, "the engine is not serving")
            msg: p.Reserved = await asyncio.wait_for(answer, self.timeout)
        except asyncio.TimeoutError:
            raise APIError(503, "the engine did not answer") from None
        finally:
            self.supervisor.forget(order.store_id)
        if msg.error:
            raise APIError(409, msg.error)
        now = time.monotonic()
        for sid in [sid for sid, (_, until) in self.keeping.items() if until <= now]:
            del self.keeping[sid]  # never reported: the engine has freed them by now
        if msg.target is not None:
            self.keeping[order.store_id] = (slot, now + horizon(self.timeout))
        return KeepAnswer(msg.held, msg.target)

    def _report(self, report: KeptReport) -> bool:
        """The keeper's last step: the giver's writes have settled (KeptKV). -> the store was known."""
        kept = self.keeping.pop(report.store_id, None)
        if kept is not None:
            self.supervisor.send(kept[0], p.KeptKV(report.store_id, report.ok, report.checksum, report.num_pages,
                                                   report.unwritten))
        return kept is not None

    async def _give(self, slot, order: GiveOrder) -> GiveAnswer:
        """The giver's step on engine `slot` (GiveKV): its answer once its writes have settled.
        asyncio.TimeoutError: none came (its writes may still be under way)."""
        try:
            answer = self.supervisor.expect(order.store_id)
        except ValueError as e:
            raise APIError(409, str(e)) from None
        try:
            # writes start within one timeout of the keeper's answer, well inside its horizon
            give = p.GiveKV(order.store_id, order.token_ids, order.held, order.target, self.supervisor.front,
                            deadline=time.monotonic() + self.timeout)
            if not self.supervisor.send(slot, give):  # nothing was written: the keeper may know at once
                return GiveAnswer(False, error="the engine is not serving", unwritten=True)
            given: p.Prefilled = await asyncio.wait_for(answer, 2 * self.timeout + MARGIN)
        finally:
            self.supervisor.forget(order.store_id)
        return GiveAnswer(given.ok, given.checksum, given.num_pages, given.error, given.unwritten)

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # no bound on connections: each order holds one for its queue and compute
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        return self._session

    async def close(self) -> None:
        for task in list(self.tasks.values()):
            task.cancel()
        if self._session is not None:
            await self._session.close()


class _Here:
    """This node's engine `slot` as one side of a store."""

    def __init__(self, federation: Federation, slot) -> None:
        self.federation, self.slot = federation, slot

    def __repr__(self) -> str:
        return f"engine {self.slot.engine_id}"

    async def keep(self, store_id: str, token_ids: list[int]) -> KeepAnswer:
        return await self.federation._reserve(self.slot, KeepOrder(store_id, token_ids))

    async def give(self, order: GiveOrder) -> GiveAnswer:
        return await self.federation._give(self.slot, order)

    async def kept(self, report: KeptReport) -> None:
        self.federation._report(report)


class _There:
    """Another node's front at `url` as one side of a store, asked with this node's key."""

    def __init__(self, federation: Federation, url: str) -> None:
        self.federation, self.url = federation, url
        self.headers = {"Content-Type": "application/json", **federation.auth}

    def __repr__(self) -> str:
        return self.url

    async def keep(self, store_id: str, token_ids: list[int]) -> KeepAnswer:
        raw = await self._post("/federation/keep", KeepOrder(store_id, token_ids), 2 * self.federation.timeout)
        return msgspec.json.decode(raw, type=KeepAnswer)

    async def give(self, order: GiveOrder) -> GiveAnswer:
        raw = await self._post("/federation/give", order, 2 * self.federation.timeout + MARGIN)
        return msgspec.json.decode(raw, type=GiveAnswer)

    async def kept(self, report: KeptReport) -> None:
        await self._post("/federation/kept", report, 2 * self.federation.timeout)

    async def _post(self, path: str, body: msgspec.Struct, timeout: float) -> bytes:
        async with self.federation._client().post(f"{self.url}{path}", data=msgspec.json.encode(body),
                                                  headers=self.headers,
                                                  timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            raw = await r.read()
            if r.status != 200:
                raise _Refused(f"{path}: {r.status} {raw[:200]!r}", r.status)
            return raw
