"""A KV receiver for tests/unit/test_kv_transport.py: a torch-layout KV cache of its own size and a
staging buffer, both registered with a Mooncake transport. It prints its endpoint, layout and
staging address as JSON, then answers "sha PAGES" (comma-separated) with the SHA-256 of those
pages, layer by layer, K then V, head by head; "scatter PAGES" puts the staged run into those
pages; "zero PAGES" clears them; anything else ends it. bench/kv_transport.py runs it too, with
the embedded model's shape (--shape, --dtype)."""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys

import torch

from tokenflowd.federation.transport import KVLayout, MooncakeTransport
from tokenflowd.kv.staging import scatter_pages

LAYERS, KV_HEADS, PAGE, HEAD_DIM = 3, 2, 4, 8  # the tests' shape; bench/kv_transport.py passes its own


def page_digest(layers: list[torch.Tensor], pages: list[int]) -> str:
    """SHA-256 of `pages` of each layer ([2, kv_heads, num_pages, page_size, d]), layer by layer,
    K then V, head by head."""
    h = hashlib.sha256()
    for layer in layers:
        for plane in (0, 1):
            for head in range(layer.shape[1]):
                for page in pages:
                    h.update(layer[plane, head, page].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("num_pages", type=int)
    ap.add_argument("--shape", default=f"{LAYERS},{KV_HEADS},{PAGE},{HEAD_DIM}", help="layers,kv_heads,page,head_dim")
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args()
    layers_n, kv_heads, page, head_dim = (int(x) for x in a.shape.split(","))
    cache = torch.zeros(layers_n, 2, kv_heads, a.num_pages, page, head_dim, dtype=getattr(torch, a.dtype))
    staging = torch.zeros(cache.numel(), dtype=cache.dtype)
    transport = MooncakeTransport()
    transport.register(cache)
    transport.register(staging)
    layout = KVLayout.of(list(cache.unbind(0)))
    print(json.dumps({"endpoint": transport.endpoint, "bases": layout.bases, "shape": layout.shape,
                      "itemsize": layout.itemsize, "staging": staging.data_ptr()}), flush=True)
    layers = list(cache.unbind(0))
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        pages = [int(p) for p in arg.split(",")] if arg else []
        if cmd == "sha":
            print(page_digest(layers, pages), flush=True)
        elif cmd == "zero":
            for layer in layers:
                layer[:, :, pages] = 0
            print("ok", flush=True)
        elif cmd == "scatter":
            shape = (layers_n, len(pages), 2, kv_heads, page, head_dim)  # gather_pages' wire layout
            scatter_pages(staging[: math.prod(shape)].view(shape), layers, pages)
            print("ok", flush=True)
        else:
            break
    transport.close()


if __name__ == "__main__":
    main()
