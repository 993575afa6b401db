"""Readers: one asyncio task and one streaming HTTP request per client, all in one aiohttp session.

A reader's app drains its socket at once into a local buffer that the person reads at
`reading_rate`; so a client only records when each token arrived (time.monotonic() when the read
that delivered it returned), and the buffer, its stalls and the effective tokens are replayed from
those times afterwards by tokenflowd.buffer.qos (report.py): one implementation of the reader model.

Token counting. Each SSE event with text (`choices[0].text`, or `delta.content` on chat) counts as
one token, and so does one with empty text that is not the chat role's opening or the finish
(tokenflowd sends such an event for a token whose text is not out yet: held bytes of a partial
character, a special token). A server may put several tokens in one event (tokenflowd gathers the
tokens of a reader far ahead, and merges those a slow client left unread). Where every event
carries the usage so far (stream_options.continuous_usage_stats, which tokenflowd and vLLM honour),
an event counts as the tokens its usage adds, all arriving with it. Otherwise a completed stream's
count is reconciled with `usage.completion_tokens` of its last event (stream_options.include_usage):
missing tokens get the time of the last text event (all had arrived by then); surplus events are
dropped from the end.

Outcomes:
    completed   the stream ended with a finish reason or `data: [DONE]`
    abandoned   the client closed the stream after `abandon_after` tokens (tokens past it are dropped)
    timeout     no byte for `timeout` s (waiting for the headers included): the client closed it
    error       a non-200 answer, an error event, a connection dropped or a stream cut short
"""
from __future__ import annotations

import asyncio
import gc
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Literal, Sequence

import aiohttp
import msgspec

from loadgen.workload import LoadRequest

Outcome = Literal["pending", "completed", "abandoned", "timeout", "error"]


@dataclass(frozen=True)
class ClientConfig:
    url: str  # the endpoint, e.g. http://127.0.0.1:8000/v1/completions
    timeout: float | None = 60.0  # s without a byte before a client gives up; None: never
    max_concurrency: int | None = None  # streams open at once; None: no bound
    headers: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.timeout is not None and not self.timeout > 0:
            raise ValueError(f"--timeout must be above 0 s, got {self.timeout}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")


@dataclass(slots=True)
class RequestRecord:
    """One client's request as it saw it. Times are s since the run's origin."""

    request_id: str
    scheduled: float  # the workload's arrival time
    reading_rate: float
    prompt_len: int
    output_len: int
    abandon_after: int | None = None
    arrival: float | None = None  # when the request was sent (after any --max-concurrency wait)
    token_times: list[float] = field(default_factory=list)
    num_events: int = 0  # SSE events that carried text
    usage_tokens: int | None = None  # usage.completion_tokens of the stream's end
    finish_reason: str | None = None
    outcome: Outcome = "pending"
    error: str | None = None

    @classmethod
    def of(cls, lr: LoadRequest) -> RequestRecord:
        r = lr.request
        return cls(r.request_id, r.arrival_time, r.reading_rate, r.prompt_len, r.output_len, lr.abandon_after)

    @property
    def ttft(self) -> float | None:
        if not self.token_times or self.arrival is None:
            return None
        return self.token_times[0] - self.arrival


@dataclass(frozen=True)
class RunResult:
    origin: float  # time.monotonic() at the run's start
    duration: float  # s from the origin until the last client finished
    records: list[RequestRecord]


# -- the SSE events we read (other fields are ignored) ------------------------------------------
class _Delta(msgspec.Struct):
    content: str | None = None
    role: str | None = None


class _Choice(msgspec.Struct):
    text: str | None = None
    delta: _Delta | None = None
    finish_reason: str | None = None


class _Usage(msgspec.Struct):
    completion_tokens: int | None = None


class _Error(msgspec.Struct):
    message: str = ""


class _Chunk(msgspec.Struct):
    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    error: _Error | str | None = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode
_JSON = {"Content-Type": "application/json"}


async def stream_one(session: aiohttp.ClientSession, url: str, lr: LoadRequest, rec: RequestRecord,
                     origin: float, timeout: float | None) -> None:
    """POST one streaming request and read it to its end (or give up); fills `rec`."""
    rec.arrival = time.monotonic() - origin
    try:
        async with session.post(url, data=lr.body, headers=_JSON) as resp:
            if resp.status != 200:
                rec.outcome, rec.error = "error", f"HTTP {resp.status}: {(await resp.text())[:500]}"
                return
            await _read_events(resp, rec, origin)
    except asyncio.TimeoutError:  # aiohttp's sock_read timeout (a subclass of both)
        rec.outcome, rec.error = "timeout", f"no data for {timeout} s"
    except (aiohttp.ClientError, msgspec.DecodeError, msgspec.ValidationError) as e:
        rec.outcome, rec.error = "error", f"{type(e).__name__}: {e}"


async def _read_events(resp: aiohttp.ClientResponse, rec: RequestRecord, origin: float) -> None:
    times = rec.token_times
    stop_at = rec.abandon_after
    pending = b""
    done = False
    async for data in resp.content.iter_any():
        now = time.monotonic() - origin  # every event of this read arrived by now
        lines = (pending + data if pending else data).split(b"\n")
        pending = lines.pop()
        for line in lines:
            if not line.startswith(b"data:"):
                continue  # blank separators, comments, event:/id: lines
            payload = line[5:].strip()
            if payload == b"[DONE]":
                done = True
                continue
            chunk = _decode_chunk(payload)
            if chunk.error is not None:
                rec.error = chunk.error if isinstance(chunk.error, str) else chunk.error.message
            so_far = chunk.usage.completion_tokens if chunk.usage is not None else None
            if so_far is not None:
                rec.usage_tokens = so_far
            for choice in chunk.choices or ():
                if _is_token(choice):
                    # continuous usage: the tokens this event adds (at least its own); else one
                    times.extend([now] * (max(1, so_far - len(times)) if so_far is not None else 1))
                    rec.num_events += 1
                if choice.finish_reason:
                    rec.finish_reason = choice.finish_reason
        if stop_at is not None and len(times) >= stop_at:
            del times[stop_at:]
            rec.outcome = "abandoned"
            resp.close()  # drops the connection: the server sees the client leave
            return
    # NOTE: read on past [DONE] to the body's end: a response released before its end closes the
    # connection, and the server's last write (the end of the chunked body) would meet a reset.
    if rec.error is not None:
        rec.outcome = "error"
    elif done or rec.finish_reason is not None:
        rec.outcome = "completed"
        _reconcile(rec)
    else:
        rec.outcome, rec.error = "error", "the stream ended without a finish reason or [DONE]"


def _is_token(choice: _Choice) -> bool:
    """An event with text, or with empty text that is neither the chat role's opening nor the
    finish: tokenflowd sends one for a token whose text is not out yet (held bytes of a partial
    character, a special token), so its time is the token's."""
    if choice.delta is None:
        return choice.text is not None and (choice.text != "" or choice.finish_reason is None)
    content = choice.delta.content
    return content is not None and (content != "" or (choice.finish_reason is None and choice.delta.role is None))


def _reconcile(rec: RequestRecord) -> None:
    """Make the token count the server's usage count (see the module docstring)."""
    times, usage = rec.token_times, rec.usage_tokens
    if usage is None or not times or usage == len(times):
        return
    if usage > len(times):
        times.extend([times[-1]] * (usage - len(times)))
    elif usage >= 1:
        del times[usage:]


async def run_load(requests: Sequence[LoadRequest], cfg: ClientConfig,
                   on_done: Callable[[RequestRecord], None] | None = None) -> RunResult:
    """Send every request at its arrival time (s after the start) and read all streams to their end."""
    records = [RequestRecord.of(lr) for lr in requests]
    slots = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    # One session, no connection bound (limit=0): thousands of streams share one pool.
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=cfg.timeout, sock_read=cfg.timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=dict(cfg.headers)) as session:
        origin = time.monotonic()

        async def client(lr: LoadRequest, rec: RequestRecord) -> None:
            while (delay := origin + lr.request.arrival_time - time.monotonic()) > 0:
                await asyncio.sleep(delay)  # again if a coarse timer (uvloop: 1 ms) woke us early
            if slots is None:
                await stream_one(session, cfg.url, lr, rec, origin, cfg.timeout)
            else:
                async with slots:
                    await stream_one(session, cfg.url, lr, rec, origin, cfg.timeout)
            if on_done is not None:
                on_done(rec)

        await asyncio.gather(*(client(lr, rec) for lr, rec in zip(requests, records)))
        duration = time.monotonic() - origin
    return RunResult(origin, duration, records)


@contextmanager
def paused_gc() -> Iterator[None]:
    """No collector passes while the streams run; one full collection after.

    NOTE: a pass walks every young object: the first ones after a burst of 1,000 new connections
    took ~10 ms each and made every stream's tokens late (bench/loadgen_overhead.py). Nothing piles
    up meanwhile: a request leaves no reference cycles behind (aiohttp 3.14: no unreachable object
    after 2,000 streams), so its memory goes by reference counting.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
        gc.collect()


def run_blocking(requests: Sequence[LoadRequest], cfg: ClientConfig,
                 on_done: Callable[[RequestRecord], None] | None = None) -> RunResult:
    """run_load on a fresh event loop (uvloop where installed)."""
    try:
        import uvloop
    except ImportError:
        uvloop = None
    with paused_gc():
        if uvloop is None:
            return asyncio.run(run_load(requests, cfg, on_done))
        return uvloop.run(run_load(requests, cfg, on_done))


async def served_model(base_url: str, headers: dict[str, str] | None = None) -> str:
    """The first model GET /v1/models lists (what --model defaults to)."""
    url = base_url.rstrip("/") + "/v1/models"
    try:
        async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=30)) as session:
            async with session.get(url) as resp:
                if resp.status != 200:
                    raise ValueError(f"GET {url} answered {resp.status}: pass --model")
                data = (await resp.json()).get("data") or []
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise ValueError(f"cannot ask {url} for the model ({type(e).__name__}: {e}): is the server up? "
                         "(or pass --model)") from None
    if not data:
        raise ValueError(f"{base_url}/v1/models lists no model: pass --model")
    return data[0]["id"]
