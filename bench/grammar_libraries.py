"""Which grammar library constrains structured output: xgrammar against llguidance, on this CPU.

For the embedded model's tokenizer (49,152 tokens, byte-level BPE), each library:
- builds its tokenizer index once (start-up cost of an engine);
- compiles 5 JSON schemas of the kinds a chat product sends (nested objects, enums, arrays,
  optional fields) and a set of JSON Schema features one by one (coverage: which it accepts);
- steps through a valid document of each of the 5 schemas token by token, computing the next
  token's mask before each token (the cost that runs beside the forward on every step);
- for each feature it accepts, feeds a document that breaks it: a library that takes the schema
  and the document alike accepted a constraint it does not enforce.

    python bench/grammar_libraries.py [--out bench/results/grammar_libraries.json]

Either library must be installed (`pip install xgrammar llguidance`); a missing one is reported.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from tokenflowd.text.source import load_tokenizer

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string"},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "integer"}},
                    "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                              "size": {"type": "string", "enum": ["S", "M", "L"]}},
             "required": ["color", "size"], "additionalProperties": False},
    "array": {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}},
                                               "scores": {"type": "array", "items": {"type": "number"}}},
              "required": ["tags", "scores"], "additionalProperties": False},
    "optional": {"type": "object", "properties": {"title": {"type": "string"},
                                                  "subtitle": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                                                  "year": {"type": "integer"}},
                 "required": ["title"], "additionalProperties": False},
    "mixed": {"type": "object", "properties": {
        "id": {"type": "integer"}, "ok": {"type": "boolean"},
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer"}}, "required": ["sku", "qty"],
            "additionalProperties": False}}},
        "required": ["id", "ok", "items"], "additionalProperties": False},
}
DOCUMENTS = {
    "nested": {"name": "Ada Lovelace", "address": {"city": "London", "zip": 12345}},
    "enum": {"color": "green", "size": "M"},
    "array": {"tags": ["alpha", "beta", "gamma"], "scores": [1.5, 2.25, -3.0]},
    "optional": {"title": "Dune", "subtitle": None, "year": 1965},
    "mixed": {"id": 7, "ok": True, "items": [{"sku": "A-1", "qty": 2}, {"sku": "B-22", "qty": 10}]},
}
FEATURES = {
    "$ref recursion": {"$defs": {"node": {"type": "object", "properties": {
        "value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["value"]}}, "$ref": "#/$defs/node"},
    "anyOf": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
    "oneOf": {"oneOf": [{"type": "integer"}, {"type": "boolean"}]},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                        {"type": "object", "properties": {"b": {"type": "string"}}}]},
    "const": {"const": "fixed"},
    "pattern": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
    "format date-time": {"type": "string", "format": "date-time"},
    "format email": {"type": "string", "format": "email"},
    "format uuid": {"type": "string", "format": "uuid"},
    "minLength/maxLength": {"type": "string", "minLength": 2, "maxLength": 5},
    "minItems/maxItems": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    "minimum/maximum": {"type": "integer", "minimum": 1, "maximum": 10},
    "exclusiveMinimum (number)": {"type": "number", "exclusiveMinimum": 0},
    "additionalProperties schema": {"type": "object", "additionalProperties": {"type": "integer"}},
    "patternProperties": {"type": "object", "patternProperties": {"^x-": {"type": "string"}}},
    "prefixItems": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]},
    "type list": {"type": ["string", "null"]},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "not": {"not": {"type": "string"}},
    "if/then/else": {"if": {"type": "integer"}, "then": {"minimum": 0}, "else": {"type": "string"}},
    "dependentRequired": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                          "dependentRequired": {"a": ["b"]}},
}

# a document each feature forbids
VIOLATIONS = {
    "$ref recursion": '{"value":1,"children":[{"children":[]}]}', "anyOf": "true", "oneOf": '"x"',
    "allOf": '{"a":1,"b":2}', "const": '"other"', "pattern": '"abc"', "format date-time": '"yesterday"',
    "format email": '"not an email"', "format uuid": '"1234"', "minLength/maxLength": '"toolongstring"',
    "minItems/maxItems": "[1,2,3,4]", "minimum/maximum": "42", "exclusiveMinimum (number)": "-1",
    "additionalProperties schema": '{"a":"x"}', "patternProperties": '{"x-a":1}', "prefixItems": '["a",1]',
    "type list": "1", "uniqueItems": "[1,1]", "not": '"a"', "if/then/else": "-5", "dependentRequired": '{"a":1}',
}


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok) -> None:
        import xgrammar as xgr
        self.xgr = xgr
        vocab = [tok.backend.id_to_token(i) or "" for i in range(tok.vocab_size)]
        info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.BYTE_LEVEL, vocab_size=tok.vocab_size,
                                 stop_token_ids=list(tok.eos_token_ids))
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.bitmask = xgr.allocate_token_bitmask(1, tok.vocab_size)

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), strict_mode=True)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def step(self, matcher, token: int) -> None:
        matcher.fill_next_token_bitmask(self.bitmask)
        if not matcher.accept_token(token):
            raise ValueError("xgrammar refused a token of a valid document")

    def ends(self, matcher, eos: int) -> bool:
        return matcher.accept_token(eos)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok) -> None:
        import llguidance
        import llguidance.torch
        self.ll = llguidance
        self.tokenizer = llguidance.LLTokenizer(tok.backend.to_str(), eos_token=list(tok.eos_token_ids))
        self.bitmask = llguidance.torch.allocate_token_bitmask(1, tok.vocab_size)
        self.fill = llguidance.torch.fill_next_token_bitmask

    def compile(self, schema: dict):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                             defaults={"whitespace_flexible": False})
        ok, error = self.ll.LLMatcher.validate_grammar(grammar, self.tokenizer), None
        if isinstance(ok, tuple):
            ok, error = ok
        if error or ok is False or isinstance(ok, str) and ok:
            raise ValueError(error or ok)
        return grammar

    def matcher(self, compiled):
        m = self.ll.LLMatcher(self.tokenizer, compiled)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def step(self, matcher, token: int) -> None:
        self.fill(matcher, self.bitmask, 0)
        if not matcher.consume_token(token):
            raise ValueError(f"llguidance refused a token of a valid document: {matcher.get_error()}")

    def ends(self, matcher, eos: int) -> bool:
        return matcher.is_accepting()


def measure(lib_cls, tok) -> dict:
    t0 = time.perf_counter()
    try:
        lib = lib_cls(tok)
    except ImportError as e:
        return {"error": f"not installed: {e}"}
    out = {"tokenizer_index_ms": (time.perf_counter() - t0) * 1e3, "schemas": {}, "features": {}}
    per_token = []
    for name, schema in SCHEMAS.items():
        t0 = time.perf_counter()
        compiled = lib.compile(schema)
        compile_ms = (time.perf_counter() - t0) * 1e3
        ids = tok.encode(json.dumps(DOCUMENTS[name], separators=(",", ":")))
        m = lib.matcher(compiled)
        times = []
        for t in ids:
            t0 = time.perf_counter()
            lib.step(m, t)
            times.append((time.perf_counter() - t0) * 1e6)
        per_token += times
        out["schemas"][name] = {"compile_ms": round(compile_ms, 2), "tokens": len(ids),
                                "mask_us_mean": round(statistics.mean(times), 1),
                                "mask_us_max": round(max(times), 1)}
    per_token.sort()
    out["mask_us_mean"] = round(statistics.mean(per_token), 1)
    out["mask_us_p99"] = round(per_token[int(0.99 * (len(per_token) - 1))], 1)
    for name, schema in FEATURES.items():
        try:
            compiled = lib.compile(schema)
        except Exception as e:  # the library's own refusal, as it words it
            out["features"][name] = f"refused: {str(e).splitlines()[0][:160]}"
            continue
        m = lib.matcher(compiled)
        try:
            for t in tok.encode(VIOLATIONS[name]):
                lib.step(m, t)
            broken = lib.ends(m, tok.eos_token_ids[0])
        except ValueError:
            broken = False
        out["features"][name] = "accepted, NOT enforced" if broken else "accepted"
    out["features_enforced"] = sum(v == "accepted" for v in out["features"].values())
    out["features_accepted_not_enforced"] = sum(v.startswith("accepted, NOT") for v in out["features"].values())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    tok = load_tokenizer("smollm2-135m")
    result = {"machine": platform.processor() or platform.machine(), "vocab": tok.vocab_size,
              "features_tried": len(FEATURES)}
    try:
        result["cpu"] = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                             if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    for lib in (XGrammar, LLGuidance):
        result[lib.name] = measure(lib, tok)
        r = result[lib.name]
        if "error" in r:
            print(f"{lib.name}: {r['error']}")
            continue
        print(f"{lib.name}: index {r['tokenizer_index_ms']:.0f} ms; compile "
              + ", ".join(f"{k} {v['compile_ms']:.1f} ms" for k, v in r["schemas"].items())
              + f"; mask {r['mask_us_mean']:.0f} us/token mean, p99 {r['mask_us_p99']:.0f} us; "
              f"features enforced {r['features_enforced']}/{len(FEATURES)}, accepted and not enforced "
              f"{r['features_accepted_not_enforced']}")
        for k, v in r["features"].items():
            if v != "accepted":
                print(f"    {k}: {v}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
