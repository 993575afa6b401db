"""Check tokenflowd on a GPU host in one command, offline, within a time budget.

    python bench/gpu_check.py --kit dist/gpu-kit-py312.tar.xz --out gpu-results [--budget 480]

Unpacks the kit (bench/gpu_kit.py: flashinfer and the wheels the host lacks) under .gpukit/, then
runs, each step bounded by what is left of the budget and skipped when too little is:

    tests       pytest tests/gpu: flashinfer against torch, graphs against eager, preempt and
                reload in flashinfer's layout, the start-up check's step downs, the KV budget
    decode      bench/gpu_decode.py: decode step time and the memory roofline, batches 1, 32, 128,
                with the host KV tier's write-through and without it, overlap scheduling on and off
    offload     bench/offload_bandwidth.py: the copier's lanes against a pinned contiguous copy
    pool        bench/pool_query.py --device cuda: two engines' processes on this GPU, per layer, a
                segment the other holds read over CUDA IPC, queried with device buffers, and queried
                through host staging, against attending to it locally (greedy equality of pooled
                engines is the tests step's)
    compare     two daemons (fcfs, tokenflow; overlap on, the GPU default) on dummy:llama3-8b and one burst of reading
                clients through `loadgen compare` (the first burst of ../shared/data/h200/README.md)
    calibrate   `tokenflowd calibrate`: the cost model the simulator would use on this GPU

It writes at most 8 files to --out and prints one summary table last. A step's output goes to
its own log file only when it fails (the table names it).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from daemon_proc import free_port, wait_healthy

ROOT = Path(__file__).resolve().parent.parent
KIT_DIR = ROOT / ".gpukit"


class Budget:
    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    @property
    def left(self) -> float:
        return self.deadline - time.monotonic()


def unpack(kit: Path) -> Path:
    """The kit's site folder, unpacked once (a second run reuses it)."""
    site = KIT_DIR / "site"
    stamp = KIT_DIR / "kit.json"
    if not (stamp.exists() and site.is_dir()):
        shutil.rmtree(KIT_DIR, ignore_errors=True)
        KIT_DIR.mkdir(parents=True)
        with tarfile.open(kit) as tar:
            tar.extractall(KIT_DIR, filter="data")
    return site


def environment(site: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(site), env.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join([str(site / "bin"), env.get("PATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_step(name: str, cmd: list[str], env: dict, out: Path, timeout: float, keep_log: bool = False) -> dict:
    t0 = time.monotonic()
    log_path = out / f"{name}.log"
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    seconds = time.monotonic() - t0
    tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or [""]
    if rc == 0 and not keep_log:
        log_path.unlink()
    return {"step": name, "rc": rc, "seconds": round(seconds, 1), "last_line": tail[0][:160],
            "log": log_path.name if log_path.exists() else ""}


def compare(env: dict, out: Path, budget: Budget) -> dict:
    """Two daemons on one GPU, then one burst against both (A: fcfs, B: tokenflow)."""
    t0 = time.monotonic()
    daemons, ports = [], []
    log = open(out / "compare.log", "w")
    try:
        for policy in ("fcfs", "tokenflow"):
            port = free_port()
            ports.append(port)
            daemons.append(subprocess.Popen(
                [sys.executable, "-m", "tokenflowd.cli", "serve", "--model", "dummy:llama3-8b", "--device", "cuda",
                 "--port", str(port), "--policy", policy, "--kv-cache-memory", "4GiB", "--host-kv-memory", "16GiB",
                 "--gpu-memory-utilization", "0.45"],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        for port, daemon in zip(ports, daemons):
            wait_healthy(port, daemon, budget.left - 60)  # what is left for the burst itself
        cmd = [sys.executable, "-m", "loadgen", "compare", "--base-url", f"http://127.0.0.1:{ports[0]}",
               "--base-url-b", f"http://127.0.0.1:{ports[1]}", "--label-a", "fcfs", "--label-b", "tokenflow",
               "--vocab-size", "49152", "--num-prompts", "96", "--request-rate", "inf", "--lengths", "fixed:512:512",
               "--reading-rate", "15:0.5,25:0.5", "--seed", "1", "--quiet", "--out", str(out / "compare.json")]
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            timeout=max(1.0, budget.left - 10)).returncode
    except (TimeoutError, subprocess.TimeoutExpired) as e:
        rc = f"timeout ({e})"
    finally:
        for d in daemons:
            with _suppress():
                os.killpg(d.pid, signal.SIGTERM)
        for d in daemons:
            with _suppress():
                d.wait(20)
        log.close()
    row = {"step": "compare", "rc": rc, "seconds": round(time.monotonic() - t0, 1), "log": "compare.log"}
    if rc == 0:
        (out / "compare.log").unlink()
        row["log"] = ""
        row["last_line"] = _compare_line(out / "compare.json")
    return row


class _suppress:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return True


def _compare_line(path: Path) -> str:
    try:
        r = json.loads(path.read_text())["ratios"]
        keys = ("effective_throughput", "throughput", "ttft_p99", "rebuffer_total")
        return "tokenflow/fcfs: " + ", ".join(f"{k} {r[k]:.2f}x" for k in keys if isinstance(r.get(k), (int, float)))
    except (OSError, KeyError, ValueError, AttributeError):
        return "(no ratios in compare.json)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kit", required=True, help="the archive from bench/gpu_kit.py")
    ap.add_argument("--out", required=True, help="a directory for at most 8 result files")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for everything (default 480)")
    ap.add_argument("--skip", default="", help="steps to leave out, comma-separated")
    a = ap.parse_args()
    budget = Budget(a.budget)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, a.skip.split(",")))
    site = unpack(Path(a.kit))
    env = environment(site)
    py = sys.executable
    steps = [  # name, command, seconds it needs at least, at most
        ("tests", [py, "-m", "pytest", "tests/gpu", "-v", "-rs", "-p", "no:cacheprovider",
                   f"--junitxml={out / 'gpu_tests.xml'}"], 120, 300),
        ("decode", [py, "bench/gpu_decode.py", "--batches", "1,32,128", "--context", "1024", "--new-tokens", "32",
                    "--offload", "write-through,none", "--overlap", "on,off", "--out", str(out / "gpu_decode.json")],
         60, 260),
        ("offload", [py, "bench/offload_bandwidth.py", "--out", str(out / "offload_bandwidth.json")], 20, 60),
        # after the tests: their JIT build of flashinfer's bf16 head_dim-64 kernels serves it too (cold,
        # the build alone takes about 100 s, hence the most)
        ("pool", [py, "bench/pool_query.py", "--device", "cuda", "--repeats", "50",
                  "--out", str(out / "pool_query_gpu.json")], 30, 150),
    ]
    rows = []
    probe = subprocess.run([py, "-c", "import torch, flashinfer; print(torch.__version__, torch.version.cuda, "
                            "torch.cuda.get_device_name(), flashinfer.__version__)"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    device = probe.stdout.strip() or probe.stderr.strip().splitlines()[-1:]
    for name, cmd, least, most in steps:
        if name in skip or budget.left < least:
            rows.append({"step": name, "rc": "skipped", "seconds": 0})
            continue
        rows.append(run_step(name, cmd, env, out, min(most, budget.left - 5), keep_log=name == "tests"))
    if "compare" not in skip and budget.left >= 200:
        rows.append(compare(env, out, budget))
    else:
        rows.append({"step": "compare", "rc": "skipped", "seconds": 0})
    if "calibrate" not in skip and budget.left >= 60:
        rows.append(run_step("calibrate", [py, "-m", "tokenflowd.cli", "calibrate", "--model", "dummy:llama3-8b",
                                           "--device", "cuda", "--batch-sizes", "1,16,64", "--context-lens", "256,2048",
                                           "--decode-steps", "8", "--out", str(out / "calibrated.json")],
                             env, out, budget.left - 5))
    else:
        rows.append({"step": "calibrate", "rc": "skipped", "seconds": 0})
    summary = {"device": device, "budget_s": a.budget, "steps": rows}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"\n{device}")
    print(f"{'step':<10} {'result':<10} {'s':>6}  detail")
    for r in rows:
        result = "ok" if r["rc"] == 0 else str(r["rc"])
        detail = r.get("last_line", "") + (f"  [{r['log']}]" if r.get("log") else "")
        print(f"{r['step']:<10} {result:<10} {r['seconds']:>6}  {detail}")
    return 0 if all(r["rc"] in (0, "skipped") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
