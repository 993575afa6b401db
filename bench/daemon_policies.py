"""fcfs against tokenflow on the real daemon (CPU, the embedded model), through
`tokenflowd-loadgen compare`, with reading rates and arrival rates scaled to this machine's speed.

    .venv/bin/python bench/daemon_policies.py [--out bench/results/daemon_policies.json]

Every daemon is `tokenflowd serve --max-num-seqs 8` (write-through offload, the default), started
on a free port and stopped with SIGTERM at the end, also on error. Steps:

    measure     on each daemon of a pair: a warm-up burst, then 8 streams (the slots) of fixed
                64-token prompts and 96-token outputs read at 100 tokens/s; C = tokens/s of the
                whole batch while all 8 decode, g = C / 8 (a request's rate in a full batch),
                T = 128 / g (s a full batch takes to stream a 128-token reply)
    burst       one burst of 24 readers (3× the slots), prompts ~N(64, 16), outputs ~N(128, 32),
                40% reading at 0.35·g and 60% at 0.5·g, seed 0: A = fcfs, B = tokenflow
    load60      bursts of 8 every P s, P such that 8 · mean output / P = 0.6 · C: A = fcfs, B = tokenflow
    load120     the same at 1.2 · C: A = fcfs, B = tokenflow
    load120-bound
                the load120 workload against a fresh pair: A = tokenflow, B = tokenflow with
                --max-queue-delay S, S = T / 2 (rounded to 0.5 s): a request whose predicted
                TTFT is beyond half a full batch's reply time is refused with a 429

With --overlap-ab the pairs are tokenflow with serial steps (A) against tokenflow with overlap
scheduling (B), in burst, load120 and load120-bound (both sides bounded there): the policy's
buffer figures and the shedding it predicts, with tokens a step late against without.

The two daemons of a compare have served the same requests before it (the loadgen's prompts
share token ids across seeds and runs, so the prefix cache sees the same history on both sides).
A refused request is an `error` in the loadgen's summary (a non-200 answer); the table splits out
the 429s, and each daemon's /metrics counters (preemptions, shed, rejected) are read before and
after each run. Ratios are B/A of one run each, measured in this one bench run.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from daemon import Daemon  # noqa: E402
from machine import cpu_info  # noqa: E402

from loadgen.client import ClientConfig, RunResult, run_blocking  # noqa: E402
from loadgen.workload import BodyFormat, LoadWorkload, build_requests, load_requests  # noqa: E402
from tokenflowd.sim.result import json_safe  # noqa: E402
from tokenflowd.sim.workload import parse_lengths  # noqa: E402

MODEL = "smollm2-135m"
SLOTS = 8  # --max-num-seqs
LENGTHS = "normal:64:16:128:32"  # scenario prompts and outputs (tokens)
REPLY_TOKENS = 128  # the reply whose full-batch time sets S
RATE_SHARES = (0.35, 0.5)  # readers' rates as shares of g; 40% at the first, 60% at the second
COUNTERS = {"preemptions": "tokenflowd_preemptions_total", "shed": "tokenflowd_requests_shed_total",
            "rejected": "tokenflowd_requests_rejected_total", "kv_pages_loaded": "tokenflowd_kv_offload_pages_total"}
TABLE = (("effective_throughput", "effective throughput (tok/s)", "{:.1f}"),
         ("throughput", "raw throughput (tok/s)", "{:.1f}"),
         ("ttft_mean", "TTFT mean (s)", "{:.2f}"),
         ("ttft_p99", "TTFT p99 (s)", "{:.2f}"),
         ("rebuffer_total", "rebuffer total (s)", "{:.2f}"),
         ("qos", "QoS (eq. 2)", "{:.1f}"),
         ("completed", "completed", "{:d}"),
         ("errors", "errors (loadgen)", "{:d}"),
         ("http_429", "  of which 429", "{:d}"),
         ("aborted", "timeouts", "{:d}"),
         ("preemptions", "preemptions (/metrics)", "{:.0f}"),
         ("shed", "shed (/metrics)", "{:.0f}"),
         ("span", "span (s)", "{:.1f}"))


# -- the machine -------------------------------------------------------------------------------
def others_running(pattern: str) -> list[str]:
    out = subprocess.run(["pgrep", "-af", pattern], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.split(maxsplit=1)[0] != str(os.getpid())]


def wait_until_quiet(pattern: str, max_wait: float, poll: float = 30.0) -> float:
    """Seconds waited until no process matching `pattern` runs (gives up after `max_wait`)."""
    t0 = time.monotonic()
    while (procs := others_running(pattern)) and time.monotonic() - t0 < max_wait:
        print(f"[bench] waiting for {len(procs)} '{pattern}' process(es) to end "
              f"({time.monotonic() - t0:.0f} s so far; load {os.getloadavg()[0]:.2f})", flush=True)
        time.sleep(poll)
    if procs:
        print(f"[bench] WARNING: still running after {max_wait:.0f} s, going on: {procs}", flush=True)
    return time.monotonic() - t0


# -- daemons -----------------------------------------------------------------------------------
def start(stack: ExitStack, label: str, log_dir: Path, *flags: str) -> Daemon:
    d = Daemon("--max-num-seqs", str(SLOTS), *flags, log_path=str(log_dir / f"{label}.log"), wait=False)
    stack.callback(stop, d, label)  # before the wait: a daemon that never gets healthy is stopped too
    d.wait_healthy()
    print(f"[bench] {label}: tokenflowd serve {' '.join(flags)} on {d.base_url} (log {log_dir / label}.log)",
          flush=True)
    return d


def stop(d: Daemon, label: str) -> None:
    rc = d.stop()  # SIGTERM, then SIGKILL after 30 s
    if rc != 0:
        print(f"[bench] WARNING: daemon {label} exited with {rc} on SIGTERM", flush=True)


def counters(d: Daemon) -> dict[str, float]:
    out = {}
    for key, name in COUNTERS.items():
        labels = {"direction": "load"} if key == "kv_pages_loaded" else {}
        try:
            out[key] = d.metric(name, **labels)
        except KeyError:  # a labelled counter appears with its first sample
            out[key] = 0.0
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in before}


# -- measuring the machine ---------------------------------------------------------------------
def burst(d: Daemon, n: int, lengths: str, rate: float, seed: int) -> RunResult:
    w = LoadWorkload(num_prompts=n, lengths=parse_lengths(lengths), reading_rates=((rate, 1.0),), seed=seed)
    loads = load_requests(w, BodyFormat("/v1/completions", MODEL))
    result = run_blocking(loads, ClientConfig(d.base_url + "/v1/completions", timeout=120.0))
    bad = [r for r in result.records if r.outcome != "completed"]
    if bad:
        raise RuntimeError(f"measurement burst on {d.base_url}: {len(bad)} of {n} failed; first: {bad[0].error}")
    return result


def full_batch_rate(result: RunResult) -> dict:
    """C: tokens/s of all streams together while every one of them decodes (from the last first
    token to the first last token), and the per-stream rates over each stream's own decode."""
    times = [r.token_times for r in result.records]
    t0, t1 = max(t[0] for t in times), min(t[-1] for t in times)
    if not t1 > t0:
        raise RuntimeError("the measurement streams never decoded together")
    tokens = sum(sum(1 for x in t if t0 < x <= t1) for t in times)
    per_stream = [(len(t) - 1) / (t[-1] - t[0]) for t in times]
    return {"capacity": tokens / (t1 - t0), "window_s": t1 - t0, "per_stream_rates": per_stream,
            "ttft_max": max(r.token_times[0] - r.arrival for r in result.records)}


def measure_pair(pair: dict[str, Daemon]) -> dict[str, dict]:
    """The same warm-up and measurement bursts on every daemon of `pair` (so they share a history)."""
    out = {}
    for label, d in pair.items():
        burst(d, SLOTS, "fixed:64:32", 100.0, seed=100)  # warm-up: allocator, kernels, the step-time fit
        out[label] = full_batch_rate(burst(d, SLOTS, "fixed:64:96", 100.0, seed=101))
        print(f"[bench] {label}: C = {out[label]['capacity']:.1f} tokens/s at {SLOTS} streams "
              f"(g = {out[label]['capacity'] / SLOTS:.2f} per stream; window {out[label]['window_s']:.1f} s)",
              flush=True)
    caps = [m["capacity"] for m in out.values()]
    if max(caps) > 1.15 * min(caps):
        print(f"[bench] WARNING: the pair's full-batch rates differ by {max(caps) / min(caps) - 1:.0%}: something "
              f"else is using the CPU (load {os.getloadavg()[0]:.2f})", flush=True)
    return out


# -- scenarios ---------------------------------------------------------------------------------
def mean_output(num_prompts: int, seed: int) -> float:
    reqs = build_requests(LoadWorkload(num_prompts=num_prompts, lengths=parse_lengths(LENGTHS), seed=seed))
    return sum(r.output_len for r in reqs) / len(reqs)


def compare(name: str, a: tuple[str, Daemon], b: tuple[str, Daemon], workload: list[str], out_dir: Path,
            timeout: float) -> dict:
    """`tokenflowd-loadgen compare` A then B; its JSON, less token times, plus the daemons' counters."""
    out = out_dir / f"{name}.json"
    cmd = [sys.executable, "-m", "loadgen", "compare", "--base-url", a[1].base_url, "--base-url-b", b[1].base_url,
           "--label-a", a[0], "--label-b", b[0], *workload, "--quiet", "--out", str(out)]
    shown = " ".join(["tokenflowd-loadgen", *cmd[3:]])
    load = os.getloadavg()
    print(f"[bench] {name}: {shown}  (load {load[0]:.2f})", flush=True)
    before = {label: counters(d) for label, d in (a, b)}
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"{name}: loadgen compare did not finish in {timeout:.0f} s; stderr: {e.stderr}") from None
    after = {label: counters(d) for label, d in (a, b)}
    for line in proc.stderr.splitlines():
        if "failed" in line or "error" in line.lower():
            print(f"[bench] {name}: loadgen stderr: {line}", flush=True)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"{name}: loadgen compare exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    doc = json.loads(out.read_text())
    runs = {}
    for label, run in doc["runs"].items():
        errors: dict[str, int] = {}
        for r in run["requests"]:
            if r["outcome"] in ("error", "timeout"):
                kind = r["error"].split(":", 1)[0] if r["error"] else r["outcome"]
                errors[kind] = errors.get(kind, 0) + 1
            r.pop("token_times")
        runs[label] = {"summary": run["summary"], "errors_by_kind": errors,
                       "daemon_counters": delta(before[label], after[label]), "requests": run["requests"]}
    return {"command": shown, "wall_s": time.monotonic() - t0, "load_before": load, "config": doc["config"]["workload"],
            "runs": runs, "ratios": doc["ratios"], "loadgen_table": proc.stdout}


def row_values(run: dict) -> dict:
    s = dict(run["summary"])
    s["http_429"] = run["errors_by_kind"].get("HTTP 429", 0)
    s.update(run["daemon_counters"])
    return s


def cell(v, fmt: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return fmt.format(int(v) if fmt == "{:d}" else v)


def print_table(name: str, title: str, scen: dict) -> None:
    (la, ra), (lb, rb) = scen["runs"].items()
    va, vb = row_values(ra), row_values(rb)
    print(f"\n== {name}: {title}")
    print(f"{'':30}{la:>16}{lb:>18}{'B/A':>8}")
    for key, text, fmt in TABLE:
        x, y = va.get(key), vb.get(key)
        numbers = all(isinstance(v, (int, float)) and not math.isnan(v) for v in (x, y))
        ratio = f"{y / x:.2f}" if numbers and x > 0 else "-"  # no ratio to a negative QoS
        print(f"{text:30}{cell(x, fmt):>16}{cell(y, fmt):>18}{ratio:>8}")
    other = {k: v for r in (ra, rb) for k, v in r["errors_by_kind"].items() if k != "HTTP 429"}
    if other:
        print(f"   other failures: {other}")


# -- main --------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench/results/daemon_policies.json"))
    ap.add_argument("--repeat-burst-size", type=int, default=SLOTS, help="requests per burst in load60/load120")
    ap.add_argument("--bursts-60", type=int, default=4)
    ap.add_argument("--bursts-120", type=int, default=6)
    ap.add_argument("--max-queue-delay", type=float, help="S for load120-bound (default: half a full batch's "
                                                          "128-token reply time, rounded to 0.5 s)")
    ap.add_argument("--wait-for", default="sim_table1", help="wait until no process whose command line matches this (pgrep -f regex) runs")
    ap.add_argument("--max-wait", type=float, default=2400.0, help="s to wait for --wait-for at most")
    ap.add_argument("--compare-timeout", type=float, default=600.0, help="s one loadgen compare may take")
    ap.add_argument("--overlap-ab", action="store_true",
                    help="A = tokenflow with serial steps, B = tokenflow with overlap scheduling (no load60)")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds the ExitStack: daemons get SIGTERM

    t_start = time.monotonic()
    machine = cpu_info()
    waited = wait_until_quiet(a.wait_for, a.max_wait) if a.wait_for else 0.0
    machine["load_at_start"] = os.getloadavg()
    machine["waited_s"] = waited
    print(f"[bench] {machine['cpu']}, {machine['cores']} cores, avx512_bf16: {machine['avx512_bf16']} "
          f"(dtype auto = {'bf16' if machine['avx512_bf16'] else 'fp32'}); load average "
          f"{' '.join(f'{x:.2f}' for x in machine['load_at_start'])}", flush=True)
    log_dir = Path(tempfile.mkdtemp(prefix="daemon_policies-"))
    scenarios: dict[str, dict] = {}
    titles: dict[str, str] = {}
    result: dict = {"machine": machine, "slots": SLOTS, "lengths": LENGTHS, "logs": str(log_dir)}
    try:
        with ExitStack() as stack:
            if a.overlap_ab:
                sides = (("serial", ("--policy", "tokenflow", "--overlap", "off")),
                         ("overlap", ("--policy", "tokenflow", "--overlap", "on")))
            else:
                sides = (("fcfs", ("--policy", "fcfs")), ("tokenflow", ("--policy", "tokenflow")))
            (la, fa), (lb, fb) = sides
            pair = {la: start(stack, la, log_dir, *fa), lb: start(stack, lb, log_dir, *fb)}
            measured = measure_pair(pair)
            cap = measured[la]["capacity"]
            g = cap / SLOTS
            reply_s = REPLY_TOKENS / g
            bound = a.max_queue_delay or max(1.0, round(reply_s / 2 * 2) / 2)
            r1, r2 = (round(s * g, 2) for s in RATE_SHARES)
            rates = f"{r1}:0.4,{r2}:0.6"
            print(f"[bench] C = {cap:.1f} tokens/s ({la} daemon), g = C/{SLOTS} = {g:.2f} tokens/s; readers at "
                  f"{r1} (40%) and {r2} (60%) tokens/s; a full batch streams a {REPLY_TOKENS}-token reply in "
                  f"{reply_s:.1f} s; --max-queue-delay S = {bound:g} s", flush=True)
            result.update(measure=measured, capacity=cap, per_stream_rate=g, reading_rates=[r1, r2],
                          reply_time_full_batch=reply_s, max_queue_delay=bound)
            common = ["--lengths", LENGTHS, "--reading-rate", rates]

            titles["burst"] = f"one burst of {3 * SLOTS} readers at {r1}/{r2} tok/s (seed 0)"
            scenarios["burst"] = compare("burst", (la, pair[la]), (lb, pair[lb]),
                                         [*common, "--num-prompts", str(3 * SLOTS), "--seed", "0"], log_dir,
                                         a.compare_timeout)
            repeated = {}
            for name, load, bursts, seed in (("load60", 0.6, a.bursts_60, 1), ("load120", 1.2, a.bursts_120, 2)):
                if a.overlap_ab and name == "load60":
                    continue
                b = a.repeat_burst_size
                mean_out = mean_output(b * bursts, seed)
                period = round(b * mean_out / (load * cap), 2)
                repeated[name] = [*common, "--num-prompts", str(b * bursts), "--burst-size", str(b),
                                  "--burst-period", str(period), "--seed", str(seed)]
                titles[name] = (f"{bursts} bursts of {b} every {period} s = {b * mean_out / period:.1f} tok/s "
                                f"offered, {load:.0%} of C (seed {seed})")
                scenarios[name] = compare(name, (la, pair[la]), (lb, pair[lb]), repeated[name], log_dir,
                                          a.compare_timeout)
                scenarios[name]["offered_load"] = load
        with ExitStack() as stack:  # a fresh pair for the bound: both sides with the same history
            if a.overlap_ab:  # both bounded: the shedding predicted with tokens a step late against without
                ba, bb = (la + "+bound", (*fa, "--max-queue-delay", f"{bound:g}")), \
                         (lb + "+bound", (*fb, "--max-queue-delay", f"{bound:g}"))
                title = f"; both with --max-queue-delay {bound:g}"
            else:
                ba, bb = ("tokenflow", ("--policy", "tokenflow")), \
                         ("tokenflow+bound", ("--policy", "tokenflow", "--max-queue-delay", f"{bound:g}"))
                title = f"; B with --max-queue-delay {bound:g}"
            pair = {ba[0]: start(stack, ba[0].replace("+", "-") + "-2", log_dir, *ba[1]),
                    bb[0]: start(stack, bb[0].replace("+", "-") + "-2", log_dir, *bb[1])}
            result["measure_bound_pair"] = measure_pair(pair)
            titles["load120-bound"] = titles["load120"] + title
            scenarios["load120-bound"] = compare("load120-bound", (ba[0], pair[ba[0]]), (bb[0], pair[bb[0]]),
                                                 repeated["load120"], log_dir, a.compare_timeout)
            scenarios["load120-bound"]["offered_load"] = 1.2
    finally:
        result["scenarios"] = scenarios
        result["wall_s"] = time.monotonic() - t_start
        result["load_at_end"] = os.getloadavg()
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(json_safe(result), indent=1, allow_nan=False) + "\n")
    for name, scen in scenarios.items():
        print_table(name, titles[name], scen)
    print(f"\n[bench] {result['wall_s']:.0f} s in all; load average at the end "
          f"{' '.join(f'{x:.2f}' for x in result['load_at_end'])}; wrote {a.out}; daemon logs in {log_dir}")


if __name__ == "__main__":
    main()
