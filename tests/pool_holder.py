"""A pool holder process for tests/unit/test_pool_query.py: a KV cache of seeded random pages in
shared memory (read mode maps it), a page table of segment keys, and a QueryService over them.
It prints its reference counts on request (stdin "refs") and exits on "quit"."""
from __future__ import annotations

import sys

import torch

from tokenflowd.engine.attention.torch_backend import TorchAttentionBackend
from tokenflowd.pool.query import QueryService
from tokenflowd.pool.shared_kv import SharedKV

HEADS, KV_HEADS, HEAD_DIM, PAGE, LAYERS, PAGES = 6, 2, 16, 4, 3, 40
SEGMENTS = {bytes([i]): [2 * i + 7, 2 * i + 8] for i in range(8)}  # key -> its two pages


def caches(seed: int) -> list[torch.Tensor]:
    backend = backend_()
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(backend.kv_cache_shape(PAGES), generator=gen) for _ in range(LAYERS)]


def backend_() -> TorchAttentionBackend:
    args = (HEADS, KV_HEADS, HEAD_DIM, PAGE, torch.float32, torch.device("cpu"))
    return TorchAttentionBackend(*args, paged_kernel=False)


def main() -> None:
    address, seed, shm_name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    shared = SharedKV.create(shm_name, LAYERS, backend_().kv_cache_shape(PAGES), torch.float32)
    for layer, values in zip(shared.layers, caches(seed)):  # read mode maps this; query mode serves it
        layer.copy_(values)
    refs: dict[int, int] = {}

    def resolve(keys):
        out = []
        for key in keys:
            if key not in SEGMENTS:
                break
            out.append(SEGMENTS[key])
            for page in SEGMENTS[key]:
                refs[page] = refs.get(page, 0) + 1
        return out

    def release(segments):
        for pages in segments:
            for page in pages:
                refs[page] -= 1

    service = QueryService(address, backend_(), shared.layers, resolve, release).start()
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "refs":
            print(sum(refs.values()), service.pinned_requests, flush=True)
        elif line.strip() == "quit":
            break
    service.close()
    shared.close()


if __name__ == "__main__":
    main()
