"""The front's routes:

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models
    GET  /v1/requests[/{id}]    POST /v1/requests/{id}/read (the client's read cursor)
    GET  /health                GET /metrics           GET /openapi.json

Response headers of a stream are sent with its first token, so a request the engine refuses still
gets a 4xx; after that, pieces are written as they come, from the supervisor's loop.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
import uuid
from typing import Any

import msgspec
from aiohttp import HttpVersion11, web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tokenflowd.daemon.api.auth import CALLER, Caller
from tokenflowd.daemon.api.connections import writable
from tokenflowd.daemon.api.front import Front, Live, Prepared
from tokenflowd.daemon.api.generation import Generation, Piece
from tokenflowd.daemon.api.sse import (
    SSE_HEADERS,
    ChatChunks,
    CompletionChunks,
    Logprobs,
    SSEConnection,
    reset,
    tune_for_backpressure,
    usage,
    usage_of,
)
from tokenflowd.daemon.procstats import process_figures
from tokenflowd.daemon.router import Choice
from tokenflowd.openai_api import schema as s
from tokenflowd.openai_api.errors import APIError, error_event
from tokenflowd.protocol import RequestInfo
from tokenflowd.text.tokenizer import Tokenizer
from tokenflowd.text.tools import ToolCall, template_messages

log = logging.getLogger("tokenflowd.api")

RELAYED = "X-Tokenflowd-Relayed"  # a request one API server process passed to another: not passed on again


class Routes:
    """The front's routes: the OpenAI endpoints, request inspection, /health, /metrics and
    /openapi.json. Each handler turns a request into the front's work (front.py) and the answer
    into JSON or SSE (sse.py)."""

    def __init__(self, front: Front) -> None:
        self.front = front

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        arrival = time.monotonic()
        body: s.ChatCompletionRequest = await self.front.decode(request, self.front.chat_decoder)
        self.front.check_model(body.model)
        self.front.check_priority(body.priority, request)
        messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {}),
                     **({"tool_calls": msgspec.to_builtins(m.tool_calls)} if m.tool_calls else {}),
                     **({"tool_call_id": m.tool_call_id} if m.tool_call_id is not None else {})}
                    for m in body.messages]
        tokenizer = self.front.tokenizer
        offered = ([msgspec.to_builtins(t) for t in body.tools]
                   if body.tools and body.tool_choice != "none" else None)
        tooling = offered or any(m.tool_calls or m.tool_call_id is not None for m in body.messages)
        rendered = template_messages(messages, offered, tokenizer.chat_template) if tooling else messages
        self.front.check_length_floor(sum(tokenizer.min_tokens(m["content"]) for m in rendered), "messages")
        nbytes = sum(len(m["content"]) for m in rendered)
        try:
            prompt_ids = await self.front.tokenize(nbytes, tokenizer.encode_chat, rendered,
                                                   *((True, offered) if offered else ()))
        except Exception as e:  # the model's chat template refused the conversation
            raise APIError(400, f"the chat template cannot render these messages: {e}", param="messages",
                           code="chat_template") from None
        turns = [(m["role"], m["content"]) for m in messages]
        cadence = self.front.conversation_cadence(request, body.user, turns, arrival)
        prep = self.front.prepare(body, prompt_ids, body.max_completion_tokens or body.max_tokens, request, cadence)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        chunks = ChatChunks(rid, self.created_now(), self.front.model_name, self._namer(prep))
        return await self._respond(request, prep, arrival, chunks)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        arrival = time.monotonic()
        body: s.CompletionRequest = await self.front.decode(request, self.front.completion_decoder)
        self.front.check_model(body.model)
        self.front.check_priority(body.priority, request)
        prompt_ids = await self._completion_prompt(body.prompt)
        cadence = self.front.conversation_cadence(request, body.user, None, arrival)
        prep = self.front.prepare(body, prompt_ids, body.max_tokens, request, cadence)
        rid = f"cmpl-{uuid.uuid4().hex}"
        chunks = CompletionChunks(rid, self.created_now(), self.front.model_name, self._namer(prep))
        return await self._respond(request, prep, arrival, chunks)

    def _namer(self, prep: Prepared) -> Tokenizer | None:
        """What names the tokens of logprobs, for the requests that ask for them."""
        return self.front.tokenizer if prep.sampling.logprobs >= 0 else None

    def _open(self, caller: Caller) -> None:
        """Counts a request open; 429 beyond --max-streams open requests, or beyond the caller's key's
        max_concurrent."""
        refused = self.front.open_counts.open(caller.identity, self.front.config.max_streams, caller.max_concurrent)
        if refused is None:
            return
        self.front.metrics.rejected.labels("429").inc()
        if refused == "streams":
            total = self.front.open_counts.total()
            raise APIError(429, f"the server has {total} requests open, its bound (--max-streams): "
                                "retry after a second", code="too_many_streams", headers={"Retry-After": "1"})
        raise APIError(429, f"this API key has {caller.max_concurrent} requests open, as many as it may: wait for "
                            "one to end", code="too_many_requests_for_key", headers={"Retry-After": "1"})

    async def _respond(self, request: web.Request, prep: Prepared, arrival: float, chunks: Any) -> web.StreamResponse:
        if prep.n > 1:
            return await self._respond_choices(request, prep, arrival, chunks)
        caller = request[CALLER]
        prefill_node = self.front.federation.decodes_remotely(request)
        pull_from = self.front.federation.pulls_from(request)
        self._open(caller)
        try:
            gen = self.front.start(prep, chunks.rid, arrival, await self.front.pick(prep, chunks.rid), prefill_node,
                                   pull_from)
        except BaseException:
            self.front.done(chunks.rid, ended=True)
            self.front.open_counts.close(caller.identity)
            raise
        self.front.live[chunks.rid] = Live(gen, prep.rate, caller.identity)
        if prefill_node is not None:
            self.front.federation.decoding.add(chunks.rid)
        try:
            if prep.stream:
                return await self._stream(request, gen, prep, chunks)
            text, piece, logprobs, calls = await _collect(gen)
            return _json(chunks.whole(text, piece.finish_reason, usage(gen), logprobs, calls), chunks.rid,
                         headers=_rate_headers(gen))
        finally:
            gen.close()
            self.front.federation.cancel(chunks.rid)
            if prefill_node is not None and gen.finish_reason in ("stop", "length") and gen.output_ids:
                # MemServe: the reply's KV goes back to the prefill node, where the next turn starts
                # (the last token's KV was never computed: its page is not whole here)
                conversation = (prep.prompt_ids + gen.output_ids)[:-1]
                self.front.federation.give_back(gen.stream.engine, conversation, prefill_node)
            del self.front.live[chunks.rid]
            self.front.done(chunks.rid, ended=True)
            self.front.federation.decoding.discard(chunks.rid)
            self.front.open_counts.close(caller.identity)
            if gen.finish_reason == "shed":
                self.front.metrics.rejected.labels("429").inc()
            if not prep.stream:  # a stream files its reply before it ends
                self.front.file_reply(prep, gen)

    async def _respond_choices(self, request: web.Request, prep: Prepared, arrival: float,
                               chunks: Any) -> web.StreamResponse:
        """n > 1: n requests on one engine, the first computing the prompt and the others starting
        once it has its first token (they share its pages); a seed moves on by one a choice, so
        that seeded choices differ. Each choice is a reader the policy schedules on its own."""
        caller = request[CALLER]
        if self.front.federation.decodes_remotely(request) is not None:
            raise APIError(400, "n > 1 is not served across nodes: send n requests", param="n")
        self._open(caller)
        gens: list[Generation] = []
        try:
            placed = await self.front.pick(prep, chunks.rid)
            seed = prep.sampling.seed
            for i in range(prep.n):
                sampling = prep.sampling if seed is None else msgspec.structs.replace(prep.sampling, seed=seed + i)
                gens.append(self.front.start(
                    dataclasses.replace(prep, sampling=sampling), chunks.rid if i == 0 else f"{chunks.rid}-{i}",
                    arrival, placed if i == 0 else Choice(placed.engine_id, placed.cached_pages),
                    after="" if i == 0 else chunks.rid))
        except BaseException:
            for g in gens:
                g.close()
            self.front.done(chunks.rid, ended=True)
            self.front.open_counts.close(caller.identity)
            raise
        self.front.live[chunks.rid] = Live(gens[0], prep.rate, caller.identity)
        try:
            if prep.stream:
                return await self._stream_choices(request, gens, prep, chunks)
            results = await asyncio.gather(*[_collect(g) for g in gens])
            choices = [chunks.choice(i, text, piece.finish_reason, logprobs, calls)
                       for i, (text, piece, logprobs, calls) in enumerate(results)]
            return _json(chunks.response(choices, usage_of(gens)), chunks.rid, headers=_rate_headers(gens[0]))
        finally:
            for g in gens:
                g.close()
            del self.front.live[chunks.rid]
            self.front.done(chunks.rid, ended=True)
            self.front.open_counts.close(caller.identity)

    async def _stream_choices(self, request: web.Request, gens: list[Generation], prep: Prepared,
                              chunks: Any) -> web.StreamResponse:
        """The choices' pieces as they come, each event carrying its choice's index."""
        resp = web.StreamResponse(headers={**SSE_HEADERS, "X-Request-Id": chunks.rid, **_rate_headers(gens[0])})
        ready = dict(enumerate(await asyncio.gather(*[_first_pieces(g) for g in gens])))
        if request.version >= HttpVersion11:
            resp.enable_chunked_encoding()
        await resp.prepare(request)
        tune_for_backpressure(request)
        conn = SSEConnection(request, resp.chunked, chunks, gens[0])
        for i in range(len(gens)):
            conn.write(chunks.role(i))
        waiting: dict[asyncio.Future, int] = {}
        try:
            while True:
                for i, pieces in ready.items():
                    text, num_tokens, last = _merge(pieces)
                    calls = _merged_calls(pieces)
                    if text or num_tokens or calls:
                        conn.write(chunks.text(text, None, _merged_logprobs(pieces), calls, index=i))
                    gens[i].delivered(num_tokens)
                    if last is None:
                        waiting[asyncio.ensure_future(gens[i].take())] = i
                    elif last.finish_reason == "error":
                        conn.write(error_event(last.error or "the engine failed while generating", code="engine_error"))
                    else:
                        conn.write(chunks.finish(last.finish_reason, index=i))
                if not waiting:
                    break
                if not await self._room(request, gens[0]):
                    return resp
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                ready = {waiting.pop(t): t.result() for t in done}
        finally:
            for t in waiting:
                t.cancel()
        if prep.include_usage:
            conn.write(chunks.usage(usage_of(gens)))
        conn.write(b"data: [DONE]\n\n")
        try:
            async with asyncio.timeout(self.front.config.write_stall_timeout):
                await resp.write_eof()
        except TimeoutError:
            self._stalled(request, gens[0])
        except ConnectionResetError:  # the client left after the last event: nothing more to send
            pass
        return resp

    async def _completion_prompt(self, prompt: str | list) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            self.front.check_length_floor(self.front.tokenizer.min_tokens(prompt), "prompt")
            return await self.front.tokenize(len(prompt), self.front.tokenizer.encode, prompt, True)
        if all(isinstance(t, int) for t in prompt):
            vocab = self.front.tokenizer.vocab_size
            if any(t >= vocab for t in prompt):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
            return list(prompt)
        raise APIError(400, "prompt must be a string, a list of token ids, or a list holding one of those: "
                            "batched prompts are not supported, send one request per prompt", param="prompt")

    async def _stream(self, request: web.Request, gen: Generation, prep: Prepared, chunks: Any) -> web.StreamResponse:
        """Headers go out with the first piece. Then the handler attaches the connection to the
        generation, which writes each piece from the supervisor's loop (see generation.py), and
        wakes only for what needs it: a client that stopped reading, the end, an error."""
        resp = web.StreamResponse(headers={**SSE_HEADERS, "X-Request-Id": gen.request_id, **_rate_headers(gen)})
        pieces = await _first_pieces(gen)  # raises APIError (no headers sent yet) if refused or failed
        if request.version >= HttpVersion11:
            resp.enable_chunked_encoding()
        await resp.prepare(request)
        tune_for_backpressure(request)
        conn = SSEConnection(request, resp.chunked, chunks, gen, prep.continuous_usage)
        conn.write(chunks.role())
        self.front.streams.add(conn)
        try:
            done = await self._send_pieces(request, gen, prep, chunks, conn, pieces)
        finally:
            self.front.streams.discard(conn)
            self.front.metrics.sse_events.inc(conn.num_events)  # once a stream: a counter's lock per event costs
        if done:  # a reader that stopped reading does not hold the handler
            try:
                async with asyncio.timeout(self.front.config.write_stall_timeout):
                    await resp.write_eof()  # aiohttp waits for room after it, with no deadline of its own
            except TimeoutError:
                self._stalled(request, gen)
            except ConnectionResetError:  # the client left after the last event: nothing more to send
                pass
        return resp

    async def _room(self, request: web.Request, gen: Generation) -> bool:
        """Wait until the client has read enough to be written to again. False when it read nothing for
        --write-stall-timeout s: then its request is aborted (its pages freed) and its connection closed."""
        if await writable(request.transport, self.front.config.write_stall_timeout):
            return True
        self._stalled(request, gen)
        return False

    def _stalled(self, request: web.Request, gen: Generation) -> None:
        log.info("request %s: its client read nothing for %g s (--write-stall-timeout); aborted", gen.request_id,
                 self.front.config.write_stall_timeout)
        gen.close(outcome="write_stall")
        reset(request)

    async def _send_pieces(self, request: web.Request, gen: Generation, prep: Prepared, chunks: Any,
                           conn: SSEConnection, pieces: list[Piece]) -> bool:
        """Sends the stream to its end; False if the client stopped reading (the request is aborted)."""
        blocked = 0.0
        while True:
            text, num_tokens, last = _merge(pieces)  # pieces held while the client was not reading: one event
            conn.send(text, num_tokens, blocked, _merged_logprobs(pieces), _merged_calls(pieces))
            if last is not None:
                if last.finish_reason == "error":
                    conn.write(error_event(last.error or "the engine failed while generating", code="engine_error"))
                else:
                    conn.write(chunks.finish(last.finish_reason))
                    if prep.include_usage:
                        conn.write(chunks.usage(usage(gen)))
                break
            t0 = time.monotonic()
            if not await self._room(request, gen):
                return False
            blocked = time.monotonic() - t0
            gen.attach(conn.push)
            pieces = await gen.take()
        self.front.file_reply(prep, gen)  # before the end reaches the client, which may send its next turn at once
        conn.write(b"data: [DONE]\n\n")
        return True

    def created_now(self) -> int:
        return int(time.time())

    async def models(self, request: web.Request) -> web.Response:
        lens = [slot.info.max_model_len for slot in self.front.supervisor.slots if slot.info]
        card = s.ModelCard(self.front.model_name, self.front.created, max_model_len=min(lens) if lens else None)
        return _json(s.ModelList([card]))

    async def request_info(self, request: web.Request) -> web.Response:
        rid = request.match_info["request_id"]
        infos = await self.front.supervisor.query([rid])
        if not infos:
            raise APIError(404, f"no live request {rid!r} (finished requests are not kept)", code="request_not_found")
        return _json(self._describe(infos[0]))

    async def request_list(self, request: web.Request) -> web.Response:
        return _json({"object": "list", "data": [self._describe(i) for i in await self.front.supervisor.query(None)]})

    def _describe(self, info: RequestInfo) -> dict[str, Any]:
        """The engine's view of a request (its state, the rate it schedules by, the modelled
        buffer) and the front's: the rate the client stated and whether it was clamped, where the
        rate now used comes from (rates.py), the tokens delivered and the read cursor."""
        out = msgspec.to_builtins(info)
        live = self.front.live.get(info.request_id)
        if live is not None:
            monitor = live.gen.rate
            out.update(stated_reading_rate=live.rate.stated, reading_rate_clamped=live.rate.clamped,
                       reading_rate_source=monitor.source, delivered_tokens=live.gen.num_delivered,
                       read_tokens=monitor.num_read)
        return out

    async def read_cursor(self, request: web.Request) -> web.Response:
        """POST /v1/requests/{id}/read {"tokens": n}: the client's reader has read n tokens of the
        output delivered so far. The engine's model of its buffer follows (delivered − read, read
        on at the rate in use), and so does the rate (rates.py). A cursor behind the last one is
        ignored ("accepted": false): reports can cross on the way, reading does not go back."""
        rid = request.match_info["request_id"]
        if rid not in self.front.live and self.front.relay is not None and RELAYED not in request.headers:
            relayed = await self.front.relay(rid, request)  # --api-servers: another API server process may stream it
            if relayed is not None:
                return relayed
        body: s.ReadCursor = await self.front.decode(request, self.front.cursor_decoder)
        live = self.front.live.get(rid)
        if live is None or live.caller != request[CALLER].identity:  # another key's request: not yours to see
            raise APIError(404, f"no live request {rid!r} of this API key (finished requests take no cursor)",
                           code="request_not_found")
        gen = live.gen
        if body.tokens > gen.num_delivered:
            raise APIError(400, f"tokens ({body.tokens}) is beyond the {gen.num_delivered} tokens delivered to this "
                                f"client so far: report at most {gen.num_delivered}", param="tokens")
        accepted = gen.read(body.tokens)
        return _json({"object": "request.read", "id": rid, "accepted": accepted, "read_tokens": gen.rate.num_read,
                      "delivered_tokens": gen.num_delivered, "reading_rate": gen.rate.current,
                      "reading_rate_source": gen.rate.source})

    async def health(self, request: web.Request) -> web.Response:
        engines = [{"engine": slot.engine_id, "state": slot.state, "restarts": slot.num_restarts,
                    "pid": slot.pid, "requests": slot.load,
                    "policy": slot.config.policy, "policy_params": slot.policy_params,
                    "consecutive_failures": slot.consecutive_failures, "last_failure": slot.last_failure,
                    "fallback": slot.info.fallback if slot.info else None,
                    "attention": slot.info.attention if slot.info else None,
                    "cuda_graphs": slot.info.cuda_graphs if slot.info else None,
                    "overlap": slot.info.overlap if slot.info else None,
                    "attention_note": slot.info.attention_note if slot.info else None,
                    "mps": (slot.info.mps or None) if slot.info else None,
                    "pool": _pool_health(slot),
                    "prefix_pages_known": self.front.supervisor.index.num_keys(slot.engine_id),  # as the router sees it
                    "process": _figures(slot)}
                   for slot in self.front.supervisor.slots]
        serving = not self.front.draining and any(slot.ready for slot in self.front.supervisor.slots)
        failing = any(slot.consecutive_failures for slot in self.front.supervisor.slots)
        status = "ok" if serving else "draining" if self.front.draining else "unhealthy" if failing else "starting"
        return _json({"status": status, "engines": engines}, status=200 if serving else 503)

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.front.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def openapi(self, request: web.Request) -> web.Response:
        lens = [slot.info.max_model_len for slot in self.front.supervisor.slots if slot.info]
        served = s.Served((self.front.model_name,), min(lens) if lens else None, self.front.tokenizer.vocab_size)
        return _json(s.openapi(served))


def _pool_health(slot) -> dict | None:
    """How the engine reads its pool peers' pages, which it queries through the host instead, and
    (a GPU engine) which other GPUs its own has peer access to."""
    stats = slot.stats
    if stats is None or not stats.pool_path:
        return None
    return {"path": stats.pool_path, "staged": {str(e): why for e, why in stats.pool_staged.items()},
            "peer_access": stats.pool_peer_access}


async def _first_pieces(gen: Generation) -> list[Piece]:
    pieces = await gen.take()
    first = pieces[0]
    if first.finish_reason == "rejected":
        raise APIError(400, first.error or "the engine refused the request")
    if first.finish_reason == "shed":  # --max-queue-delay: refused at once rather than answered late
        retry = str(max(1, math.ceil(first.retry_after or 1)))
        raise APIError(429, first.error or f"the server is overloaded: retry after {retry} s", code="overloaded",
                       headers={"Retry-After": retry})
    if first.finish_reason == "error" and not first.num_tokens:
        raise APIError(503, f"{first.error}", code="engine_failed", headers={"Retry-After": "1"})
    return pieces


def _merge(pieces: list[Piece]) -> tuple[str, int, Piece | None]:
    """(text, tokens, the last piece if it ends the stream)."""
    last = pieces[-1] if pieces[-1].finish_reason is not None else None
    return "".join(p.text for p in pieces), sum(p.num_tokens for p in pieces), last


def _merged_calls(pieces: list[Piece]) -> list[ToolCall] | None:
    return [c for p in pieces for c in p.tool_calls or ()] or None


def _merged_logprobs(pieces: list[Piece]) -> Logprobs | None:
    if pieces[0].logprobs is None:  # the request did not ask
        return None
    return [entry for p in pieces for entry in p.logprobs or ()]


async def _collect(gen: Generation) -> tuple[str, Piece, Logprobs | None, list[ToolCall]]:
    parts, calls = [], []
    logprobs: Logprobs | None = [] if gen.wants_logprobs else None
    pieces = await _first_pieces(gen)
    while True:
        text, num_tokens, last = _merge(pieces)
        gen.delivered(num_tokens)
        parts.append(text)
        calls += _merged_calls(pieces) or ()
        if logprobs is not None:
            logprobs += _merged_logprobs(pieces) or ()
        if last is not None:
            if last.finish_reason == "error":
                raise APIError(500, last.error or "the engine failed while generating", code="engine_failed")
            return "".join(parts), last, logprobs, calls
        pieces = await gen.take()


def _rate_headers(gen: Generation) -> dict[str, str]:
    """The reading rate the request started with, and where it came from (rates.py)."""
    return {"X-Reading-Rate": f"{gen.rate.initial_rate:g}", "X-Reading-Rate-Source": gen.rate.initial_source}


def _figures(slot) -> dict | None:
    """The engine process's RSS, CPU time, threads and open descriptors (None: no live process)."""
    figures = process_figures(slot.pid)
    return figures.to_dict() if figures else None


def _json(obj: Any, request_id: str | None = None, status: int = 200,
          headers: dict[str, str] | None = None) -> web.Response:
    headers = {"X-Request-Id": request_id, **(headers or {})} if request_id else headers
    return web.Response(body=msgspec.json.encode(obj), status=status, content_type="application/json", headers=headers)
