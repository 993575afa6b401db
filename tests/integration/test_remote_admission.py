"""A decode node's side of disaggregation, in process: a request whose prompt another engine (the
prefill node) computed joins this engine with that KV written into pages it allocated for it, and
goes on with the same greedy tokens as one engine alone; a transfer that fails makes it compute
its prompt here instead, with the same tokens, and no page leaks."""
from __future__ import annotations

import pytest
import torch

from tokenflowd.config import EngineConfig
from tokenflowd.engine.core import EngineCore
from tokenflowd.engine.request import Request, SamplingParams
from tokenflowd.kv.staging import gather_pages, scatter_pages

PROMPT = list(range(5, 23))  # 18 tokens: 4 full pages of 4 and a partial one
MAX_TOKENS = 12


def core(tiny, **kw) -> EngineCore:
    cfg = EngineConfig.resolve(model="tiny", device="cpu", dtype="float32", page_size=4, num_pages=64,
                               max_num_batched_tokens=64, max_num_seqs=4, policy="fcfs", offload="none", **kw)
    c = EngineCore.from_config(cfg, tiny)
    c.kv.remote_grace = 0.0  # no bytes on a wire here: a settled sender's pages are free at once
    return c


def request(rid: str, max_tokens: int = MAX_TOKENS) -> Request:
    return Request(rid, list(PROMPT), SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0))


def run(c: EngineCore, rid: str) -> list[int]:
    out: list[int] = []
    while c.has_unfinished():
        out += [t for o in c.step() if o.request_id == rid for t in o.new_token_ids]
    return out


def prefill(tiny) -> tuple[EngineCore, Request, int]:
    """The prefill node: the prompt computed and its first token sampled; the request holds its pages."""
    p = core(tiny)
    req = request("a", max_tokens=2)
    p.add_request(req)
    first = [t for o in p.step() for t in o.new_token_ids]
    assert len(first) == 1 and req.num_computed_tokens == len(PROMPT)
    return p, req, first[0]


def test_a_request_prefilled_elsewhere_decodes_here_with_one_engines_greedy_tokens(tiny):
    alone = core(tiny)
    alone.add_request(request("ref"))
    want = run(alone, "ref")
    p, done, first = prefill(tiny)
    d = core(tiny)
    req = request("a")
    pages = d.add_remote(req, len(PROMPT))
    assert pages is not None and len(pages) == 5 and not run_one_step_makes_progress(d, "a")
    src = p.kv.block_table(done)
    staged = gather_pages(p.runner.kv_layers, src, torch.empty(1 << 20), p.runner.attn.page_axis)
    scatter_pages(staged, d.runner.kv_layers, pages, d.runner.attn.page_axis)
    out = d.remote_arrived("a", first)
    assert out is not None and out.new_token_ids == [first] and not out.finished
    assert [first] + run(d, "a") == want
    assert d.pool.num_used == 0


def run_one_step_makes_progress(c: EngineCore, rid: str) -> bool:
    """A step while its KV is on the way produces nothing for it."""
    return any(o.request_id == rid and o.new_token_ids for o in c.step())


def test_a_failed_transfer_computes_the_prompt_here_with_the_same_tokens(tiny):
    alone = core(tiny)
    alone.add_request(request("ref"))
    want = run(alone, "ref")
    _, _, first = prefill(tiny)
    d = core(tiny)
    req = request("a")
    assert d.add_remote(req, len(PROMPT)) is not None
    assert d.remote_arrived("a", None) is None
    assert run(d, "a") == want
    assert d.pool.num_used == 0


def test_a_transfer_given_up_unsettled_keeps_its_pages_until_the_senders_timeout(tiny):
    d = core(tiny)
    free = d.pool.num_free
    d.kv.remote_quarantine = 0.2
    req = request("a")
    pages = d.add_remote(req, len(PROMPT))
    d.remote_arrived("a", None, settled=False)  # the prefill node is gone: it may still be writing
    d.step()
    assert d.kv.num_remote_pending == len(pages)
    run(d, "a")
    import time
    time.sleep(0.25)
    d.scheduler.poll_copies()
    assert d.kv.num_remote_pending == 0 and d.pool.num_free == free and d.pool.num_used == 0


def test_a_first_token_that_stops_ends_the_request_and_caches_its_prompt(tiny):
    d = core(tiny)
    req = request("a", max_tokens=1)
    assert d.add_remote(req, len(PROMPT)) is not None
    out = d.remote_arrived("a", 7)
    assert out.finished and out.new_token_ids == [7] and not d.has_unfinished()
    assert d.pool.num_used == 0 and d.pool.num_cached == len(PROMPT) // 4


def test_no_room_admits_nothing_and_changes_nothing(tiny):
    d = core(tiny)
    held = [d.pool.allocate() for _ in range(d.pool.num_free - 2)]
    assert d.add_remote(request("a"), len(PROMPT)) is None
    assert "a" not in d.scheduler.requests and d.pool.num_free == 2
    del held


def test_pages_of_a_request_aborted_while_its_kv_arrives_stay_taken_until_the_transfer_is_done(tiny):
    d = core(tiny)
    free = d.pool.num_free
    req = request("a")
    pages = d.add_remote(req, len(PROMPT))
    assert d.abort("a")
    d.step() if d.has_unfinished() else d.scheduler.poll_copies()
    assert d.pool.num_free == free - len(pages), "the sender may still be writing into them"
    d.kv.remote_done(req, ok=False, settled=True)  # the sender says it is done writing
    d.scheduler.poll_copies()
    assert d.pool.num_free == free and d.pool.num_used == 0


def test_a_reservation_takes_a_seat_and_none_is_made_when_no_seat_is_free(tiny):
    """Seats (max_num_seqs) bound reservations as they bound local admissions: a reservation beyond
    them would hold pages idle and go ahead of the requests queued before it. None: the decode node
    queues the request and computes its prompt itself."""
    d = core(tiny)  # 4 seats
    for rid in ("r0", "r1", "r2"):
        assert d.add_remote(request(rid), len(PROMPT)) is not None
    d.add_request(request("w"))  # queued before the next: it has the last seat
    free = d.pool.num_free
    assert d.add_remote(request("e"), len(PROMPT)) is None
    assert "e" not in d.scheduler.requests and d.pool.num_free == free
    d.abort("w")
    assert d.add_remote(request("e"), len(PROMPT)) is not None  # the seat is free again
    assert d.add_remote(request("f"), len(PROMPT)) is None
    d.add_request(request("f"))  # as a local request: it waits for a seat
    for rid in ("r0", "r1", "r2", "e"):
        d.remote_arrived(rid, None)
    while d.has_unfinished():
        d.step()
    assert d.pool.num_used == 0


def test_a_reservation_past_max_queue_delay_is_none_and_the_request_is_shed_as_a_local_one(tiny):
    from tokenflowd.buffer.estimates import StepCost
    from tokenflowd.engine.admission import MIN_OBSERVED_STEPS, QueueDelayExceeded, engine_ttft

    d = core(tiny, max_queue_delay=1.0)
    d.add_request(request("warm", max_tokens=MIN_OBSERVED_STEPS + 2))
    while d.has_unfinished():
        d.step()
    assert d.admission.num_steps >= MIN_OBSERVED_STEPS
    for rid in ("a", "b"):  # two seats of four decode
        d.add_request(request(rid, max_tokens=40))
    d.step()
    sched = d.scheduler
    sched.step_model.cost = StepCost(base=0.1, per_token=0.01, per_context=0.0)
    d.admission.pace = 1.0
    # its prompt computed elsewhere, it waits here for a seat and one token's step, not its prompt's
    remote, local = engine_ttft(sched, request("x"), remote=True), engine_ttft(sched, request("x"))
    assert remote < local
    d.admission.bound = remote / 2
    free = d.pool.num_free
    assert d.add_remote(request("e"), len(PROMPT)) is None
    assert "e" not in sched.requests and d.pool.num_free == free and d.admission.num_shed == 0
    with pytest.raises(QueueDelayExceeded):  # the decode node then sheds it, as a local request
        d.add_request(request("e"))
    assert d.admission.num_shed == 1
    d.admission.bound = (remote + local) / 2  # a reservation fits it, a local prompt would not
    assert d.add_remote(request("e"), len(PROMPT)) is not None
    d.remote_arrived("e", None)
    while d.has_unfinished():
        d.step()
    assert d.pool.num_used == 0


def test_kv_that_ends_on_a_page_boundary_arrives_with_the_page_its_next_token_needs(tiny):
    """16 prompt tokens fill 4 pages: the sender gets those 4 to write into, and the request holds a
    fifth, so that once its KV is in it steps without asking the pool for a page (kv/manager.py
    _next_page: arrivals holding every page would otherwise leave it nowhere to grow)."""
    d = core(tiny)
    req = Request("b", list(range(5, 21)), SamplingParams(max_tokens=4, ignore_eos=True, temperature=0))
    free = d.pool.num_free
    pages = d.add_remote(req, 16)
    assert pages is not None and len(pages) == 4 and free - d.pool.num_free == 5
    assert d.kv.block_table(req)[:4] == pages
    d.remote_arrived("b", 7)  # what the pages hold does not matter here
    held = d.pool.num_free
    d.step()
    assert len(d.kv.block_table(req)) == 5 and d.pool.num_free == held  # its next token's KV went into the fifth
    run(d, "b")
    assert d.pool.num_used == 0
