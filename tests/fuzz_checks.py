"""A schemathesis check for the fuzz test (tests/integration/test_fuzz.py), loaded with
SCHEMATHESIS_HOOKS. It stands in for schemathesis's positive_data_acceptance, which fails any 400 to
a body valid under the schema. Some refusals depend on more than the schema can say, and are
accepted here, by their error code, and only these: a prompt longer than the context once
tokenized (context_length_exceeded) or empty once tokenized (empty_prompt: control characters the
tokenizer drops), a conversation the model's chat template refuses (chat_template), a JSON schema
the grammar library cannot enforce (invalid_json_schema), and what ties two fields together, which
JSON Schema cannot compare: min_tokens above max_tokens, top_logprobs without logprobs, a required
or named tool_choice without tools or naming one not offered, and response_format with a required
call. Every other 400 to a schema-valid body still fails."""
from __future__ import annotations

import json

import schemathesis
from schemathesis.core.failures import Failure

SCHEMA_CANNOT_SAY = {"context_length_exceeded", "min_tokens_above_max_tokens", "chat_template", "empty_prompt",
                     "invalid_json_schema", "top_logprobs_without_logprobs", "tool_choice_without_tools",
                     "unknown_tool", "conflicting_constraints"}
ACCEPTED = {401, 403, 404, 409, 429} | set(range(200, 400)) | set(range(500, 600))


@schemathesis.check
def valid_bodies_are_taken(ctx, response, case):
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or response.status_code in ACCEPTED:
        return None
    code = None
    if response.status_code == 400:
        try:
            code = json.loads(response.content)["error"]["code"]
        except (ValueError, KeyError, TypeError):
            pass
    if code in SCHEMA_CANNOT_SAY:
        return None
    raise Failure(operation=case.operation.label, title="Schema-valid request refused",
                  message=f"{response.status_code} ({code}) to a body valid under the schema")
