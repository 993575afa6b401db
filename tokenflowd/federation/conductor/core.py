"""`tokenflowd conductor --config cluster.toml`: the global scheduler in front of a federated cluster.

    client ──OpenAI API──► conductor ──the same request (+ X-Tokenflowd-Prefill-Node)──► decode node
                             │  polls every node's /federation/state:         │ its front asks the
                             │  role, queue, step-time model, prefix keys     ▼ prefill node to fill
                             └──────────────────────────────────────────► prefill node (KV over Mooncake TE)

For each request the conductor tokenizes the prompt (the nodes' tokenizer, so its page keys are
theirs), finds each prefill node's cached prefix, and picks a (prefill, decode) pair by Mooncake's
Algorithm 1 (placement.py): the least predicted TTFT, and the decode node of least predicted time
between tokens. A node of role `both` is its own pair. A prefill node far behind the longest match
may be placed to fetch it first, when the transfer (a token's KV bytes over the bandwidth the
holder's transfer engine measured to it, or its mean measured egress, or `link_gbps`) and its own
queue beat the holder's queue: the request then also names the holder
(`X-Tokenflowd-Prefix-Node`), and the prefill node pulls those pages into its own prefix cache,
where they stay (daemon/api/federation.py). Before any prefill is spent, early
rejection (rejection.py) refuses the request with 429 and Retry-After when the decode pool is
predicted to be full by the time the request would reach it. The decode node's response (its SSE
stream) is passed to the client byte for byte.

Faults: a node whose state poll fails, or that refuses a connection, leaves placement at once and
comes back when its state answers again. A request whose decode node cannot be reached before
any byte came back is placed again without that node; one whose stream breaks midway ends with an
SSE error event.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import time
import uuid

import aiohttp
import msgspec
from aiohttp import web

from tokenflowd.federation.conductor.config import ConductorConfig
from tokenflowd.federation.conductor.nodes import NodeView
from tokenflowd.federation.conductor.placement import DecodeNode, Placement, PrefillNode, Rejection, place
from tokenflowd.federation.conductor.rejection import DecodeLoad, EarlyRejection
from tokenflowd.federation.conductor.remote_prefill import RemotePrefill
from tokenflowd.federation.wire import PREFILL_HEADER, PREFIX_HEADER
from tokenflowd.kv.pages import chain_page_keys
from tokenflowd.openai_api import schema as s
from tokenflowd.openai_api.errors import APIError, error_event

log = logging.getLogger("tokenflowd.conductor")

_PASSED_HEADERS = ("Authorization", "X-Reading-Rate", "Content-Type", "Accept")
_HOP_BY_HOP = {"content-length", "transfer-encoding", "connection", "keep-alive", "date", "server"}
SLOW_POLLS = 3  # state polls in a row that time out before a node leaves placement
MAX_SERVED = 100_000  # request ids remembered with their decode node (read cursors)
MAX_BODY = 4 * 2**20  # the nodes' default --max-body-size


class Conductor:
    def __init__(self, config: ConductorConfig, tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.nodes = {name: NodeView(name, url) for name, url in config.nodes}
        self.load = DecodeLoad(capacity=1, decode_seconds=config.decode_seconds)
        self.gate = EarlyRejection(self.load, predict="current" if config.rejection == "current" else "predicted")
        self.session: aiohttp.ClientSession | None = None
        self.counts = {"accepted": 0, "rejected": 0, "replaced": 0, "failed": 0,
                       "fetched": 0}  # fetched: placed on a prefill node that pulls a longer prefix first
        self.placed: collections.Counter[str] = collections.Counter()  # "prefill->decode" -> requests
        self.served: collections.OrderedDict[str, str] = collections.OrderedDict()  # request id -> decode node
        self._chat = msgspec.json.Decoder(s.ChatCompletionRequest)
        self._completion = msgspec.json.Decoder(s.CompletionRequest)
        self._polls: list[asyncio.Task] = []
        self._auth = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        queue = config.prfaas_queue_seconds if config.prfaas_queue_seconds is not None else config.ttft_slo / 4
        self.remote_prefill = RemotePrefill(config.prfaas_threshold, config.prfaas_output_tokens, config.tbt_slo, queue,
                               config.prfaas_probe_period, config.prfaas_retransmit_share)
        self.converting: dict[str, tuple[str, float]] = {}  # node -> (the role it is to take, since when)

    # -- the nodes --------------------------------------------------------------------------------
    async def start(self) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=2.0))
        self._polls = [asyncio.create_task(self._follow(node)) for node in self.nodes.values()]
        if self.config.remote or self.config.prfaas_replan_period:
            self._polls.append(asyncio.create_task(self._plan()))

    async def stop(self) -> None:
        for task in self._polls:
            task.cancel()
        for task in self._polls:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.session is not None:
            await self.session.close()

    async def _follow(self, node: NodeView) -> None:
        """Poll the node's state. One that refuses the connection, or answers with an error, leaves
        placement at once; one that is slow to answer (a busy front) only after SLOW_POLLS polls in a
        row have timed out. It comes back with its first answer."""
        timeout = aiohttp.ClientTimeout(total=max(2.0, 8 * self.config.poll_interval))
        slow = 0
        while True:
            try:
                async with self.session.get(f"{node.url}/federation/state", params={"since": str(node.seq)},
                                            timeout=timeout, headers=self._auth) as r:
                    r.raise_for_status()
                    node.apply(await r.json())
                if not node.healthy:
                    log.info("node %s (%s, %s) is serving", node.name, node.role, node.url)
                node.healthy, slow = True, 0
            except asyncio.TimeoutError as e:
                slow += 1
                if slow >= SLOW_POLLS:
                    self._down(node, f"{slow} polls unanswered ({e!r})")
            except (aiohttp.ClientError, OSError, KeyError, ValueError, TypeError, AttributeError) as e:
                self._down(node, repr(e))  # a state that is not one (TypeError: a field of the wrong kind)
            await asyncio.sleep(self.config.poll_interval)

    async def _plan(self) -> None:
        """PrfaaS's two timescales (federation/conductor/remote_prefill.py): every prfaas_period the threshold, every
        prfaas_replan_period the local split; and the conversions under way, until they are done."""
        c = self.config
        remote = [self.nodes[name] for name in c.remote]
        local = [n for n in self.nodes.values() if n.name not in c.remote]
        replanned = time.monotonic()
        while True:
            await asyncio.sleep(c.prfaas_period)
            now = time.monotonic()
            if remote:
                self.remote_prefill.update(remote, local, now)
            if c.prfaas_replan_period and not self.converting and now - replanned >= c.prfaas_replan_period:
                replanned = now
                move = self.remote_prefill.split(remote, [n for n in local if n.name not in self.converting],
                                          c.prfaas_convert_gain)
                if move is not None:
                    self.converting[move[0]] = (move[1], now)
            for name, (role, since) in list(self.converting.items()):
                await self._convert(self.nodes[name], role, since, now)

    async def _convert(self, node: NodeView, role: str, since: float, now: float) -> None:
        """One try at the node's new role: it takes it once it has no work of its old role left."""
        try:
            async with self.session.post(f"{node.url}/federation/role", json={"role": role}, headers=self._auth,
                                         timeout=aiohttp.ClientTimeout(total=10)) as r:
                body = await r.json(content_type=None)
                if r.status == 200:
                    log.info("node %s takes the %s role", node.name, role)
                    node.role = role  # the next poll says so too
                    del self.converting[node.name]
                    return
                code = (body.get("error") or {}).get("code") if isinstance(body, dict) else None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
            code = repr(e)
        if code != "draining" or now - since > self.config.prfaas_drain_timeout:
            log.warning("node %s did not take the %s role (%s): it stays %s", node.name, role, code, node.role)
            del self.converting[node.name]

    def _down(self, node: NodeView, why: str) -> None:
        if node.healthy:
            log.warning("node %s is out of placement: %s", node.name, why)
        node.healthy, node.seq = False, -1

    # -- placement ----------------------------------------------------------------------------------
    def bandwidth(self, src: str, dst: str) -> float:
        """Bytes/s from node `src` to node `dst`: measured between them, else `src`'s mean measured
        egress, else the nominal link_gbps."""
        a, b = self.nodes[src], self.nodes[dst]
        measured = [bps for peer, bps in a.links.items() if peer in b.kv_endpoints] or list(a.links.values())
        if measured:
            return sum(measured) / len(measured)
        return self.config.link_gbps * 1e9 / 8

    def place(self, prompt_ids: list[int], exclude: set[str], reading_rate: float | None = None) -> Placement | Rejection:
        """`reading_rate`: the client's tokens/s; a slower reader is served by a decode node whose
        time between tokens is up to 1/rate, beyond the operator's tbt_slo (its buffer covers it)."""
        # a node being converted takes no new work (it drains)
        serving = [n for n in self.nodes.values() if n.serving and n.name not in exclude and n.name not in self.converting]
        if not serving:
            return Rejection("no node")
        keys = chain_page_keys(prompt_ids, serving[0].page_size, [])
        prefill = [n for n in serving if n.role == "prefill" and n.name not in self.config.remote]
        decode = [n for n in serving if n.role == "decode"]
        far = [n for n in serving if n.role == "prefill" and n.name in self.config.remote]
        # PrfaaS: the remote nodes prefill what stays long after the local caches (every request's
        # length is recorded: the long-term plan needs them, remote nodes or not)
        offloading = bool(far and decode)
        uncached = len(prompt_ids) - max((n.prefix_tokens(keys) for n in prefill), default=0)
        if self.remote_prefill.route(len(prompt_ids), uncached, offloading) or (offloading and not prefill):
            prefill = far
        groups = [(prefill, decode)] if prefill and decode else []
        groups += [([n], [n]) for n in serving if n.role == "both"]
        if not prefill or not decode:  # one side is gone: the other's nodes serve requests whole
            groups += [([n], [n]) for n in prefill + decode]
        best: Placement | Rejection = Rejection("no prefill and decode pair")
        c = self.config
        for ps, ds in groups:
            # a prefix moves only between nodes with transfer engines that say what a token weighs
            token_bytes = min(n.kv_token_bytes for n in ps)
            bandwidth = self.bandwidth if token_bytes else _no_link
            choice = place(len(prompt_ids),
                           [PrefillNode(n.name, n.prefix_tokens(keys), n.queue_seconds(), n.prefill_seconds) for n in ps],
                           [DecodeNode(n.name, n.tbt_seconds()) for n in ds],
                           bandwidth=bandwidth, kv_bytes_per_token=token_bytes,
                           balancing_threshold=c.balancing_threshold,
                           ttft_slo=c.ttft_slo, tbt_slo=max(c.tbt_slo, 1.0 / reading_rate if reading_rate else 0.0))
            if isinstance(choice, Placement) and (not isinstance(best, Placement)
                                                  or choice.ttft_seconds < best.ttft_seconds):
                best = choice
            elif isinstance(best, Rejection) and isinstance(choice, Rejection) and best.reason.startswith("no"):
                best = choice
        return best

    def admit(self, placement: Placement, now: float) -> bool:
        if self.config.rejection == "off":
            return True
        serving = [n for n in self.nodes.values() if n.serving]
        self.load.capacity = sum(n.capacity for n in serving if n.role != "prefill")
        # the soonest a request arriving now could reach decode: behind the shortest prefill queue
        queues = [n.queue_seconds() for n in serving if n.role != "decode"] or [0.0]
        return self.gate.admit(now, now + placement.ttft_seconds, earliest=now + min(queues))

    # -- the OpenAI API -------------------------------------------------------------------------------
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = self._chat.decode(raw)
            messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                        for m in body.messages]
            prompt_ids, rate = self.tokenizer.encode_chat(messages), body.reading_rate
        except Exception:  # the node says what is wrong with it, in its words
            prompt_ids, rate = [], None
        return await self._forward(request, raw, prompt_ids, rate)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        prompt_ids: list[int] = []
        rate = None
        with contextlib.suppress(Exception):
            body = self._completion.decode(raw)
            prompt, rate = body.prompt, body.reading_rate
            if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
                prompt = prompt[0]
            if isinstance(prompt, str):
                prompt_ids = self.tokenizer.encode(prompt)
            elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                prompt_ids = list(prompt)
        return await self._forward(request, raw, prompt_ids, rate)

    async def _forward(self, request: web.Request, raw: bytes, prompt_ids: list[int],
                       reading_rate: float | None) -> web.StreamResponse:
        now = time.monotonic()
        rid = uuid.uuid4().hex
        tried: set[str] = set()
        if reading_rate is None:
            with contextlib.suppress(ValueError):
                reading_rate = float(request.headers.get("X-Reading-Rate", "nan"))
        if reading_rate is not None and not 0 < reading_rate < math.inf:
            reading_rate = None
        retry_after = {"Retry-After": str(max(1, round(self.load.decode_seconds / 4)))}
        accepted = False
        try:
            while True:
                placement = self.place(prompt_ids or [0], tried, reading_rate)
                if isinstance(placement, Rejection):
                    self.counts["rejected" if not accepted else "failed"] += 1
                    if placement.reason.startswith("no"):
                        raise APIError(503, f"no node can serve this now ({placement.reason}): retry shortly",
                                       code="unavailable", headers={"Retry-After": "1"})
                    late = placement.ttft_seconds if placement.reason == "ttft" else placement.tbt_seconds
                    raise APIError(429, f"the cluster is overloaded (predicted {placement.reason} {late:.1f} s, over "
                                        "its SLO): retry later", code="overloaded", headers=retry_after)
                if not accepted:
                    if not self.admit(placement, now):
                        self.counts["rejected"] += 1
                        raise APIError(429, "the decode nodes are predicted to be full when this request would reach "
                                            "them: retry later", code="overloaded", headers=retry_after)
                    accepted = True
                    self.counts["accepted"] += 1
                    self.load.accepted(rid, now + placement.ttft_seconds)
                self.placed[f"{placement.prefill}->{placement.decode}"] += 1
                try:
                    return await self._proxy(request, raw, placement, rid)
                except _Unreachable as e:  # nothing was sent: place it again without that node
                    self._down(self.nodes[e.node], e.why)
                    tried.add(e.node)
                    self.counts["replaced"] += 1
        finally:
            if accepted:  # on every path, the client's going included: the decode load counts it no more
                self.load.finished(rid, time.monotonic())

    async def _proxy(self, request: web.Request, raw: bytes, placement: Placement, rid: str) -> web.StreamResponse:
        decode = self.nodes[placement.decode]
        headers = {h: request.headers[h] for h in _PASSED_HEADERS if h in request.headers}
        if placement.prefill != placement.decode:
            headers[PREFILL_HEADER] = self.nodes[placement.prefill].url
            if placement.fetch_from is not None:  # the prefill node pulls the longer prefix from there first
                headers[PREFIX_HEADER] = self.nodes[placement.fetch_from].url
                self.counts["fetched"] += 1
        try:
            upstream_cm = self.session.post(f"{decode.url}{request.path_qs}", data=raw, headers=headers)
            upstream = await upstream_cm.__aenter__()
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError, OSError) as e:
            raise _Unreachable(decode.name, f"{type(e).__name__}: {e}") from None
        try:
            response = web.StreamResponse(status=upstream.status, headers=_returned(upstream.headers))
            served = upstream.headers.get("X-Request-Id")
            if served:  # its read cursor and inspection go to the node that serves it
                self.served[served] = decode.name
                while len(self.served) > MAX_SERVED:
                    self.served.popitem(last=False)
            # a stream's first bytes are its decode's start; a whole response decoded from when its
            # decode was predicted to start (it says no more)
            stream = upstream.headers.get("Content-Type", "").startswith("text/event-stream")
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                if stream and self.load.pending_start(rid) is not None:
                    self.load.started(rid, time.monotonic())
                await response.write(chunk)
            predicted = self.load.pending_start(rid)
            if not stream and upstream.status == 200 and predicted is not None:
                self.load.started(rid, min(predicted, time.monotonic()))
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
            self.counts["failed"] += 1
            log.warning("the stream from %s broke: %s", decode.name, e)
            if upstream.headers.get("Content-Type", "").startswith("text/event-stream"):
                with contextlib.suppress(ConnectionError, RuntimeError):
                    await response.write(error_event(f"the decode node {decode.name} failed mid-stream: {e}", code="node_failed"))
        finally:
            await upstream_cm.__aexit__(None, None, None)
        with contextlib.suppress(ConnectionError, RuntimeError):
            await response.write_eof()
        return response

    async def request_route(self, request: web.Request) -> web.StreamResponse:
        """GET /v1/requests/{id}, POST /v1/requests/{id}/read: to the node that serves the request."""
        node = self.nodes.get(self.served.get(request.match_info["request_id"], ""))
        if node is None:
            raise APIError(404, "no request with this id is being served here", code="not_found")
        headers = {h: request.headers[h] for h in _PASSED_HEADERS if h in request.headers}
        try:
            async with self.session.request(request.method, f"{node.url}{request.path_qs}", data=await request.read(),
                                            headers=headers, timeout=aiohttp.ClientTimeout(total=10)) as r:
                return web.Response(status=r.status, body=await r.read(), headers=_returned(r.headers))
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise APIError(502, f"the node serving it did not answer: {e}") from None

    async def request_list(self, request: web.Request) -> web.Response:
        """GET /v1/requests: the requests under way on every node, asked with the client's key and
        merged in a node's format. A node that does not answer, and one out of placement (not
        asked), is left out and named in "unreachable"; a key the nodes refuse is refused as they do."""
        headers = {h: request.headers[h] for h in _PASSED_HEADERS if h in request.headers}
        asked = [n for n in self.nodes.values() if n.healthy]
        answers = dict(zip((n.name for n in asked), await asyncio.gather(
            *(self._requests_of(n, headers) for n in asked), return_exceptions=True)))
        data: list[dict] = []
        unreachable: list[str] = []
        for name in self.nodes:
            answer = answers.get(name)
            if isinstance(answer, _Refused):
                return answer.response
            if isinstance(answer, BaseException):
                raise answer
            if answer is None:
                unreachable.append(name)
            else:  # a prefill node's order for a request is the request the decode node lists
                data += [r for r in answer if not str(r.get("request_id", "")).startswith("prefill-")]
        if len(unreachable) == len(self.nodes):
            raise APIError(502, f"no node answered (unreachable: {', '.join(unreachable)}): retry shortly",
                           code="unavailable", headers={"Retry-After": "1"})
        return web.json_response({"object": "list", "data": data, "unreachable": unreachable})

    async def _requests_of(self, node: NodeView, headers: dict[str, str]) -> list[dict] | None:
        """The node's GET /v1/requests list, or None when it gives none. Raises _Refused when it
        refuses the client's key (the nodes share their keys: each would)."""
        try:
            async with self.session.get(f"{node.url}/v1/requests", headers=headers,
                                        timeout=aiohttp.ClientTimeout(total=10)) as r:
                body = await r.read()
                if r.status in (401, 403):
                    raise _Refused(web.Response(status=r.status, body=body, headers=_returned(r.headers)))
                if r.status != 200:
                    log.warning("node %s answered GET /v1/requests with %d", node.name, r.status)
                    return None
                return msgspec.json.decode(body, type=_RequestList).data
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, msgspec.DecodeError) as e:
            log.warning("node %s did not list its requests: %r", node.name, e)
            return None

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.config.model, "object": "model",
                                                              "owned_by": "tokenflowd"}]})

    async def health(self, request: web.Request) -> web.Response:
        nodes = {n.name: {"healthy": n.healthy, "serving": n.serving, "role": n.role, "url": n.url, "keys": len(n.keys)}
                 for n in self.nodes.values()}
        ok = any(n.serving for n in self.nodes.values())
        offload = {"threshold": None if math.isinf(self.remote_prefill.threshold) else self.remote_prefill.threshold,
                   "offloaded": self.remote_prefill.offloaded, "probes": self.remote_prefill.probes,
                   "congested": self.remote_prefill.congested, "egress_measured": self.remote_prefill.egress,
                   "planned_throughput": self.remote_prefill.planned, "bound": self.remote_prefill.bound,
                   "converting": {name: role for name, (role, _) in self.converting.items()}}
        return web.json_response({"status": "ok" if ok else "no node", "nodes": nodes, "placed": self.placed,
                                  **self.counts, "prfaas": offload},
                                 status=200 if ok else 503)


def _no_link(src: str, dst: str) -> float:
    return 0.0


def _returned(headers) -> dict[str, str]:
    """A node's response headers, as the client gets them (the connection's own left out)."""
    return {k: v for k, v in headers.items() if k.lower() not in _HOP_BY_HOP}


class _RequestList(msgspec.Struct):
    data: list[dict]


class _Refused(Exception):
    def __init__(self, response: web.Response) -> None:
        super().__init__(response.status)
        self.response = response


class _Unreachable(Exception):
    def __init__(self, node: str, why: str) -> None:
        super().__init__(why)
        self.node, self.why = node, why
