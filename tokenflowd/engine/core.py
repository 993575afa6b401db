"""EngineCore: token ids in, token ids out. What one engine process runs; knows no text.

    add_request(req)  ->  step() -> [EngineCoreOutput]  ...  abort(id)

    step:  scheduler.schedule() -> executor.execute(batch) -> scheduler.update(batch, sampled)

Overlapped (`overlap`, the default on a GPU), a step launches the next batch before it collects
the one in flight, so the device never waits for the host's scheduling and bookkeeping:

    schedule N+1 -> launch N+1 -> collect N -> update N -> copies for N+1     (N+1 runs meanwhile)

The scheduler counts a launched row as computed and its sampled token as a placeholder the next
row reads on the device (scheduler.py, `ahead`); the outputs of a step are its tokens, one step late.

The one step loop there is: the engine runs it with the model runner on the wall clock
(`EngineCore.from_config`), the simulator with the cost model's executor on a virtual clock.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Container

import torch

from tokenflowd.buffer import make_policy
from tokenflowd.config import EngineConfig
from tokenflowd.engine.admission import AdmissionControl
from tokenflowd.engine.errors import EngineFailed, ForeignPrefixLost, device_lost
from tokenflowd.engine.executor import Executor, Launched
from tokenflowd.engine.grammar import Grammars
from tokenflowd.engine.model.loader import LoadedModel, load_model_source
from tokenflowd.engine.request import FinishReason, InvalidRequestError, Request, RequestStatus, SamplingParams
from tokenflowd.engine.runner import ModelRunner
from tokenflowd.engine.sampler import Sampler
from tokenflowd.engine.scheduler import ScheduledBatch, Scheduler
from tokenflowd.engine.self_check import self_check
from tokenflowd.engine.startup import ATTENTION, FastPaths, start, supported, why_not_flashinfer
from tokenflowd.offload.build import build_kv
from tokenflowd.protocol import TokenLogprobs

log = logging.getLogger(__name__)

WARM_UP_PROMPT_LEN = 64  # tokens, at most, of the warm-up request's prompt (engine start-up)
MAX_FAILED_STEPS = 3  # consecutive steps that raise before the engine gives up (EngineFailed)


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    logprobs: list[TokenLogprobs] | None = None  # one a new token, where the request asks

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StepStats:
    num_steps: int = 0
    num_batched_tokens: int = 0
    last_step_time: float = 0.0


class EngineCore:
    """The step loop over an executor and a scheduler (which carries the clock and the KV manager).

    `vocab_size` bounds prompt token ids; `eos_token_ids` end a request unless it ignores them;
    `admission` is --max-queue-delay's load shedding (None: off)."""

    def __init__(self, executor: Executor, scheduler: Scheduler, *, max_model_len: int, vocab_size: int,
                 eos_token_ids: tuple[int, ...] = (), admission: AdmissionControl | None = None) -> None:
        self.executor = executor
        self.scheduler = scheduler
        self.kv = scheduler.kv
        self.pool = self.kv.pool
        self.clock = scheduler.clock
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.admission = admission
        self.stats = StepStats()
        self.num_failed_steps = 0  # consecutive
        self.last_batch = ScheduledBatch()  # the step just taken (the simulator records it)
        self.config: EngineConfig | None = None  # set by from_config, with the model's:
        self.model_config = None
        self.tokenizer = None
        self._grammars: Grammars | None = None  # structured output's matchers, on the first request that asks
        # n > 1: a request's other choices, held until its prompt's KV is in the prefix cache; then
        # each finds the prompt's whole pages there (shared, counted once) and computes only its tail
        self._forks: dict[str, list[Request]] = {}
        self.fallback = ""  # the fast paths start-up stepped down from, and why (engine/startup.py); "": none
        self.attention_note = ""  # why a GPU engine left to choose runs the torch backend ("": it does not)
        # Held by the engine's loop while it touches the KV pages, when another thread of the
        # process does too (the pool's query service, pool/member.py); a step lets go of it while
        # the model runs. None: only the loop's thread touches them.
        self.lock: threading.Lock | None = None
        # called with each step's batch before it runs (federation/: a prefill node plans its sends)
        self.on_batch: list[Callable[[ScheduledBatch], None]] = []  # each batch, scheduled, before it runs
        self._in_flight: Launched | None = None  # overlapped: the step launched and not yet collected
        self._overlap = False

    @property
    def overlap(self) -> bool:
        """Whether each step launches the next batch before it collects the one in flight."""
        return self._overlap

    @overlap.setter
    def overlap(self, on: bool) -> None:
        """Only between steps with none in flight (`drain`), and only where the executor can."""
        assert self._in_flight is None, "overlap changes with a step in flight"
        on = bool(on) and self.executor.overlaps
        self._overlap = on
        # where steps are computed on another thread (a CPU), copies wait for the step last launched
        self.kv.copier.fence = getattr(self.executor, "copy_fence", None) if on else None

    @classmethod
    def from_config(cls, config: EngineConfig, loaded: LoadedModel | None = None,
                    kv_memory=None) -> "EngineCore":
        """The engine on a model: loads it (unless given), its runner, the KV tiers and the scheduler.
        `kv_memory`: where the runner puts its KV cache (runner.py)."""
        loaded = loaded or load_model_source(config.model, getattr(torch, config.dtype), config.device,
                                             config.quantization)
        asked = FastPaths.of(config)
        why_not = supported(asked, loaded.config.head_dim)
        note = why_not_flashinfer(config) or ""
        if why_not is not None and config.attention_auto:  # a choice, not a failure: nothing to report
            asked, why_not, note = asked.without(ATTENTION), None, why_not
        if note:
            log.info("attention: the torch backend, as %s", note)
        runner, paths, fallback = start(asked, lambda paths: ModelRunner(paths.apply(config), loaded, kv_memory),
                                        self_check, config.device, why_not)
        config = paths.apply(config)
        kv = build_kv(config, runner.kv_cache, runner.attn.page_axis, runner.num_pages)
        scheduler = Scheduler(kv, make_policy(config.policy, config.policy_params), config.max_num_batched_tokens,
                              config.max_num_seqs, expected_output_len=config.policy_params.expected_output_len)
        eos = tuple(sorted(set(loaded.config.eos_token_ids) | set(loaded.tokenizer.eos_token_ids)))
        # --max-queue-delay: None, off
        admission = AdmissionControl(config.max_queue_delay) if config.max_queue_delay is not None else None
        core = cls(runner, scheduler, max_model_len=runner.max_model_len, vocab_size=loaded.config.vocab_size,
                   eos_token_ids=eos, admission=admission)
        core.config, core.model_config, core.tokenizer = config, loaded.config, loaded.tokenizer
        core.fallback = fallback
        core.attention_note = note
        core.overlap = config.overlap
        return core

    @property
    def runner(self) -> Executor:
        return self.executor

    def warm_up(self, prompt_len: int = WARM_UP_PROMPT_LEN, max_tokens: int = 4) -> int:
        """Two short requests (a prefill, then one over a cached prefix, each with a few decodes)
        before the engine says it is ready: the first
        step of a fresh process pays one-time costs (kernel and allocator set-up, on CUDA the
        graphs), which the first user's request paid before. The prompt is a one-line chat in
        the model's template, so the template's fixed head (a default system prompt and the user
        turn's opening: 24 tokens on the embedded model) is in the prefix cache when the first user's request arrives, as it
        is for the tenth. Leaves no other trace: the engine's counters, step-time model,
        output-length model and load-shedding pace start afresh, and the prompt's pages are only
        cached (evictable). Returns the tokens it generated."""
        n = max(1, min(prompt_len, self.max_model_len - max_tokens - 1))
        generated = 0
        for i, text in enumerate(("Hello.", "Hi, how are you?")):  # the second runs over the first's cached head
            ids = []
            if self.tokenizer is not None and self.tokenizer.chat_template:
                ids = self.tokenizer.encode_chat([{"role": "user", "content": text}])[:n]
            if not ids:  # no template: a prompt of no text that no user sends
                ids = [(7919 * k + 13 + i) % self.vocab_size for k in range(n)]
            req = Request(f"warm-up-{i}", ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                          arrival_time=time.monotonic())
            self.add_request(req)  # validated and given the engine's context and end tokens, as a user's
            while self.scheduler.has_unfinished():
                generated += sum(len(out.new_token_ids) for out in self.step())
        self.drain()
        self.wait_copies()
        self.stats = StepStats()
        self.kv.reset_stats()
        self.scheduler.num_preemptions = 0
        self.scheduler.reset_models()
        if self.admission is not None:  # its pace was taken against the models just forgotten
            self.admission = AdmissionControl(self.admission.bound)
        return generated

    # -- API ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def unlocked(self):
        """Let go of `lock` (held by the caller) for a while: the model's run, a call to a peer."""
        if self.lock is None:
            yield
            return
        self.lock.release()
        try:
            yield
        finally:
            self.lock.acquire()

    def add_request(self, req: Request, after: str | None = None) -> None:
        """Validate and queue. Raises InvalidRequestError (nothing changes) when it cannot be served,
        QueueDelayExceeded (nothing changes) when it would wait longer than --max-queue-delay.
        `after`: another choice of the same prompt (n > 1) whose first token this one waits for, so
        that the prompt's pages are computed once and shared."""
        self._validate(req)
        if self.admission is not None:
            self.admission.check(self.scheduler, req)
        parent = self.scheduler.requests.get(after) if after else None
        if parent is not None and parent.first_token_time is None:
            self._forks.setdefault(parent.request_id, []).append(req)
            return
        self.scheduler.add(req)

    @property
    def leaders(self) -> Container[str]:
        """Requests whose other choices (n > 1) wait here for their first token."""
        return self._forks.keys()

    def _release_forks(self) -> None:
        """Queue the choices whose first choice has its first token (or has ended)."""
        for rid in [rid for rid, kids in self._forks.items()
                    if (p := self.scheduler.requests.get(rid)) is None or p.first_token_time is not None]:
            for req in self._forks.pop(rid):
                self.scheduler.add(req)

    def add_remote(self, req: Request, num_tokens: int) -> list[int] | None:
        """A request whose prompt another node computes (federation/): validated as any, then given
        pages for that node to write its `num_tokens` of KV into (Scheduler.add_remote). None
        (nothing changes): no room or no seat now, or it would wait longer than --max-queue-delay
        for its seat; then it is a local request, queued or shed as `add_request` decides."""
        self._validate(req)
        if num_tokens != req.num_prompt_tokens:
            raise InvalidRequestError("a prefill node sends the whole prompt's KV")
        if self.admission is not None and self.admission.over_bound(self.scheduler, req, remote=True) is not None:
            return None
        return self.scheduler.add_remote(req, num_tokens)

    def remote_arrived(self, request_id: str, first_token: int | None, settled: bool = True,
                       num_cached_tokens: int = 0) -> EngineCoreOutput | None:
        """The prefill node's KV for `request_id` is in place and it sampled `first_token` (None:
        the transfer failed; the request computes its prompt here; `settled` as in kv.remote_done).
        `num_cached_tokens`: the prefill node's prefix hit, reported as this request's.
        -> the first token's output."""
        req = self.scheduler.requests.get(request_id)
        if req is None or req.status is not RequestStatus.LOADING:
            return None
        if first_token is not None and not 0 <= first_token < self.vocab_size:
            first_token = None  # a prefill node that sent nonsense: compute it here
        if first_token is not None and req.generator is not None and not req.sampling_params.greedy:
            # the prefill node drew the first token from the same seed: the next draw here is the second
            Sampler.draw_seed(req.generator)
        ended = self.scheduler.remote_arrived(req, first_token, settled)
        if first_token is None:
            return None
        req.num_cached_tokens = num_cached_tokens
        return EngineCoreOutput(request_id, [first_token], req.finish_reason if ended else None,
                                num_cached_tokens=req.num_cached_tokens)

    def _validate(self, req: Request) -> None:
        n = req.prefix_offset + req.num_prompt_tokens
        if n == 0:
            raise InvalidRequestError("the prompt is empty")
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {n} tokens but this engine's context holds {self.max_model_len} "
                f"(prompt plus at least one new token): shorten the prompt"
            )
        mt = req.sampling_params.max_tokens
        if mt is not None and n + mt > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({n} tokens) plus max_tokens ({mt}) exceeds the context length "
                f"{self.max_model_len}: lower max_tokens to at most {self.max_model_len - n}"
            )
        vocab = self.vocab_size
        if any(t < 0 or t >= vocab for t in req.prompt_token_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        req.max_model_len = self.max_model_len - req.prefix_offset  # its own tokens' room
        if not req.eos_token_ids:
            req.eos_token_ids = self.eos_token_ids
        grammar = req.sampling_params.grammar
        if grammar is not None and req.grammar is None:
            if self.tokenizer is None:
                raise InvalidRequestError("structured output needs the model's tokenizer, which this engine lacks")
            if self._grammars is None:
                self._grammars = Grammars(self.tokenizer)
            req.grammar = self._grammars.matcher(grammar)

    def abort(self, request_id: str) -> bool:
        for kids in self._forks.values():
            for req in kids:
                if req.request_id == request_id:
                    kids.remove(req)
                    return True
        return self.scheduler.abort(request_id) is not None

    def has_unfinished(self) -> bool:
        """Requests are queued or running. (A step in flight whose requests all ended carries nothing
        to wait for: the next step or `drain` collects it.)"""
        return self.scheduler.has_unfinished() or bool(self._forks)

    def stalled(self) -> bool:
        """Requests wait, but the last step ran nothing and none is in flight: nothing changes
        until a message, a copy or a peer frees room (the loop can wait rather than spin)."""
        return not len(self.last_batch) and self._in_flight is None and self.scheduler.has_unfinished()

    def copies_in_flight(self) -> bool:
        return self.kv.busy()

    def wait_copies(self) -> None:
        """Block until the KV copies in flight have ended, and account for them."""
        self.kv.wait()
        self.scheduler.poll_copies()

    def close(self) -> None:
        """Finish the step and the copies in flight and let go of the host and disk tiers."""
        self.drain()
        self.kv.close()
        close = getattr(self.executor, "close", None)
        if close is not None:
            close()

    def set_reading_rate(self, request_id: str, reading_rate: float, now: float) -> bool:
        req = self.scheduler.requests.get(request_id)
        if req is not None:
            req.buffer.set_rate(reading_rate, now)
        return req is not None

    def set_read_cursor(self, request_id: str, num_read: int, now: float) -> bool:
        """The client has read `num_read` tokens by `now`: its buffer is what it holds unread."""
        req = self.scheduler.requests.get(request_id)
        if req is not None:
            req.buffer.set_read(num_read, now)
        return req is not None

    def step(self) -> list[EngineCoreOutput]:
        if self._forks:
            self._release_forks()
        if self._overlap:
            return self._step_overlapped()
        clock = self.clock
        entered = clock()
        batch = self.last_batch = self.scheduler.schedule()
        self.scheduler.issue_copies(batch)
        if not len(batch):
            if self.scheduler.loading:
                self.kv.wait_oldest()  # nothing to compute until KV is back in place
            return []
        for hook in self.on_batch:
            hook(batch)
        t0 = clock()
        try:
            with self.unlocked():
                sampled = self.executor.execute(batch)
        except ForeignPrefixLost as e:  # nothing of the step is kept; it runs again without them
            log.warning("%s: %d requests recompute their prefix here", e, len(e.request_ids))
            for rid in e.request_ids:
                req = self.scheduler.requests.get(rid)
                if req is not None:
                    self.scheduler.take_foreign_prefix(req)
            return []
        except Exception as e:  # a fault ends this step's requests with an error, never a hang
            return self._failed(batch, e)
        return self._apply(batch, sampled, self.executor.step_seconds(t0, clock()), entered)

    def _step_overlapped(self) -> list[EngineCoreOutput]:
        """Schedule and launch the next step, then collect the one in flight (the module's doc)."""
        entered = self.clock()
        batch = self.last_batch = self.scheduler.schedule(ahead=True)
        outs: list[EngineCoreOutput] = []
        launched = None
        if len(batch):
            try:
                launched = self.executor.launch(batch)
            except Exception as e:
                self.scheduler.drop_pending(batch)
                outs = self._failed(batch, e)
        prev, self._in_flight = self._in_flight, launched
        if prev is not None:
            outs += self._collect(prev, entered)
        # after update: the pages the new step fills are keyed by tokens the host now knows; on a
        # GPU the copy streams wait for the compute stream, on a CPU for the step (copier `fence`)
        self.scheduler.issue_copies(batch)
        if launched is None and prev is None and self.scheduler.loading:
            self.kv.wait_oldest()  # nothing to compute until KV is back in place
        return outs

    def _collect(self, launched: Launched, entered: float) -> list[EngineCoreOutput]:
        try:
            with self.unlocked():
                sampled = self.executor.collect(launched)
        except Exception as e:
            self.scheduler.drop_pending(launched.batch)
            return self._failed(launched.batch, e)
        return self._apply(launched.batch, sampled, launched.seconds or 0.0, entered)

    def drain(self) -> list[EngineCoreOutput]:
        """Collect the step in flight, if any (overlap): what it sampled."""
        launched, self._in_flight = self._in_flight, None
        return self._collect(launched, self.clock()) if launched is not None else []

    def _failed(self, batch: ScheduledBatch, e: Exception) -> list[EngineCoreOutput]:
        """A fault ends this step's requests with an error, never a hang; the engine gives up on a
        lost device or after MAX_FAILED_STEPS in a row."""
        log.exception("step failed; ending its %d requests", len(batch), exc_info=e)
        outs = self._fail(batch, f"engine error: {type(e).__name__}: {e}")
        self.num_failed_steps += 1
        if device_lost(e):
            raise EngineFailed(f"the device failed: {e}") from e
        if self.num_failed_steps >= MAX_FAILED_STEPS:
            raise EngineFailed(f"{self.num_failed_steps} steps in a row failed, the last with {e}") from e
        return outs

    def _apply(self, batch: ScheduledBatch, sampled: list[int | None], seconds: float,
               entered: float) -> list[EngineCoreOutput]:
        """A computed step's tokens into the requests, its time into the models; its outputs."""
        clock = self.clock
        self.num_failed_steps = 0
        requests = [self.scheduler.requests.get(rid) for rid in batch.request_ids]
        logprobs = self.executor.take_logprobs()
        finished = self.scheduler.update(batch, sampled)
        self.stats.last_step_time = seconds
        self.stats.num_steps += 1
        self.stats.num_batched_tokens += batch.total_tokens
        # the step as the model priced it before seeing it (only load shedding's pace reads it)
        priced = (self.scheduler.cost.step_time(batch.total_tokens, batch.num_context_tokens)
                  if self.admission is not None else 0.0)
        # NOTE: a fresh engine's first step carries one-time costs (kernel and allocator set-up): 8 s
        # for a 0.2 s step on a 2-core CPU. Fitted, it inflated per_token eightfold for the model's window.
        if self.stats.num_steps > 1 or not self.executor.cold_start:
            self.scheduler.observe_step(batch, self.stats.last_step_time)
        done = {r.request_id for r in finished}
        outs = []
        for i, (req, token) in enumerate(zip(requests, sampled)):
            if req is None or (token is None and req.request_id not in done):
                continue
            lp = logprobs.get(i) if token is not None else None
            outs.append(
                EngineCoreOutput(
                    req.request_id,
                    [token] if token is not None else [],
                    req.finish_reason if req.request_id in done else None,
                    num_cached_tokens=req.prompt_cached_tokens,
                    num_preemptions=req.num_preemptions,
                    logprobs=[lp] if lp is not None else None,
                )
            )
        if self.admission is not None and self.stats.num_steps > 1:
            # the whole step, scheduling and bookkeeping too: what a request waiting behind it waits
            self.admission.observe_step(priced, clock() - entered)
        return outs

    def _fail(self, batch: ScheduledBatch, error: str) -> list[EngineCoreOutput]:
        """End the batch's requests with `error`."""
        outs = []
        for rid in batch.request_ids:
            req = self.scheduler.requests.get(rid)
            if req is not None:
                self.scheduler.finish(req, FinishReason.ERROR, error)
                outs.append(EngineCoreOutput(rid, [], FinishReason.ERROR, error,
                                             req.prompt_cached_tokens, req.num_preemptions))
        return outs
