"""`tokenflowd` command line. `tokenflowd generate "prompt"` streams a completion to the terminal."""
from __future__ import annotations

import argparse
import logging
import sys
import time

from tokenflowd.config import EngineConfig
from tokenflowd.engine.loader import ModelLoadError
from tokenflowd.engine.request import InvalidRequestError, SamplingParams


def _engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default="smollm2-135m",
                   help="smollm2-135m (embedded), a .gguf file, a Hugging Face directory, or dummy:<preset>")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--kv-cache-memory", default=None,
                   help="KV cache size, e.g. 512MiB or 4GiB (default: 1GiB on CPU, a fraction of free GPU memory)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of one step")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "flashinfer"])
    g.add_argument("--no-cuda-graphs", action="store_true")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--threads", type=int, default=None, help="CPU threads for torch")


def engine_config(a: argparse.Namespace) -> EngineConfig:
    kw = dict(
        model=a.model, device=a.device, dtype=a.dtype, kv_cache_memory=a.kv_cache_memory,
        gpu_memory_utilization=a.gpu_memory_utilization, page_size=a.page_size,
        max_num_seqs=a.max_num_seqs, max_model_len=a.max_model_len, attention_backend=a.attention_backend,
        enable_prefix_caching=not a.no_prefix_caching, num_threads=a.threads,
        cuda_graphs=False if a.no_cuda_graphs else None,
    )
    if a.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = a.max_num_batched_tokens
    return EngineConfig.resolve(**kw)


def cmd_generate(a: argparse.Namespace) -> int:
    from tokenflowd.engine.engine import Engine

    params = SamplingParams(
        max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
        seed=a.seed, stop=tuple(a.stop or ()), ignore_eos=a.ignore_eos,
    )
    engine = Engine(engine_config(a))
    if a.raw:
        kw = {"prompt": a.prompt}
    else:
        msgs = ([{"role": "system", "content": a.system}] if a.system else []) + [{"role": "user", "content": a.prompt}]
        kw = {"messages": msgs}
    t0 = time.perf_counter()
    first = None
    n = 0
    for out in engine.stream("cli", sampling_params=params, **kw):
        if first is None and out.token_ids:
            first = time.perf_counter() - t0
        n = out.num_output_tokens
        sys.stdout.write(out.text)
        sys.stdout.flush()
    total = time.perf_counter() - t0
    sys.stdout.write("\n")
    if a.stats:
        print(f"[{n} tokens, TTFT {first or 0:.3f} s, {n / total:.1f} tokens/s]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenflowd", description=__doc__)
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="stream a completion of one prompt to the terminal")
    g.add_argument("prompt")
    g.add_argument("--raw", action="store_true", help="complete the text as is, without the chat template")
    g.add_argument("--system", default=None, help="a system message for the chat template")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="a stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--stats", action="store_true", help="print tokens, TTFT and speed to stderr")
    _engine_args(g)
    g.set_defaults(func=cmd_generate)
    a = parser.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return a.func(a)
    except (ModelLoadError, InvalidRequestError, ValueError) as e:
        print(f"tokenflowd: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
