"""The engine's KV tiers and manager, from its configuration."""
from __future__ import annotations

import logging
import os

import torch

from tokenflowd.config import EngineConfig
from tokenflowd.kv.manager import KVCacheManager
from tokenflowd.kv.pages import PagePool
from tokenflowd.offload.copier import make_copier
from tokenflowd.offload.tiers import DiskTier, HostTier
from tokenflowd.offload.traffic import HostOffloader

log = logging.getLogger(__name__)


# The node's host tiers together take at most this share of its RAM by default (pinned memory
# cannot be swapped out: the rest is the OS's, the API servers' and the page cache's).
HOST_RAM_SHARE = 0.25
# A GPU's host tier holds this many device pools by default. A burst's working set outgrows the
# device many times over; a host tier no larger than the device pool evicts preempted KV that is
# then recomputed: in the simulator (bench/sim_table1.py) 4090-b and 4090-d lost 9% of fcfs's raw
# throughput to it with a 1× tier, and gained 3–8% with 4× (more changed nothing).
HOST_POOLS_PER_DEVICE_POOL = 4


def host_budget(config: EngineConfig, device_kv_bytes: int, ram: int | None = None) -> int:
    """Bytes of host tier: as asked, else on a GPU box HOST_POOLS_PER_DEVICE_POOL× the device pool
    within this engine's share of HOST_RAM_SHARE of the node's `ram` (the node's engines split it
    evenly; each engine sees one GPU, so the GPU count says nothing here). The tier is locked
    exactly (offload/pinned.py), with no allocator rounding on top. On a CPU, where the device
    pool is host memory too, as large as the device pool."""
    if config.host_kv_memory is not None:
        return config.host_kv_memory
    if not config.device.startswith("cuda"):
        return device_kv_bytes
    ram = ram if ram is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    share = int(ram * HOST_RAM_SHARE) // max(1, config.engines_on_node)
    return min(HOST_POOLS_PER_DEVICE_POOL * device_kv_bytes, share)


def build_kv(config: EngineConfig, kv_cache: torch.Tensor, page_axis: int, num_pages: int) -> KVCacheManager:
    """The KV manager over `kv_cache` ([layers, *shape], `num_pages` pages on axis 1 + page_axis),
    with a host tier unless offload is off or it would hold no page."""
    device = PagePool(num_pages, config.enable_prefix_caching)
    if config.offload == "none":
        return KVCacheManager(device, config.page_size)
    device_pages = kv_cache.movedim(1 + page_axis, 0)  # [num_pages + 1, layers, *rest]
    page_bytes = device_pages[0].numel() * device_pages.element_size()
    num_host = host_budget(config, num_pages * page_bytes) // page_bytes
    if num_host < 1:
        log.warning("host KV tier holds no page: offload off, preempted KV is recomputed")
        return KVCacheManager(device, config.page_size)
    disk = None
    if config.disk_kv_memory:
        directory = config.disk_kv_dir or os.environ["STATE_DIRECTORY"].split(":")[0]
        disk = DiskTier(directory, max(1, config.disk_kv_memory // page_bytes), page_bytes)
    on_gpu = device_pages.device.type == "cuda"
    node = None
    if on_gpu:
        from tokenflowd.offload.pinned import gpu_numa_node

        node = gpu_numa_node(device_pages.device.index or 0)
    host = HostTier.create(num_host, tuple(device_pages.shape[1:]), device_pages.dtype, pin=on_gpu,
                           enable_prefix_caching=config.enable_prefix_caching, disk=disk, numa_node=node)
    log.info("host KV tier: %d pages (%.1f MiB, %s%s)%s", num_host, num_host * page_bytes / 2**20, config.offload,
             f", pinned on NUMA node {node}" if node is not None else ", pinned" if on_gpu else "",
             f", disk tier {disk.num_pages} pages in {directory}" if disk else "")
    offloader = HostOffloader(device, config.page_size, host, make_copier(device_pages, host.pages), config.offload,
                              config.load_evict_overlap)
    return KVCacheManager(device, config.page_size, offloader)
