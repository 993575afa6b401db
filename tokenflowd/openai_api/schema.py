"""What the HTTP API accepts and returns, as msgspec Structs: the decoder validates types and
ranges in one pass, and the same Structs give the published OpenAPI schema.

Fields the OpenAI API defines but tokenflowd does not implement (best_of, logit_bias, echo, suffix)
are declared so that their default values pass and anything else is refused with a 400 that
names the field; unknown fields are refused too. Nothing a client sends is dropped silently.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

# A stated reading rate's bounds, as published and as validated (one Meta serves both). Below a
# token every 1000 s no reader is reading; 5e-324, valid under a bound of "above 0", is 0 to the
# engine's arithmetic.
MIN_READING_RATE, MAX_READING_RATE = 1e-3, 1e6
Rate = Annotated[float, Meta(ge=MIN_READING_RATE, le=MAX_READING_RATE,
                             description="tokens/s this client reads; above the server's max_reading_rate it is "
                                         "clamped to it")]
Priority = Annotated[int, Meta(ge=-1000, le=1000, description="higher is scheduled sooner; above 0 only for API keys "
                                                             "granted it (else 403), below 0 for anyone")]
INT32_MAX = 2**31 - 1  # the bound of counts and ids (the published schema narrows it to the model's: openapi())
TokenCount = Annotated[int, Meta(ge=1, le=INT32_MAX)]
TokenId = Annotated[int, Meta(ge=0, le=INT32_MAX)]
MAX_CHOICES = 16  # n: more choices of one prompt than this are more requests
MAX_LOGPROBS = 20  # the most likely tokens a sampled token's logprobs may list (engine/request.py's bound)
TopLogprobs = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS, description="the most likely tokens listed with each "
                                                                     "sampled token, with their log-probabilities")]
StopString = Annotated[str, Meta(min_length=1)]
Stop = StopString | Annotated[list[StopString], Meta(max_length=16)] | None


class StreamOptions(Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: Annotated[bool, Meta(description="every event carries the usage so far (as vLLM's): a "
                                                             "client counts the tokens of a gathered event")] = False
    coalesce: Annotated[bool, Meta(description="tokenflowd: false sends one event per token; true (the default) "
                                               "gathers tokens into one event per --coalesce-interval while the "
                                               "reader's buffer holds over --coalesce-buffer s")] = True


class TextPart(Struct, forbid_unknown_fields=True):
    type: Literal["text"]
    text: str


class FunctionCall(Struct, forbid_unknown_fields=True):
    name: str
    arguments: str  # JSON text


class ToolCallIn(Struct, forbid_unknown_fields=True):
    """A call an assistant message of the conversation made."""

    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatMessage(Struct, forbid_unknown_fields=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCallIn], Meta(max_length=128)] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool's result: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ReadCursor(Struct, forbid_unknown_fields=True):
    """`POST /v1/requests/{id}/read`: how far the client's reader has got in the streamed output."""

    tokens: Annotated[int, Meta(ge=0, le=INT32_MAX, description="output tokens read so far, at most those delivered")]


class FunctionDefinition(Struct, forbid_unknown_fields=True):
    name: Annotated[str, Meta(min_length=1, max_length=64, pattern="^[A-Za-z0-9_-]+$")]
    description: str | None = None
    parameters: Annotated[dict[str, Any], Meta(description="a JSON Schema of the arguments")] | None = None
    strict: bool | None = None


class Tool(Struct, forbid_unknown_fields=True):
    function: FunctionDefinition
    type: Literal["function"] = "function"


class NamedFunction(Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(Struct, forbid_unknown_fields=True):
    function: NamedFunction
    type: Literal["function"] = "function"


class JsonSchemaFormat(Struct, forbid_unknown_fields=True):
    name: Annotated[str, Meta(min_length=1, max_length=64, pattern="^[A-Za-z0-9_-]+$")]
    schema: Annotated[dict[str, Any] | bool, Meta(description="a JSON Schema the output is a document of; "
                                                              "keys the grammar library cannot enforce are a 400")] = True
    description: str | None = None
    strict: Annotated[bool | None, Meta(description="tokenflowd constrains the output either way")] = None


class TextFormat(Struct, forbid_unknown_fields=True, tag_field="type", tag="text"):
    """Free text."""


class JsonObjectFormat(Struct, forbid_unknown_fields=True, tag_field="type", tag="json_object"):
    """Any JSON object (the tokens are constrained to one as they are sampled)."""


class JsonSchemaResponseFormat(Struct, forbid_unknown_fields=True, tag_field="type", tag="json_schema"):
    """A document of json_schema.schema (the tokens are constrained to it as they are sampled)."""

    json_schema: JsonSchemaFormat


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaResponseFormat


class _Sampling(Struct, forbid_unknown_fields=True, kw_only=True):
    model: str
    temperature: Annotated[float, Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    top_k: Annotated[int, Meta(ge=-1, le=INT32_MAX, description="0 or -1: off")] | None = None
    min_tokens: Annotated[int, Meta(ge=0, le=INT32_MAX)] = 0
    ignore_eos: bool = False
    seed: Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)] | None = None
    stop: Stop = None
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=64)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_CHOICES, description="choices: the prompt is computed once and its pages "
                                                            "shared; each choice is a reader of its own")] = 1
    user: str | None = None
    reading_rate: Rate | None = None
    priority: Priority = 0
    frequency_penalty: Annotated[float, Meta(ge=-2, le=2)] | None = None
    presence_penalty: Annotated[float, Meta(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0, le=10, description="an extension: 1 is off")] | None = None
    # Declared so their defaults pass; other values are refused (not implemented).
    logit_bias: Annotated[dict[str, float], Meta(max_length=0, description="not supported")] | None = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_tokens: TokenCount | None = None
    max_completion_tokens: TokenCount | None = None
    logprobs: Annotated[bool, Meta(description="each output token's log-probability (of the model's raw "
                                                "distribution, before penalties and temperature)")] | None = None
    top_logprobs: Annotated[TopLogprobs, Meta(description="with logprobs: true, the most likely tokens at each "
                                                          "position")] | None = None
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Tool], Meta(max_length=128)] | None = None
    tool_choice: Annotated[Literal["none", "auto", "required"] | NamedToolChoice,
                           Meta(description="required and a named function constrain the reply to calls whose "
                                            "arguments are valid for the function's parameters")] | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: Annotated[str, Meta(min_length=1)] | Annotated[
        list[Annotated[str, Meta(min_length=1)] | TokenId | Annotated[list[TokenId], Meta(min_length=1)]],
        Meta(min_length=1)]
    max_tokens: TokenCount | None = 16
    echo: Literal[False] = False
    logprobs: Annotated[TopLogprobs, Meta(description="each output token's log-probability and the most likely "
                                                      "tokens at each position, this many")] | None = None
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


class FunctionCallOut(Struct):
    name: str
    arguments: str


class ToolCallOut(Struct):
    id: str
    function: FunctionCallOut
    type: str = "function"


class AssistantMessage(Struct):
    content: str | None
    role: str = "assistant"
    tool_calls: list[ToolCallOut] | None = None


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(Struct):
    """A chat choice's logprobs: one entry an output token, in order."""

    content: list[TokenLogprob] | None
    refusal: None = None


class CompletionLogprobs(Struct):
    """A completion choice's logprobs (the legacy shape): parallel lists, one entry a token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"


class FunctionDelta(Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(Struct, omit_defaults=True):
    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionDelta | None = None


class ChunkDelta(Struct, omit_defaults=True):
    content: str | None = None
    role: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(Struct):
    index: int
    delta: ChunkDelta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


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
    logprobs: CompletionLogprobs | None = None


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
    code: str | None = None  # a string, as OpenAI's, or null


class ErrorResponse(Struct):
    error: ErrorDetail


@dataclass(frozen=True)
class Served:
    """What the published schema takes from the running server: the model names it answers to,
    its context and its vocabulary, so that a body valid under the schema is one the server takes
    (a fuzzer then reaches generation instead of a wall of 404s and range errors)."""

    model_names: tuple[str, ...]
    max_model_len: int | None  # None: engines not ready yet (no bound published)
    vocab_size: int


def _cap_integers(node: Any, maximum: int) -> None:
    """Set `maximum` on every integer schema under `node`."""
    if isinstance(node, dict):
        if node.get("type") == "integer":
            node["maximum"] = min(node.get("maximum", maximum), maximum)
        for value in node.values():
            _cap_integers(value, maximum)
    elif isinstance(node, list):
        for value in node:
            _cap_integers(value, maximum)


def _narrow(components: dict[str, Any], served: Served) -> None:
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        props = components[name]["properties"]
        props["model"] = {"type": "string", "enum": list(served.model_names)}
        _cap_integers(props["stop_token_ids"], served.vocab_size - 1)
        if served.max_model_len is not None:
            for field in ("max_tokens", "max_completion_tokens", "min_tokens"):
                if field in props:
                    _cap_integers(props[field], served.max_model_len - 1)
    prompt = components["CompletionRequest"]["properties"]["prompt"]
    _cap_integers(prompt, served.vocab_size - 1)
    if served.max_model_len is not None:  # a token-id prompt leaves room for one new token
        for ids in (prompt["anyOf"][1], prompt["anyOf"][2]["items"]["anyOf"][1]):
            ids["maxItems"] = served.max_model_len - 1


def _prompt_schema() -> dict[str, Any]:
    """What `prompt` may be, exactly: text, token ids, or a batch of one of those (the decoder's
    type is looser, as msgspec's unions allow one array type; daemon/api/app.py refuses the rest)."""
    text = {"type": "string", "minLength": 1}
    ids = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": INT32_MAX}, "minItems": 1}
    return {"anyOf": [text, ids, {"type": "array", "items": {"anyOf": [text, dict(ids)]}, "minItems": 1,
                                  "maxItems": 1, "description": "a batch of one prompt"}]}


def _sse_event(chunk: dict[str, Any], error: dict[str, Any]) -> dict[str, Any]:
    """One event of a stream (OpenAPI 3.1: the schema of text/event-stream describes an event): its
    data is a chunk, an error (the stream failed after it began) or the closing `[DONE]`."""
    json_data = {"type": "string", "contentMediaType": "application/json", "contentSchema": {"anyOf": [chunk, error]}}
    return {"type": "object", "required": ["data"], "properties": {
        "data": {"anyOf": [{"const": "[DONE]"}, json_data]}, "event": {"type": "string"}}}


def openapi(served: Served | None = None) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the endpoints and the bodies they accept, narrowed to what the
    running server serves (`served`)."""
    (chat, comp, cc, chunk, cmpl, models, err, cursor), components = msgspec.json.schema_components(
        [ChatCompletionRequest, CompletionRequest, ChatCompletion, ChatCompletionChunk, Completion, ModelList,
         ErrorResponse, ReadCursor],
        ref_template="#/components/schemas/{name}",
    )
    components["CompletionRequest"]["properties"]["prompt"] = _prompt_schema()
    if served is not None:
        _narrow(components, served)
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
                                    "text/event-stream": {"schema": _sse_event(stream_chunk, err)}}},
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
                "parameters": [{"name": "request_id", "in": "path", "required": True, "schema": {"type": "string"},
                                "description": "the id of a live request of this API key (X-Request-Id)"}],
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
