"""Structured output's grammars, compiled where requests arrive: a JSON schema (or "any JSON
object") becomes llguidance's grammar, which the engine's matcher follows token by token
(engine/grammar.py). llguidance is the library (bench/grammar_libraries.py): it refuses the
schema keys it cannot enforce ("Unimplemented keys: [\"not\"]"), where the alternative measured
accepted five of them and let documents that break them through.
"""
from __future__ import annotations

from typing import Any

# Compact JSON: the separators fixed, no free whitespace between tokens. A model allowed any
# whitespace can spend its tokens on it (a small model loops on newlines) before the document ends.
COMPACT = {"whitespace_flexible": False}
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def json_grammar(schema: dict[str, Any] | bool) -> str:
    """llguidance's grammar for documents valid under `schema`; ValueError naming the problem when
    the library cannot compile or enforce it."""
    from llguidance import LLMatcher

    try:
        grammar = LLMatcher.grammar_from_json_schema(schema, defaults=COMPACT)
    except (ValueError, TypeError) as e:
        raise ValueError(str(e)) from None
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ValueError(messages[0] if messages else "the schema cannot be compiled")
    return grammar
