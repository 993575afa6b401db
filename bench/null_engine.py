"""A model-free engine process: the protocol of tokenflowd/engine/process/loop.py, tokens at a fixed rate.

    python bench/null_engine.py '<EngineSpec as JSON>'     (what bench/front_capacity.py's supervisor runs)

For benchmarks of the HTTP front only. It is an EngineEndpoint like the real engine process (the
same sockets, structs and message handling, tokenflowd/engine/process/endpoint.py): Ready first; then one StepOutputs per loop iteration that has
anything to report, carrying one Delta per request that got a token and the EngineStats; an idle
StepOutputs every heartbeat interval; AddRequest / AbortRequests / SetReadingRate / QueryRequests /
Shutdown handled through the same endpoint. It imports no torch and loads no model.

Schedule. A request received at t_recv gets token k (k = 0 .. max_tokens-1) due at
t_recv + k / rate, so requests are staggered by their own arrival, never in lockstep. Every
iteration emits one token to each request whose next token is due (one StepOutputs for all of
them, as the real engine sends one per step) and sleeps until the next due time or an input. A
request behind schedule gets one token per iteration until it has caught up, never two at once.
The last token carries finish_reason "length" (or "stop" if the token id is a stop token id).

Environment:
    NULL_ENGINE_RATE      tokens/s per request (default 20)
    NULL_ENGINE_TOKEN_ID  the token id emitted (default 260: " the" in SmolLM2's tokenizer)
    NULL_ENGINE_LOG       a path: at exit, write {request_id: [send time of token 0, 1, ...]}
                          (msgpack, time.monotonic() seconds) for latency measurements
    NULL_ENGINE_CPUS      CPUs to run on, e.g. "1" (sched_setaffinity)

The send time of a token is taken just before its StepOutputs is handed to zmq; for a token the
endpoint's pacing holds (engine/process/pacing.py), when it would have been sent unheld: the hold is part
of what the front adds to its latency.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import os
import sys
import time

import msgspec

from tokenflowd import protocol as p
from tokenflowd.config.platform import die_with_parent
from tokenflowd.engine.process.endpoint import EngineEndpoint

log = logging.getLogger("tokenflowd.null_engine")
DEFAULT_TOKEN_ID = 260  # " the" (tokenflowd.text.source.load_tokenizer("smollm2-135m").encode(" the"))
DEFAULT_MAX_MODEL_LEN = 8192  # SmolLM2's context, when the config does not cap it


class _Request:
    __slots__ = ("request_id", "num_prompt_tokens", "max_tokens", "stop_ids", "reading_rate", "priority",
                 "arrival_time", "start", "num_output", "done", "sent")

    def __init__(self, msg: p.AddRequest, max_tokens: int, start: float, sent: list[float]) -> None:
        self.request_id = msg.request_id
        self.num_prompt_tokens = len(msg.prompt_token_ids)
        self.max_tokens = max_tokens
        self.stop_ids = frozenset(msg.sampling.stop_token_ids)
        self.reading_rate = msg.reading_rate
        self.priority = msg.priority
        self.arrival_time = msg.arrival_time
        self.start = start  # token k is due at start + k * period
        self.num_output = 0
        self.done = False
        self.sent = sent  # the send time of each token


class NullEngine(EngineEndpoint):
    def __init__(self, spec: p.EngineSpec) -> None:
        super().__init__(spec)
        cfg = spec.config
        self.model = cfg.get("model", "null")
        self.page_size = cfg.get("page_size", 16)
        self.max_model_len = cfg.get("max_model_len") or DEFAULT_MAX_MODEL_LEN
        self.period = 1.0 / float(os.environ.get("NULL_ENGINE_RATE", "20"))
        self.token_id = int(os.environ.get("NULL_ENGINE_TOKEN_ID", DEFAULT_TOKEN_ID))
        self.log_path = os.environ.get("NULL_ENGINE_LOG")
        self.live: dict[str, _Request] = {}
        self.log: dict[str, list[float]] = {}  # every request's send times, finished and aborted ones too
        self.heap: list[tuple[float, int, _Request]] = []  # (due time of its next token, tiebreak, request)
        self._seq = itertools.count()
        self.num_steps = 0
        self.last_step_time = 0.0

    def run(self) -> None:
        self.send(p.Ready(self.spec.engine_id, self.spec.incarnation, os.getpid(), self.model,
                           self.max_model_len, self.page_size, "null", self._stats()))
        heartbeat, period, token_id = self.spec.heartbeat_interval, self.period, self.token_id
        heap, live = self.heap, self.live
        last_sent = time.monotonic()
        while self.running:
            now = time.monotonic()
            wait = self.wait_until(heap[0][0] if heap else last_sent + heartbeat, now)  # held tokens too
            if self.inbox.poll(int(wait * 1000 + 0.999)):  # ms, rounded up: never wakes early
                self.drain_inbox()
            now = time.monotonic()
            deltas = self.take_rejected()
            emitted: list[_Request] = []
            while heap and heap[0][0] <= now:
                req = heapq.heappop(heap)[2]
                if req.done:  # aborted while queued
                    continue
                req.num_output += 1
                finish = "stop" if token_id in req.stop_ids else "length" if req.num_output >= req.max_tokens else None
                if finish is not None:
                    req.done = True
                    del live[req.request_id]
                deltas.append(p.Delta(req.request_id, [token_id], finish))
                emitted.append(req)
            if emitted:
                self.num_steps += 1
                self.last_step_time = now
            deltas = self.pace(deltas, now)
            made = time.monotonic()  # a held token's time is this too: when it would have left unheld
            if self.must_report(deltas, now, last_sent):
                last_sent = made
                self.send_step(now, deltas, self._stats())
            for req in emitted:
                req.sent.append(made)
            for req in emitted:  # back into the heap after the batch: at most one token per iteration
                if not req.done:
                    heapq.heappush(heap, (req.start + req.num_output * period, next(self._seq), req))
            if not heap and self.orphaned(log):
                break
        self.close()
        self._write_log()

    def abort(self, request_id: str) -> None:
        req = self.live.pop(request_id, None)
        if req is not None:
            req.done = True  # its heap entry is skipped when it comes up

    def set_reading_rate(self, msg: p.SetReadingRate) -> None:
        req = self.live.get(msg.request_id)
        if req is not None:
            req.reading_rate = msg.reading_rate

    def set_read_cursor(self, msg: p.SetReadCursor) -> None:
        pass  # no buffer model: tokens go out on a fixed schedule whatever the reader does

    def add(self, msg: p.AddRequest) -> str | None:
        n = len(msg.prompt_token_ids)
        max_tokens = msg.sampling.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - n
        error = None
        if msg.request_id in self.live:
            error = f"request id {msg.request_id!r} is already in use"
        elif n == 0 or n >= self.max_model_len:
            error = f"the prompt has {n} tokens; the context holds {self.max_model_len}"
        elif max_tokens < 1 or n + max_tokens > self.max_model_len:
            error = f"prompt ({n}) plus max_tokens ({max_tokens}) exceeds the context {self.max_model_len}"
        if error is not None:
            return error
        sent = self.log.setdefault(msg.request_id, [])
        req = _Request(msg, max_tokens, time.monotonic(), sent)
        self.live[msg.request_id] = req
        heapq.heappush(self.heap, (req.start, next(self._seq), req))
        return None

    def infos(self, request_ids: list[str] | None) -> list[p.RequestInfo]:
        chosen = self.live.values() if request_ids is None else [self.live[r] for r in request_ids if r in self.live]
        return [
            p.RequestInfo(r.request_id, "running", r.reading_rate, r.priority, r.arrival_time,
                          r.sent[0] if r.sent else None, r.num_prompt_tokens, r.num_output,
                          r.num_prompt_tokens + r.num_output, 0, 0, 0.0, 0.0, 0, 0)
            for r in chosen
        ]

    def _stats(self) -> p.EngineStats:
        return p.EngineStats(num_running=len(self.live), num_waiting=0, kv_pages_used=0, kv_pages_cached=0,
                             kv_pages_total=0, num_preemptions=0, num_steps=self.num_steps,
                             last_step_time=self.last_step_time)

    def _write_log(self) -> None:
        if self.log_path:
            tmp = self.log_path + ".tmp"
            with open(tmp, "wb") as f:
                f.write(msgspec.msgpack.encode(self.log))
            os.replace(tmp, self.log_path)


def main(argv: list[str] | None = None) -> int:
    die_with_parent()
    argv = sys.argv[1:] if argv is None else argv
    spec = msgspec.json.decode(argv[0], type=p.EngineSpec)
    logging.basicConfig(level=os.environ.get("TOKENFLOWD_LOG_LEVEL", "WARNING").upper(),
                        format=f"%(asctime)s %(levelname)s null-engine{spec.engine_id}: %(message)s")
    cpus = os.environ.get("NULL_ENGINE_CPUS")
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    NullEngine(spec).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
