"""Overlap scheduling (engine/core.py): with the next step scheduled and launched while one runs,
every client sees the stream it sees with overlap off, through preemptions and host reloads, stop
tokens, EOS, max_tokens and min_tokens, an abort with a step in flight, and seeded sampling."""
from __future__ import annotations

import torch
from scripted_policy import ScriptedPolicy

from tokenflowd.config import EngineConfig
from tokenflowd.engine.core import EngineCore
from tokenflowd.engine.request import PLACEHOLDER, FinishReason, Request, SamplingParams

PAGE = 4


def make(loaded, overlap: bool, preempting: bool, **kw) -> EngineCore:
    base = dict(model="tiny", device="cpu", dtype="float32", page_size=PAGE, num_pages=40,
                max_num_batched_tokens=16, max_num_seqs=4, offload="write-through", host_kv_memory=1 << 22,
                overlap=overlap)
    core = EngineCore.from_config(EngineConfig.resolve(**{**base, **kw}), loaded)
    assert core.overlap is overlap
    if preempting:
        # FCFS that preempts the first running request every third plan, and reloads what the host holds
        core.scheduler.policy = ScriptedPolicy(
            lambda step, view: (view.running[0].request_id,) if view.running and step % 3 == 2 else ())
    return core


def streams(core: EngineCore, reqs: list[Request], abort: tuple[str, int] | None = None):
    """What each client receives: its tokens and how its stream ended; and what came after an abort."""
    got = {r.request_id: [[], None] for r in reqs}
    after_abort = []
    for r in reqs:
        core.add_request(r)
    aborted = None
    for step in range(3000):  # a cap: a livelock fails instead of hanging
        if not core.has_unfinished():
            break
        if abort is not None and step == abort[1]:
            assert core.abort(abort[0])
            aborted = abort[0]
        for out in core.step():
            if out.request_id == aborted:
                after_abort.append(out)
            got[out.request_id][0] += out.new_token_ids
            if out.finish_reason is not None:
                got[out.request_id][1] = out.finish_reason
    assert not core.has_unfinished()
    assert core.drain() == []  # a step still in flight carries nothing for anyone
    core.wait_copies()
    assert core.pool.num_used == 0 and core.kv.host.pool.num_used == 0  # no page leaked in either tier
    for r in reqs:
        assert PLACEHOLDER not in r.token_ids
    core.close()
    return {k: tuple(v) for k, v in got.items()}, after_abort


def requests(prompts: list[list[int]], reference: dict | None = None) -> list[Request]:
    """Greedy rows with max_tokens; one ending on a stop token, one on EOS, one whose stop token is
    held back by min_tokens, and a seeded sampled row (tokens chosen from `reference`, a plain run)."""
    greedy = dict(temperature=0.0)
    ref = {k: v[0] for k, v in reference.items()} if reference else {}
    out = [Request("len", prompts[0], SamplingParams(max_tokens=13, ignore_eos=True, **greedy)),
           Request("seeded", prompts[1], SamplingParams(max_tokens=17, temperature=0.9, top_k=20, seed=7,
                                                        ignore_eos=True))]
    if ref:
        out += [Request("stop", prompts[2], SamplingParams(max_tokens=30, stop_token_ids=(ref["plain2"][5],), **greedy)),
                Request("eos", prompts[3], SamplingParams(max_tokens=30, **greedy), eos_token_ids=(ref["plain3"][3],)),
                Request("min", prompts[2], SamplingParams(max_tokens=30, min_tokens=9, stop_token_ids=(ref["plain2"][2],),
                                                          **greedy)),
                Request("long", prompts[4], SamplingParams(max_tokens=25, ignore_eos=True, **greedy))]
    else:
        out += [Request(f"plain{i}", prompts[i], SamplingParams(max_tokens=30, ignore_eos=True, **greedy))
                for i in (2, 3)]
    return out


def check(loaded, prompts: list[list[int]], on_core=None, **kw) -> None:
    """`on_core(core)`: called with each overlapped engine (the GPU test asserts its paths)."""
    plain, _ = streams(make(loaded, False, False, **kw), requests(prompts))
    off, _ = streams(make(loaded, False, True, **kw), requests(prompts, plain))
    seen = on_core or (lambda core: None)
    on_core = make(loaded, True, True, **kw)
    seen(on_core)
    on, _ = streams(on_core, requests(prompts, plain))
    assert on_core.scheduler.num_preemptions > 0 and on_core.kv.stats.pages_loaded > 0  # the paths ran
    assert on == off
    assert off["stop"][1] is FinishReason.STOP and off["eos"][1] is FinishReason.STOP
    assert off["min"][1] is FinishReason.STOP and len(off["min"][0]) >= 9
    assert off["len"] == (plain["len"][0], FinishReason.LENGTH) and len(off["len"][0]) == 13
    assert off["seeded"] == plain["seeded"]
    # an abort with a step in flight: what the client got is a prefix of its stream, and nothing after
    for at in (4, 7):
        core = make(loaded, True, True, **kw)
        seen(core)
        on_abort, late = streams(core, requests(prompts, plain), ("long", at))
        assert late == [] and on_abort["long"][1] is None
        assert on_abort["long"][0] == off["long"][0][: len(on_abort["long"][0])]
        assert {k: v for k, v in on_abort.items() if k != "long"} == {k: v for k, v in off.items() if k != "long"}


def test_overlap_on_and_off_give_every_client_the_same_stream(tiny):
    g = torch.Generator().manual_seed(5)
    check(tiny, [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (9, 14, 22, 6, 17)])


def test_the_same_on_the_embedded_model(embedded_fp32):
    _, loaded = embedded_fp32
    text = loaded.tokenizer.encode("The history of computing is a story of abstractions built on abstractions. " * 3)
    check(loaded, [text[i : i + n] for i, n in ((0, 12), (3, 20), (5, 9), (8, 15), (11, 18))],
          num_pages=48, max_num_batched_tokens=32)
