"""The host tier's copier against the raw copy peak of this machine, measured in one run.

    python bench/offload_bandwidth.py [--pages 512] [--chunk 64] [--out bench/results/offload_bandwidth.json]

The device KV cache is laid out as the engine lays it out (the attention backend's shape, all
layers), the host tier as the engine's host tier (pinned on a GPU). The peak is one contiguous
copy of the same number of bytes in the same direction: pinned cudaMemcpyAsync on a GPU, a memcpy
(torch's copy_) on a CPU. The copier moves the same pages as jobs of `--chunk` pages, the way the
chunked writer issues them, through its lanes (a CUDA stream, or a worker thread, per direction);
its time runs from the first submit to the last job seen done. Best of `--repeat`.
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from tokenflowd.engine.model.dummy import DUMMY_PRESETS
from tokenflowd.kv.copier import LOAD, WRITE, CopyJob
from tokenflowd.offload.copier import make_copier


def kv_cache(preset: str, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    cfg = DUMMY_PRESETS[preset]
    if device.type == "cuda":  # flashinfer's layout: [layers, 2, pages, kv_heads, page, head_dim]
        shape = (cfg.num_layers, 2, num_pages, cfg.num_kv_heads, page_size, cfg.head_dim)
    else:  # the torch backend's: [layers, 2, kv_heads, pages, page, head_dim]
        shape = (cfg.num_layers, 2, cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)
    return torch.randn(shape, dtype=torch.float32, device=device).to(dtype)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak(dev_flat: torch.Tensor, host_flat: torch.Tensor, lane: str, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        sync(dev_flat.device)
        t0 = time.perf_counter()
        if lane == WRITE:
            host_flat.copy_(dev_flat, non_blocking=True)
        else:
            dev_flat.copy_(host_flat, non_blocking=True)
        sync(dev_flat.device)
        best = min(best, time.perf_counter() - t0)
    return dev_flat.numel() * dev_flat.element_size() / best


def copier_rate(copier, num_pages: int, chunk: int, page_bytes: int, lane: str, repeat: int) -> float:
    best = float("inf")
    order = list(range(num_pages))
    for _ in range(repeat):
        sync(copier.dev.device)
        t0 = time.perf_counter()
        for i in range(0, num_pages, chunk):
            pages = order[i : i + chunk]
            copier.submit(CopyJob(lane, pages, pages, len(pages) * page_bytes))
        copier.wait()
        best = min(best, time.perf_counter() - t0)
        copier.poll()
    return num_pages * page_bytes / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default=None, help="model shapes (default: llama3-8b on GPU, smollm2-135m on CPU)")
    ap.add_argument("--pages", type=int, default=512)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=64, help="pages per copy job")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    preset = a.preset or ("llama3-8b" if device.type == "cuda" else "smollm2-135m")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cache = kv_cache(preset, a.pages, a.page_size, dtype, device)
    axis = 2 if device.type == "cuda" else 3  # the page axis of [layers, *shape]
    dev_pages = cache.movedim(axis, 0)  # [pages, layers, *rest], what the engine hands the copier
    host = torch.empty(dev_pages.shape, dtype=dtype, pin_memory=device.type == "cuda")
    page_bytes = dev_pages[0].numel() * dev_pages.element_size()
    copier = make_copier(dev_pages, host)
    dev_flat = torch.empty(a.pages * page_bytes // dev_pages.element_size(), dtype=dtype, device=device)
    host_flat = torch.empty(dev_flat.shape, dtype=dtype, pin_memory=device.type == "cuda")
    rows = {}
    for lane in (WRITE, LOAD):
        copier_rate(copier, a.pages, a.chunk, page_bytes, lane, 1)  # warm up: threads, allocator
        p = peak(dev_flat, host_flat, lane, a.repeat)
        c = copier_rate(copier, a.pages, a.chunk, page_bytes, lane, a.repeat)
        rows[lane] = {"peak_GBps": p / 1e9, "copier_GBps": c / 1e9, "ratio": c / p}
        print(f"{lane:6} ({'device->host' if lane == WRITE else 'host->device'}): peak {p / 1e9:6.2f} GB/s  "
              f"copier {c / 1e9:6.2f} GB/s  = {100 * c / p:5.1f}% of peak")
    dev_check = dev_pages[: a.pages].clone()
    copier.submit(CopyJob(WRITE, list(range(a.pages)), list(range(a.pages)), 0))
    copier.wait()
    copier.poll()
    assert torch.equal(host.to(device), dev_check), "the copier's bytes differ"
    copier.close()
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"machine": platform.processor() or platform.machine(), "device": str(device),
                       "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
                       "threads": torch.get_num_threads(), "preset": preset, "dtype": str(dtype),
                       "pages": a.pages, "page_bytes": page_bytes, "chunk": a.chunk, "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
