"""Federation on one machine (root: network namespaces joined by veth, tests/netns.py).

    .venv/bin/python bench/federation_cluster.py [--parts bandwidth,cluster] [--rates 1gbit,10gbit]
        [--num-prompts 200] [--out bench/results/federation_cluster.json]

bandwidth: Mooncake's transfer engine (TCP) writing from one namespace into registered memory in
another, against raw TCP (iperf3, one stream) over the same veth, with the sender's link limited by
`tc tbf` to each of `--rates` and unlimited. Two write shapes: a prefill node's layer-wise KV stream
(one batch per layer of a 1,024-token prompt's pages of the embedded model in fp32, runs as
kv_blocks makes them) and 4 MiB blocks. Each figure: bytes over the wall time of the whole run.

cluster: the Mooncake conversation trace (the first `--num-prompts` records, 512-token blocks cut
to `--block-tokens`, prompts capped, outputs scaled), replayed by the load generator through the
conductor, in two set-ups started fresh one after the other on the same slice and pace: a prefill
node and a decode node (PD-disaggregated), and two colocated nodes (role both). The pace is
`--load` times the prompt tokens/s one node prefills (measured first on a plain node). Reports the
loadgen's throughput, TTFT mean and P99, and where each request went.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
from daemon import Daemon, free_port, terminate  # noqa: E402
from machine import cpu_info  # noqa: E402
from netns import Network  # noqa: E402

from loadgen import report  # noqa: E402
from loadgen.client import ClientConfig, run_blocking  # noqa: E402
from loadgen.workload import BodyFormat, LoadWorkload, build_requests, load_requests  # noqa: E402
from tokenflowd.sim.result import json_safe  # noqa: E402
from tokenflowd.sim.workload import parse_lengths  # noqa: E402

MODEL = "smollm2-135m"
PY = sys.executable
BURST = {"1gbit": "512kb", "10gbit": "4mb"}

WRITER = r'''
import sys, time, torch
sys.path.insert(0, sys.argv[1])
from tokenflowd.federation.transport import Block, KVLayout, MooncakeTransport, kv_blocks
host, peer, base, shape = sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
t = MooncakeTransport(host)
if shape == "layers":  # the embedded model's cache in fp32: 30 layers x [2, 3 heads, pages, 16, 64]
    pages = 1024 // 16
    cache = torch.ones(30, 2, 3, 256, 16, 64)
    t.register(cache)
    src = KVLayout.of(list(cache.unbind(0)))
    dst = KVLayout(tuple(base + i * cache[0].numel() * 4 for i in range(30)), src.shape, 4)
    one = [kv_blocks(KVLayout((src.bases[l],), src.shape, 4), KVLayout((dst.bases[l],), dst.shape, 4),
                     range(pages), range(pages)) for l in range(30)]
    rounds = 40
else:
    buf = torch.ones(64 << 20, dtype=torch.uint8)
    region = t.register(buf)
    one = [[Block(region.address + i * (4 << 20), base + i * (4 << 20), 4 << 20)] for i in range(16)]
    rounds = 8
t.write(peer, one[0])  # the handshake, outside the figure
total, t0 = 0, time.monotonic()
for _ in range(rounds):
    transfers = [t.submit_write(peer, blocks) for blocks in one]
    for x in transfers:
        t.wait(x, 60)
        total += x.nbytes
print(total, time.monotonic() - t0, flush=True)
'''

RECEIVER = r'''
import sys, time, torch
sys.path.insert(0, sys.argv[1])
from tokenflowd.federation.transport import MooncakeTransport
t = MooncakeTransport(sys.argv[2])
buf = torch.zeros(30 * 2 * 3 * 256 * 16 * 64 * 4 + (64 << 20), dtype=torch.uint8)
region = t.register(buf)
print(t.endpoint, region.address, flush=True)
time.sleep(600)
'''


def bandwidth(rates: list[str]) -> list[dict]:
    rows = []
    net = Network(["send", "recv"])
    tmp = Path(tempfile.mkdtemp())
    (tmp / "writer.py").write_text(WRITER)
    (tmp / "receiver.py").write_text(RECEIVER)
    ns, addr = net.ns, net.addr
    recv = subprocess.Popen(["ip", "netns", "exec", ns["recv"], PY, str(tmp / "receiver.py"), str(ROOT), addr["recv"]],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        endpoint, base = recv.stdout.readline().split()
        for rate in rates + ["none"]:
            if rate != "none":
                subprocess.run(["ip", "netns", "exec", ns["send"], "tc", "qdisc", "replace", "dev", "eth0", "root",
                                "tbf", "rate", rate, "burst", BURST.get(rate, "4mb"), "latency", "50ms"], check=True)
            else:
                subprocess.run(["ip", "netns", "exec", ns["send"], "tc", "qdisc", "del", "dev", "eth0", "root"],
                               capture_output=True)
            row = {"rate": rate, "tcp_gbps": iperf3(ns["send"], ns["recv"], addr["recv"])}
            for shape in ("layers", "blocks"):
                out = subprocess.run(["ip", "netns", "exec", ns["send"], PY, str(tmp / "writer.py"), str(ROOT),
                                      addr["send"], endpoint, base, shape], capture_output=True, text=True, timeout=600)
                nbytes, seconds = out.stdout.split()
                row[f"mooncake_{shape}_gbps"] = int(nbytes) * 8 / float(seconds) / 1e9
            print(f"[bench] link {rate}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items() if k != "rate"), flush=True)
            rows.append(row)
    finally:
        recv.kill()
        net.close()
    return rows


def iperf3(client_ns: str, server_ns: str, server: str) -> float:
    """One TCP stream's Gbit/s over 3 s (an iperf3 server that serves this one test)."""
    srv = subprocess.Popen(["ip", "netns", "exec", server_ns, "iperf3", "-s", "-1", "-B", server],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    out = subprocess.run(["ip", "netns", "exec", client_ns, "iperf3", "-c", server, "-t", "3", "-J"], capture_output=True,
                         text=True, timeout=60)
    srv.wait(10)
    return json.loads(out.stdout)["end"]["sum_received"]["bits_per_second"] / 1e9


NODE = ["--dtype", "float32", "--quantization", "none", "--kv-cache-memory", "128MiB"]


def cluster(setup: str, workload: LoadWorkload, log_dir: Path) -> dict:
    net = Network(["n1", "n2", "conductor"])
    roles = ("prefill", "decode") if setup == "pd" else ("both", "both")
    nodes, conductor = [], None
    try:
        for name, role in zip(("n1", "n2"), roles):
            extra = ["--role", role, "--kv-host", net.addr[name]] if role != "both" else []
            if role == "decode":  # it takes KV from the prefill node, started first
                extra += ["--federation-peers", nodes[0].base_url]
            nodes.append(Daemon(*NODE, *extra, netns=net.ns[name], host=net.addr[name], wait=False,
                                log_path=str(log_dir / f"{setup}-{name}.log")))
        for d in nodes:
            d.wait_healthy(300)
            d.wait_all_engines(300)
        config = log_dir / f"{setup}.toml"
        config.write_text(f'[conductor]\nmodel = "{MODEL}"\nttft_slo = 3600\ntbt_slo = 600\nrejection = "off"\n'
                          + "".join(f'\n[[nodes]]\nname = "{n}"\nurl = "{d.base_url}"\n' for n, d in zip(("n1", "n2"), nodes)))
        port = free_port()
        url = f"http://{net.addr['conductor']}:{port}"
        log = open(log_dir / f"{setup}-conductor.log", "w")
        conductor = subprocess.Popen(["ip", "netns", "exec", net.ns["conductor"], PY, "-m", "tokenflowd.cli", "conductor",
                                      "--config", str(config), "--host", net.addr["conductor"], "--port", str(port)],
                                     stdout=log, stderr=subprocess.STDOUT)
        import httpx
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                h = httpx.get(f"{url}/health", timeout=2).json()
                if all(n["serving"] for n in h["nodes"].values()):
                    break
            except (httpx.TransportError, ValueError):
                pass
            time.sleep(0.2)
        loads = load_requests(workload, BodyFormat("/v1/completions", MODEL))
        result = run_blocking(loads, ClientConfig(url + "/v1/completions", timeout=900.0))
        placed = httpx.get(f"{url}/health", timeout=5).json()["placed"]
    finally:
        if conductor is not None:
            terminate(conductor)
        for d in nodes:
            d.stop()
        net.close()
    s = report.summary(result.records, report.SLO(), result.duration)
    out = {"setup": setup, "throughput": s["throughput"], "effective_throughput": s["effective_throughput"],
           "ttft_mean": s["ttft_mean"], "ttft_p99": s["ttft_p99"], "completed": s["completed"], "errors": s["errors"],
           "placed": placed}
    print(f"[bench] {setup}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                           for k, v in out.items() if k != "setup"), flush=True)
    return out


def prefill_rate(log_dir: Path) -> float:
    d = Daemon(*NODE, log_path=str(log_dir / "measure.log"))
    try:
        d.wait_all_engines()
        w = LoadWorkload(num_prompts=8, lengths=parse_lengths("fixed:512:1"), seed=9, request_rate=float("inf"))
        t0 = time.monotonic()
        result = run_blocking(load_requests(w, BodyFormat("/v1/completions", MODEL)),
                              ClientConfig(d.base_url + "/v1/completions", timeout=600.0))
        assert all(r.outcome == "completed" for r in result.records)
        return 8 * 512 / (time.monotonic() - t0)
    finally:
        d.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default="bandwidth,cluster")
    p.add_argument("--rates", default="1gbit,10gbit")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--block-tokens", type=int, default=64)
    p.add_argument("--max-prompt-len", type=int, default=1024)
    p.add_argument("--output-scale", type=float, default=0.1)
    p.add_argument("--load", type=float, default=0.5, help="offered prompt tokens/s over one node's prefill rate")
    p.add_argument("--setups", default="pd,colocated")
    p.add_argument("--out", default=str(ROOT / "bench/results/federation_cluster.json"))
    a = p.parse_args()
    log_dir = Path("/tmp/federation_bench")
    log_dir.mkdir(exist_ok=True)
    doc: dict = {"machine": cpu_info(), "args": vars(a)}
    parts = a.parts.split(",")
    if "bandwidth" in parts:
        doc["bandwidth"] = bandwidth(a.rates.split(","))
    if "cluster" in parts:
        base = LoadWorkload(dataset="mooncake", num_prompts=a.num_prompts, max_prompt_len=a.max_prompt_len,
                            output_scale=a.output_scale, block_tokens=a.block_tokens, seed=0, reading_rates=((20.0, 1.0),))
        reqs = build_requests(base)
        span = reqs[-1].arrival_time - reqs[0].arrival_time
        tokens = sum(r.prompt_len for r in reqs)
        rate = prefill_rate(log_dir)
        time_scale = tokens / (a.load * rate) / span
        workload = LoadWorkload(**{**base.__dict__, "time_scale": time_scale})
        print(f"[bench] one node prefills {rate:.0f} tokens/s; {len(reqs)} requests, {tokens} prompt tokens over "
              f"{span * time_scale:.0f} s", flush=True)
        doc.update(prefill_rate=rate, time_scale=time_scale, requests=len(reqs), prompt_tokens=tokens,
                   cluster=[cluster(s, workload, log_dir) for s in a.setups.split(",")])
    Path(a.out).write_text(json.dumps(json_safe(doc), indent=1))
    print(f"[bench] wrote {a.out}")


if __name__ == "__main__":
    main()
