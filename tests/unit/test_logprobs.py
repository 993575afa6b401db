"""Logprobs (engine/sampler.py `sample_with_logprobs`): the raw logits' log-softmax, taken before
penalties and temperature, for the rows that ask only; held with their tokens when the engine
coalesces a stream (pacing.py); named by the bytes their tokens stand for (text/tokenizer.py)."""
from __future__ import annotations

import math

import pytest
import torch

from tokenflowd.daemon.api.sse import ChatChunks, CompletionChunks
from tokenflowd.engine.process.pacing import DeltaPacer
from tokenflowd.engine.request import InvalidRequestError, SamplingParams, SamplingRow
from tokenflowd.engine.sampler import Sampler
from tokenflowd.protocol import Coalesce, Delta, TokenLogprobs
from tokenflowd.text.source import load_tokenizer


def row(**params) -> SamplingRow:
    p = SamplingParams(**params)
    if not p.penalized:
        return SamplingRow(p, None, 0, frozenset())
    return SamplingRow(p, None, 1, frozenset(), [5, 7], [], 1)


def test_logprobs_are_the_raw_log_softmax_whatever_penalties_and_temperature_do():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 32, generator=g)
    raw = logits.double().log_softmax(-1)
    rows = [row(temperature=0.0, logprobs=5, frequency_penalty=2.0), row(temperature=0.0),
            row(temperature=1.5, top_k=3, logprobs=0), row(temperature=0.0, logprobs=20)]
    tokens, lp = Sampler().sample_with_logprobs(logits.clone(), rows)
    assert lp.rows == [0, 2, 3] and lp.ks == [5, 0, 20]
    for j, i in enumerate(lp.rows):
        assert math.isclose(lp.chosen[j], raw[i, tokens[i]], abs_tol=1e-6)
        top_values, top_ids = raw[i].topk(lp.ks[j])
        assert lp.top_ids[j, :lp.ks[j]].tolist() == top_ids.tolist()
        assert torch.allclose(lp.top_logprobs[j, :lp.ks[j]].double(), top_values, atol=1e-6)
    # the penalized row's token is drawn from the penalized logits, its logprob from the raw ones
    assert tokens[0] != 7 or logits[0].argmax() == 7
    assert tokens[3] == raw[3].argmax() == lp.top_ids[2, 0]


def test_rows_without_logprobs_get_none():
    tokens, lp = Sampler().sample_with_logprobs(torch.randn(3, 16), [row(temperature=0.0)] * 3)
    assert lp is None and tokens.shape == (3,)


@pytest.mark.parametrize("k", [-1, 21])
def test_logprobs_out_of_range_are_refused(k):
    with pytest.raises(InvalidRequestError, match="logprobs"):
        SamplingParams(logprobs=k)


def test_a_coalesced_delta_carries_the_held_tokens_logprobs_in_order():
    pacer = DeltaPacer()
    pacer.track("r", 1.0, Coalesce(interval=10.0, buffer=0.5))
    lp = [TokenLogprobs(-0.1 * i, [i], [-0.1 * i]) for i in range(6)]
    out = []
    for t in range(6):
        out += pacer.pace([Delta("r", [t], logprobs=[lp[t]])], now=0.0)  # a reader at 1 token/s: held after 1
    out += pacer.pace([Delta("r", [], "stop")], now=0.1)
    tokens = [t for d in out for t in d.token_ids]
    assert tokens == list(range(6)) and len(out) < 6
    assert [x for d in out for x in d.logprobs or ()] == lp


def test_tokens_are_named_by_their_bytes():
    tok = load_tokenizer("smollm2-135m")
    text = "Héllo wörld, 日本語 😀\n\tend"
    ids = tok.encode(text)
    assert b"".join(tok.token_bytes(i) for i in ids).decode() == text
    assert tok.token_bytes(tok.vocab_size + 5) == b""
    lps = [(i, TokenLogprobs(-1.0, [i, ids[0]], [-1.0, -2.0])) for i in ids]
    chat = ChatChunks("id", 0, "m", tok)._logprobs(lps)
    assert b"".join(bytes(c.bytes) for c in chat.content).decode() == text
    assert all(c.top_logprobs[0].token == c.token for c in chat.content)
    completion = CompletionChunks("id", 0, "m", tok)
    first = completion._completion_logprobs(lps[:2])
    second = completion._completion_logprobs(lps[2:])
    offsets = first.text_offset + second.text_offset
    names = first.tokens + second.tokens
    assert offsets == [sum(len(n) for n in names[:k]) for k in range(len(names))]


@pytest.mark.parametrize("overlap", [False, True])
def test_the_engine_hands_out_one_logprob_a_token_overlapped_or_not(embedded_fp32, overlap):
    """Overlap scheduling: the step that samples a token is collected a step later; its logprobs come
    with it, and a batch of requests that ask and requests that do not keeps them apart."""
    from tokenflowd.config import EngineConfig
    from tokenflowd.engine.core import EngineCore
    from tokenflowd.engine.request import Request

    dtype, loaded = embedded_fp32
    core = EngineCore.from_config(EngineConfig.resolve(device="cpu", dtype=dtype, quantization="none",
                                                       kv_cache_memory="64MiB", overlap=overlap), loaded)
    assert core.overlap is overlap
    prompt = core.tokenizer.encode("The three primary colors are", add_special_tokens=True)
    for rid, k in (("a", 3), ("b", None), ("c", 0)):
        core.add_request(Request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                             logprobs=k)))
    tokens: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    logprobs: dict[str, list[TokenLogprobs]] = {"a": [], "b": [], "c": []}
    while core.has_unfinished():
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
            assert (out.logprobs is None) == (out.request_id == "b" or not out.new_token_ids)
            logprobs[out.request_id] += out.logprobs or []
    assert tokens["a"] == tokens["b"] == tokens["c"] and len(tokens["a"]) == 6
    assert [lp.top_ids[0] for lp in logprobs["a"]] == tokens["a"]  # greedy: the top token is the one sampled
    assert all(len(lp.top_ids) == 3 and lp.logprob == lp.top_logprobs[0] for lp in logprobs["a"])
    assert [lp.logprob for lp in logprobs["c"]] == pytest.approx([lp.logprob for lp in logprobs["a"]], abs=1e-4)
    assert all(lp.top_ids == [] for lp in logprobs["c"])
    core.close()
