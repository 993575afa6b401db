"""The pool's query path on this machine: what a layer's attention to a segment held by a peer engine
costs, and the segment size that the TokenLake threshold picks from measured α, B and k_comp.

    python bench/pool_query.py [--prefix 256,1024,4096] [--rows 1,16] [--threads 1] [--device cpu|cuda]

Two processes, as in a pool of two engines on one host: this one (the requester) and a holder
started from this script, with a KV cache shaped as the embedded model's (9 heads, 3 KV heads,
d 64, page 16) and a QueryService over it. For each prefix length S and row count R, on a CPU (fp32):

    local    backend.attend_pages on a cache of this process (what the requester would spend
             attending to the segment were it its own)
    shipped  query mode, QueryClient.query: rows into shared memory, a zmq round trip, the
             holder's attend_pages, (o, lse) back
    read     read mode: this process's attend_pages on the holder's cache, mapped from shared
             memory (shared_kv.py); no message per layer
    added    shipped − local, and read − local: what a layer pays for not holding the segment

With --device cuda both processes share one GPU, each with its cache there (bf16) and the attention
backend the engine would run (flashinfer where it imports and passes a first call, else torch; the
JSON names it, and the GPU in "machine"):

    local         backend.attend_pages on this process's cache
    read_ipc      read mode: attend_pages on the holder's cache, opened in place over CUDA IPC
                  (cuda_ipc.py: the holder exports it, DeviceKV.open)
    query_device  query mode with the rows in a device block of this process's, opened by the holder
                  over CUDA IPC (QueryBuffers.on_device: what the engine's clients use on a GPU)
    query_host    query mode staged through host shared memory (what --no-pool-ipc gives)
    added         each − its local, and how far each path's (o, lse) is from local's (same pages, same values)

Each time is the median of --repeats calls after a warm-up, alternating the two sides; on a GPU
each call runs between torch.cuda.synchronize() calls. α, B and k_comp come from pool/segments.py's
measures (medians of --repeats calls; on a GPU α and B for each query path): α is half the round
trip of a 1-row query over no pages; B comes from the extra time of --bw-rows rows over 1 row (the
bytes of q out and o, lse back); k_comp is the slope of attend_pages for one row between S/4 and S.
Torch threads: --threads in both processes.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import pickle
import select
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_info  # noqa: E402

from tokenflowd.config import platform  # noqa: E402
from tokenflowd.engine.attention.base import AttentionBackend, PageQuery  # noqa: E402
from tokenflowd.engine.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from tokenflowd.pool.cuda_ipc import DeviceKV, export  # noqa: E402
from tokenflowd.pool.names import export_path, query_buffers_path  # noqa: E402
from tokenflowd.pool.query import QueryClient, QueryService  # noqa: E402
from tokenflowd.pool.segments import (SegmentCosts, attend_probe, measure_k_comp, measure_link,  # noqa: E402
                                      pages_per_segment, query_payload)
from tokenflowd.pool.shared_kv import SharedKV  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, PAGE = 9, 3, 64, 16
# fp32 on a CPU; bf16 on a GPU: what the engine runs there (flashinfer has no fp32 kernels), and the
# dtype whose head_dim-64 flashinfer kernels gpu_check's tests step has JIT-built already
DTYPES = {"cpu": torch.float32, "cuda": torch.bfloat16}
# seconds for the holder to say it serves: on a GPU its CUDA start-up and a first call, which loads
# the flashinfer kernels the requester's first call built (a JIT build takes about 100 s on an H200)
READY_WITHIN = {"cpu": 60.0, "cuda": 120.0}
HERE = Path(__file__).resolve().parent


def backend(device: str = "cpu", name: str = "torch") -> AttentionBackend:
    args = (HEADS, KV_HEADS, HEAD_DIM, PAGE, DTYPES[device], torch.device(device))
    if name == "flashinfer":
        from tokenflowd.engine.attention.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(*args)
    return TorchAttentionBackend(*args)


def cache(num_pages: int, b: AttentionBackend) -> torch.Tensor:
    """One layer's cache of seeded values, the same in both processes: [*b.kv_cache_shape] b.dtype b.device."""
    values = torch.randn(b.kv_cache_shape(num_pages), generator=torch.Generator().manual_seed(0))
    return values.to(b.dtype).to(b.device)


def segment_of(tokens: int) -> bytes:
    return tokens.to_bytes(8, "little")


def holder(a: argparse.Namespace) -> None:
    platform.die_with_parent()  # a requester killed at its time limit takes its holder along
    torch.set_num_threads(a.threads)
    b = backend(a.device, a.backend)
    shared = None
    if a.device == "cpu":
        shared = SharedKV.create(a.shm, 1, b.kv_cache_shape(a.pages), b.dtype)
        kv = shared.layers[0]
        kv.copy_(cache(a.pages, b))
    else:
        whole = cache(a.pages, b).unsqueeze(0)  # [1, *kv_cache_shape] bf16 cuda: one allocation, as the runner's
        kv = whole[0]
        try:
            export(whole, a.export)
        except (RuntimeError, OSError) as e:  # the requester finds no export and times the query paths only
            print(f"holder: its cache cannot be exported over CUDA IPC: {e}", file=sys.stderr, flush=True)
        # a first call before "ready": a JIT build of flashinfer's kernels (where the requester's left
        # none) must not fall in a query, whose answer the requester awaits 10 s at most
        b.attend_pages(torch.zeros(1, HEADS, HEAD_DIM, dtype=b.dtype, device=b.device), kv, PageQuery([0, 1], [[0]]))
        torch.cuda.synchronize()

    def resolve(keys):
        return [list(range(int.from_bytes(k, "little") // PAGE)) for k in keys]

    service = QueryService(a.address, b, [kv], resolve, lambda pages: None).start()
    print("ready", flush=True)
    sys.stdin.readline()  # "quit", or the end of input: the requester is gone
    service.close()
    if shared is not None:
        shared.close()


def start_holder(args: list[str], within: float) -> subprocess.Popen:
    """The holder process, once it says it serves. SystemExit where it does not within `within` s
    (killed then; its traceback, if any, is on stderr)."""
    proc = subprocess.Popen([sys.executable, __file__, "--role", "holder", *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    said, _, _ = select.select([proc.stdout], [], [], within)
    if said and proc.stdout.readline().strip() == "ready":
        return proc
    proc.kill()
    proc.wait()
    why = f"exited (code {proc.returncode}; its error is above)" if said else f"said nothing within {within:.0f} s"
    raise SystemExit(f"the pool holder did not start: it {why}")


def stop_holder(proc: subprocess.Popen) -> None:
    with contextlib.suppress(OSError):  # BrokenPipeError: it is gone already
        proc.stdin.write("quit\n")
        proc.stdin.close()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def no_sync() -> None:
    pass


def median_pair(local, other, repeats: int, sync: Callable[[], None] = no_sync) -> tuple[float, float]:
    """Medians of `repeats` timed calls of each, alternating which goes first, after one of each to
    warm up; `sync` waits for the device's queued work before and after each call."""
    local(), other()
    a, b = [], []
    for i in range(repeats):
        for f, out in ((local, a), (other, b)) if i % 2 == 0 else ((other, b), (local, a)):
            sync()
            t0 = time.perf_counter()
            f()
            sync()
            out.append(time.perf_counter() - t0)
    return statistics.median(a), statistics.median(b)


def shipped(client: QueryClient, q: torch.Tensor, query_start: list[int],
            request_ids: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """A query's round trip as a step pays it: (o, lse) on q's device (pool/attention.py QueriedHolder)."""
    o, lse = client.query(0, q, query_start, request_ids)
    return o.to(q.device), lse.to(q.device)


def bench_cpu(a: argparse.Namespace, prefixes: list[int], rows_list: list[int]) -> dict:
    torch.set_num_threads(a.threads)
    num_pages = max(prefixes) // PAGE + 1
    b = backend()
    kv = cache(num_pages, b)
    with tempfile.TemporaryDirectory() as tmp:
        address, shm = f"ipc://{tmp}/query.sock", f"tokenflowd-bench-{os.getpid()}"
        proc = start_holder(["--address", address, "--pages", str(num_pages), "--threads", str(a.threads),
                             "--shm", shm], READY_WITHIN["cpu"])
        peer = client = None
        rows_out = []
        try:
            peer = SharedKV.attach(shm, 1, b.kv_cache_shape(num_pages), b.dtype)
            client = QueryClient(1, address, max(max(rows_list), a.bw_rows), HEADS, HEAD_DIM, b.dtype,
                                 alive=lambda: proc.poll() is None)
            # α and B: queries over no pages (request "": the holder returns the empty state); k_comp:
            # one row over S/4 and S tokens, locally. Medians of --repeats, as the engine would measure.
            payload = query_payload(HEADS, HEAD_DIM, 4)
            qs = torch.randn(a.bw_rows, HEADS, HEAD_DIM)
            alpha, bandwidth = measure_link(lambda n: shipped(client, qs[:n], [0, n], [""]), payload,
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
                    local, query = median_pair(lambda: b.attend_pages(q, kv, PageQuery(starts, pages)),
                                               lambda: shipped(client, q, starts, [rid] * rows), a.repeats)
                    local2, read = median_pair(lambda: b.attend_pages(q, kv, PageQuery(starts, pages)),
                                               lambda: b.attend_pages(q, peer.layers[0], PageQuery(starts, pages)),
                                               a.repeats)
                    rows_out.append({"prefix_tokens": tokens, "rows": rows, "local_us": round(local * 1e6, 1),
                                     "shipped_us": round(query * 1e6, 1), "read_us": round(read * 1e6, 1),
                                     "query_added_us_per_layer": round((query - local) * 1e6, 1),
                                     "read_added_us_per_layer": round((read - local2) * 1e6, 1)})
                    print(f"prefix {tokens:5d} rows {rows:3d}: local {local * 1e6:8.1f} us  query {query * 1e6:8.1f}"
                          f" (+{(query - local) * 1e6:7.1f})  read {read * 1e6:8.1f} (+{(read - local2) * 1e6:6.1f})"
                          f" us per layer", flush=True)
                    client.unpin(rid)
        finally:
            if peer is not None:
                peer.close()
            stop_holder(proc)
            if client is not None:
                client.close()
    threshold = costs.threshold_tokens()
    doc = {
        "machine": {**cpu_info(), "torch": torch.__version__},
        "threads": a.threads,
        "k_comp_ns_per_token": significant(k_comp * 1e9), "payload_bytes": payload, **link_figures(costs),
        "rows": rows_out,
    }
    print(f"alpha {alpha * 1e6:.1f} us, B {bandwidth / 1e9:.4g} GB/s, k_comp {k_comp * 1e9:.2f} ns/token, "
          f"payload {payload} B -> threshold {threshold:.0f} tokens = {doc['pages_per_segment']} pages of {PAGE}")
    return doc


def significant(x: float, digits: int = 4) -> float:
    """`x` to `digits` significant figures: a loaded machine can measure B at a few MB/s, where
    a fixed three decimals of GB/s would move the threshold rebuilt from the record by percents."""
    return float(f"{x:.{digits}g}")


def link_figures(costs: SegmentCosts) -> dict:
    """α, B and the segment size they give, as the bench records them."""
    return {"alpha_us": significant(costs.alpha * 1e6), "bandwidth_GBps": significant(costs.bandwidth / 1e9),
            "threshold_tokens": round(costs.threshold_tokens(), 1), "pages_per_segment": pages_per_segment(costs, PAGE)}


# -- on a GPU -----------------------------------------------------------------------------------
def gpu_backend() -> tuple[AttentionBackend, str]:
    """The backend the engine would run on this GPU (config/engine.py `resolve`: flashinfer where it
    imports), stepped down to torch where building it or a first call fails, as start-up would
    (engine/startup.py); and why it stepped down ("": it did not). The first call JIT-builds
    flashinfer's kernels where no earlier process did, before the holder starts and finds them built."""
    if not platform.has_flashinfer():
        return backend("cuda"), "flashinfer is not installed"
    try:
        b = backend("cuda", "flashinfer")
        q = torch.zeros(1, HEADS, HEAD_DIM, dtype=b.dtype, device=b.device)
        b.attend_pages(q, torch.zeros(b.kv_cache_shape(1), dtype=b.dtype, device=b.device), PageQuery([0, 1], [[0]]))
        torch.cuda.synchronize()
        return b, ""
    except Exception as e:  # anything raised building or running it is a failed fast path (startup.py)
        return backend("cuda"), f"flashinfer failed its first call: {type(e).__name__}: {e}"


def open_peer(path: str, num_pages: int, b: AttentionBackend) -> tuple[DeviceKV | None, str]:
    """The holder's cache opened over CUDA IPC (read mode's path), or why it cannot be."""
    try:
        return DeviceKV.open(path, 1, b.kv_cache_shape(num_pages), b.dtype), ""
    except (OSError, ValueError, RuntimeError, KeyError, pickle.UnpicklingError) as e:
        return None, f"the holder's cache cannot be opened over CUDA IPC: {type(e).__name__}: {e}"


def gpu_paths(b: AttentionBackend, q: torch.Tensor, query: PageQuery, kv: torch.Tensor, peer: DeviceKV | None,
              clients: dict[str, QueryClient], request_ids: list[str]) -> tuple[Callable, dict[str, Callable]]:
    """One layer's attention of q's rows to the segment of `query`'s pages: here (local), and each
    way the pool reaches it on the holder, by name. A path that could not be set up is left out."""

    def local():
        return b.attend_pages(q, kv, query)

    def read_ipc():
        return b.attend_pages(q, peer.layers[0], query)

    paths = {} if peer is None else {"read_ipc": read_ipc}
    for name, client in clients.items():
        paths[name] = functools.partial(shipped, client, q, query.query_start, request_ids)
    return local, paths


def max_abs_diff(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> dict:
    return {"o": (got[0].float() - want[0].float()).abs().max().item(),
            "lse": (got[1] - want[1]).abs().max().item()}


def bench_cuda(a: argparse.Namespace, prefixes: list[int], rows_list: list[int]) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here")
    torch.set_num_threads(a.threads)
    num_pages = max(prefixes) // PAGE + 1
    max_rows = max(max(rows_list), a.bw_rows)
    sync = torch.cuda.synchronize
    b, fallback = gpu_backend()
    kv = cache(num_pages, b)
    with tempfile.TemporaryDirectory() as tmp:
        address, kv_file = f"ipc://{tmp}/query.sock", export_path(tmp, 0, 0)  # the holder: engine 0
        proc = start_holder(["--address", address, "--pages", str(num_pages), "--threads", str(a.threads),
                             "--device", "cuda", "--backend", b.name, "--export", kv_file], READY_WITHIN["cuda"])
        peer, clients, rows_out = None, {}, []
        try:
            ask = {"alive": lambda: proc.poll() is None, "holder": "the bench's holder"}
            # as the engine's clients (pool/member.py `_client`): rows on this GPU, in a block the
            # holder opens over CUDA IPC; and, as --no-pool-ipc makes them, in host shared memory
            clients["query_device"] = QueryClient(1, address, max_rows, HEADS, HEAD_DIM, b.dtype, device=b.device,
                                                  export=query_buffers_path(tmp, 1, 0, 0), **ask)
            clients["query_host"] = QueryClient(2, address, max_rows, HEADS, HEAD_DIM, b.dtype, **ask)
            peer, not_read = open_peer(kv_file, num_pages, b)
            payload = query_payload(HEADS, HEAD_DIM, torch.empty((), dtype=b.dtype).element_size())
            qs = torch.randn(a.bw_rows, HEADS, HEAD_DIM).to(b.dtype).to(b.device)
            links = {name: measure_link(lambda n, c=c: (shipped(c, qs[:n], [0, n], [""]), sync()), payload,
                                        a.bw_rows, a.repeats) for name, c in clients.items()}
            # NOTE: a client whose device block the holder could not open staged its queries through
            # the host (`staged` says why): its figures would be query_host's under another name
            staged = clients["query_device"].staged
            if staged:
                del links["query_device"]
                clients.pop("query_device").close()
            k_comp = measure_k_comp(attend_probe(b, num_pages), max(prefixes), a.repeats)
            for tokens in prefixes:
                for rows in rows_list:
                    rid = f"s{tokens}"
                    for c in clients.values():
                        c.pin(rid, [segment_of(tokens)])
                    q = torch.randn(rows, HEADS, HEAD_DIM).to(b.dtype).to(b.device)  # [rows, heads, d] bf16 cuda
                    query = PageQuery(list(range(rows + 1)), [list(range(tokens // PAGE))] * rows)
                    local, paths = gpu_paths(b, q, query, kv, peer, clients, [rid] * rows)
                    want = local()
                    diffs = {name: max_abs_diff(f(), want) for name, f in paths.items()}
                    times = {name: median_pair(local, f, a.repeats, sync) for name, f in paths.items()}
                    row = {"prefix_tokens": tokens, "rows": rows,
                           "local_us": round(next(iter(times.values()))[0] * 1e6, 1)}
                    for name, (here, there) in times.items():
                        row[f"{name}_us"] = round(there * 1e6, 1)
                        row[f"{name}_added_us_per_layer"] = round((there - here) * 1e6, 1)
                    row["max_abs_diff"] = diffs
                    rows_out.append(row)
                    print(f"prefix {tokens:5d} rows {rows:3d}: local {row['local_us']:7.1f} us  " + "  ".join(
                        f"{name} {row[f'{name}_us']:7.1f} (+{row[f'{name}_added_us_per_layer']:6.1f})"
                        for name in times) + " us per layer", flush=True)
                    for c in clients.values():
                        c.unpin(rid)
        finally:
            if peer is not None:
                peer.close()  # before the holder frees what it maps
            stop_holder(proc)  # it unmaps the query blocks before their owner frees them
            for c in clients.values():
                c.close()
    machine = {**cpu_info(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "cuda": torch.version.cuda}
    if b.name == "flashinfer":
        import flashinfer

        machine["flashinfer"] = flashinfer.__version__
    link_doc = {}
    for name, (alpha, bandwidth) in links.items():
        costs = SegmentCosts(alpha, bandwidth, k_comp, payload)
        link_doc[name] = link_figures(costs)
        print(f"{name}: alpha {alpha * 1e6:.1f} us, B {bandwidth / 1e9:.4g} GB/s -> threshold "
              f"{costs.threshold_tokens():.0f} tokens = {link_doc[name]['pages_per_segment']} pages of {PAGE}")
    not_measured = {k: v for k, v in (("read_ipc", not_read), ("query_device", staged)) if v}
    for name, why in not_measured.items():
        print(f"{name} not measured: {why}")
    return {
        "machine": machine, "device": "cuda", "dtype": str(b.dtype).removeprefix("torch."), "backend": b.name,
        "backend_fallback": fallback, "threads": a.threads, "not_measured": not_measured,
        "k_comp_ns_per_token": significant(k_comp * 1e9), "payload_bytes": payload, "links": link_doc,
        "rows": rows_out,
    }


def summary_line(doc: dict) -> str:
    """The largest prefix's decode row (the fewest rows), one line: what gpu_check's table shows."""
    r = max(doc["rows"], key=lambda r: (r["prefix_tokens"], -r["rows"]))
    added = ", ".join(f"{k.removesuffix('_added_us_per_layer')} +{v}" for k, v in r.items()
                      if k.endswith("_added_us_per_layer"))
    return (f"{doc['backend']} {doc['dtype']}, prefix {r['prefix_tokens']} rows {r['rows']}: local {r['local_us']} us,"
            f" added {added} us per layer")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefix", default="256,1024,4096", help="segment tokens the rows attend to")
    ap.add_argument("--rows", default="1,16", help="query rows per call (decode rows of a batch)")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1, help="torch threads in each process")
    ap.add_argument("--bw-rows", type=int, default=256)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where both engines' caches live (cuda: one GPU shared by both processes)")
    ap.add_argument("--out", default=str(HERE / "results" / "pool_query.json"))
    ap.add_argument("--role", default="bench", help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    ap.add_argument("--pages", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--shm", help=argparse.SUPPRESS)
    ap.add_argument("--backend", default="torch", help=argparse.SUPPRESS)
    ap.add_argument("--export", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.role == "holder":
        holder(a)
        return
    prefixes = [int(x) for x in a.prefix.split(",")]
    rows_list = [int(x) for x in a.rows.split(",")]
    doc = (bench_cuda if a.device == "cuda" else bench_cpu)(a, prefixes, rows_list)
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    print("wrote", a.out)
    if a.device == "cuda":
        print(summary_line(doc), flush=True)  # last: gpu_check's table shows a step's last line


if __name__ == "__main__":
    main()
