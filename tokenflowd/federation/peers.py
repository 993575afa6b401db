"""The nodes this node exchanges KV with (`--federation-peers`), each URL in one spelling.

A request names a node in a header (the conductor's X-Tokenflowd-Prefill-Node); the header is a
client's word, so a node calls, and moves KV to or from, only the peers its operator listed: any
other URL would point the node's HTTP calls and its KV at a machine of the client's choice.
"""
from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import urlsplit

_DEFAULT_PORTS = {"http": 80, "https": 443}


def normal_url(url: str) -> str | None:
    """`url` as the peer list holds it: scheme and host in lower case, the scheme's default port
    left out, no trailing slash; None when it is not the http(s) URL of a host (user info, a
    query or a fragment have no place in a node's base URL)."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:  # a port that is not a number, or out of range
        return None
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS or not parts.hostname or parts.username is not None or parts.query \
            or parts.fragment:
        return None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname  # hostname is lower case
    if port is not None and port != _DEFAULT_PORTS[scheme]:
        host += f":{port}"
    return f"{scheme}://{host}{parts.path.rstrip('/')}"


class Peers:
    """The listed nodes; `named(url)` is the listed spelling of `url`, or None when it is not listed."""

    def __init__(self, urls: Iterable[str]) -> None:
        self.urls = frozenset(u for u in map(normal_url, urls) if u is not None)

    def named(self, url: str) -> str | None:
        url = normal_url(url)
        return url if url in self.urls else None
