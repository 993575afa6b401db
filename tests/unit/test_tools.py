"""Tool calls (text/tools.py): calls taken out of streamed text in either format, whatever the
split; conversations rendered for templates that know tools and for those that do not; and the
grammar of a required call accepting exactly calls valid for the function."""
from __future__ import annotations

import json

import llguidance
import pytest

from tokenflowd.text.source import load_tokenizer
from tokenflowd.text.tokenizer import Tokenizer
from tokenflowd.text.tools import HERMES, JSON_CALLS, ToolCallParser, call_grammar, template_messages, tool_format

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"], "additionalProperties": False}}}
NOTE = {"type": "function", "function": {"name": "note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string", "maxLength": 8}}, "required": ["text"]}}}


def parse(fmt: str, text: str, step: int) -> tuple[str, list[tuple[str, dict]]]:
    p, content, calls = ToolCallParser(fmt), "", []
    for i in range(0, len(text), step):
        c, more = p.push(text[i:i + step])
        content, calls = content + c, calls + more
    c, more = p.flush()
    return content + c, [(x.name, json.loads(x.arguments)) for x in calls + more]


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_hermes_calls_come_out_of_the_text_whatever_the_split(step):
    text = ('Let me add. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
            '<tool_call>\n{"name": "note", "arguments": {"text": "a<b"}}')  # the last block never closed
    assert parse(HERMES, text, step) == ("Let me add. ", [("add", {"a": 1, "b": 2}), ("note", {"text": "a<b"})])
    assert parse(HERMES, "no calls here, 1 < 2 <tool", step) == ("no calls here, 1 < 2 <tool", [])
    broken = "<tool_call>\nnot json\n</tool_call> after"
    assert parse(HERMES, broken, step) == (broken, [])


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_json_calls_are_held_and_parsed_at_the_end(step):
    text = '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "note", "parameters": {"text": "x;y"}}'
    assert parse(JSON_CALLS, text, step) == ("", [("add", {"a": 1, "b": 2}), ("note", {"text": "x;y"})])
    assert parse(JSON_CALLS, "  Plain words.", step) == ("  Plain words.", [])
    assert parse(JSON_CALLS, '{"not": "a call"}', step) == ('{"not": "a call"}', [])


def test_a_template_without_tools_gets_them_in_its_system_message():
    tok = load_tokenizer("smollm2-135m")
    assert tool_format(tok.chat_template) == HERMES
    messages = [{"role": "user", "content": "add 1 and 2"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "3"}]
    out = template_messages(messages, [ADD], tok.chat_template)
    assert out[0]["role"] == "system" and '"name": "add"' in out[0]["content"] and "<tool_call>" in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    text = tok.apply_chat_template(out)
    assert "<|im_start|>tool\n3<|im_end|>" in text


def test_a_template_that_knows_tools_renders_them_itself():
    tok = load_tokenizer("smollm2-135m")
    template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.role }}:"
                "{% for c in m.tool_calls or [] %}{{ c.function.name }}({{ c.function.arguments.a }}){% endfor %}"
                "{{ m.content }};{% endfor %}")
    native = Tokenizer(tok.backend, eos_token_ids=tok.eos_token_ids, bos_token_id=None, chat_template=template)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 7, "b": 2}'}}]}]
    out = template_messages(messages, [ADD], template)
    assert native.apply_chat_template(out, add_generation_prompt=False, tools=[ADD]) == "[add]user:hi;assistant:add(7);"


@pytest.mark.parametrize("fmt", [HERMES, JSON_CALLS])
def test_a_required_calls_grammar_takes_valid_calls_only(fmt):
    tok = load_tokenizer("smollm2-135m")
    index = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=tok.vocab_size, eos_token=list(tok.eos_token_ids))
    grammar = call_grammar([ADD, NOTE], ["add"], parallel=False, fmt=fmt)
    key = "arguments" if fmt == HERMES else "parameters"

    def accepts(doc: str) -> bool:
        m = llguidance.LLMatcher(index, grammar, log_level=0)
        return all(m.consume_token(t) for t in tok.encode(doc)) and m.is_accepting()

    wrap = (lambda body: f"<tool_call>\n{body}\n</tool_call>") if fmt == HERMES else (lambda body: body)
    assert accepts(wrap(json.dumps({"name": "add", key: {"a": 1, "b": 2}}, separators=(",", ":"))))
    assert not accepts(wrap(json.dumps({"name": "add", key: {"a": "one", "b": 2}}, separators=(",", ":"))))
    assert not accepts(wrap(json.dumps({"name": "note", key: {"text": "x"}}, separators=(",", ":"))))
    with pytest.raises(ValueError, match="note"):
        call_grammar([{"type": "function", "function": {"name": "note", "parameters": {"not": {}}}}], ["note"],
                     False, fmt)
