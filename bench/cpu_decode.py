"""CPU decode throughput on the embedded model: tokenflowd with its weights in int4 (the default on
a CPU for this Q4_1 file) and dequantized, vs Hugging Face transformers `generate` on the dequantized
weights, in one run. Also the TTFT of a 128-token prompt on an idle engine.

    python bench/cpu_decode.py [--batches 1,16,32] [--out bench/results/cpu_decode.json]

Decode tokens/s = batch * (new_tokens - 1) / (time to the last token - time to the first token):
prefill is left out on both sides (for transformers: generate(64) minus generate(1)).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from tokenflowd.config import EngineConfig
from tokenflowd.engine.offline import Engine
from tokenflowd.engine.model.loader import load_model_source
from tokenflowd.engine.request import SamplingParams

TEXT = (
    "The history of computing is a story of abstractions built on abstractions. Early machines were "
    "programmed by rewiring; stored programs made software a thing of its own; compilers let people "
    "write for problems rather than for circuits. Each layer hid the one below and let more people build. "
)


def prompts(tokenizer, batch: int, length: int) -> list[list[int]]:
    ids = tokenizer.encode(TEXT * 20)
    return [ids[i * 7 : i * 7 + length] for i in range(batch)]  # distinct prompts, same length


def ours(dtype: str, batch: int, prompt_len: int, new: int, quantization: str = "none") -> float:
    loaded = load_model_source("smollm2-135m", getattr(torch, dtype), "cpu", quantization)
    eng = Engine(EngineConfig.resolve(device="cpu", dtype=dtype, enable_prefix_caching=False, quantization=quantization,
                                      max_num_batched_tokens=max(512, prompt_len)), loaded)
    return decode_rate(eng, batch, prompt_len, new)


def decode_rate(eng: Engine, batch: int, prompt_len: int, new: int) -> float:
    """Decode tokens/s of `batch` distinct prompts on `eng`, from the last request's first token on."""
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    for i, p in enumerate(prompts(eng.tokenizer, batch, prompt_len)):
        eng.add_request(f"r{i}", p, params)
    seen, t_first = set(), None
    while eng.has_unfinished():
        for out in eng.step():
            seen.add(out.request_id)
        if t_first is None and len(seen) == batch:
            t_first = time.perf_counter()
    return batch * (new - 1) / (time.perf_counter() - t_first)


def hf(dtype: str, batch: int, prompt_len: int, new: int) -> float:
    import transformers

    loaded = load_model_source("smollm2-135m", getattr(torch, dtype), "cpu")
    c = loaded.config
    cfg = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        tie_word_embeddings=c.tie_word_embeddings,
    )
    model = transformers.LlamaForCausalLM(cfg).to(getattr(torch, dtype)).eval()
    model.load_state_dict(loaded.weights, strict=False)
    model.tie_weights()
    ids = torch.tensor(prompts(loaded.tokenizer, batch, prompt_len))
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, eos_token_id=None)

    def timed(n: int) -> float:
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        assert out.shape[1] == prompt_len + n
        return time.perf_counter() - t

    timed(2)  # warm-up
    return batch * (new - 1) / (timed(new) - timed(1))


def ttft(dtype: str, prompt_len: int, repeats: int = 5, quantization: str = "none") -> float:
    loaded = load_model_source("smollm2-135m", getattr(torch, dtype), "cpu", quantization)
    eng = Engine(EngineConfig.resolve(device="cpu", dtype=dtype, enable_prefix_caching=False,
                                      quantization=quantization), loaded)
    ps = prompts(eng.tokenizer, repeats + 1, prompt_len)
    eng.generate({"warm": dict(prompt=ps[-1], sampling_params=SamplingParams(max_tokens=1))})
    times = []
    for i in range(repeats):
        t = time.perf_counter()
        eng.add_request(f"t{i}", ps[i], SamplingParams(temperature=0, max_tokens=1))
        while not eng.step():
            pass
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,16,32")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", default="bench/results/cpu_decode.json")
    a = ap.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    fast = EngineConfig.resolve(device="cpu").dtype
    rows = []
    for b in batches:
        row = {"batch": b}
        row["tokenflowd_int4"] = ours(fast, b, a.prompt_len, a.new_tokens, "int4")
        row[f"tokenflowd_{fast}"] = ours(fast, b, a.prompt_len, a.new_tokens)
        if fast != "float32":
            row["tokenflowd_float32"] = ours("float32", b, a.prompt_len, a.new_tokens)
        row["transformers_float32"] = hf("float32", b, a.prompt_len, a.new_tokens)
        if fast != "float32":
            row[f"transformers_{fast}"] = hf(fast, b, a.prompt_len, a.new_tokens)
        row["ratio_int4_vs_transformers_fp32"] = row["tokenflowd_int4"] / row["transformers_float32"]
        row["ratio_int4_vs_dequantized"] = row["tokenflowd_int4"] / row[f"tokenflowd_{fast}"]
        row["ratio_default_vs_transformers_fp32"] = row[f"tokenflowd_{fast}"] / row["transformers_float32"]
        row["ratio_same_dtype"] = row[f"tokenflowd_{fast}"] / row[f"transformers_{fast}"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {
        "machine": {"cpu_threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version()},
        "default_cpu_dtype": fast,
        "prompt_len": a.prompt_len,
        "new_tokens": a.new_tokens,
        "decode_tokens_per_s": rows,
        "ttft_s": {"int4": ttft(fast, a.prompt_len, quantization="int4"), fast: ttft(fast, a.prompt_len),
                   "float32": ttft("float32", a.prompt_len)},
    }
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)
    print("\ndecode tokens/s (prompt %d, %d new tokens)" % (a.prompt_len, a.new_tokens))
    cols = [k for k in rows[0] if k != "batch"]
    print("batch  " + "  ".join(f"{c:>26}" for c in cols))
    for r in rows:
        print(f"{r['batch']:>5}  " + "  ".join(f"{r[c]:>26.2f}" for c in cols))
    print("TTFT of a %d-token prompt, idle engine: %s" % (a.prompt_len, {k: f"{v * 1e3:.0f} ms" for k, v in result["ttft_s"].items()}))


if __name__ == "__main__":
    main()
