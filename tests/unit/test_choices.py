"""n > 1 (engine/core.py `add_request(after=...)`): the other choices of a prompt wait for the first
one's first token, then find the prompt's whole pages in the prefix cache: the prompt is computed
once and its pages are held once, whatever n; a seeded choice samples as it would alone."""
from __future__ import annotations

import pytest

from tokenflowd.config import EngineConfig
from tokenflowd.engine.core import EngineCore
from tokenflowd.engine.request import Request, SamplingParams


def run(core: EngineCore, reqs: list[tuple[Request, str | None]], watch=None) -> dict[str, list[int]]:
    """Each request's tokens; `watch(core, tokens so far)` after every step."""
    out: dict[str, list[int]] = {r.request_id: [] for r, _ in reqs}
    for r, after in reqs:
        core.add_request(r, after)
    while core.has_unfinished():
        for o in core.step():
            out[o.request_id] += o.new_token_ids
        if watch is not None:
            watch(core, out)
    return out


@pytest.mark.parametrize("overlap", [False, True])
def test_four_choices_compute_and_hold_the_prompts_pages_once(embedded_fp32, overlap):
    dtype, loaded = embedded_fp32
    core = EngineCore.from_config(EngineConfig.resolve(device="cpu", dtype=dtype, quantization="none",
                                                       kv_cache_memory="64MiB", overlap=overlap), loaded)
    page = core.kv.page_size
    prompt = core.tokenizer.encode(" ".join(f"word{i}" for i in range(60)), add_special_tokens=True)
    whole = len(prompt) // page
    assert whole >= 6 and len(prompt) % page
    computed = []
    run_ = core.executor.execute

    def counting(batch):
        computed.append(batch.total_tokens)
        return run_(batch)

    core.executor.execute = counting
    core.executor.launch = lambda batch, launch=core.executor.launch: (computed.append(batch.total_tokens),
                                                                       launch(batch))[1]
    peak = [0]
    used_before = core.kv.pool.num_used

    def watch(c, out):
        if all(len(toks) for toks in out.values()):  # every choice decodes
            peak[0] = max(peak[0], c.kv.pool.num_used - used_before)

    n, max_tokens = 4, 8
    reqs = [(Request(f"c{i}", prompt, SamplingParams(temperature=1.0, seed=100 + i, max_tokens=max_tokens,
                                                     ignore_eos=True)), None if i == 0 else "c0") for i in range(n)]
    out_so_far = run(core, reqs, watch)
    assert all(len(t) == max_tokens for t in out_so_far.values())
    # the prompt once, then each other choice only its tail (the partial page) plus the decodes
    tail = len(prompt) - whole * page
    assert sum(computed) == len(prompt) + (n - 1) * tail + n * (max_tokens - 1)
    # pages held while all four decode: the prompt's whole pages once, each choice's own tail
    own = -(-(tail + max_tokens) // page)
    assert whole < peak[0] <= whole + n * own < whole * n
    # a seeded choice samples what it samples alone
    alone = run(core, [(Request("alone", prompt, SamplingParams(temperature=1.0, seed=102, max_tokens=max_tokens,
                                                                 ignore_eos=True)), None)])
    assert alone["alone"] == out_so_far["c2"]
    core.close()


def test_an_aborted_waiting_choice_is_dropped(embedded_fp32):
    dtype, loaded = embedded_fp32
    core = EngineCore.from_config(EngineConfig.resolve(device="cpu", dtype=dtype, quantization="none",
                                                       kv_cache_memory="64MiB"), loaded)
    prompt = core.tokenizer.encode("Tell me a story.", add_special_tokens=True)
    core.add_request(Request("a", prompt, SamplingParams(max_tokens=3)))
    core.add_request(Request("b", prompt, SamplingParams(max_tokens=3)), after="a")
    assert core.abort("b")
    done = set()
    while core.has_unfinished():
        done |= {o.request_id for o in core.step() if o.finished}
    assert done == {"a"}
    core.close()
