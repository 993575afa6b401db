"""Server-sent events as the front writes them: each response's chunk bodies (chat and
completions), and the connection that writes a stream's events straight to its transport,
with the small socket buffers that make a slow reader show as backpressure.
"""
from __future__ import annotations

import socket
import struct
import time
from typing import Any

import msgspec
from aiohttp import web

from tokenflowd.daemon.api.generation import Generation, Piece
from tokenflowd.openai_api import schema as s
from tokenflowd.protocol import TokenLogprobs
from tokenflowd.text.tokenizer import Tokenizer
from tokenflowd.text.tools import ToolCall

Logprobs = list[tuple[int, TokenLogprobs]]  # (token id, its logprobs), one a token in order

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
STREAM_SNDBUF = 8 * 1024  # small socket buffers: a slow reader shows as backpressure within ~25 KB
STREAM_HIGH_WATER = 4 * 1024  # the transport pauses writing above it, resumes below a quarter of it
KEEP_ALIVE = b": keep-alive\n\n"  # an SSE comment: no event, bytes on the wire


# -- helpers -----------------------------------------------------------------------------------
class ChatChunks:
    """One response's bodies: its SSE events, or the whole non-streamed object; `index` is the
    choice's (n > 1). `tokenizer` names the tokens of logprobs (requests that ask for them)."""

    def __init__(self, rid: str, created: int, model: str, tokenizer: Tokenizer | None = None) -> None:
        self.rid, self.created, self.model = rid, created, model
        self.tokenizer = tokenizer
        self.num_calls: dict[int, int] = {}  # tool calls sent so far, by choice: the index of the next

    def _event(self, choices: list, usage: s.Usage | None = None) -> bytes:
        return b"data: " + msgspec.json.encode(s.ChatCompletionChunk(self.rid, self.created, self.model, choices,
                                                                     usage)) + b"\n\n"

    def role(self, index: int = 0) -> bytes:
        return self._event([s.ChatChunkChoice(index, s.ChunkDelta(content="", role="assistant"))])

    def text(self, text: str, usage: s.Usage | None = None, logprobs: Logprobs | None = None,
             tool_calls: list[ToolCall] | None = None, index: int = 0) -> bytes:
        calls = None
        if tool_calls:  # each call whole in one delta: its id, name and all its arguments
            first = self.num_calls.get(index, 0)
            calls = [s.ToolCallDelta(first + k, c.id, "function", s.FunctionDelta(c.name, c.arguments))
                     for k, c in enumerate(tool_calls)]
            self.num_calls[index] = first + len(tool_calls)
        delta = s.ChunkDelta(content=text if text or not calls else None, tool_calls=calls)
        return self._event([s.ChatChunkChoice(index, delta, logprobs=self._logprobs(logprobs))], usage)

    def finish(self, reason: str, index: int = 0) -> bytes:
        return self._event([s.ChatChunkChoice(index, s.ChunkDelta(), reason)])

    def usage(self, usage: s.Usage) -> bytes:
        return self._event([], usage)

    def choice(self, index: int, text: str, finish_reason: str | None, logprobs: Logprobs | None = None,
               tool_calls: list[ToolCall] | None = None) -> s.ChatChoice:
        calls = [s.ToolCallOut(c.id, s.FunctionCallOut(c.name, c.arguments)) for c in tool_calls or ()] or None
        message = s.AssistantMessage(text if text or not calls else None, tool_calls=calls)
        return s.ChatChoice(index, message, finish_reason, self._logprobs(logprobs))

    def response(self, choices: list, usage: s.Usage) -> s.ChatCompletion:
        return s.ChatCompletion(self.rid, self.created, self.model, choices, usage)

    def whole(self, text: str, finish_reason: str | None, usage: s.Usage, logprobs: Logprobs | None = None,
              tool_calls: list[ToolCall] | None = None) -> s.ChatCompletion:
        return self.response([self.choice(0, text, finish_reason, logprobs, tool_calls)], usage)

    def _name(self, token_id: int) -> tuple[str, list[int]]:
        raw = self.tokenizer.token_bytes(token_id)
        return raw.decode("utf-8", errors="replace"), list(raw)

    def _logprobs(self, logprobs: Logprobs | None) -> s.ChoiceLogprobs | None:
        if logprobs is None or self.tokenizer is None:
            return None
        name, content = self._name, []
        for token_id, lp in logprobs:
            top = []
            for t, v in zip(lp.top_ids, lp.top_logprobs):
                text, raw = name(t)
                top.append(s.TopLogprob(text, v, raw))
            text, raw = name(token_id)
            content.append(s.TokenLogprob(text, lp.logprob, raw, top))
        return s.ChoiceLogprobs(content)


class CompletionChunks(ChatChunks):
    def __init__(self, rid: str, created: int, model: str, tokenizer: Tokenizer | None = None) -> None:
        super().__init__(rid, created, model, tokenizer)
        self.text_offset: dict[int, int] = {}  # by choice: characters of its output before its next token

    def _event(self, choices: list, usage: s.Usage | None = None) -> bytes:
        body = msgspec.json.encode(s.Completion(self.rid, self.created, self.model, choices, usage))
        return b"data: " + body + b"\n\n"

    def role(self, index: int = 0) -> bytes:
        return b""

    def text(self, text: str, usage: s.Usage | None = None, logprobs: Logprobs | None = None,
             tool_calls: list[ToolCall] | None = None, index: int = 0) -> bytes:
        return self._event([s.CompletionChoice(index, text, logprobs=self._completion_logprobs(logprobs, index))],
                           usage)

    def finish(self, reason: str, index: int = 0) -> bytes:
        return self._event([s.CompletionChoice(index, "", reason)])

    def choice(self, index: int, text: str, finish_reason: str | None, logprobs: Logprobs | None = None,
               tool_calls: list[ToolCall] | None = None) -> s.CompletionChoice:
        return s.CompletionChoice(index, text, finish_reason, self._completion_logprobs(logprobs, index))

    def response(self, choices: list, usage: s.Usage) -> s.Completion:
        return s.Completion(self.rid, self.created, self.model, choices, usage)

    def _completion_logprobs(self, logprobs: Logprobs | None, index: int = 0) -> s.CompletionLogprobs | None:
        if logprobs is None or self.tokenizer is None:
            return None
        out = s.CompletionLogprobs([], [], [], [])
        offset = self.text_offset.get(index, 0)
        for token_id, lp in logprobs:
            text = self._name(token_id)[0]
            out.tokens.append(text)
            out.token_logprobs.append(lp.logprob)
            out.top_logprobs.append({self._name(t)[0]: v for t, v in zip(lp.top_ids, lp.top_logprobs)})
            out.text_offset.append(offset)
            offset += len(text)
        self.text_offset[index] = offset
        return out


class SSEConnection:
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
            self.write(KEEP_ALIVE)

    def send(self, text: str, num_tokens: int, blocked: float = 0.0, logprobs: Logprobs | None = None,
             tool_calls: list[ToolCall] | None = None) -> None:
        """One event with `text` (its `num_tokens` tokens, and their logprobs where asked), now. A
        token with no text yet (held bytes of a character, a special token) still gets its event:
        clients time every token, as the engine counts it."""
        if text or num_tokens or tool_calls:
            gen = self.gen
            usage = usage_so_far(gen, gen.num_delivered + num_tokens) if self.continuous_usage else None
            self.write(self.chunks.text(text, usage, logprobs, tool_calls))
            self.num_events += 1
        self.gen.delivered(num_tokens, blocked)  # no-op without tokens

    def push(self, piece: Piece) -> bool:
        """Send one piece now if the connection has room; False leaves it to the handler."""
        transport = self.transport
        if transport is None or transport.get_write_buffer_size() > STREAM_HIGH_WATER:
            return False
        self.send(piece.text, piece.num_tokens, logprobs=piece.logprobs, tool_calls=piece.tool_calls)
        return True


def usage(gen: Generation) -> s.Usage:
    return usage_so_far(gen, gen.num_output_tokens)


def usage_of(gens: list[Generation]) -> s.Usage:
    """n > 1: the prompt once, the completion tokens of every choice."""
    first, completion = gens[0], sum(g.num_output_tokens for g in gens)
    return s.Usage(first.num_prompt_tokens, completion, first.num_prompt_tokens + completion,
                   s.PromptTokensDetails(first.num_cached_tokens))


def usage_so_far(gen: Generation, num_tokens: int) -> s.Usage:
    return s.Usage(gen.num_prompt_tokens, num_tokens, gen.num_prompt_tokens + num_tokens,
                   s.PromptTokensDetails(gen.num_cached_tokens))


def reset(request: web.Request) -> None:
    """Close the connection with a reset, dropping what it could not send: a closed socket would
    otherwise keep its unsent bytes in the kernel, probing a reader that reads nothing for minutes."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def tune_for_backpressure(request: web.Request) -> None:
    """Small send buffers, so a client reading slower than tokens come blocks our writes soon."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_SNDBUF)
    transport.set_write_buffer_limits(high=STREAM_HIGH_WATER)
