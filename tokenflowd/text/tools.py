"""Tool calls: tool definitions and tool messages into the chat template, the model's calls out of
its text, and the grammar that makes a required or named call valid for its function's schema.

Two ways a model writes its calls, chosen by its chat template:
- hermes: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block a call (Qwen2.5
  and others whose template writes `<tool_call>`); also the embedded model's, whose template knows
  nothing of tools: the definitions then go into its system message, in that format;
- json: one JSON object `{"name": ..., "parameters": {...}}`, calls separated by ";", maybe after
  `<|python_tag|>` (Llama 3.1's template).

A template that mentions `tools` renders them itself (they are passed to it, as Hugging Face does,
with each call's arguments as an object); the others get them written into the system message.
`required` and a named `tool_choice` constrain the output with a grammar (llguidance's Lark, with
each function's parameters as a JSON schema), so the call parses and its arguments are valid.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from tokenflowd.text.structured import COMPACT, json_grammar

HERMES, JSON_CALLS = "hermes", "json"
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"


def tool_format(template: str | None) -> str:
    if template and _PYTHON_TAG in template and _OPEN not in template:
        return JSON_CALLS
    return HERMES


def renders_tools(template: str | None) -> bool:
    """Whether the template writes tool definitions itself."""
    return bool(template) and "tools" in template


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def system_text(tools: list[dict[str, Any]]) -> str:
    """The tools, as the system message tells a model whose template does not (hermes format)."""
    lines = ["You may call one or more functions to assist with the user query. The functions, as JSON "
             "schemas, are within <tools></tools>:", "<tools>"]
    lines += [json.dumps(t["function"], ensure_ascii=False) for t in tools]
    lines += ["</tools>", "To call a function, answer with a JSON object of its name and arguments within "
              "<tool_call></tool_call> tags, one block a call:",
              '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>']
    return "\n".join(lines)


def template_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                      template: str | None) -> list[dict[str, Any]]:
    """The conversation as the template is given it: calls as objects for a template that renders
    tools; for one that does not, the tools in the system message and calls and results as text."""
    native = renders_tools(template)
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        call_id = m.pop("tool_call_id", None)
        if calls:
            if native:
                m["tool_calls"] = [{"type": "function", "id": c.get("id"), "function": {
                    "name": c["function"]["name"], "arguments": _as_object(c["function"]["arguments"])}}
                    for c in calls]
            else:
                blocks = [_block(c["function"]["name"], _as_object(c["function"]["arguments"])) for c in calls]
                m["content"] = "\n".join(filter(None, [m.get("content") or "", *blocks]))
        if call_id is not None and native:
            m["tool_call_id"] = call_id
        if m.get("content") is None:
            m["content"] = ""
        out.append(m)
    if tools and not native:
        text = system_text(tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "role": "system", "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _block(name: str, arguments: Any) -> str:
    """A call as the hermes format writes it."""
    return f"{_OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{_CLOSE}"


def _as_object(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def call_grammar(tools: list[dict[str, Any]], names: list[str], parallel: bool, fmt: str) -> str:
    """llguidance's grammar for output that is only calls of `names` (one, or more if `parallel`),
    each call's arguments a document of its function's parameters."""
    from llguidance import LLMatcher

    key = "arguments" if fmt == HERMES else "parameters"
    by_name = {t["function"]["name"]: t for t in tools}
    for n in names:  # each schema alone: the library names what it cannot enforce (inside Lark it may not)
        try:
            json_grammar(_parameters(by_name[n]))
        except ValueError as e:
            raise ValueError(f"{n}: {e}") from None
    options = [{"type": "object", "properties": {"name": {"const": n}, key: _parameters(by_name[n])},
                "required": ["name", key], "additionalProperties": False} for n in names]
    top = options[0] if len(options) == 1 else {"anyOf": options}
    schema = json.dumps({**top, "x-guidance": COMPACT})  # as response_format's: no free whitespace
    if fmt == HERMES:
        more = "+" if parallel else ""
        lark = f'start: call{more}\ncall: "{_OPEN}\\n" body "\\n{_CLOSE}"\nbody: %json {schema}\n'
    else:
        more = ' ("; " body)*' if parallel else ""
        lark = f"start: body{more}\nbody: %json {schema}\n"
    grammar = LLMatcher.grammar_from_lark(lark)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ValueError(messages[0] if messages else "the tools' schemas cannot be compiled")
    return grammar


class ToolCallParser:
    """Splits streamed text into content and the calls in it. Hermes: text outside the blocks is
    content; a block's call comes out when the block closes. JSON calls: output that starts as a
    JSON object is held whole and parsed at the end."""

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt
        self._buf = ""
        self._started = False  # json: whether the output has begun (leading whitespace aside)
        self._held = False  # json: the output is a call, held to the end
        self._after_call = False  # hermes: whitespace after a call's block is not content

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buf += text
        if self.fmt == JSON_CALLS:
            return self._push_json()
        content, calls = [], []

        def emit(text: str) -> None:
            if self._after_call:  # whitespace between calls' blocks is not content
                text = text.lstrip()
                self._after_call = not text
            content.append(text)

        while True:
            start = self._buf.find(_OPEN)
            if start < 0:
                keep = _partial_suffix(self._buf, _OPEN)
                emit(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                break
            emit(self._buf[:start])
            end = self._buf.find(_CLOSE, start)
            if end < 0:
                self._buf = self._buf[start:]
                break
            call = _parse_call(self._buf[start + len(_OPEN): end], "arguments")
            if call is not None:
                calls.append(call)
                self._after_call = True
            else:  # not a call after all: the text stays the model's
                emit(self._buf[start: end + len(_CLOSE)])
            self._buf = self._buf[end + len(_CLOSE):]
        return "".join(content), calls

    def _push_json(self) -> tuple[str, list[ToolCall]]:
        if self._held:
            return "", []
        stripped = self._buf.lstrip()
        if not stripped:
            return "", []
        if stripped.startswith(("{", _PYTHON_TAG)) or _PYTHON_TAG.startswith(stripped):
            self._held = True
            return "", []
        out, self._buf = self._buf, ""
        self.fmt = "text"  # plain text from here on
        return out, []

    def flush(self) -> tuple[str, list[ToolCall]]:
        """At the end of the output: an unclosed block or a held JSON that parses is a call; else text."""
        buf, self._buf = self._buf, ""
        if self.fmt == "text" or not buf:
            return buf, []
        if self.fmt == JSON_CALLS:
            body = buf.strip().removeprefix(_PYTHON_TAG)
            calls = [_parse_call(part, "parameters") for part in _split_calls(body)]
            return ("", calls) if calls and all(c is not None for c in calls) else (buf, [])
        if buf.startswith(_OPEN):
            call = _parse_call(buf[len(_OPEN):], "arguments")
            if call is not None:
                return "", [call]
        return buf, []


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that begins `tag` (held back: a tag may be arriving)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def _split_calls(body: str) -> list[str]:
    """`{...}; {...}` into its JSON objects (a ";" inside a string is not a separator)."""
    decoder, parts, i = json.JSONDecoder(), [], 0
    while i < len(body):
        while i < len(body) and body[i] in " \n\t;":
            i += 1
        if i >= len(body):
            break
        try:
            _, end = decoder.raw_decode(body, i)
        except ValueError:
            return [body[i:]]
        parts.append(body[i:end])
        i = end
    return parts


def _parse_call(text: str, key: str) -> ToolCall | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))
