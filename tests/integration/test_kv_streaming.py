"""Layer-wise prefill between two engines in one process (federation/streaming.py), over a transport
that copies bytes in place of the network: the prefill engine's Sender writes each layer's finished
pages as the layer ends, chunk by chunk, and the decode engine's Receiver checks them and decodes
with one engine's greedy tokens. Pages the sender read are pinned until its writes settle, and a
failed write makes the decode engine compute the prompt itself."""
from __future__ import annotations

import math
import os
import sys

from tokenflowd import protocol as p
from tokenflowd.config import EngineConfig
from tokenflowd.engine.core import EngineCore
from tokenflowd.engine.request import Request, SamplingParams
from tokenflowd.federation.streaming import Receiver, Sender

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from local_transport import LocalTransport  # noqa: E402

PROMPT = list(range(5, 47))  # 42 tokens: 10 full pages of 4 and a partial one
MAX_TOKENS = 10


def core(tiny, budget: int = 64) -> EngineCore:
    cfg = EngineConfig.resolve(model="tiny", device="cpu", dtype="float32", page_size=4, num_pages=64,
                               max_num_batched_tokens=budget, max_num_seqs=4, policy="fcfs", offload="none")
    c = EngineCore.from_config(cfg, tiny)
    c.kv.remote_grace = 0.0  # no bytes on a wire here: a settled sender's pages are free at once
    return c


def request(rid: str, max_tokens: int = MAX_TOKENS) -> Request:
    return Request(rid, list(PROMPT), SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0))


def tokens(c: EngineCore, rid: str) -> list[int]:
    out: list[int] = []
    while c.has_unfinished():
        out += [t for o in c.step() if o.request_id == rid for t in o.new_token_ids]
    return out


class Pair:
    """A prefill engine and a decode engine joined by a LocalTransport; the decode engine has
    reserved pages for request "a" (`target`). `budget`: the prefill engine's chunk."""

    def __init__(self, tiny, budget: int = 64, make=None) -> None:
        self.make = make or request
        self.transport = LocalTransport()
        self.p, self.d = core(tiny, budget), core(tiny)
        self.sender = Sender(self.transport, self.p.runner.kv_cache, self.p.runner.attn.page_axis, 4, self.p.pool)
        self.receiver = Receiver(self.transport, self.d.runner.kv_cache, self.d.runner.attn.page_axis)
        req = self.make("a")
        self.d._validate(req)
        self.target = self.receiver.reserve(self.d, req)
        self.p.on_batch = [self._plan]

    def _plan(self, batch) -> None:
        self.p.runner.layer_hook = self.sender.after_layer if self.sender.plan(batch, self.p.scheduler.requests) else None

    def prefill(self, deadline: float = math.inf) -> p.Prefilled:
        """The prefill engine's part: the prompt in chunks, the layer hook sending as it goes."""
        assert self.sender.add("a", self.target, len(PROMPT), 0, deadline) is None
        self.p.add_request(self.make("a", max_tokens=1))
        while self.p.has_unfinished():
            for out in self.p.step():
                self.sender.output(out.request_id, out.new_token_ids, out.finished, out.error, out.num_cached_tokens)
        (_, answer), = self.sender.poll(0, 0)
        return answer

    def arrived(self, answer: p.Prefilled, checksum: int | None = None):
        msg = p.RemoteArrived("a", answer.first_token, answer.checksum if checksum is None else checksum)
        return self.receiver.arrived(self.d, msg, 0.0)


def alone(tiny, make=None) -> list[int]:
    c = core(tiny)
    c.add_request((make or request)("ref"))
    return tokens(c, "ref")


def test_a_prompt_streamed_layer_by_layer_in_chunks_decodes_with_one_engines_tokens(tiny):
    want = alone(tiny)
    pair = Pair(tiny, budget=16)  # 16-token chunks: the prompt takes three steps
    assert pair.target is not None and len(pair.target.pages) == 11
    answer = pair.prefill()
    # one batch a layer a step, and every page sent once: chunks end at 16 and 32 tokens (4 and 8
    # full pages), the last one sends the rest, the partial page included
    assert len(pair.transport.batches) == 3 * tiny.config.num_layers
    assert answer.ok and answer.first_token == want[0] and answer.checksum
    assert pair.p.pool.num_used == 0, "the pages it sent are unpinned once the writes settled"
    out = pair.arrived(answer)
    assert out is not None and out.new_token_ids == [want[0]]
    assert [want[0]] + tokens(pair.d, "a") == want
    assert pair.d.pool.num_used == 0


def test_a_checksum_that_does_not_match_makes_the_decode_engine_compute_the_prompt(tiny):
    want = alone(tiny)
    pair = Pair(tiny)
    answer = pair.prefill()
    assert pair.arrived(answer, checksum=answer.checksum ^ 1) is None
    assert pair.receiver.poll(pair.d, 100.0) == []  # past the time bytes may still be in flight: given up
    assert "a" not in pair.receiver.incoming
    assert tokens(pair.d, "a") == want  # its own first token too
    # the bytes that did not match may yet land: those pages wait out the sender's horizon
    assert pair.d.kv.num_remote_pending == pair.d.pool.num_used == len(pair.target.pages)


def seeded(rid: str, max_tokens: int = MAX_TOKENS) -> Request:
    return Request(rid, list(PROMPT), SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=1.0, seed=7))


def test_a_seeded_sample_continues_on_the_decode_engine_as_on_one_engine(tiny):
    want = alone(tiny, seeded)
    pair = Pair(tiny, make=seeded)
    answer = pair.prefill()
    pair.arrived(answer)
    assert [answer.first_token] + tokens(pair.d, "a") == want


def test_a_sender_past_its_deadline_writes_nothing_more(tiny):
    pair = Pair(tiny, budget=16)
    answer = pair.prefill(deadline=0.0)  # long past
    assert not pair.transport.batches and not answer.ok and "deadline" in answer.error
    assert pair.p.pool.num_used == 0


def test_an_order_id_already_being_sent_is_refused(tiny):
    pair = Pair(tiny)
    assert pair.sender.add("a", pair.target, len(PROMPT), 0) is None
    assert "already" in pair.sender.add("a", pair.target, len(PROMPT), 0)


def test_a_failed_write_is_answered_as_failed_and_frees_the_senders_pins(tiny):
    pair = Pair(tiny)
    pair.transport.fail = True
    answer = pair.prefill()
    assert not answer.ok and answer.first_token is None and "failed" in answer.error
    assert len(pair.transport.batches) == 1, "after a failed write it sends no more"
    assert pair.p.pool.num_used == 0


def test_a_target_of_another_shape_is_refused(tiny):
    transport = LocalTransport()
    p_core = core(tiny)
    sender = Sender(transport, p_core.runner.kv_cache, p_core.runner.attn.page_axis, 4, p_core.pool)
    shape = list(p_core.runner.kv_cache.shape[1:])
    shape[-1] *= 2
    bad = p.KVTarget("local", [0] * tiny.config.num_layers, shape, 4, p_core.runner.attn.page_axis, list(range(11)))
    assert "shape" in sender.add("a", bad, len(PROMPT), 0)
    short = p.KVTarget("local", [0] * tiny.config.num_layers, list(p_core.runner.kv_cache.shape[1:]), 4,
                       p_core.runner.attn.page_axis, list(range(3)))
    assert "pages" in sender.add("b", short, len(PROMPT), 0)
    assert not sender.out
