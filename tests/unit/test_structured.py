"""Structured output (engine/grammar.py, text/structured.py): a constrained request's tokens follow
its schema's grammar on the embedded model, with overlap scheduling on (a token the matcher needs is
still on the device when the next step's mask is computed) and off, beside unconstrained rows; the
bitmask is applied as llguidance defines it; schemas the library cannot enforce are refused."""
from __future__ import annotations

import json

import pytest
import torch

from tokenflowd.engine.grammar import apply_masks
from tokenflowd.text.structured import json_grammar

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "kind": {"enum": ["fruit", "vegetable"]},
    "grams": {"type": "integer", "minimum": 1, "maximum": 999}},
    "required": ["name", "kind", "grams"], "additionalProperties": False}


def test_a_mask_leaves_exactly_its_set_bits():
    logits = torch.zeros(3, 70)
    masks = torch.zeros(2, 2, dtype=torch.int32)  # 64 tokens' worth: 64..69 are past it, always masked
    masks[0, 0] = 0b101  # tokens 0 and 2
    masks[1, 1] = -(1 << 31)  # token 63 (bit 31 of word 1)
    apply_masks(logits, [0, 2], masks)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0, 2]
    assert torch.isfinite(logits[1]).all()
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [63]


@pytest.mark.parametrize("schema", [{"not": {"type": "string"}}, {"type": "frog"}, {"$ref": "#/nowhere"}])
def test_schemas_the_library_cannot_enforce_are_refused(schema):
    with pytest.raises(ValueError):
        json_grammar(schema)


@pytest.mark.parametrize("overlap", [False, True])
def test_constrained_rows_follow_their_schema_beside_free_ones(embedded_fp32, overlap):
    from tokenflowd.config import EngineConfig
    from tokenflowd.engine.core import EngineCore
    from tokenflowd.engine.request import Request, SamplingParams

    dtype, loaded = embedded_fp32
    core = EngineCore.from_config(EngineConfig.resolve(device="cpu", dtype=dtype, quantization="none",
                                                       kv_cache_memory="64MiB", overlap=overlap), loaded)
    prompt = core.tokenizer.encode_chat([{"role": "user", "content": "Describe a food."}])
    grammar = json_grammar(SCHEMA)
    asks = {"greedy": SamplingParams(temperature=0.0, max_tokens=60, grammar=grammar),
            "sampled": SamplingParams(temperature=1.0, seed=5, max_tokens=60, grammar=grammar),
            "free": SamplingParams(temperature=0.0, max_tokens=24)}
    for rid, params in asks.items():
        core.add_request(Request(rid, prompt, params))
    out: dict[str, list[int]] = {rid: [] for rid in asks}
    reasons = {}
    while core.has_unfinished():
        for o in core.step():
            out[o.request_id] += o.new_token_ids
            if o.finished:
                reasons[o.request_id] = o.finish_reason.value
    core.close()
    for rid in ("greedy", "sampled"):
        assert reasons[rid] == "stop", (rid, core.tokenizer.decode(out[rid]))
        doc = json.loads(core.tokenizer.decode(out[rid]))
        assert set(doc) == {"name", "kind", "grams"} and doc["kind"] in ("fruit", "vegetable")
        assert len(doc["name"]) <= 12 and 1 <= doc["grams"] <= 999
    with pytest.raises(json.JSONDecodeError):  # unconstrained, the model writes prose
        json.loads(core.tokenizer.decode(out["free"]))


def test_a_grammar_the_engine_cannot_build_refuses_the_request(embedded_fp32):
    from tokenflowd.config import EngineConfig
    from tokenflowd.engine.core import EngineCore
    from tokenflowd.engine.request import InvalidRequestError, Request, SamplingParams

    dtype, loaded = embedded_fp32
    core = EngineCore.from_config(EngineConfig.resolve(device="cpu", dtype=dtype, quantization="none",
                                                       kv_cache_memory="64MiB"), loaded)
    with pytest.raises(InvalidRequestError, match="grammar"):
        core.add_request(Request("bad", [1, 2, 3], SamplingParams(grammar='{"grammars": 5}')))
    assert not core.has_unfinished()
    core.close()
