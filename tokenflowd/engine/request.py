"""The one request-state object and its sampling parameters."""
from __future__ import annotations

import enum
import functools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from tokenflowd.buffer.tracker import TokenBuffer

if TYPE_CHECKING:
    import torch

    from tokenflowd.engine.grammar import GrammarState

DEFAULT_READING_RATE = 20.0  # tokens/s: a fast human reader
# In a request's token_ids, a token a launched step samples that the host has not seen yet
# (overlap scheduling, engine/core.py): at most one per request, always its last.
PLACEHOLDER = -1
MAX_LOGPROBS = 20  # the most likely tokens a sampled token may come with (OpenAI's bound)


class InvalidRequestError(ValueError):
    """The request cannot be served as given; the message says what to change."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = None  # None: up to the context length
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    # OpenAI's: subtracted from a token's logit once it was generated (presence) and per time
    # (frequency); and repetition_penalty (an extension, as in Hugging Face's and vLLM's): a token
    # of the prompt or the output has its logit divided by it where positive, else multiplied
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # None: none; k: each sampled token's logprob and the top k (k <= 20)
    grammar: str | None = None  # structured output: llguidance's grammar the output must follow (engine/grammar.py)

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be non-negative token ids")
        if self.min_tokens < 0:
            raise InvalidRequestError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(f"min_tokens ({self.min_tokens}) exceeds max_tokens ({self.max_tokens})")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) for s in self.stop):
            raise InvalidRequestError("stop must be a tuple of strings")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise InvalidRequestError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or self.repetition_penalty != 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


class SamplingRow(NamedTuple):
    """What the sampler needs of a request that samples this step (a row of ScheduledBatch)."""

    params: SamplingParams
    generator: "torch.Generator | None"
    num_output_tokens: int  # before this step's token
    stop_token_ids: frozenset[int]
    # a penalized or constrained request's (the request's own lists, not copies; else None): its
    # tokens (prompt, then output, PLACEHOLDER where a token is still on the device) and the
    # prompt's leading tokens the pool holds (request.py foreign_token_ids)
    tokens: "list[int] | None" = None
    foreign: "list[int] | None" = None
    num_prompt_tokens: int = 0  # of tokens
    grammar: "GrammarState | None" = None  # a constrained request's matcher (engine/grammar.py)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    LOADING = "loading"  # admitted; its KV is coming back from a lower tier
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # a stop token or stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"
    ERROR = "error"


@dataclass(eq=False)
class Request:
    """A request's whole state in the engine. Tokens are one list: prompt, then output.

        token_ids:  [ p0 p1 ... p(P-1) | o0 o1 ... ]
                      <- num_prompt_tokens -> <- num_output_tokens ->
        computed:   [=========== num_computed_tokens ===)     KV of these is on the device

    Where that KV lives, in every tier, is the KV manager's (kv/state.py: RequestKV).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    max_model_len: int = 0
    reading_rate: float = DEFAULT_READING_RATE  # tokens/s the client stated; the live rate is buffer.reading_rate
    priority: int = 0  # higher is sooner
    arrival_seq: int = 0  # set by the scheduler: arrival order, the tie-break of equal arrival times
    # The prompt's leading tokens whose KV peer engines of the pool hold (pool/member.py): this
    # engine neither stores nor computes them; its tokens' positions start after them, and
    # key_seed is the last of their page keys, so its own pages are keyed as the whole prompt's.
    foreign_token_ids: list[int] = field(default_factory=list)
    key_seed: bytes = b""
    # of those, the tokens this engine computed and handed to their segments' homes (pool/: write
    # into the home): read there from then on, but no saving of the prefix cache's
    num_handed_tokens: int = 0

    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at the last admission
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    buffer: TokenBuffer = field(init=False)  # the client's token buffer, fed as tokens are sampled
    generator: torch.Generator | None = None
    grammar: "GrammarState | None" = None  # structured output's matcher, set at admission (engine/core.py)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        if not 0 < self.reading_rate < float("inf"):
            raise InvalidRequestError(f"reading_rate must be a finite number of tokens/s above 0, got {self.reading_rate}")
        self.buffer = TokenBuffer(self.reading_rate)
        if self.sampling_params.seed is not None:
            import torch  # here: the front builds SamplingParams from this module without torch

            self.generator = torch.Generator().manual_seed(self.sampling_params.seed)

    @property
    def prefix_offset(self) -> int:
        """Tokens before token_ids[0] that peers hold (position of token_ids[0] in the sequence)."""
        return len(self.foreign_token_ids)

    def set_foreign_prefix(self, num_tokens: int, key_seed: bytes) -> None:
        """Its first `num_tokens` prompt tokens (whole pages) are read where peers of the pool hold
        them; `key_seed` is the key of the last of those pages. Only before it is queued."""
        assert self.num_computed_tokens == 0 and self.num_output_tokens == 0 and not self.foreign_token_ids
        assert 0 < num_tokens < self.num_prompt_tokens, "the last prompt token is always computed here"
        self.foreign_token_ids = self.prompt_token_ids[:num_tokens]
        self.prompt_token_ids = self.prompt_token_ids[num_tokens:]
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens -= num_tokens
        self.key_seed = key_seed

    def extend_foreign_prefix(self, num_tokens: int, key_seed: bytes) -> None:
        """Its next `num_tokens` tokens (whole pages, computed here) are now read where the pool
        holds them: the KV manager has let go of their pages (kv/manager.py `hand_off`); `key_seed`
        is the key of the last of them."""
        assert 0 < num_tokens <= self.num_computed_tokens and num_tokens < self.num_prompt_tokens
        self.foreign_token_ids = self.foreign_token_ids + self.prompt_token_ids[:num_tokens]
        self.prompt_token_ids = self.prompt_token_ids[num_tokens:]
        self.token_ids = self.token_ids[num_tokens:]
        self.num_prompt_tokens -= num_tokens
        self.num_computed_tokens -= num_tokens
        self.max_model_len -= num_tokens
        cached = min(self.num_cached_tokens, num_tokens)  # the leading ones: those the prefix cache served
        self.num_cached_tokens -= cached
        self.num_handed_tokens += num_tokens - cached
        self.key_seed = key_seed

    @property
    def prompt_cached_tokens(self) -> int:
        """Prompt tokens whose KV this request did not compute: read on the pool's engines or hit in
        this engine's prefix cache (the usage's cached_tokens)."""
        return self.prefix_offset - self.num_handed_tokens + self.num_cached_tokens

    def take_foreign_prefix(self) -> None:
        """The peers' prefix is lost: it becomes this request's own tokens, to be computed here.
        Only while it holds no KV (the scheduler frees it first)."""
        assert self.num_computed_tokens == 0
        f = self.foreign_token_ids
        self.prompt_token_ids = f + self.prompt_token_ids
        self.token_ids = f + self.token_ids
        self.num_prompt_tokens += len(f)
        self.max_model_len += len(f)
        self.foreign_token_ids, self.key_seed, self.num_handed_tokens = [], b"", 0

    @property
    def first_token_time(self) -> float | None:
        return self.buffer.first_token_time

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def max_tokens(self) -> int:
        """Output tokens this request may produce: its max_tokens, capped by the context."""
        room = self.max_model_len - self.num_prompt_tokens
        mt = self.sampling_params.max_tokens
        return room if mt is None else min(mt, room)

    def sampling_row(self) -> SamplingRow:
        if self.sampling_params.penalized or self.grammar is not None:
            return SamplingRow(self.sampling_params, self.generator, self.num_output_tokens, self.stop_token_ids,
                               self.token_ids, self.foreign_token_ids, self.num_prompt_tokens, self.grammar)
        return SamplingRow(self.sampling_params, self.generator, self.num_output_tokens, self.stop_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @functools.cached_property
    def stop_token_ids(self) -> frozenset[int]:
        """Read first after admission, once eos_token_ids is final."""
        ids = set(self.sampling_params.stop_token_ids)
        if not self.sampling_params.ignore_eos:
            ids.update(self.eos_token_ids)
        return frozenset(ids)
