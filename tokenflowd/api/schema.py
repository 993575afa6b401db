"""What the HTTP API accepts and returns, as msgspec Structs: the decoder validates types and
ranges in one pass, and the same Structs give the published OpenAPI schema.

Fields the OpenAI API defines but tokenflowd does not implement (logprobs, penalties, tools, n>1)
are declared so that their default values pass and anything else is refused with a 400 that
names the field; unknown fields are refused too. Nothing a client sends is dropped silently.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

Rate = Annotated[float, Meta(gt=0, le=1e6, description="tokens/s this client reads; above the server's "
                                                       "max_reading_rate it is clamped to it")]
Priority = Annotated[int, Meta(ge=-1000, le=1000, description="higher is scheduled sooner; above 0 only for API keys "
                                                             "granted it (else 403), below 0 for anyone")]
TokenCount = Annotated[int, Meta(ge=1)]
Stop = str | Annotated[list[str], Meta(max_length=16)] | None


class StreamOptions(Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    coalesce: Annotated[bool, Meta(description="tokenflowd: false sends one event per token; true (the default) "
                                               "gathers tokens into one event per --coalesce-interval while the "
                                               "reader's buffer holds over --coalesce-buffer s")] = True


class TextPart(Struct, forbid_unknown_fields=True):
    type: Literal["text"]
    text: str


class ChatMessage(Struct, forbid_unknown_fields=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ReadCursor(Struct, forbid_unknown_fields=True):
    """`POST /v1/requests/{id}/read`: how far the client's reader has got in the streamed output."""

    tokens: Annotated[int, Meta(ge=0, description="output tokens read so far, at most those delivered")]


class ResponseFormat(Struct, forbid_unknown_fields=True):
    type: Literal["text"]


class _Sampling(Struct, forbid_unknown_fields=True, kw_only=True):
    model: str
    temperature: Annotated[float, Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    top_k: Annotated[int, Meta(ge=-1, description="0 or -1: off")] | None = None
    min_tokens: Annotated[int, Meta(ge=0)] = 0
    ignore_eos: bool = False
    seed: Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)] | None = None
    stop: Stop = None
    stop_token_ids: Annotated[list[Annotated[int, Meta(ge=0)]], Meta(max_length=64)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Meta(ge=1, le=1, description="only 1 is supported")] = 1
    user: str | None = None
    reading_rate: Rate | None = None
    priority: Priority = 0
    # Declared so their defaults pass; other values are refused (not implemented).
    frequency_penalty: Annotated[float, Meta(ge=0, le=0, description="not supported: only 0")] = 0.0
    presence_penalty: Annotated[float, Meta(ge=0, le=0, description="not supported: only 0")] = 0.0
    logit_bias: Annotated[dict[str, float], Meta(max_length=0, description="not supported")] | None = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_tokens: TokenCount | None = None
    max_completion_tokens: TokenCount | None = None
    logprobs: Literal[False] = False
    top_logprobs: Annotated[int, Meta(ge=0, le=0, description="not supported")] | None = None
    response_format: ResponseFormat | None = None
    tools: Annotated[list[dict[str, Any]], Meta(max_length=0, description="not supported")] | None = None
    tool_choice: Literal["none", "auto"] | None = None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | Annotated[list[str | Annotated[int, Meta(ge=0)] | list[Annotated[int, Meta(ge=0)]]], Meta(min_length=1)]
    max_tokens: TokenCount | None = 16
    echo: Literal[False] = False
    logprobs: Annotated[int, Meta(ge=0, le=0, description="not supported")] | None = None
    best_of: Annotated[int, Meta(ge=1, le=1, description="only 1 is supported")] | None = None
    suffix: Annotated[str, Meta(max_length=0, description="not supported")] | None = None


# -- responses -------------------------------------------------------------------------------
class PromptTokensDetails(Struct):
    cached_tokens: int


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class AssistantMessage(Struct):
    content: str
    role: str = "assistant"


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletion(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"


class ChunkDelta(Struct, omit_defaults=True):
    content: str | None = None
    role: str | None = None


class ChatChunkChoice(Struct):
    index: int
    delta: ChunkDelta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"


class CompletionChoice(Struct):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: None = None


class Completion(Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"


class ModelCard(Struct):
    id: str
    created: int
    owned_by: str = "tokenflowd"
    max_model_len: int | None = None
    object: str = "model"


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"


class ErrorDetail(Struct):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(Struct):
    error: ErrorDetail


def openapi() -> dict[str, Any]:
    """The OpenAPI 3.1 document of the endpoints and the bodies they accept."""
    (chat, comp, cc, chunk, cmpl, models, err, cursor), components = msgspec.json.schema_components(
        [ChatCompletionRequest, CompletionRequest, ChatCompletion, ChatCompletionChunk, Completion, ModelList,
         ErrorResponse, ReadCursor],
        ref_template="#/components/schemas/{name}",
    )
    errors = {
        str(code): {"description": why, "content": {"application/json": {"schema": err}}}
        for code, why in (
            (400, "the body is malformed, a value is out of range, or the prompt does not fit the context"),
            (403, "`priority` above what the API key may set"),
            (404, "the model is not served here"),
            (413, "the body is larger than the server's limit"),
            (429, "the waiting queue is full; retry after the Retry-After header's seconds"),
            (503, "no engine is serving (starting or draining)"),
        )
    }

    def post(body: dict, ok: dict, stream_chunk: dict, summary: str) -> dict:
        return {"post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
            "responses": {
                "200": {"description": "the completion, or with stream=true server-sent events of chunks "
                                       "ending in `data: [DONE]`",
                        "content": {"application/json": {"schema": ok},
                                    "text/event-stream": {"schema": stream_chunk}}},
                **errors,
            },
        }}

    return {
        "openapi": "3.1.0",
        "info": {"title": "tokenflowd", "version": "1", "description": "OpenAI-compatible streaming API with "
                 "per-client reading rates (`reading_rate` in the body or the X-Reading-Rate header)."},
        "paths": {
            "/v1/chat/completions": post(chat, cc, chunk, "Chat completion"),
            "/v1/completions": post(comp, cmpl, cmpl, "Text completion"),
            "/v1/models": {"get": {"summary": "Served models",
                                   "responses": {"200": {"description": "the models",
                                                         "content": {"application/json": {"schema": models}}}}}},
            "/v1/requests/{request_id}/read": {"post": {
                "summary": "Report how far the client's reader has got (its read cursor)",
                "requestBody": {"required": True, "content": {"application/json": {"schema": cursor}}},
                "responses": {
                    "200": {"description": "the cursor taken (or ignored, if behind the last one), the rate now used"},
                    "400": errors["400"],
                    "404": {"description": "no live request with that id for this API key",
                            "content": {"application/json": {"schema": err}}},
                },
            }},
        },
        "components": {"schemas": components},
    }
