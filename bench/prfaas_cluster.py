"""PrfaaS on one machine (root: network namespaces joined by veth, tests/netns.py).

    .venv/bin/python bench/prfaas_cluster.py [--rates 100mbit,1gbit] [--num-prompts 60] [--load 0.6]
        [--setups pd,prfaas,naive] [--out bench/results/prfaas_cluster.json]

Set-ups, each started fresh on the same requests and pace, each node a real `tokenflowd` on the
embedded model (fp32) in its own namespace, the conductor in another:

  pd      a local prefill node and a decode node: the cluster without PrfaaS
  prfaas  the same, and a remote prefill node (`remote = true`) whose outgoing link `tc tbf` limits
          to RATE: the conductor sends it the prompts whose uncached part is longer than t, and
          solves t from what crosses the link (federation/conductor/remote_prefill.py)
  naive   the same three nodes, the third a plain prefill node behind the same limited link: the
          conductor places every prompt on either prefill node by their queues, blind to the link

The workload is the paper's length distribution (log-normal, μ 9.90, σ 1.00, on a 128K context)
scaled to a 4K context: median e^9.90 / 32 ≈ 620 tokens, σ 1.00, truncated to [16, 4096], random
tokens (no shared prefixes), 16 output tokens each read at 20 tokens/s, Poisson arrivals offering
`--load` × the prompt tokens/s one plain node prefills (measured first). Reported per set-up: the
loadgen's throughput (output tokens/s), requests/s, TTFT mean, P90 and P99, and where requests went.

All nodes share this machine's cores: the remote node adds no compute here, only a second queue
behind a link, so what separates the set-ups is where each prompt waits and what its KV crosses.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import httpx
import msgspec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
from federated import MODEL, Cluster  # noqa: E402
from federation_cluster import prefill_rate  # noqa: E402
from machine import cpu_info  # noqa: E402

from loadgen import report  # noqa: E402
from loadgen.client import ClientConfig, run_blocking  # noqa: E402
from loadgen.workload import BodyFormat, LoadRequest, LoadWorkload, build_requests, request_body  # noqa: E402
from tokenflowd.sim.result import json_safe  # noqa: E402
from tokenflowd.sim.workload import LengthDist  # noqa: E402

NODE = ("--dtype", "float32", "--quantization", "none", "--kv-cache-memory", "512MiB", "--kv-transfer-timeout", "300")
CONDUCTOR = ('ttft_slo = 3600\ntbt_slo = 600\nrejection = "off"\nprfaas_threshold = 1024\nprfaas_period = 5\n'
             "prfaas_replan_period = 0\nprfaas_output_tokens = 16\n")
CONTEXT = 4096
MEDIAN = math.exp(9.90) / 32


def requests(num: int, rate: float, seed: int) -> list[LoadRequest]:
    w = LoadWorkload(num_prompts=num, request_rate=rate, lengths=LengthDist("lognormal", MEDIAN, 1.0, 16, 0.0),
                     seed=seed, reading_rates=((20.0, 1.0),))
    fmt = BodyFormat("/v1/completions", MODEL)
    reqs = []
    for r in build_requests(w):
        n = min(CONTEXT, max(16, r.prompt_len))
        reqs.append(replace(r, prompt_len=n, output_len=16, hash_ids=r.hash_ids[:math.ceil(n / r.block_tokens)]))
    return [LoadRequest(r, msgspec.json.encode(request_body(r, fmt)), None) for r in reqs]


def run(setup: str, rate: str | None, loads: list[LoadRequest], log_dir: Path) -> dict:
    tmp = Path(tempfile.mkdtemp(dir=log_dir, prefix=f"{setup}-{rate or 'none'}-"))
    third = ("remote",) if setup != "pd" else ()
    cluster = Cluster(tmp, NODE, prefill=("prefill", *third) if setup == "naive" else ("prefill",),
                      remote=third if setup == "prfaas" else (), conductor=CONDUCTOR, start_timeout=300)
    try:
        if third:
            cluster.net.rate("remote", rate)
        for node in cluster.nodes.values():
            node.wait_all_engines(300)
        result = run_blocking(loads, ClientConfig(cluster.url + "/v1/completions", timeout=1800.0))
        health = httpx.get(f"{cluster.url}/health", timeout=5).json()
    finally:
        cluster.close()
    s = report.summary(result.records, report.SLO(), result.duration)
    out = {"setup": setup, "link": rate, "throughput": s["throughput"], "requests_per_s": s["completed"] / result.duration,
           "ttft_mean": s["ttft_mean"], "ttft_p90": s["ttft_p90"],
           "ttft_p99": s["ttft_p99"], "completed": s["completed"], "errors": s["errors"], "duration": result.duration,
           "placed": health["placed"], "prfaas": health.get("prfaas")}
    print(f"[bench] {setup} {rate or ''}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                                       for k, v in out.items() if k not in ("setup", "link")), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rates", default="100mbit,1gbit")
    p.add_argument("--setups", default="pd,prfaas,naive")
    p.add_argument("--num-prompts", type=int, default=60)
    p.add_argument("--load", type=float, default=0.6, help="offered prompt tokens/s over one node's prefill rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "bench/results/prfaas_cluster.json"))
    a = p.parse_args()
    log_dir = Path("/tmp/prfaas_bench")
    log_dir.mkdir(exist_ok=True)
    tokens_per_s = prefill_rate(log_dir)
    probe = requests(a.num_prompts, 1.0, a.seed)
    mean_prompt = sum(r.request.prompt_len for r in probe) / len(probe)
    rate = a.load * tokens_per_s / mean_prompt
    loads = requests(a.num_prompts, rate, a.seed)
    print(f"[bench] one node prefills {tokens_per_s:.0f} tokens/s; {len(loads)} requests, mean prompt "
          f"{mean_prompt:.0f} tokens, {rate:.3f} req/s", flush=True)
    doc: dict = {"machine": cpu_info(), "args": vars(a), "prefill_rate": tokens_per_s, "mean_prompt": mean_prompt,
                 "request_rate": rate, "runs": []}
    t0 = time.monotonic()
    for setup in a.setups.split(","):
        for link in ([None] if setup == "pd" else a.rates.split(",")):
            doc["runs"].append(run(setup, link, loads, log_dir))
            Path(a.out).write_text(json.dumps(json_safe(doc), indent=1))
    print(f"[bench] wrote {a.out} after {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
