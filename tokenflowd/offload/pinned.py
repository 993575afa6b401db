"""Host memory for the host KV tier on a GPU box: exactly the bytes asked for, placed on the GPU's
NUMA node where the OS says which it is, and page-locked for the copier's asynchronous copies.

torch's pinned allocator (pin_memory=True) rounds each block up to a power of two: a 33 GiB tier
takes 64 GiB of locked RAM. Here an anonymous mapping of exactly the tier's bytes is registered
with CUDA (cudaHostRegister), and the copies read it as they read pinned memory.

NOTE: the registration must end before the mapping does, or the next allocation at that address
fails to register ("already mapped"). The mapping owns it: the tensor holds the mapping alive,
and the mapping unregisters as it goes, whenever the last view of the tensor does.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def gpu_numa_node(device: int = 0) -> int | None:
    """The NUMA node of CUDA device `device` (sysfs, from its PCI address), or None where the OS
    does not say (one node, or a virtual machine)."""
    props = torch.cuda.get_device_properties(device)
    domain, bus, dev = (getattr(props, f"pci_{name}_id", None) for name in ("domain", "bus", "device"))
    if bus is None:
        return None
    path = Path(f"/sys/bus/pci/devices/{domain or 0:04x}:{bus:02x}:{dev or 0:02x}.0/numa_node")
    try:
        node = int(path.read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def bind_to_node(address: int, nbytes: int, node: int) -> bool:
    """Place the not yet touched pages of [address, address + nbytes) on NUMA node `node`
    (libnuma's numa_tonode_memory); False where libnuma is missing."""
    name = ctypes.util.find_library("numa")
    if name is None:
        return False
    numa = ctypes.CDLL(name)
    if numa.numa_available() < 0:
        return False
    numa.numa_tonode_memory(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), ctypes.c_int(node))
    return True


class LockedMapping(mmap.mmap):
    """Anonymous memory (zero-filled, touched only when locked) registered with CUDA for as long as
    it lives."""

    address: int = 0
    registered: bool = False

    def lock(self, node: int | None) -> None:
        view = (ctypes.c_char * len(self)).from_buffer(self)
        self.address = ctypes.addressof(view)
        del view  # the export would keep the mapping from ever closing
        if node is not None and not bind_to_node(self.address, len(self), node):
            log.info("libnuma is missing: the host KV tier is not bound to the GPU's NUMA node %d", node)
        err = int(torch.cuda.cudart().cudaHostRegister(self.address, len(self), 0))
        if err != 0:
            raise RuntimeError(f"cudaHostRegister of {len(self) / 2**30:.1f} GiB failed with CUDA error {err} "
                               "(the memlock limit? systemd's LimitMEMLOCK=infinity)")
        self.registered = True

    def __del__(self) -> None:
        if self.registered:
            self.registered = False
            try:
                torch.cuda.cudart().cudaHostUnregister(self.address)
            except Exception:  # noqa: BLE001 - at interpreter exit torch may be gone; so is the process
                pass


def pinned_zeros(shape: tuple[int, ...], dtype: torch.dtype, node: int | None = None) -> torch.Tensor:
    """A zeroed CPU tensor whose exact bytes are page-locked with CUDA, on NUMA node `node` when
    given and libnuma is there; unlocked when the last view of it is freed."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    mapping = LockedMapping(-1, max(nbytes, 1))
    mapping.lock(node)
    return torch.frombuffer(mapping, dtype=dtype, count=torch.Size(shape).numel()).view(shape)
