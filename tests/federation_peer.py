"""A KV receiver for tests/unit/test_kv_transport.py: a torch-layout KV cache of its own size and a
staging buffer, both registered with a Mooncake transport. It prints its endpoint, layout and
staging address as JSON, then answers "sha PAGES" (comma-separated) with the SHA-256 of those
pages, layer by layer, K then V, head by head; "scatter PAGES" puts the staged run into those
pages; "quit" ends it."""
from __future__ import annotations

import hashlib
import json
import math
import sys

import torch

from tokenflowd.federation.transport import KVLayout, MooncakeTransport, scatter_pages

LAYERS, KV_HEADS, PAGE, HEAD_DIM = 3, 2, 4, 8


def page_digest(layers: list[torch.Tensor], pages: list[int]) -> str:
    h = hashlib.sha256()
    for layer in layers:
        for plane in (0, 1):
            for head in range(KV_HEADS):
                for page in pages:
                    h.update(layer[plane, head, page].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    num_pages = int(sys.argv[1])
    cache = torch.zeros(LAYERS, 2, KV_HEADS, num_pages, PAGE, HEAD_DIM, dtype=torch.bfloat16)
    staging = torch.zeros(cache.numel(), dtype=torch.bfloat16)
    transport = MooncakeTransport()
    transport.register(cache)
    transport.register(staging)
    layout = KVLayout.of(list(cache.unbind(0)))
    print(json.dumps({"endpoint": transport.endpoint, "bases": layout.bases, "shape": layout.shape,
                      "itemsize": layout.itemsize, "staging": staging.data_ptr()}), flush=True)
    layers = list(cache.unbind(0))
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "sha":
            print(page_digest(layers, [int(p) for p in arg.split(",")]), flush=True)
        elif cmd == "scatter":
            pages = [int(p) for p in arg.split(",")]
            shape = (LAYERS, 2, KV_HEADS, len(pages), PAGE, HEAD_DIM)
            scatter_pages(staging[: math.prod(shape)].view(shape), layers, pages)
            print("ok", flush=True)
        elif cmd == "quit":
            break
    transport.close()


if __name__ == "__main__":
    main()
