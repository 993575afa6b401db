"""What the OpenAI features cost a decode step, on the embedded model in this process (CPU).

Two figures, each a ratio within one run:
- decode tokens/s of requests constrained by a JSON schema against the same requests free, at
  batch 1 and 16 (the schema's mask is computed on a thread while the forward runs);
- decode tokens/s of plain greedy requests at this checkout against another revision (--against),
  run in turn four times each in subprocesses (each side first half the time): a request that asks for none of the features
  must cost what it cost before them.

    python bench/features_cost.py [--against REV] [--plain-batches 1,16] [--no-schema] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = {"type": "object", "properties": {
    "items": {"type": "array", "items": {"type": "object", "properties": {
        "name": {"type": "string"}, "note": {"type": "string"}}, "required": ["name", "note"]}}},
    "required": ["items"]}  # unbounded: a constrained reply runs to max_tokens like a free one


def decode_rate(batch: int, grammar: bool, steps: int = 96) -> float:
    """Decode tokens/s of `batch` greedy requests (prompt computed first, not counted)."""
    import torch

    from tokenflowd.config import EngineConfig
    from tokenflowd.engine.core import EngineCore
    from tokenflowd.engine.request import Request, SamplingParams

    torch.manual_seed(0)
    core = EngineCore.from_config(EngineConfig.resolve(device="cpu", kv_cache_memory="256MiB"))
    extra = {}
    if grammar:
        from tokenflowd.text.structured import json_grammar
        extra["grammar"] = json_grammar(SCHEMA)
    prompt = core.tokenizer.encode_chat([{"role": "user", "content": "List some fruits as JSON."}])
    for i in range(batch):
        core.add_request(Request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=steps + 1,
                                                                 ignore_eos=True, **extra)))
    produced, t0 = 0, None
    while core.has_unfinished():
        outs = core.step()
        if t0 is None:
            if outs and all(o.new_token_ids for o in outs) and len(outs) == batch:
                t0 = time.perf_counter()  # every prompt computed: decoding from here
            continue
        produced += sum(len(o.new_token_ids) for o in outs)
    seconds = time.perf_counter() - t0
    core.close()
    return produced / seconds


def _at(rev_dir: Path, batch: int) -> float:
    code = (f"import sys; sys.path.insert(0, {str(rev_dir)!r}); sys.path.insert(1, {str(ROOT / 'bench')!r});"
            f"from features_cost import decode_rate; print(decode_rate({batch}, False))")
    env = {**os.environ, "PYTHONPATH": str(rev_dir)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, cwd=rev_dir)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", help="a revision whose plain greedy decode this checkout's is compared with")
    ap.add_argument("--plain-batches", default="1,16", help="batch sizes of the plain greedy comparison")
    ap.add_argument("--no-schema", action="store_true", help="only the comparison with --against")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    result: dict = {"cpu": next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                                 if line.startswith("model name")), "?"), "schema": SCHEMA}
    decode_rate(1, False)  # a first engine in a process pays one-time costs: not one side's
    for batch in () if args.no_schema else (1, 16):
        runs = [(decode_rate(batch, False), decode_rate(batch, True)) for _ in range(2)]  # in turn
        free, constrained = max(r[0] for r in runs), max(r[1] for r in runs)
        result[f"batch_{batch}"] = {"free_tokens_per_s": round(free, 1), "json_schema_tokens_per_s": round(constrained, 1),
                                    "ratio": round(constrained / free, 3)}
        print(f"batch {batch}: free {free:.1f} tok/s, json_schema {constrained:.1f} tok/s, ratio {constrained / free:.3f}")
    if args.against:
        with tempfile.TemporaryDirectory() as tmp:
            other = Path(tmp) / "rev"
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(other), args.against],
                           check=True, capture_output=True)
            try:
                for batch in (int(b) for b in args.plain_batches.split(",")):
                    here, there = [], []
                    for k in range(4):  # in turn, each first half the time: load or order is not one side's
                        pair = [(here, ROOT), (there, other)]
                        for into, where in (pair if k % 2 == 0 else pair[::-1]):
                            into.append(_at(where, batch))
                    ratio = statistics.median(here) / statistics.median(there)
                    result[f"plain_batch_{batch}_vs_{args.against}"] = {
                        "here_tokens_per_s": [round(x, 1) for x in here], "there_tokens_per_s": [round(x, 1) for x in there],
                        "ratio_of_medians": round(ratio, 3)}
                    print(f"plain greedy, batch {batch}: here {statistics.median(here):.1f} tok/s, "
                          f"{args.against} {statistics.median(there):.1f} tok/s, ratio {ratio:.3f}")
            finally:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(other)], check=False)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
