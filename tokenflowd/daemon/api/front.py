"""The node's HTTP front: its state (supervisor, tokenizer, router, live requests, open counts)
and a request's preparation, which routes.py drives: decode and validate the body (schema.py) →
the caller's rights (priority: auth.py) → tokens → its reading rate (stated, learned from its
conversation, or the default: rates.py, cadence.py) → admission checks (context, queue bound) →
the router picks an engine → the engine is sent the request. With the pool on, an idle engine
takes a queued request from the busiest (`_steal`, pool/steal.py).
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Sequence

import msgspec
from aiohttp import web

from tokenflowd.config import ServerConfig
from tokenflowd.daemon.api.arrivals import Arrivals
from tokenflowd.daemon.api.auth import CALLER, priority_refusal
from tokenflowd.daemon.api.cadence import CadenceEstimator, ConversationKeys, Lookup
from tokenflowd.daemon.api.federation import Federation
from tokenflowd.daemon.api.generation import Generation
from tokenflowd.daemon.api.metrics import Metrics
from tokenflowd.daemon.api.open_counts import OpenCounts
from tokenflowd.daemon.api.rates import RateChoice, RateMonitor, choose_rate
from tokenflowd.daemon.api.sse import SSEConnection
from tokenflowd.daemon.api.tokenizing import TokenizerPool
from tokenflowd.daemon.router import Arrival, Choice, Router, TrafficCost
from tokenflowd.daemon.supervisor import NoEngineReady, Supervisor
from tokenflowd.federation.wire import PrefillOrder
from tokenflowd.openai_api import schema as s
from tokenflowd.openai_api.errors import APIError, not_utf8
from tokenflowd.pool.steal import idle, staying, victim
from tokenflowd.protocol import AddRequest, Coalesce, Delta, PrefixRun, Reads, Sampling, Withdraw, Withdrawn
from tokenflowd.text import tools
from tokenflowd.text.structured import ANY_OBJECT, json_grammar
from tokenflowd.text.tokenizer import Tokenizer

log = logging.getLogger("tokenflowd.api")

TYPICAL_BYTES_PER_TOKEN = 4  # English text through a BPE tokenizer
JSON_BYTES_PER_TEXT_BYTE = 6  # the most a JSON string spends on one byte of text (\u00XX)
BYTES_PER_MESSAGE = 64  # a chat message's keys and quotes; the chat template gives each a token at least
BODY_SLACK = 64 << 10  # the body's other fields (sampling, stop strings, stream options)


def body_limit_note(max_body_size: int, max_model_len: int, max_token_bytes: int) -> tuple[int, str] | None:
    """The body limit against what the model's context could ever use: (log level, why) when it
    refuses prompts the context would hold, or lets in bodies no prompt that fits could need."""
    typical = max_model_len * TYPICAL_BYTES_PER_TOKEN
    if max_body_size < typical:
        return logging.WARNING, (f"--max-body-size {max_body_size} bytes is below what a prompt filling the "
                                 f"{max_model_len}-token context takes as text (about {typical} bytes at "
                                 f"{TYPICAL_BYTES_PER_TOKEN} bytes a token): such prompts get 413")
    ceiling = max_model_len * max(JSON_BYTES_PER_TEXT_BYTE * max_token_bytes, BYTES_PER_MESSAGE) + BODY_SLACK
    if max_body_size > ceiling:
        return logging.INFO, (f"no body over {ceiling} bytes holds a prompt that fits the {max_model_len}-token "
                              f"context (a token stands for at most {max_token_bytes} bytes of text, 6 in JSON): "
                              f"--max-body-size {ceiling} would refuse them before reading them (now {max_body_size})")
    return None

# Why a value was refused, for the fields declared only to refuse anything but their default.
_UNSUPPORTED = {
    "best_of": "best_of must be 1 or absent: tokenflowd returns one choice per request",
    "logit_bias": "logit_bias is not supported: leave it out or send {}",
    "echo": "echo is not supported: leave it out",
    "suffix": "suffix is not supported: leave it out",
}

# s an engine asked to give back a queued request (protocol.Withdraw) may take to answer before the
# front asks it again (an answer lost with an engine that went away); one takes a round trip (ms)
WITHDRAW_SECONDS = 2.0

# dispatch's guess of a request's output tokens (max_tokens caps it): a chat reply's length
DEFAULT_EXPECTED_OUTPUT = 256


@dataclass(frozen=True)
class Prepared:
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
    tool_format: str | None = None  # the calls in the reply are parsed, written this way (text/tools.py); None: not
    n: int = 1  # choices


@dataclass(frozen=True)
class _Cadence:
    lookup: Lookup
    user: str | None  # scoped to the caller
    keys: ConversationKeys | None  # chat requests


@dataclass(frozen=True)
class Live:
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
        self.router = Router(supervisor.engine_config.page_size, supervisor.index,
                             copy_hot=supervisor.engine_config.pool_copy)
        self.arrivals: Arrivals[Arrival, Choice] = Arrivals(self._place)  # the pool's dispatch groups
        supervisor.on_resolve = self._resolve
        supervisor.on_started = self.done
        supervisor.on_computing = self.router.computing
        # the pool: an engine asked to give back a queued request (Withdraw) -> (the idle engine it goes to, when asked)
        self._withdrawing: dict[int, tuple[int, float]] = {}
        self._refused: dict[int, int] = {}  # an engine that gave nothing back -> its queue's length then
        if supervisor.engine_config.pool_mode != "off":
            for slot in supervisor.slots:
                self.metrics.moved.labels(str(slot.engine_id))  # every series from 0
            if supervisor.engine_config.pool_steal:
                supervisor.on_report, supervisor.on_withdrawn = self._steal, self._withdrawn
        self.draining = False
        self.created = int(time.time())
        self.chat_decoder = msgspec.json.Decoder(s.ChatCompletionRequest)
        self.completion_decoder = msgspec.json.Decoder(s.CompletionRequest)
        self.cursor_decoder = msgspec.json.Decoder(s.ReadCursor)
        self.cadence = CadenceEstimator(max_rate=config.max_reading_rate)
        self.live: dict[str, Live] = {}
        # open requests, in total and per API key (its identity): this front's, or all fronts' (--api-servers)
        self.open_counts = open_counts or OpenCounts()
        # rate-aware coalescing of streamed requests, done by the engine's endpoint (engine/process/pacing.py)
        self.coalescing = (Coalesce(config.coalesce_buffer, config.coalesce_interval)
                           if config.coalesce_interval > 0 else None)
        self.streams: set[SSEConnection] = set()  # open SSE responses, for the keep-alive sweep
        # --api-servers N > 1: passes a read cursor for a request this front does not serve to the one
        # that does (api_server.py); None answers 404 as before
        self.relay: Callable[[str, web.Request], Awaitable[web.Response | None]] | None = None
        self.federation = Federation(self)  # /federation/*, and a decode node's requests (daemon/api/federation.py)
        # prompts are tokenized off the event loop, at most four bodies' worth at once (tokenizing.py)
        self.tokenizing = TokenizerPool(4 * config.max_body_size)
        self._checked_len: int | None = None  # the context the body limit was last checked against

    async def tokenize(self, nbytes: int, fn: Callable[..., list[int]], *args: Any) -> list[int]:
        """fn(*args), a tokenization of about `nbytes` of text, in the tokenizing workers."""
        return await self.tokenizing.run(nbytes, fn, *args)

    def check_length_floor(self, min_tokens: int, param: str) -> None:
        """Refuse a prompt whose length in bytes alone proves it cannot fit the context, before it
        is tokenized (Tokenizer.min_tokens: a token stands for at most max_token_bytes bytes)."""
        max_len = self.max_model_len()
        if min_tokens >= max_len:
            raise APIError(400, f"the prompt has at least {min_tokens} tokens (from its length in bytes) but the "
                                f"context holds {max_len} (prompt plus at least one new token): shorten the prompt",
                           param=param, code="context_length_exceeded")

    async def close(self) -> None:
        self.tokenizing.close()

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

    async def decode(self, request: web.Request, decoder: msgspec.json.Decoder) -> Any:
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
            try:  # msgspec 0.23 says "Invalid UTF-8 encoded string" without the place: find the byte
                body.decode("utf-8")
            except UnicodeDecodeError as bad:
                raise not_utf8(bad) from None
            raise APIError(400, f"the body is not valid JSON ({e}): send a JSON object", code="invalid_json") from None
        except UnicodeDecodeError as e:  # (msgspec before 0.23)
            raise not_utf8(e) from None

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"model {model!r} is not served here; this server serves {self.model_name!r} "
                                "(GET /v1/models)", param="model", code="model_not_found")

    def check_priority(self, priority: int, request: web.Request) -> None:
        why = priority_refusal(request[CALLER], priority)
        if why is not None:
            raise APIError(403, why, param="priority", code="priority_not_allowed")

    def conversation_cadence(self, request: web.Request, user: str | None, messages: list[tuple[str, str]] | None,
                 now: float) -> _Cadence | None:
        """Match the request with the reply it follows (by `user`, or by conversation for a chat)."""
        scope = request[CALLER].identity
        user_key = f"user:{scope}:{user}" if user else None
        keys = ConversationKeys.of(scope, messages) if messages else None
        if user_key is None and keys is None:
            return None
        return _Cadence(self.cadence.on_request(now, user_key, keys), user_key, keys)

    def file_reply(self, prep: Prepared, gen: Generation) -> None:
        """A reply that ended normally is what the next turn of its conversation follows."""
        c = prep.cadence
        if c is None or gen.finish_reason not in ("stop", "length") or gen.last_sent is None:
            return
        # A whole (non-streamed) reply reaches the reader at once: reading starts when it ends.
        t_first = gen.first_sent if prep.stream and gen.first_sent is not None else gen.last_sent
        reply_key = c.keys.reply("".join(gen.text_parts or ())) if c.keys is not None else None
        self.cadence.on_reply(c.lookup.owner, t_first, gen.last_sent, gen.num_delivered, user=c.user,
                              reply_key=reply_key)

    def prepare(self, body: s.ChatCompletionRequest | s.CompletionRequest, prompt_ids: list[int],
                 max_tokens: int | None, request: web.Request, cadence: _Cadence | None = None) -> Prepared:
        max_len = self.max_model_len()
        n = len(prompt_ids)
        if n == 0:
            raise APIError(400, "the prompt is empty once tokenized: send some text", param="prompt",
                           code="empty_prompt")
        chat = isinstance(body, s.ChatCompletionRequest)
        if n >= max_len:
            raise APIError(400, f"the prompt has {n} tokens but the context holds {max_len} (prompt plus at least "
                                "one new token): shorten the prompt", param="messages" if chat else "prompt",
                           code="context_length_exceeded")
        if max_tokens is not None and n + max_tokens > max_len:
            field = "max_completion_tokens" if chat and body.max_completion_tokens is not None else "max_tokens"
            raise APIError(400, f"prompt ({n} tokens) plus {field} ({max_tokens}) exceeds the context length "
                                f"{max_len}: lower {field} to at most {max_len - n}", param=field,
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
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            logprobs=self._logprobs(body),
            grammar=self._tool_grammar(body) or self._grammar(body),
        )
        learned = cadence.lookup.reading_rate if cadence is not None else None
        rate = choose_rate(self._stated_rate(body, request), learned, self.config.default_reading_rate,
                           self.config.max_reading_rate)
        options = body.stream_options
        return Prepared(prompt_ids, sampling, stop, rate.reading_rate, body.priority, body.stream,
                         bool(options and options.include_usage), rate, cadence,
                         coalesce=options is None or options.coalesce,
                         continuous_usage=bool(options and options.continuous_usage_stats),
                         tool_format=self.tool_format(body), n=body.n)

    def tool_format(self, body: s.ChatCompletionRequest | s.CompletionRequest) -> str | None:
        """How the reply's calls are written, when it may make some (tools offered, tool_choice not none)."""
        if not isinstance(body, s.ChatCompletionRequest) or not body.tools or body.tool_choice == "none":
            return None
        return tools.tool_format(self.tokenizer.chat_template)

    def _tool_grammar(self, body: s.ChatCompletionRequest | s.CompletionRequest) -> str | None:
        """tool_choice required or named: the reply is only calls, each valid for its function."""
        if not isinstance(body, s.ChatCompletionRequest) or body.tool_choice is None:
            return None
        choice = body.tool_choice
        if choice in ("none", "auto"):
            return None
        offered = [t.function.name for t in body.tools or ()]
        if not offered:
            raise APIError(400, "tool_choice names a call but no tools are offered", param="tool_choice",
                           code="tool_choice_without_tools")
        if isinstance(choice, s.NamedToolChoice):
            if choice.function.name not in offered:
                raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not among the tools "
                                    f"({', '.join(offered)})", param="tool_choice.function.name",
                               code="unknown_tool")
            names = [choice.function.name]
        else:
            names = offered
        if body.response_format is not None and not isinstance(body.response_format, s.TextFormat):
            raise APIError(400, "response_format and a required tool call each constrain the reply: send one",
                           param="response_format", code="conflicting_constraints")
        defs = [msgspec.to_builtins(t) for t in body.tools]
        try:
            return tools.call_grammar(defs, names, body.parallel_tool_calls is not False,
                                      tools.tool_format(self.tokenizer.chat_template))
        except ValueError as e:
            raise APIError(400, f"the tools' parameters cannot be enforced: {e}", param="tools",
                           code="invalid_json_schema") from None

    @staticmethod
    def _grammar(body: s.ChatCompletionRequest | s.CompletionRequest) -> str | None:
        """response_format's grammar (None: free text); 400 naming what the library cannot enforce."""
        fmt = body.response_format if isinstance(body, s.ChatCompletionRequest) else None
        if fmt is None or isinstance(fmt, s.TextFormat):
            return None
        if isinstance(fmt, s.JsonObjectFormat):
            return json_grammar(ANY_OBJECT)
        try:
            return json_grammar(fmt.json_schema.schema)
        except ValueError as e:
            raise APIError(400, f"response_format.json_schema.schema cannot be enforced: {e}",
                           param="response_format.json_schema.schema", code="invalid_json_schema") from None

    @staticmethod
    def _logprobs(body: s.ChatCompletionRequest | s.CompletionRequest) -> int:
        """The top count each sampled token's logprobs come with (-1: no logprobs)."""
        if isinstance(body, s.CompletionRequest):
            return -1 if body.logprobs is None else body.logprobs
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs",
                           code="top_logprobs_without_logprobs")
        return (body.top_logprobs or 0) if body.logprobs else -1

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
        if not s.MIN_READING_RATE <= rate <= s.MAX_READING_RATE:
            raise APIError(400, f"X-Reading-Rate must be a number of tokens/s in [{s.MIN_READING_RATE:g}, "
                                f"{s.MAX_READING_RATE:g}], got {header!r}", param="X-Reading-Rate")
        return rate

    def max_model_len(self) -> int:
        lens = [slot.info.max_model_len for slot in self.supervisor.slots if slot.ready and slot.info]
        if not lens:
            raise self._unavailable()
        length = min(lens)
        if length != self._checked_len:  # once for each context the engines publish
            self._checked_len = length
            note = body_limit_note(self.config.max_body_size, length, self.tokenizer.max_token_bytes)
            if note is not None:
                log.log(*note)
        return length

    def _unavailable(self) -> APIError:
        why = "draining for shutdown" if self.draining else "starting or restarting its engines"
        return APIError(503, f"the server is {why}: retry shortly", code="unavailable", headers={"Retry-After": "1"})

    async def pick(self, prep: Prepared, request_id: str = "") -> Choice:
        """The engine (and, with the pool on, where its prefix is read and its new segments go):
        refusals first (draining, the waiting bound, no engine ready). `done(request_id)` once the
        request ends (the pool's router records what it was named to compute)."""
        self.admissible()
        if self.supervisor.engine_config.pool_mode == "off":
            return self.router.pick(self.ready_slots(), prep.prompt_ids)
        output = prep.sampling.max_tokens or DEFAULT_EXPECTED_OUTPUT
        return await self.arrivals.add(Arrival(prep.prompt_ids, min(output, DEFAULT_EXPECTED_OUTPUT), request_id))

    def done(self, request_id: str, ended: bool = False) -> None:
        """The request has its first token (Supervisor.on_started), or `ended`: what it was named to
        compute is no longer being computed (Router.done), and the queued requests that waited for
        it (Reads.pending) hear where their prefix is now, without asking again; where it ended
        before its first token, the first of them is named to compute it and the others wait on."""
        for waiter in self.router.done(request_id, computed=not ended):
            for slot in self.supervisor.slots:
                stream = slot.streams.get(waiter)
                if stream is not None:
                    self._resolve(slot, stream)
                    break

    def _place(self, arrivals: Sequence[Arrival]) -> list[Choice]:
        """A group of arrivals with the pool on (daemon/api/arrivals.py)."""
        slots = self.ready_slots()
        infos = [slot.info for slot in slots if slot.info is not None]
        segment = self._segment_pages(slots)
        cost = TrafficCost(max(i.pool_query_row_bytes for i in infos), max(i.pool_kv_token_bytes for i in infos))
        place = self.supervisor.engine_config.pool_placement == "home"
        choices = self.router.dispatch(slots, arrivals, segment, cost, place=place)
        for arrival, choice in zip(arrivals, choices):  # (its engine's Computing may come after a peer's question)
            if self._begins_at_once(self.supervisor.slots[choice.engine_id]):
                self.router.computing(arrival.request_id)
        return choices

    @staticmethod
    def _begins_at_once(slot) -> bool:
        """Nothing is queued on `slot`: a request sent there now begins at its next step."""
        return not slot.num_waiting and slot.stats is not None and not slot.stats.num_waiting

    @staticmethod
    def _segment_pages(slots: Sequence) -> int:
        return min((slot.info.pool_segment_pages for slot in slots if slot.info is not None), default=1) or 1

    def _resolve(self, slot, stream) -> None:
        """A request queued on `slot` nears the front of its queue (protocol.ResolveReads): its reads
        named again, from where the pool holds its prefix now."""
        slots = [x for x in self.supervisor.slots if x.ready]  # (not ready_slots: none ready is no error here)
        runs, copies = self.router.reads(slots, stream.add.prompt_token_ids, self._segment_pages(slots),
                                         slot.engine_id) if slot in slots and stream.add is not None else ([], [])
        self.supervisor.send(slot, Reads(stream.request_id, [PrefixRun(e, keys) for e, keys in runs],
                                         [PrefixRun(e, keys) for e, keys in copies],
                                         self.router.being_computed(stream.request_id)))

    def _steal(self, slot) -> None:
        """An engine reported its state (each step, and every heartbeat while it runs nothing): if it
        is idle, it takes a queued request from the engine with the longest queue (pool/steal.py),
        one Withdraw in flight to or for an engine at a time, none to an engine that gave nothing back
        until its queue grows. It counts as idle only while the requests sent to it without a first
        token are no more than it runs (none sent since its report)."""
        st, asked = slot.stats, self._withdrawing
        if st is None or not slot.ready or slot.num_waiting > st.num_running or not idle(
                st.num_waiting, st.num_running, slot.config.max_num_seqs, st.kv_pages_total - st.kv_pages_used,
                st.kv_pages_total):
            return
        now = time.monotonic()
        for giver in [e for e, (_, t) in asked.items() if now - t > WITHDRAW_SECONDS]:
            del asked[giver]  # its answer is lost (the engine went away): ask again
        if slot.engine_id in asked or any(thief == slot.engine_id for thief, _ in asked.values()):
            return
        queues = {x.engine_id: x.stats.num_waiting for x in self.supervisor.slots
                  if x.ready and x.stats is not None and x.engine_id not in asked
                  and x.stats.num_waiting > self._refused.get(x.engine_id, -1)}
        giver = victim(queues, slot.engine_id)
        if giver is None:
            return
        keep = self._staying(self.supervisor.slots[giver], slot)
        if self.supervisor.send(self.supervisor.slots[giver], Withdraw(self.supervisor.front, keep)):
            asked[giver] = (slot.engine_id, now)

    def _staying(self, giver, thief) -> list[str]:
        """The requests queued on `giver` without a first token that stay there rather than go to
        `thief` (pool/steal.py `staying`); each prompt's page keys are kept on its Stream."""
        def keys_of(stream) -> list[bytes]:
            if stream.keys is None:
                stream.keys = self.router.prompt_keys(stream.add.prompt_token_ids)
            return stream.keys

        fresh = [s for s in giver.streams.values() if not s.started and s.add is not None]
        return staying(fresh, keys_of, self.router.index, giver.engine_id, thief.engine_id, self.router.page_size)

    def _withdrawn(self, giver, msg: Withdrawn) -> None:
        """An engine gave queued requests back (Withdraw): each goes to the idle engine it was asked
        for, its reads and homes named for where it runs now (Router.pick_pooled); where that engine no longer
        serves, back to the engine that gave it, at the end of its queue, where it was."""
        thief, _ = self._withdrawing.pop(giver.engine_id, (giver.engine_id, 0.0))
        if msg.request_ids or giver.stats is None:
            self._refused.pop(giver.engine_id, None)
        else:  # every request queued there has started: not asked again before its queue grows
            self._refused[giver.engine_id] = giver.stats.num_waiting
        for rid in msg.request_ids:
            stream = giver.streams.get(rid)
            if stream is None or stream.add is None:
                continue  # its client went away meanwhile (its abort found it gone on the engine)
            slots = [x for x in self.supervisor.slots if x.ready]
            for target in (self.supervisor.slots[thief], giver):
                if target not in slots:
                    continue
                choice = self.router.pick_pooled(slots, stream.add.prompt_token_ids, self._segment_pages(slots),
                                                 place=self.supervisor.engine_config.pool_placement == "home",
                                                 target=target.engine_id, count=False, request_id=rid)
                add = msgspec.structs.replace(stream.add, prefix=[PrefixRun(e, keys) for e, keys in choice.runs],
                                              place=[PrefixRun(e, keys) for e, keys in choice.places], copy=[],
                                              pending=choice.pending)
                at_once = self._begins_at_once(target)  # (as `_place` counts a request computing)
                if self.supervisor.move(stream, target, add):
                    if at_once:
                        self.router.computing(rid)
                    if target is not giver:
                        self.metrics.moved.labels(str(giver.engine_id)).inc()
                    break
            else:
                giver.deliver(Delta(rid, [], "error", "its engine gave it back and no engine serves now"))

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

    def start(self, prep: Prepared, request_id: str, arrival: float, choice: Choice,
               prefill_node: str | None = None, pull_from: str | None = None, after: str = "") -> Generation:
        """`prefill_node`: a federated decode node's request, whose prompt that node computes, having
        first pulled a longer prefix from `pull_from`. `after`: the first choice of the same prompt
        (n > 1), whose first token this one waits for on the engine."""
        self.admissible()  # again: the requests placed with this one may have filled the queue
        slot = self.supervisor.slots[choice.engine_id]
        coalesce = self.coalescing if prep.stream and prep.coalesce else None
        add = AddRequest(request_id, prep.prompt_ids, prep.sampling, prep.reading_rate, prep.priority, arrival,
                         front=self.supervisor.front, front_epoch=self.supervisor.front_epoch, coalesce=coalesce,
                         prefix=[PrefixRun(e, keys) for e, keys in choice.runs],
                         place=[PrefixRun(e, keys) for e, keys in choice.places],
                         copy=[PrefixRun(e, keys) for e, keys in choice.copies], pending=choice.pending,
                         remote_kv=prefill_node is not None, after=after)
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
                             keep_ids=prefill_node is not None,
                             tool_parser=tools.ToolCallParser(prep.tool_format) if prep.tool_format else None)
        except NoEngineReady:
            self.supervisor.forget(request_id)
            raise self._unavailable() from None
        if reserved is not None:
            order = PrefillOrder(request_id, prep.prompt_ids, prep.sampling, None, 0.0, prep.priority,
                                 prep.reading_rate, pull_from)
            self.federation.drive(slot, request_id, order, prefill_node, reserved)
        return gen


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
