"""KV between two processes over Mooncake's Transfer Engine on this host (TCP over loopback): what
one request's pages cost to move, as one aggregated batch against one batch per page run.

    python bench/kv_transport.py [--tokens 512,2048,8192] [--dtype float32] [--repeats 5]

The cache is shaped as the embedded model's (30 layers, 3 KV heads, head_dim 64, pages of 16) on
both sides; the receiver's holds more pages. For each prompt length the sender writes the
request's pages, scattered (every other page), onto scattered pages of the receiver:

    batch     kv_blocks(...) as one submit_write (MemServe §4's aggregated transfer): one byte run
              per (layer, K|V, KV head, page) in the torch layout, adjacent runs merged
    per_run   one submit_write and wait per byte run (what a naive sender does)
    staged    gather_pages into a registered contiguous buffer, one write of it to the
              receiver's staging buffer, and the receiver's scatter_pages on a message (the time
              includes the gather, the write and the scatter's round trip)

and the receiver checks the SHA-256 of what landed once per length and way. Times are medians of
--repeats, the ways' order rotating; bandwidth is the request's KV bytes over that time.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("GLOG_minloglevel", "2")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import federation_peer  # noqa: E402  (the receiver, shared with the transport's tests)
from machine import cpu_info  # noqa: E402

from tokenflowd.federation.transport import Block, KVLayout, MooncakeTransport, kv_blocks  # noqa: E402
from tokenflowd.kv.staging import gather_pages  # noqa: E402

LAYERS, KV_HEADS, PAGE, HEAD_DIM = 30, 3, 16, 64
HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="512,2048,8192")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(HERE / "results" / "kv_transport.json"))
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    lengths = [int(x) for x in a.tokens.split(",")]
    recv_pages = 2 * (max(lengths) // PAGE) + 2
    proc = subprocess.Popen([sys.executable, federation_peer.__file__, str(recv_pages), "--dtype", a.dtype,
                             "--shape", f"{LAYERS},{KV_HEADS},{PAGE},{HEAD_DIM}"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    info = json.loads(proc.stdout.readline())
    dst_layout = KVLayout(tuple(info["bases"]), tuple(info["shape"]), info["itemsize"])
    send_pages = 2 * (max(lengths) // PAGE) + 2
    cache = torch.randn(LAYERS, 2, KV_HEADS, send_pages, PAGE, HEAD_DIM, generator=torch.Generator().manual_seed(0))
    cache = cache.to(dtype)
    staging = torch.empty(cache.numel() // 2, dtype=dtype)
    transport = MooncakeTransport()
    transport.register(cache)
    transport.register(staging)
    src_layout = KVLayout.of(list(cache.unbind(0)))
    layers = list(cache.unbind(0))

    def ask(line: str) -> str:
        proc.stdin.write(line + "\n")
        proc.stdin.flush()
        return proc.stdout.readline().strip()

    rows = []
    try:
        for tokens in lengths:
            n = tokens // PAGE
            src, dst = list(range(0, 2 * n, 2)), list(range(1, 2 * n + 1, 2))
            blocks = kv_blocks(src_layout, dst_layout, src, dst)
            nbytes = sum(b.nbytes for b in blocks)

            def batch():
                transport.write(info["endpoint"], blocks, timeout=120)

            def per_run():
                for block in blocks:
                    transport.write(info["endpoint"], [block], timeout=120)

            def staged():
                run = gather_pages(layers, src, staging)
                nb = run.numel() * run.element_size()
                transport.write(info["endpoint"], [Block(run.data_ptr(), info["staging"], nb)], timeout=120)
                # DONE means sent: a real receiver would confirm arrival before its scatter
                assert ask("scatter " + ",".join(map(str, dst))) == "ok"

            ways = {"batch": batch, "per_run": per_run, "staged": staged}
            want = federation_peer.page_digest(layers, src)
            for name, f in ways.items():  # warm each way, and check what it lands on cleared pages
                assert ask("zero " + ",".join(map(str, dst))) == "ok"
                f()
                deadline = time.monotonic() + 60
                while ask("sha " + ",".join(map(str, dst))) != want:
                    if time.monotonic() > deadline:
                        raise SystemExit(f"{tokens} tokens, {name}: the pages never arrived intact")
                    time.sleep(0.05)
            times = {name: [] for name in ways}
            order = list(ways)
            for r in range(a.repeats):
                for name in order[r % 3:] + order[: r % 3]:
                    t0 = time.perf_counter()
                    ways[name]()
                    times[name].append(time.perf_counter() - t0)
            med = {k: statistics.median(v) for k, v in times.items()}
            row = {"tokens": tokens, "pages": n, "bytes": nbytes, "runs": len(blocks), "verified": True,
                   **{f"{k}_s": round(v, 5) for k, v in med.items()},
                   **{f"{k}_GBps": round(nbytes / v / 1e9, 3) for k, v in med.items()},
                   "per_run_over_batch": round(med["per_run"] / med["batch"], 2),
                   "batch_over_staged": round(med["batch"] / med["staged"], 2)}
            rows.append(row)
            print(f"{tokens:6d} tokens, {nbytes / 2**20:7.1f} MiB in {len(blocks):5d} runs: "
                  + ", ".join(f"{k} {v * 1e3:8.1f} ms ({nbytes / v / 1e9:.2f} GB/s)" for k, v in med.items()),
                  flush=True)
    finally:
        transport.close()
        proc.stdin.write("quit\n")
        proc.stdin.flush()
        proc.wait(timeout=60)
    doc = {"machine": {**cpu_info(), "torch": torch.__version__}, "dtype": a.dtype, "transport": "mooncake tcp loopback",
           "link_bandwidth_measured_GBps": round((transport.bandwidth(info["endpoint"]) or 0) / 1e9, 3), "rows": rows}
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    print("wrote", a.out)


if __name__ == "__main__":
    main()
