"""Layer-wise prefill between two engines in one process (federation/streaming.py), over a transport
that copies bytes in place of the network: the prefill engine's Sender writes each layer's finished
pages as the layer ends, chunk by chunk, and the decode engine's Receiver checks them and decodes
with one engine's greedy tokens. Pages the sender read are pinned until its writes settle, and a
failed write makes the decode engine compute the prompt itself."""
from __future__ import annotations

import ctypes
from typing import Sequence

import pytest
import torch

from tokenflowd import protocol as p
from tokenflowd.config import EngineConfig
from tokenflowd.engine.core import EngineCore
from tokenflowd.engine.request import Request, SamplingParams
from tokenflowd.federation.streaming import Receiver, Sender
from tokenflowd.federation.transport import DONE, FAILED, Block, KVTransport, Region, Transfer

PROMPT = list(range(5, 47))  # 42 tokens: 10 full pages of 4 and a partial one
MAX_TOKENS = 10


class LocalTransport(KVTransport):
    """Writes are memmoves within this process; `fail` makes every later write fail."""

    def __init__(self) -> None:
        super().__init__()
        self.fail = False
        self.batches: list[int] = []  # blocks per batch, in submission order

    @property
    def endpoint(self) -> str:
        return "local"

    def register(self, tensor: torch.Tensor) -> Region:
        return Region(tensor.data_ptr(), tensor.numel() * tensor.element_size())

    def unregister(self, region: Region) -> None:
        pass

    def submit_write(self, peer: str, blocks: Sequence[Block]) -> Transfer:
        t = Transfer(peer, sum(b.nbytes for b in blocks), 0.0)
        self.batches.append(len(blocks))
        if self.fail:
            t.state = FAILED
            return t
        for b in blocks:
            ctypes.memmove(b.dst, b.src, b.nbytes)
        t.state = DONE
        return t

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def tiny(hf_dirs):
    from tokenflowd.engine.loader import load_model_source

    return load_model_source(str(hf_dirs["llama"]), torch.float32, "cpu")


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


def prefill_for(p_core: EngineCore, sender: Sender, target: p.KVTarget, rid: str = "a") -> p.Prefilled:
    """The prefill engine's part: the prompt in chunks, the layer hook sending as it goes."""
    def plan(batch) -> None:
        p_core.runner.layer_hook = sender.after_layer if sender.plan(batch, p_core.scheduler.requests) else None

    p_core.on_batch = plan
    assert sender.add(rid, target, len(PROMPT), 0) is None
    p_core.add_request(request(rid, max_tokens=1))
    while p_core.has_unfinished():
        for out in p_core.step():
            sender.output(out.request_id, out.new_token_ids, out.finished, out.error, out.num_cached_tokens)
    (_, answer), = sender.poll(0, 0)
    return answer


def test_a_prompt_streamed_layer_by_layer_in_chunks_decodes_with_one_engines_tokens(tiny):
    alone = core(tiny)
    alone.add_request(request("ref"))
    want = tokens(alone, "ref")
    transport = LocalTransport()
    p_core, d_core = core(tiny, budget=16), core(tiny)  # 16-token chunks: the prompt takes three steps
    sender = Sender(transport, p_core.runner.kv_cache, p_core.runner.attn.page_axis, 4, p_core.pool)
    receiver = Receiver(transport, d_core.runner.kv_cache, d_core.runner.attn.page_axis)
    req = request("a")
    d_core._validate(req)
    target = receiver.reserve(d_core, req)
    assert target is not None and len(target.pages) == 11
    answer = prefill_for(p_core, sender, target)
    layers = tiny.config.num_layers
    # one batch a layer a step, and every page sent once: chunks end at 16 and 32 tokens (4 and 8
    # full pages), the last one sends the rest, the partial page included
    assert len(transport.batches) == 3 * layers
    assert answer.ok and answer.first_token == want[0] and answer.checksum
    assert p_core.pool.num_used == 0, "the pages it sent are unpinned once the writes settled"
    out = receiver.arrived(d_core, p.RemoteArrived("a", answer.first_token, answer.checksum), 0.0)
    assert out is not None and out.new_token_ids == [want[0]]
    assert [want[0]] + tokens(d_core, "a") == want
    assert d_core.pool.num_used == 0


def test_a_checksum_that_does_not_match_makes_the_decode_engine_compute_the_prompt(tiny):
    alone = core(tiny)
    alone.add_request(request("ref"))
    want = tokens(alone, "ref")
    transport = LocalTransport()
    p_core, d_core = core(tiny), core(tiny)
    sender = Sender(transport, p_core.runner.kv_cache, p_core.runner.attn.page_axis, 4, p_core.pool)
    receiver = Receiver(transport, d_core.runner.kv_cache, d_core.runner.attn.page_axis)
    req = request("a")
    d_core._validate(req)
    target = receiver.reserve(d_core, req)
    answer = prefill_for(p_core, sender, target)
    assert receiver.arrived(d_core, p.RemoteArrived("a", answer.first_token, answer.checksum ^ 1), 0.0) is None
    assert receiver.poll(d_core, 100.0) == []  # past the time bytes may still be in flight: given up
    assert "a" not in receiver.incoming
    assert tokens(d_core, "a") == want  # its own first token too
    # the bytes that did not match may yet land: those pages wait out the sender's horizon
    assert d_core.kv.num_remote_pending == d_core.pool.num_used == len(target.pages)


def test_a_seeded_sample_continues_on_the_decode_engine_as_on_one_engine(tiny):
    def seeded(rid: str, max_tokens: int = MAX_TOKENS) -> Request:
        return Request(rid, list(PROMPT), SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=1.0,
                                                         seed=7))
    alone = core(tiny)
    alone.add_request(seeded("ref"))
    want = tokens(alone, "ref")
    transport = LocalTransport()
    p_core, d_core = core(tiny), core(tiny)
    sender = Sender(transport, p_core.runner.kv_cache, p_core.runner.attn.page_axis, 4, p_core.pool)
    receiver = Receiver(transport, d_core.runner.kv_cache, d_core.runner.attn.page_axis)
    req = seeded("a")
    d_core._validate(req)
    target = receiver.reserve(d_core, req)

    def plan(batch) -> None:
        p_core.runner.layer_hook = sender.after_layer if sender.plan(batch, p_core.scheduler.requests) else None

    p_core.on_batch = plan
    sender.add("a", target, len(PROMPT), 0)
    p_core.add_request(seeded("a", max_tokens=1))
    while p_core.has_unfinished():
        for out in p_core.step():
            sender.output(out.request_id, out.new_token_ids, out.finished, out.error, out.num_cached_tokens)
    (_, answer), = sender.poll(0, 0)
    receiver.arrived(d_core, p.RemoteArrived("a", answer.first_token, answer.checksum), 0.0)
    assert [answer.first_token] + tokens(d_core, "a") == want


def test_a_sender_past_its_deadline_writes_nothing_more(tiny):
    transport = LocalTransport()
    p_core, d_core = core(tiny, budget=16), core(tiny)
    sender = Sender(transport, p_core.runner.kv_cache, p_core.runner.attn.page_axis, 4, p_core.pool)
    receiver = Receiver(transport, d_core.runner.kv_cache, d_core.runner.attn.page_axis)
    req = request("a")
    d_core._validate(req)
    target = receiver.reserve(d_core, req)
    p_core.on_batch = lambda batch: setattr(p_core.runner, "layer_hook",
                                            sender.after_layer if sender.plan(batch, p_core.scheduler.requests) else None)
    assert sender.add("a", target, len(PROMPT), 0, deadline=0.0) is None  # long past
    assert "already" in sender.add("a", target, len(PROMPT), 0)
    p_core.add_request(request("a", max_tokens=1))
    while p_core.has_unfinished():
        for out in p_core.step():
            sender.output(out.request_id, out.new_token_ids, out.finished, out.error, out.num_cached_tokens)
    (_, answer), = sender.poll(0, 0)
    assert not transport.batches and not answer.ok and "deadline" in answer.error
    assert p_core.pool.num_used == 0


def test_a_failed_write_is_answered_as_failed_and_frees_the_senders_pins(tiny):
    transport = LocalTransport()
    transport.fail = True
    p_core, d_core = core(tiny), core(tiny)
    sender = Sender(transport, p_core.runner.kv_cache, p_core.runner.attn.page_axis, 4, p_core.pool)
    receiver = Receiver(transport, d_core.runner.kv_cache, d_core.runner.attn.page_axis)
    req = request("a")
    d_core._validate(req)
    answer = prefill_for(p_core, sender, receiver.reserve(d_core, req))
    assert not answer.ok and answer.first_token is None and "failed" in answer.error
    assert len(transport.batches) == 1, "after a failed write it sends no more"
    assert p_core.pool.num_used == 0


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
