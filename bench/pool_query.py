"""The pool's query path on this CPU: what shipping a layer's query rows to a peer engine costs,
and the segment size that the TokenLake threshold picks from measured α, B and k_comp.

    python bench/pool_query.py [--prefix 256,1024,4096] [--rows 1,16] [--threads 1]

Two processes, as in a pool of two engines on one host: this one (the requester) and a holder
started from this script, with a KV cache shaped as the embedded model's (9 heads, 3 KV heads,
d 64, page 16; fp32) and a QueryService over it. For each prefix length S and row count R:

    local    backend.attend_pages on a cache of this process (what the requester would spend
             attending to the segment were it its own)
    shipped  query mode, QueryClient.query: rows into shared memory, a zmq round trip, the
             holder's attend_pages, (o, lse) back
    read     read mode: this process's attend_pages on the holder's cache, mapped from shared
             memory (shared_kv.py); no message per layer
    added    shipped − local, and read − local: what a layer pays for not holding the segment

Each time is the median of --repeats calls after a warm-up, alternating the two sides. α, B and
k_comp come from pool/segments.py's measures (medians of --repeats calls): α is half the round
trip of a 1-row query over no pages; B comes from the extra time of --bw-rows rows over 1 row (the
bytes of q out and o, lse back); k_comp is the slope of attend_pages for one row between S/4 and S.
Torch threads: --threads in both processes.
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_info  # noqa: E402

from tokenflowd.engine.attention.base import PageQuery  # noqa: E402
from tokenflowd.engine.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from tokenflowd.pool.query import QueryClient, QueryService  # noqa: E402
from tokenflowd.pool.segments import (SegmentCosts, attend_probe, measure_k_comp, measure_link,  # noqa: E402
                                      pages_per_segment, query_payload)
from tokenflowd.pool.shared_kv import SharedKV  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, PAGE = 9, 3, 64, 16
HERE = Path(__file__).resolve().parent


def backend() -> TorchAttentionBackend:
    return TorchAttentionBackend(HEADS, KV_HEADS, HEAD_DIM, PAGE, torch.float32, torch.device("cpu"))


def cache(num_pages: int) -> torch.Tensor:
    return torch.randn(backend().kv_cache_shape(num_pages), generator=torch.Generator().manual_seed(0))


def segment_of(tokens: int) -> bytes:
    return tokens.to_bytes(8, "little")


def holder(address: str, num_pages: int, threads: int, shm_name: str) -> None:
    torch.set_num_threads(threads)
    shared = SharedKV.create(shm_name, 1, backend().kv_cache_shape(num_pages), torch.float32)
    kv = shared.layers[0]
    kv.copy_(cache(num_pages))

    def resolve(keys):
        return [list(range(int.from_bytes(k, "little") // PAGE)) for k in keys]

    service = QueryService(address, backend(), [kv], resolve, lambda pages: None).start()
    print("ready", flush=True)
    sys.stdin.readline()
    service.close()
    shared.close()


def median_pair(local, shipped, repeats: int) -> tuple[float, float]:
    local(), shipped()
    a, b = [], []
    for i in range(repeats):
        for f, out in ((local, a), (shipped, b)) if i % 2 == 0 else ((shipped, b), (local, a)):
            t0 = time.perf_counter()
            f()
            out.append(time.perf_counter() - t0)
    return statistics.median(a), statistics.median(b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefix", default="256,1024,4096", help="segment tokens the rows attend to")
    ap.add_argument("--rows", default="1,16", help="query rows per call (decode rows of a batch)")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1, help="torch threads in each process")
    ap.add_argument("--bw-rows", type=int, default=256)
    ap.add_argument("--out", default=str(HERE / "results" / "pool_query.json"))
    ap.add_argument("--role", default="bench", help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    ap.add_argument("--pages", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--shm", help=argparse.SUPPRESS)
    a = ap.parse_args()
    prefixes = [int(x) for x in a.prefix.split(",")]
    rows_list = [int(x) for x in a.rows.split(",")]
    num_pages = max(prefixes) // PAGE + 1
    if a.role == "holder":
        holder(a.address, a.pages, a.threads, a.shm)
        return
    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        address, shm = f"ipc://{tmp}/query.sock", f"tokenflowd-bench-{os.getpid()}"
        proc = subprocess.Popen([sys.executable, __file__, "--role", "holder", "--address", address, "--pages",
                                 str(num_pages), "--threads", str(a.threads), "--shm", shm], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        peer = SharedKV.attach(shm, 1, backend().kv_cache_shape(num_pages), torch.float32)
        max_rows = max(max(rows_list), a.bw_rows)
        client = QueryClient(1, address, max_rows, HEADS, HEAD_DIM, torch.float32)
        b, kv = backend(), cache(num_pages)
        rows_out = []
        try:
            # α and B: queries over no pinned pages (the holder returns the empty state); k_comp:
            # one row over S/4 and S tokens, locally. Medians of --repeats, as the engine would measure.
            payload = query_payload(HEADS, HEAD_DIM, 4)
            qs = torch.randn(a.bw_rows, HEADS, HEAD_DIM)
            alpha, bandwidth = measure_link(lambda n: client.query(0, qs[:n], [0, n], ["none"]), payload,
                                            a.bw_rows, a.repeats)
            k_comp = measure_k_comp(attend_probe(b, num_pages), max(prefixes), a.repeats)
            costs = SegmentCosts(alpha, bandwidth, k_comp, payload)
            for tokens in prefixes:
                for rows in rows_list:
                    rid = f"s{tokens}"
                    client.pin(rid, [segment_of(tokens)])
                    q = torch.randn(rows, HEADS, HEAD_DIM)
                    starts = list(range(rows + 1))
                    pages = [list(range(tokens // PAGE))] * rows
                    local, shipped = median_pair(lambda: b.attend_pages(q, kv, PageQuery(starts, pages)),
                                                 lambda: client.query(0, q, starts, [rid] * rows), a.repeats)
                    local2, read = median_pair(lambda: b.attend_pages(q, kv, PageQuery(starts, pages)),
                                               lambda: b.attend_pages(q, peer.layers[0], PageQuery(starts, pages)),
                                               a.repeats)
                    rows_out.append({"prefix_tokens": tokens, "rows": rows, "local_us": round(local * 1e6, 1),
                                     "shipped_us": round(shipped * 1e6, 1), "read_us": round(read * 1e6, 1),
                                     "query_added_us_per_layer": round((shipped - local) * 1e6, 1),
                                     "read_added_us_per_layer": round((read - local2) * 1e6, 1)})
                    print(f"prefix {tokens:5d} rows {rows:3d}: local {local * 1e6:8.1f} us  query {shipped * 1e6:8.1f}"
                          f" (+{(shipped - local) * 1e6:7.1f})  read {read * 1e6:8.1f} (+{(read - local2) * 1e6:6.1f})"
                          f" us per layer", flush=True)
                    client.unpin(rid)
        finally:
            client.close()
            peer.close()
            proc.stdin.write("quit\n")
            proc.stdin.flush()
            proc.wait(timeout=30)
    threshold = costs.threshold_tokens()
    doc = {
        "machine": {**cpu_info(), "torch": torch.__version__},
        "threads": a.threads,
        "alpha_us": round(alpha * 1e6, 2), "bandwidth_GBps": round(bandwidth / 1e9, 3),
        "k_comp_ns_per_token": round(k_comp * 1e9, 3), "payload_bytes": payload,
        "threshold_tokens": round(threshold, 1), "pages_per_segment": pages_per_segment(costs, PAGE),
        "rows": rows_out,
    }
    print(f"alpha {alpha * 1e6:.1f} us, B {bandwidth / 1e9:.2f} GB/s, k_comp {k_comp * 1e9:.2f} ns/token, "
          f"payload {payload} B -> threshold {threshold:.0f} tokens = {doc['pages_per_segment']} pages of {PAGE}")
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    print("wrote", a.out)


if __name__ == "__main__":
    main()
