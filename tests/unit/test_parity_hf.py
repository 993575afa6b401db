"""Logits through our paged engine agree with Hugging Face transformers: prefill and 32 greedy
decode steps, a batch of sequences of different lengths, chunked-prefill boundaries and prefix hits."""
from __future__ import annotations

import pytest
import torch

from tokenflowd.config import EngineConfig
from tokenflowd.engine.core import EngineCore
from tokenflowd.engine.request import Request, SamplingParams

NUM_DECODE = 32


class RecordingCore(EngineCore):
    """EngineCore whose runner also hands back each sampled row's logits, by request id."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.logits: dict[str, list[torch.Tensor]] = {}
        self.chunked: set[str] = set()
        inner = self.runner.compute_logits

        def compute_logits(batch, *args):
            logits, sampling = inner(batch, *args)
            for row, i in enumerate(sampling):
                self.logits.setdefault(batch.request_ids[i], []).append(logits[row].clone())
            for rid, row in zip(batch.request_ids, batch.sampling):
                if row is None:  # a chunk that ends mid-prompt
                    self.chunked.add(rid)
            return logits, sampling

        self.runner.compute_logits = compute_logits


def run_all(core: RecordingCore, reqs: list[Request]) -> None:
    for r in reqs:
        core.add_request(r)
    while core.has_unfinished():
        core.step()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_logits_match_transformers(hf_dirs, arch):
    import transformers

    path = hf_dirs[arch]
    cfg = EngineConfig.resolve(
        model=str(path), device="cpu", dtype="float32", page_size=8, max_num_batched_tokens=48,
        kv_cache_memory="64MiB",
    )
    core = RecordingCore.from_config(cfg)
    g = torch.Generator().manual_seed(1)
    vocab = core.model_config.vocab_size
    lengths = [5, 17, 40, 90, 33, 64, 8]
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_DECODE, ignore_eos=True)
    first = [Request(f"r{i}", p, greedy) for i, p in enumerate(prompts)]
    run_all(core, first)
    # Second wave: continuations of finished requests (multi-turn) and a shared long prefix,
    # so admission hits the prefix cache with decode-phase pages too.
    second_prompts = [
        first[3].token_ids + prompts[0],
        prompts[5][:48] + prompts[1],
        first[2].token_ids[:-5],
    ]
    second = [Request(f"s{i}", p, greedy) for i, p in enumerate(second_prompts)]
    run_all(core, second)

    assert all(r.num_cached_tokens > 0 for r in second), [r.num_cached_tokens for r in second]
    assert {"r3", "r5"} <= core.chunked  # 90 and 64 tokens with a 48-token budget

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32, attn_implementation="eager")
    hf.eval()
    for req in first + second:
        assert len(req.output_token_ids) == NUM_DECODE
        seq = torch.tensor([req.token_ids[:-1]])
        with torch.no_grad():
            ref = hf(seq).logits[0, req.num_prompt_tokens - 1 :]  # [NUM_DECODE, vocab]
        ours = torch.stack(core.logits[req.request_id])
        assert ours.shape == ref.shape
        err = (ours - ref).abs().max().item()
        assert err < 2e-4 * max(1.0, ref.abs().max().item()), f"{req.request_id}: max |diff| {err}"
        # and the greedy tokens are HF's argmax
        assert req.output_token_ids == ref.argmax(-1).tolist()
    core.wait_copies()
    assert core.pool.num_used == 0


@pytest.mark.parametrize("preset", ["smollm2-135m", "llama3-8b"])
def test_rope_tables_are_the_angles_cos_and_sin_rounded_once(preset):
    """The model's RoPE tables hold, for each position and frequency, the fp32 angle's cos and sin
    correctly rounded to fp32, checked here against Python's math on every 7th entry: no vector
    library's accuracy mode reaches them (llama.rope_tables' NOTE). torch's own CPU cos differs
    from that in about 5% of the entries, so a table built by torch fails here."""
    import math

    import numpy as np

    from tokenflowd.engine.model.dummy import DUMMY_PRESETS
    from tokenflowd.engine.model.llama import LlamaModel, rope_inv_freq

    cfg = DUMMY_PRESETS[preset]  # the embedded model's shapes; Llama 3's, with its frequency scaling
    model = LlamaModel(cfg, 8192, torch.float32, torch.device("cpu"))
    angles = torch.outer(torch.arange(8192, dtype=torch.float32), rope_inv_freq(cfg)).flatten().tolist()
    cos, sin = model.rope_cos.flatten().tolist(), model.rope_sin.flatten().tolist()
    wrong = [i for i in range(0, len(angles), 7)
             if (cos[i], sin[i]) != (float(np.float32(math.cos(angles[i]))), float(np.float32(math.sin(angles[i]))))]
    assert not wrong, f"{len(wrong)} entries off, the first at {wrong[0]}"
