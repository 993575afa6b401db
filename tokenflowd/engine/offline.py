"""The in-process API: EngineCore plus text (tokenize, detokenize incrementally, stop strings).

    engine = Engine(EngineConfig.resolve())
    engine.add_request("r1", messages=[{"role": "user", "content": "What is 2+2?"}],
                       sampling_params=SamplingParams(temperature=0, max_tokens=32))
    while engine.has_unfinished():
        for out in engine.step(): print(out.text, end="")
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from tokenflowd.config import EngineConfig
from tokenflowd.engine.core import EngineCore
from tokenflowd.engine.model.weights import LoadedModel
from tokenflowd.engine.request import FinishReason, InvalidRequestError, Request, SamplingParams
from tokenflowd.text.stream import IncrementalDetokenizer, StopStringMatcher


@dataclass
class RequestOutput:
    """What one step produced for one request: a text delta and the token ids behind it."""

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None


@dataclass
class _TextState:
    detok: IncrementalDetokenizer
    stops: StopStringMatcher
    num_prompt_tokens: int
    num_output_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)


class Engine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.core = EngineCore.from_config(config, loaded)
        self.tokenizer = self.core.tokenizer
        self._text: dict[str, _TextState] = {}

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int] | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        messages: list[dict[str, str]] | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request given as text, token ids, or chat messages (rendered with the model's
        chat template). Raises InvalidRequestError, changing nothing, if it cannot be served."""
        if (prompt is None) == (messages is None):
            raise InvalidRequestError("give exactly one of prompt or messages")
        if request_id in self._text:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if messages is not None:
            ids = self.tokenizer.encode_chat(messages)
        elif isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)  # bos where the model wants one
        else:
            ids = list(prompt)
        params = sampling_params or SamplingParams()
        req = Request(request_id, ids, params, arrival_time=time.monotonic() if arrival_time is None else arrival_time)
        self.core.add_request(req)
        self._text[request_id] = _TextState(
            IncrementalDetokenizer(self.tokenizer, ids), StopStringMatcher(params.stop), len(ids)
        )

    def abort(self, request_id: str) -> bool:
        self._text.pop(request_id, None)
        return self.core.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def step(self) -> list[RequestOutput]:
        outputs = []
        for out in self.core.step():
            st = self._text.get(out.request_id)
            if st is None:
                continue
            st.output_ids.extend(out.new_token_ids)
            st.num_output_tokens += len(out.new_token_ids)
            text, matched = st.stops.push(st.detok.push(out.new_token_ids))
            reason = out.finish_reason
            if matched and reason is None:
                self.core.abort(out.request_id)
                reason = FinishReason.STOP
            elif reason is not None and not matched:
                tail, matched = st.stops.push(st.detok.flush())
                text += tail if matched else tail + st.stops.flush()
                reason = FinishReason.STOP if matched else reason
            if reason is not None:
                del self._text[out.request_id]
            outputs.append(
                RequestOutput(out.request_id, text, out.new_token_ids, reason is not None, reason,
                              st.num_prompt_tokens, st.num_output_tokens, out.num_cached_tokens, out.error)
            )
        return outputs

    # -- conveniences -------------------------------------------------------------------------
    def stream(self, request_id: str, **kw) -> Iterator[RequestOutput]:
        """Add one request and yield its outputs as they come (other queued requests also run)."""
        self.add_request(request_id, **kw)
        while self.has_unfinished():
            for out in self.step():
                if out.request_id == request_id:
                    yield out
                    if out.finished:
                        return

    def generate(self, prompts: dict[str, dict]) -> dict[str, RequestOutput]:
        """Run {request_id: add_request kwargs} to completion; whole text and tokens per request."""
        for rid, kw in prompts.items():
            self.add_request(rid, **kw)
        acc: dict[str, RequestOutput] = {rid: RequestOutput(rid, "", []) for rid in prompts}
        while self.has_unfinished():
            for out in self.step():
                a = acc.get(out.request_id)
                if a is None:  # queued before this call: its caller collects it
                    continue
                a.text += out.text
                a.token_ids += out.token_ids
                a.finished, a.finish_reason = out.finished, out.finish_reason
                a.num_prompt_tokens, a.num_output_tokens = out.num_prompt_tokens, out.num_output_tokens
                a.num_cached_tokens, a.error = out.num_cached_tokens, out.error
        return acc
