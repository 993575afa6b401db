"""Values as an operator writes them: sizes with units, node URLs in one spelling."""
from __future__ import annotations

import re
from urllib.parse import urlsplit

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """'24MiB' -> 25165824, '4GiB', '1.5GB', '4096' -> bytes. Raises ValueError with the accepted units."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must be non-negative, got {text}")
        return text
    m = _SIZE_RE.match(text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"cannot parse size {text!r}: use a number with an optional unit such as 512MiB, 4GiB or 2GB")
    return int(float(m.group(1)) * _UNITS[unit])


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
