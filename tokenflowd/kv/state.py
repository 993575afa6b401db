"""What the KV manager knows of a request (the Request protocol) and what it keeps for one
(RequestKV): the request's pages in every tier and the frontiers between them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


class Request(Protocol):
    """What the KV manager reads of a request (engine/request.py's Request is one)."""

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int  # written by admit / load / release
    num_cached_tokens: int  # written by admit
    num_preemptions: int
    key_seed: bytes  # the key chained before token_ids[0] (b"": the sequence's start)

    @property
    def num_tokens(self) -> int: ...

    @property
    def is_finished(self) -> bool: ...


@dataclass(eq=False, slots=True)
class RequestKV:
    """One request's KV across the tiers. The KV manager (kv/manager.py) writes its device half;
    its offloader (kv/offloader.py, offload/traffic.py) writes the host half.

    block_table[i] holds token page i on the device; host_pages[i] on the host, with
    len(host_pages) == cdiv(num_offload_issued, page_size) (only its last page can be partial, and a
    partial page is never in a prefix cache)."""

    # device: the manager's
    block_table: list[int] = field(default_factory=list)
    page_hashes: list[bytes] = field(default_factory=list)  # chained keys of full pages, lazily extended
    num_published_pages: int = 0  # leading pages of block_table offered to the device prefix cache
    num_load_tokens: int = 0  # num_computed_tokens once the load is in place
    load_source: str = ""  # the tier the load reads (HOST; DISK hits are promoted to the host first)
    remote_until: float = 0.0  # a REMOTE load: by then (monotonic) its sender can write no more
    # host: the offloader's
    host_pages: list[int] = field(default_factory=list)
    num_offloaded_tokens: int = 0  # the write frontier: leading tokens whose KV the host holds
    num_offload_issued: int = 0  # leading tokens whose copy to the host is issued (>= the frontier)
    load_queue: list[tuple[int, int]] = field(default_factory=list)  # (device, host) pages not yet issued
    num_loading_pages: int = 0  # loads issued and not yet done
    epoch: int = 0  # moves on at each failed copy: copies issued before it carry nothing to trust
    recompute: bool = False  # a load of it failed: it is recomputed, never loaded again
    # the manager's: its last view_match while it waits, with what that match read (kv/manager.py)
    view_match: tuple | None = None
