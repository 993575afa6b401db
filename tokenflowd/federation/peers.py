"""The nodes this node exchanges KV with (`--federation-peers`), each URL in one spelling.

A request names a node in a header (the conductor's X-Tokenflowd-Prefill-Node); the header is a
client's word, so a node calls, and moves KV to or from, only the peers its operator listed: any
other URL would point the node's HTTP calls and its KV at a machine of the client's choice.
"""
from __future__ import annotations

from collections.abc import Iterable

from tokenflowd.config.values import normal_url


class Peers:
    """The listed nodes; `named(url)` is the listed spelling of `url`, or None when it is not listed."""

    def __init__(self, urls: Iterable[str]) -> None:
        self.urls = frozenset(u for u in map(normal_url, urls) if u is not None)

    def named(self, url: str) -> str | None:
        url = normal_url(url)
        return url if url in self.urls else None
