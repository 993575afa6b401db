"""The aiohttp application: OpenAI-compatible routes, SSE, /health, /metrics, request inspection.

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models
    GET  /v1/requests[/{id}]    POST /v1/requests/{id}/read (the client's read cursor)
    GET  /health                GET /metrics           GET /openapi.json

A request: decode and validate the body (schema.py) → the caller's rights (priority: auth.py) →
tokens → its reading rate (stated, learned from its conversation, or the default: rates.py,
cadence.py) → admission checks (context, queue bound) → router picks an engine → Generation turns
its deltas into text pieces → JSON or SSE.
Response headers of a stream are sent with its first token, so a request the engine refuses still
gets a 4xx; after that, pieces are written as they come, from the supervisor's loop.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import struct
import time
import uuid
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Sequence

import msgspec
from aiohttp import HttpVersion11, web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tokenflowd.openai_api import schema as s
from tokenflowd.daemon.api.arrivals import Arrivals
from tokenflowd.daemon.api.auth import CALLER, Caller, KeyTable, auth_middleware, exposure_warning, load_api_keys, priority_refusal
from tokenflowd.daemon.api.cadence import CadenceEstimator, ConversationKeys, Lookup
from tokenflowd.daemon.api.connections import head_middleware, writable
from tokenflowd.openai_api.errors import MAX_BODY_SIZE, APIError, error_event, error_middleware
from tokenflowd.daemon.api.federation import Federation
from tokenflowd.federation.wire import PrefillOrder
from tokenflowd.daemon.api.generation import Generation, Piece
from tokenflowd.daemon.api.metrics import Metrics
from tokenflowd.daemon.api.open_counts import OpenCounts
from tokenflowd.daemon.api.rates import RateChoice, RateMonitor, choose_rate
from tokenflowd.config import ServerConfig
from tokenflowd.daemon.procstats import process_figures
from tokenflowd.protocol import AddRequest, Coalesce, PrefixRun, RequestInfo, Sampling
from tokenflowd.daemon.router import Arrival, Choice, Router, TrafficCost
from tokenflowd.daemon.supervisor import NoEngineReady, Supervisor
from tokenflowd.text.tokenizer import Tokenizer

# Why a value was refused, for the fields declared only to refuse anything but their default.
_UNSUPPORTED = {
    "n": "n must be 1: tokenflowd returns one choice per request (send n requests instead)",
    "best_of": "best_of must be 1 or absent: tokenflowd returns one choice per request",
    "frequency_penalty": "frequency_penalty is not supported: leave it out or send 0",
    "presence_penalty": "presence_penalty is not supported: leave it out or send 0",
    "logit_bias": "logit_bias is not supported: leave it out or send {}",
    "logprobs": "logprobs are not supported: leave them out",
    "top_logprobs": "top_logprobs are not supported: leave them out",
    "echo": "echo is not supported: leave it out",
    "suffix": "suffix is not supported: leave it out",
    "tools": "tools are not supported: leave them out",
    "tool_choice": "tool_choice must be 'none' or 'auto' (tools are not supported)",
    "response_format": "response_format must be {\"type\": \"text\"}: structured output is not supported",
}

# dispatch's guess of a request's output tokens (max_tokens caps it): a chat reply's length
DEFAULT_EXPECTED_OUTPUT = 256

log = logging.getLogger("tokenflowd.api")

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_STREAM_SNDBUF = 8 * 1024  # small socket buffers: a slow reader shows as backpressure within ~25 KB
_STREAM_HIGH_WATER = 4 * 1024  # the transport pauses writing above it, resumes below a quarter of it
_KEEP_ALIVE = b": keep-alive\n\n"  # an SSE comment: no event, bytes on the wire
RELAYED = "X-Tokenflowd-Relayed"  # a request one front process passed to another: not passed on again


@dataclass(frozen=True)
class _Prepared:
    prompt_ids: list[int]
    sampling: Sampling
    stop: tuple[str, ...]
    reading_rate: float
    priority: int
    stream: bool
    include_usage: bool
    rate: RateChoice  # reading_rate and where it came from
    cadence: _Cadence | None = None  # chat turns and requests with `user`: the reply feeds the cadence
    coalesce: bool = True  # stream_options.coalesce: false asks for one event per token
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: the usage so far in every event


@dataclass(frozen=True)
class _Cadence:
    lookup: Lookup
    user: str | None  # scoped to the caller
    keys: ConversationKeys | None  # chat requests


@dataclass(frozen=True)
class _Live:
    """A request the front is serving, for /v1/requests and the read cursor."""

    gen: Generation
    rate: RateChoice
    caller: str  # the identity of its API key: only it may move the cursor


class Front:
    def __init__(self, supervisor: Supervisor, tokenizer: Tokenizer, config: ServerConfig, model_name: str,
                 open_counts: OpenCounts | None = None) -> None:
        self.supervisor = supervisor
        self.tokenizer = tokenizer
        self.config = config
        self.model_name = model_name
        self.metrics = Metrics(supervisor)
        self.router = Router(supervisor.engine_config.page_size, supervisor.index)
        self.arrivals: Arrivals[Arrival, Choice] = Arrivals(self._place)  # the pool's dispatch groups
        self.draining = False
        self.created = int(time.time())
        self._chat_decoder = msgspec.json.Decoder(s.ChatCompletionRequest)
        self._completion_decoder = msgspec.json.Decoder(s.CompletionRequest)
        self._cursor_decoder = msgspec.json.Decoder(s.ReadCursor)
        self.cadence = CadenceEstimator(max_rate=config.max_reading_rate)
        self.live: dict[str, _Live] = {}
        # open requests, in total and per API key (its identity): this front's, or all fronts' (--api-servers)
        self.open_counts = open_counts or OpenCounts()
        # rate-aware coalescing of streamed requests, done by the engine's endpoint (engine/process/pacing.py)
        self.coalescing = (Coalesce(config.coalesce_buffer, config.coalesce_interval)
                           if config.coalesce_interval > 0 else None)
        self.streams: set[_SSEConnection] = set()  # open SSE responses, for the keep-alive sweep
        # --api-servers N > 1: passes a read cursor for a request this front does not serve to the one
        # that does (front_process.py); None answers 404 as before
        self.relay: Callable[[str, web.Request], Awaitable[web.Response | None]] | None = None
        self.federation = Federation(self)  # /federation/*, and a decode node's requests (daemon/api/federation.py)

    async def keep_alive(self) -> None:
        """Every half keep-alive interval, an SSE comment to each stream silent for the interval.

        A buffer-aware engine leaves a stream silent while its reader has plenty in hand: tens of
        seconds for a slow reader far ahead. Proxies and clients drop a connection after 60 s
        without a byte (nginx's proxy_read_timeout, SDK read timeouts), which would cut off a
        reader the engine is deliberately pausing. A comment line is ignored by every SSE client."""
        while True:
            await asyncio.sleep(self.config.sse_keepalive / 2)
            self.sweep_keep_alive(time.monotonic())

    def sweep_keep_alive(self, now: float) -> None:
        """A comment line to each open stream that has written nothing for sse_keepalive s."""
        quiet_since = now - self.config.sse_keepalive
        for conn in list(self.streams):
            if conn.last_write < quiet_since:
                try:
                    conn.keep_alive()
                except Exception:  # one broken connection must not end the sweep for every stream
                    log.exception("SSE keep-alive failed on one stream; the others go on")

    # -- request preparation ------------------------------------------------------------------
    async def read_body(self, request: web.Request) -> bytes:
        """The body, within --body-timeout (else 408); over client_max_size aiohttp raises → 413."""
        try:
            async with asyncio.timeout(self.config.body_timeout):
                return await request.read()
        except TimeoutError:
            raise APIError(408, f"the request body did not arrive within {self.config.body_timeout:g} s: send it "
                                "at once", code="body_timeout", headers={"Connection": "close"}) from None

    async def _decode(self, request: web.Request, decoder: msgspec.json.Decoder) -> Any:
        body = await self.read_body(request)
        try:
            try:
                return decoder.decode(body)
            except msgspec.ValidationError as e:  # a subclass of DecodeError: first
                if "got `float`" not in str(e):
                    raise
                # 3.0 is an integer to JSON Schema (and to the published schema). The typed decoder
                # stops at the first error, so the body may still not be JSON further on.
                return msgspec.convert(_integral_floats_as_ints(msgspec.json.decode(body)), decoder.type)
        except msgspec.ValidationError as e:
            raise _validation_error(e) from None
        except msgspec.DecodeError as e:
            raise APIError(400, f"the body is not valid JSON ({e}): send a JSON object") from None

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"model {model!r} is not served here; this server serves {self.model_name!r} "
                                "(GET /v1/models)", param="model", code="model_not_found")

    def _check_priority(self, priority: int, request: web.Request) -> None:
        why = priority_refusal(request[CALLER], priority)
        if why is not None:
            raise APIError(403, why, param="priority", code="priority_not_allowed")

    def _cadence(self, request: web.Request, user: str | None, messages: list[tuple[str, str]] | None,
                 now: float) -> _Cadence | None:
        """Match the request with the reply it follows (by `user`, or by conversation for a chat)."""
        scope = request[CALLER].identity
        user_key = f"user:{scope}:{user}" if user else None
        keys = ConversationKeys.of(scope, messages) if messages else None
        if user_key is None and keys is None:
            return None
        return _Cadence(self.cadence.on_request(now, user_key, keys), user_key, keys)

    def _file_reply(self, prep: _Prepared, gen: Generation) -> None:
        """A reply that ended normally is what the next turn of its conversation follows."""
        c = prep.cadence
        if c is None or gen.finish_reason not in ("stop", "length") or gen.last_sent is None:
            return
        # A whole (non-streamed) reply reaches the reader at once: reading starts when it ends.
        t_first = gen.first_sent if prep.stream and gen.first_sent is not None else gen.last_sent
        reply_key = c.keys.reply("".join(gen.text_parts or ())) if c.keys is not None else None
        self.cadence.on_reply(c.lookup.owner, t_first, gen.last_sent, gen.num_delivered, user=c.user,
                              reply_key=reply_key)

    def _prepare(self, body: s.ChatCompletionRequest | s.CompletionRequest, prompt_ids: list[int],
                 max_tokens: int | None, request: web.Request, cadence: _Cadence | None = None) -> _Prepared:
        max_len = self.max_model_len()
        n = len(prompt_ids)
        if n == 0:
            raise APIError(400, "the prompt is empty once tokenized: send some text", param="prompt",
                           code="empty_prompt")
        if n >= max_len:
            raise APIError(400, f"the prompt has {n} tokens but the context holds {max_len} (prompt plus at least "
                                "one new token): shorten the prompt", param="messages", code="context_length_exceeded")
        if max_tokens is not None and n + max_tokens > max_len:
            raise APIError(400, f"prompt ({n} tokens) plus max_tokens ({max_tokens}) exceeds the context length "
                                f"{max_len}: lower max_tokens to at most {max_len - n}", param="max_tokens",
                           code="context_length_exceeded")
        if n + body.min_tokens > max_len:
            raise APIError(400, f"prompt ({n} tokens) plus min_tokens ({body.min_tokens}) exceeds the context length "
                                f"{max_len}: lower min_tokens to at most {max_len - n}", param="min_tokens",
                           code="context_length_exceeded")
        if body.min_tokens and max_tokens is not None and body.min_tokens > max_tokens:
            raise APIError(400, f"min_tokens ({body.min_tokens}) exceeds max_tokens ({max_tokens})", param="min_tokens",
                           code="min_tokens_above_max_tokens")
        vocab = self.tokenizer.vocab_size
        if body.stop_token_ids and any(t >= vocab for t in body.stop_token_ids):
            raise APIError(400, f"stop_token_ids must be in [0, {vocab})", param="stop_token_ids")
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        sampling = Sampling(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=max(0, body.top_k or 0),
            seed=body.seed,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            min_tokens=body.min_tokens,
        )
        learned = cadence.lookup.reading_rate if cadence is not None else None
        rate = choose_rate(self._stated_rate(body, request), learned, self.config.default_reading_rate,
                           self.config.max_reading_rate)
        options = body.stream_options
        return _Prepared(prompt_ids, sampling, stop, rate.reading_rate, body.priority, body.stream,
                         bool(options and options.include_usage), rate, cadence,
                         coalesce=options is None or options.coalesce,
                         continuous_usage=bool(options and options.continuous_usage_stats))

    def _stated_rate(self, body: s.ChatCompletionRequest | s.CompletionRequest, request: web.Request) -> float | None:
        """The client's own rate (the body's, else the X-Reading-Rate header's), before the clamp."""
        if body.reading_rate is not None:
            return body.reading_rate
        header = request.headers.get("X-Reading-Rate")
        if header is None:
            return None
        try:
            rate = float(header)
        except ValueError:
            rate = math.nan
        if not 0 < rate <= 1e6:
            raise APIError(400, f"X-Reading-Rate must be a number of tokens/s in (0, 1e6], got {header!r}",
                           param="X-Reading-Rate")
        return rate

    def max_model_len(self) -> int:
        lens = [slot.info.max_model_len for slot in self.supervisor.slots if slot.ready and slot.info]
        if not lens:
            raise self._unavailable()
        return min(lens)

    def _unavailable(self) -> APIError:
        why = "draining for shutdown" if self.draining else "starting or restarting its engines"
        return APIError(503, f"the server is {why}: retry shortly", code="unavailable", headers={"Retry-After": "1"})

    async def _pick(self, prep: _Prepared) -> Choice:
        """The engine (and, with the pool on, where its prefix is read and its new segments go):
        refusals first (draining, the waiting bound, no engine ready)."""
        self.admissible()
        if self.supervisor.engine_config.pool_mode == "off":
            return self.router.pick(self.ready_slots(), prep.prompt_ids)
        output = prep.sampling.max_tokens or DEFAULT_EXPECTED_OUTPUT
        return await self.arrivals.add(Arrival(prep.prompt_ids, min(output, DEFAULT_EXPECTED_OUTPUT)))

    def _place(self, arrivals: Sequence[Arrival]) -> list[Choice]:
        """A group of arrivals with the pool on (daemon/api/arrivals.py)."""
        slots = self.ready_slots()
        infos = [slot.info for slot in slots if slot.info is not None]
        segment = min(i.pool_segment_pages for i in infos) or 1
        cost = TrafficCost(max(i.pool_query_row_bytes for i in infos), max(i.pool_kv_token_bytes for i in infos))
        place = self.supervisor.engine_config.pool_placement == "home"
        return self.router.dispatch(slots, arrivals, segment, cost, place=place)

    def ready_slots(self) -> list:
        slots = [slot for slot in self.supervisor.slots if slot.ready]
        if not slots:
            raise self._unavailable()
        return slots

    def admissible(self) -> None:
        if self.draining:
            raise self._unavailable()
        if self.supervisor.num_waiting >= self.config.max_waiting_requests:
            self.metrics.rejected.labels("429").inc()
            raise APIError(429, f"{self.supervisor.num_waiting} requests are already waiting for an engine "
                                f"(the bound is {self.config.max_waiting_requests}): retry after a second",
                           code="queue_full", headers={"Retry-After": "1"})

    def _start(self, prep: _Prepared, request_id: str, arrival: float, choice: Choice,
               prefill_node: str | None = None, pull_from: str | None = None) -> Generation:
        """`prefill_node`: a federated decode node's request, whose prompt that node computes, having
        first pulled a longer prefix from `pull_from`."""
        self.admissible()  # again: the requests placed with this one may have filled the queue
        slot = self.supervisor.slots[choice.engine_id]
        coalesce = self.coalescing if prep.stream and prep.coalesce else None
        add = AddRequest(request_id, prep.prompt_ids, prep.sampling, prep.reading_rate, prep.priority, arrival,
                         front=self.supervisor.front, front_epoch=self.supervisor.front_epoch, coalesce=coalesce,
                         prefix=[PrefixRun(e, keys) for e, keys in choice.runs],
                         place=[PrefixRun(e, keys) for e, keys in choice.places], remote_kv=prefill_node is not None)
        try:
            reserved = self.supervisor.expect(request_id) if prefill_node is not None else None
        except ValueError as e:
            raise APIError(400, str(e)) from None
        try:
            gen = Generation(self.supervisor, slot, add, self.tokenizer, prep.stop,
                             self.metrics.engine(slot.engine_id), arrival,
                             rate=RateMonitor(prep.reading_rate, max_rate=self.config.max_reading_rate,
                                              initial_source=prep.rate.source),
                             keep_text=prep.cadence is not None and prep.cadence.keys is not None,
                             keep_ids=prefill_node is not None)
        except NoEngineReady:
            self.supervisor.forget(request_id)
            raise self._unavailable() from None
        if reserved is not None:
            order = PrefillOrder(request_id, prep.prompt_ids, prep.sampling, None, 0.0, prep.priority,
                                 prep.reading_rate, pull_from)
            self.federation.drive(slot, request_id, order, prefill_node, reserved)
        return gen

    # -- routes -------------------------------------------------------------------------------
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        arrival = time.monotonic()
        body: s.ChatCompletionRequest = await self._decode(request, self._chat_decoder)
        self._check_model(body.model)
        self._check_priority(body.priority, request)
        messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                    for m in body.messages]
        try:
            prompt_ids = self.tokenizer.encode_chat(messages)
        except Exception as e:  # the model's chat template refused the conversation
            raise APIError(400, f"the chat template cannot render these messages: {e}", param="messages",
                           code="chat_template") from None
        cadence = self._cadence(request, body.user, [(m["role"], m["content"]) for m in messages], arrival)
        prep = self._prepare(body, prompt_ids, body.max_completion_tokens or body.max_tokens, request, cadence)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        return await self._respond(request, prep, arrival, _ChatChunks(rid, self.created_now(), self.model_name))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        arrival = time.monotonic()
        body: s.CompletionRequest = await self._decode(request, self._completion_decoder)
        self._check_model(body.model)
        self._check_priority(body.priority, request)
        prompt_ids = self._completion_prompt(body.prompt)
        cadence = self._cadence(request, body.user, None, arrival)
        prep = self._prepare(body, prompt_ids, body.max_tokens, request, cadence)
        rid = f"cmpl-{uuid.uuid4().hex}"
        return await self._respond(request, prep, arrival, _CompletionChunks(rid, self.created_now(), self.model_name))

    def _open(self, caller: Caller) -> None:
        """Counts a request open; 429 beyond --max-streams open requests, or beyond the caller's key's
        max_concurrent."""
        refused = self.open_counts.open(caller.identity, self.config.max_streams, caller.max_concurrent)
        if refused is None:
            return
        self.metrics.rejected.labels("429").inc()
        if refused == "streams":
            raise APIError(429, f"the server has {self.open_counts.total()} requests open, its bound (--max-streams): "
                                "retry after a second", code="too_many_streams", headers={"Retry-After": "1"})
        raise APIError(429, f"this API key has {caller.max_concurrent} requests open, as many as it may: wait for "
                            "one to end", code="too_many_requests_for_key", headers={"Retry-After": "1"})

    async def _respond(self, request: web.Request, prep: _Prepared, arrival: float, chunks: Any) -> web.StreamResponse:
        caller = request[CALLER]
        prefill_node = self.federation.decodes_remotely(request)
        pull_from = self.federation.pulls_from(request)
        self._open(caller)
        try:
            gen = self._start(prep, chunks.rid, arrival, await self._pick(prep), prefill_node, pull_from)
        except BaseException:
            self.open_counts.close(caller.identity)
            raise
        self.live[chunks.rid] = _Live(gen, prep.rate, caller.identity)
        if prefill_node is not None:
            self.federation.decoding.add(chunks.rid)
        try:
            if prep.stream:
                return await self._stream(request, gen, prep, chunks)
            text, piece = await _collect(gen)
            return _json(chunks.whole(text, piece.finish_reason, _usage(gen)), chunks.rid, headers=_rate_headers(gen))
        finally:
            gen.close()
            self.federation.cancel(chunks.rid)
            if prefill_node is not None and gen.finish_reason in ("stop", "length") and gen.output_ids:
                # MemServe: the reply's KV goes back to the prefill node, where the next turn starts
                # (the last token's KV was never computed: its page is not whole here)
                self.federation.give_back(gen.stream.engine, (prep.prompt_ids + gen.output_ids)[:-1], prefill_node)
            del self.live[chunks.rid]
            self.federation.decoding.discard(chunks.rid)
            self.open_counts.close(caller.identity)
            if gen.finish_reason == "shed":
                self.metrics.rejected.labels("429").inc()
            if not prep.stream:  # a stream files its reply before it ends
                self._file_reply(prep, gen)

    def _completion_prompt(self, prompt: str | list) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        if all(isinstance(t, int) for t in prompt):
            vocab = self.tokenizer.vocab_size
            if any(t >= vocab for t in prompt):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
            return list(prompt)
        raise APIError(400, "prompt must be a string, a list of token ids, or a list holding one of those: "
                            "batched prompts are not supported, send one request per prompt", param="prompt")

    async def _stream(self, request: web.Request, gen: Generation, prep: _Prepared, chunks: Any) -> web.StreamResponse:
        """Headers go out with the first piece. Then the handler attaches the connection to the
        generation, which writes each piece from the supervisor's loop (see generation.py), and
        wakes only for what needs it: a client that stopped reading, the end, an error."""
        resp = web.StreamResponse(headers={**_SSE_HEADERS, "X-Request-Id": gen.request_id, **_rate_headers(gen)})
        pieces = await _first_pieces(gen)  # raises APIError (no headers sent yet) if refused or failed
        if request.version >= HttpVersion11:
            resp.enable_chunked_encoding()
        await resp.prepare(request)
        _tune_for_backpressure(request)
        conn = _SSEConnection(request, resp.chunked, chunks, gen, prep.continuous_usage)
        conn.write(chunks.role())
        self.streams.add(conn)
        try:
            done = await self._send_pieces(request, gen, prep, chunks, conn, pieces)
        finally:
            self.streams.discard(conn)
            self.metrics.sse_events.inc(conn.num_events)  # once a stream: a counter's lock per event costs
        if done:  # a reader that stopped reading does not hold the handler
            try:
                async with asyncio.timeout(self.config.write_stall_timeout):
                    await resp.write_eof()  # aiohttp waits for room after it, with no deadline of its own
            except TimeoutError:
                self._stalled(request, gen)
        return resp

    async def _room(self, request: web.Request, gen: Generation) -> bool:
        """Wait until the client has read enough to be written to again. False when it read nothing for
        --write-stall-timeout s: then its request is aborted (its pages freed) and its connection closed."""
        if await writable(request.transport, self.config.write_stall_timeout):
            return True
        self._stalled(request, gen)
        return False

    def _stalled(self, request: web.Request, gen: Generation) -> None:
        log.info("request %s: its client read nothing for %g s (--write-stall-timeout); aborted", gen.request_id,
                 self.config.write_stall_timeout)
        gen.close(outcome="write_stall")
        _reset(request)

    async def _send_pieces(self, request: web.Request, gen: Generation, prep: _Prepared, chunks: Any,
                           conn: _SSEConnection, pieces: list[Piece]) -> bool:
        """Sends the stream to its end; False if the client stopped reading (the request is aborted)."""
        blocked = 0.0
        while True:
            text, num_tokens, last = _merge(pieces)  # pieces held while the client was not reading: one event
            conn.send(text, num_tokens, blocked)
            if last is not None:
                if last.finish_reason == "error":
                    conn.write(error_event(last.error or "the engine failed while generating"))
                else:
                    conn.write(chunks.finish(last.finish_reason))
                    if prep.include_usage:
                        conn.write(chunks.usage(_usage(gen)))
                break
            t0 = time.monotonic()
            if not await self._room(request, gen):
                return False
            blocked = time.monotonic() - t0
            gen.attach(conn.push)
            pieces = await gen.take()
        self._file_reply(prep, gen)  # before the end reaches the client, which may send its next turn at once
        conn.write(b"data: [DONE]\n\n")
        return True

    def created_now(self) -> int:
        return int(time.time())

    async def models(self, request: web.Request) -> web.Response:
        lens = [slot.info.max_model_len for slot in self.supervisor.slots if slot.info]
        card = s.ModelCard(self.model_name, self.created, max_model_len=min(lens) if lens else None)
        return _json(s.ModelList([card]))

    async def request_info(self, request: web.Request) -> web.Response:
        rid = request.match_info["request_id"]
        infos = await self.supervisor.query([rid])
        if not infos:
            raise APIError(404, f"no live request {rid!r} (finished requests are not kept)", code="request_not_found")
        return _json(self._describe(infos[0]))

    async def request_list(self, request: web.Request) -> web.Response:
        return _json({"object": "list", "data": [self._describe(i) for i in await self.supervisor.query(None)]})

    def _describe(self, info: RequestInfo) -> dict[str, Any]:
        """The engine's view of a request (its state, the rate it schedules by, the modelled
        buffer) and the front's: the rate the client stated and whether it was clamped, where the
        rate now used comes from (rates.py), the tokens delivered and the read cursor."""
        out = msgspec.to_builtins(info)
        live = self.live.get(info.request_id)
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
        if rid not in self.live and self.relay is not None and RELAYED not in request.headers:
            relayed = await self.relay(rid, request)  # --api-servers: another front process may stream it
            if relayed is not None:
                return relayed
        body: s.ReadCursor = await self._decode(request, self._cursor_decoder)
        live = self.live.get(rid)
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
                    "prefix_pages_known": self.supervisor.index.num_keys(slot.engine_id),  # as the router sees it
                    "process": _figures(slot)}
                   for slot in self.supervisor.slots]
        serving = not self.draining and any(slot.ready for slot in self.supervisor.slots)
        failing = any(slot.consecutive_failures for slot in self.supervisor.slots)
        status = "ok" if serving else "draining" if self.draining else "unhealthy" if failing else "starting"
        return _json({"status": status, "engines": engines}, status=200 if serving else 503)

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def openapi(self, request: web.Request) -> web.Response:
        lens = [slot.info.max_model_len for slot in self.supervisor.slots if slot.info]
        served = s.Served((self.model_name,), min(lens) if lens else None, self.tokenizer.vocab_size)
        return _json(s.openapi(served))


def build_app(front: Front) -> web.Application:
    keys = KeyTable(load_api_keys(front.config.api_key_file), front.config.auth)
    warning = exposure_warning(front.config.host, keys)
    if warning:
        log.warning(warning)
    app = web.Application(middlewares=[head_middleware, auth_middleware(keys), error_middleware],
                          client_max_size=front.config.max_body_size)
    app[MAX_BODY_SIZE] = front.config.max_body_size
    app.router.add_post("/v1/chat/completions", front.chat_completions)
    app.router.add_post("/v1/completions", front.completions)
    app.router.add_get("/v1/models", front.models)
    app.router.add_get("/v1/requests", front.request_list)
    app.router.add_get("/v1/requests/{request_id}", front.request_info)
    app.router.add_post("/v1/requests/{request_id}/read", front.read_cursor)
    app.router.add_get("/health", front.health)
    app.router.add_get("/metrics", front.metrics_endpoint)
    app.router.add_get("/openapi.json", front.openapi)
    app.router.add_get("/federation/state", front.federation.state)
    app.router.add_post("/federation/prefill", front.federation.prefill)
    app.router.add_post("/federation/abort", front.federation.abort)
    app.router.add_post("/federation/keep", front.federation.keep)
    app.router.add_post("/federation/kept", front.federation.kept)
    app.router.add_post("/federation/give", front.federation.give)
    app.router.add_post("/federation/role", front.federation.set_role)

    async def close_federation(_app: web.Application) -> None:
        await front.federation.close()

    app.on_cleanup.append(close_federation)
    if front.config.sse_keepalive > 0:
        app.cleanup_ctx.append(_background(front.keep_alive))
    return app


def _background(run: Callable[[], Awaitable[None]]):
    """An aiohttp cleanup context: `run` as a task for the application's life."""
    async def ctx(app: web.Application):
        task = asyncio.create_task(run())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    return ctx


# -- helpers -----------------------------------------------------------------------------------
class _ChatChunks:
    """One response's bodies: its SSE events, or the whole non-streamed object."""

    def __init__(self, rid: str, created: int, model: str) -> None:
        self.rid, self.created, self.model = rid, created, model

    def _event(self, choices: list, usage: s.Usage | None = None) -> bytes:
        return b"data: " + msgspec.json.encode(s.ChatCompletionChunk(self.rid, self.created, self.model, choices,
                                                                     usage)) + b"\n\n"

    def role(self) -> bytes:
        return self._event([s.ChatChunkChoice(0, s.ChunkDelta(content="", role="assistant"))])

    def text(self, text: str, usage: s.Usage | None = None) -> bytes:
        return self._event([s.ChatChunkChoice(0, s.ChunkDelta(content=text))], usage)

    def finish(self, reason: str) -> bytes:
        return self._event([s.ChatChunkChoice(0, s.ChunkDelta(), reason)])

    def usage(self, usage: s.Usage) -> bytes:
        return self._event([], usage)

    def whole(self, text: str, finish_reason: str | None, usage: s.Usage) -> s.ChatCompletion:
        choice = s.ChatChoice(0, s.AssistantMessage(text), finish_reason)
        return s.ChatCompletion(self.rid, self.created, self.model, [choice], usage)


class _CompletionChunks(_ChatChunks):
    def _event(self, choices: list, usage: s.Usage | None = None) -> bytes:
        return b"data: " + msgspec.json.encode(s.Completion(self.rid, self.created, self.model, choices, usage)) + b"\n\n"

    def role(self) -> bytes:
        return b""

    def text(self, text: str, usage: s.Usage | None = None) -> bytes:
        return self._event([s.CompletionChoice(0, text)], usage)

    def finish(self, reason: str) -> bytes:
        return self._event([s.CompletionChoice(0, "", reason)])

    def whole(self, text: str, finish_reason: str | None, usage: s.Usage) -> s.Completion:
        return s.Completion(self.rid, self.created, self.model, [s.CompletionChoice(0, text, finish_reason)], usage)


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


async def _collect(gen: Generation) -> tuple[str, Piece]:
    parts = []
    pieces = await _first_pieces(gen)
    while True:
        text, num_tokens, last = _merge(pieces)
        gen.delivered(num_tokens)
        parts.append(text)
        if last is not None:
            if last.finish_reason == "error":
                raise APIError(500, last.error or "the engine failed while generating", code="engine_failed")
            return "".join(parts), last
        pieces = await gen.take()


class _SSEConnection:
    """Writes SSE events straight to a prepared response's transport, framed as its chunked
    encoding needs: synchronous, so the generation can write a piece from the supervisor's loop.
    (The response's headers are already sent: aiohttp's StreamResponse sends them in prepare().)
    Each piece is one event: a delta that carries several tokens (the engine coalesced them for a
    reader far ahead, engine/process/pacing.py) is one event with all of them."""

    def __init__(self, request: web.Request, chunked: bool, chunks: Any, gen: Generation,
                 continuous_usage: bool = False) -> None:
        self.transport = request.transport
        self.chunked = chunked
        self.chunks = chunks
        self.gen = gen
        self.num_events = 0  # events that carried tokens (tokenflowd_sse_events, counted when the stream ends)
        self.continuous_usage = continuous_usage
        self.last_write = time.monotonic()

    def write(self, event: bytes) -> None:
        transport = self.transport
        if not event or transport is None or transport.is_closing():
            return  # a client gone: its handler is cancelled and aborts the request
        transport.write(b"%x\r\n%s\r\n" % (len(event), event) if self.chunked else event)
        self.last_write = time.monotonic()

    def keep_alive(self) -> None:
        """A comment line, unless bytes still wait to go out (then the line is not idle, the
        client is not reading, and the backpressure check must see the bytes it did not read)."""
        transport = self.transport
        if transport is not None and transport.get_write_buffer_size() == 0:
            self.write(_KEEP_ALIVE)

    def send(self, text: str, num_tokens: int, blocked: float = 0.0) -> None:
        """One event with `text` (its `num_tokens` tokens), now. A token with no text yet (held bytes
        of a character, a special token) still gets its event: clients time every token, as the
        engine counts it."""
        if text or num_tokens:
            gen = self.gen
            usage = _usage_so_far(gen, gen.num_delivered + num_tokens) if self.continuous_usage else None
            self.write(self.chunks.text(text, usage))
            self.num_events += 1
        self.gen.delivered(num_tokens, blocked)  # no-op without tokens

    def push(self, piece: Piece) -> bool:
        """Send one piece now if the connection has room; False leaves it to the handler."""
        transport = self.transport
        if transport is None or transport.get_write_buffer_size() > _STREAM_HIGH_WATER:
            return False
        self.send(piece.text, piece.num_tokens)
        return True


def _usage(gen: Generation) -> s.Usage:
    return _usage_so_far(gen, gen.num_output_tokens)


def _usage_so_far(gen: Generation, num_tokens: int) -> s.Usage:
    return s.Usage(gen.num_prompt_tokens, num_tokens, gen.num_prompt_tokens + num_tokens,
                   s.PromptTokensDetails(gen.num_cached_tokens))


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


def _reset(request: web.Request) -> None:
    """Close the connection with a reset, dropping what it could not send: a closed socket would
    otherwise keep its unsent bytes in the kernel, probing a reader that reads nothing for minutes."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def _tune_for_backpressure(request: web.Request) -> None:
    """Small send buffers, so a client reading slower than tokens come blocks our writes soon."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _STREAM_SNDBUF)
    transport.set_write_buffer_limits(high=_STREAM_HIGH_WATER)


def _integral_floats_as_ints(value: Any) -> Any:
    """Integral floats (3.0) as ints, anywhere in a decoded JSON value: an integer field takes them,
    a float field takes an int as well."""
    if isinstance(value, float):
        return int(value) if value.is_integer() else value
    if isinstance(value, list):
        return [_integral_floats_as_ints(v) for v in value]
    if isinstance(value, dict):
        return {k: _integral_floats_as_ints(v) for k, v in value.items()}
    return value


def _validation_error(e: msgspec.ValidationError) -> APIError:
    message = str(e)
    param = message.rsplit("`$.", 1)[1].rstrip("`") if "`$." in message else None
    if "unknown field" in message:
        field = message.split("`")[1] if "`" in message else "?"
        where = f" in {param}" if param else ""
        return APIError(400, f"unknown field {field!r}{where}: remove it (see /openapi.json for the accepted "
                             "fields)", param=field)
    top = param.split(".")[0].split("[")[0] if param else None
    if top in _UNSUPPORTED:
        return APIError(400, _UNSUPPORTED[top], param=top)
    return APIError(400, f"invalid request: {message}", param=param)
