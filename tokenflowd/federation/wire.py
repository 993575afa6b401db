"""What crosses between a federation's nodes and its conductor over HTTP: the headers a request
carries from the conductor, and the JSON bodies of /federation/* (daemon/api/federation.py serves
them; federation/conductor/ sets the headers).
"""
from __future__ import annotations

import msgspec

from tokenflowd import protocol as p

PREFILL_HEADER = "X-Tokenflowd-Prefill-Node"
PREFIX_HEADER = "X-Tokenflowd-Prefix-Node"  # the prefill node first pulls the prompt's longer prefix from there
HEARTBEAT = 1.0  # s between a prefill node's signs of life while it computes a prompt


class PrefillOrder(msgspec.Struct):
    request_id: str
    prompt_token_ids: list[int]
    sampling: p.Sampling
    target: p.KVTarget | None
    send_window: float  # s from now in which writes may start (federation/timing.py)
    priority: int = 0  # the client's, for the prefill node's queue
    reading_rate: float | None = None
    pull_from: str | None = None  # another prefill node holding a longer prefix: pull it first (PREFIX_HEADER)


class PrefillAnswer(msgspec.Struct):
    ok: bool
    first_token: int | None = None
    checksum: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    settled: bool = True  # its writes are over (the decode node still gives their last bytes a grace)


class KeepOrder(msgspec.Struct):
    store_id: str
    token_ids: list[int]


class KeepAnswer(msgspec.Struct):
    held: int
    target: p.KVTarget | None = None


class KeptReport(msgspec.Struct):
    store_id: str
    ok: bool
    checksum: int = 0
    num_pages: int = 0
    unwritten: bool = False  # the giver never wrote: the keeper frees the pages at once


class GiveOrder(msgspec.Struct):
    store_id: str
    token_ids: list[int]
    held: int  # leading whole pages the keeper holds already: the giver writes those after them
    target: p.KVTarget


class GiveAnswer(msgspec.Struct):
    """Once the giver's writes have settled: ok, and the crc32 of the pages it wrote."""

    ok: bool
    checksum: int = 0
    num_pages: int = 0
    error: str | None = None
    unwritten: bool = False  # refused before any write: nothing can land at the target
