"""API keys: `Authorization: Bearer KEY` on /v1/*, checked in constant time.

Keys come from `--api-key-file` (one a line; blank lines and `#` comments skipped) and from the
TOKENFLOWD_API_KEY environment variable (comma-separated), so a systemd unit can hand them over
with LoadCredential= or EnvironmentFile= without putting them on the command line. With no key
configured the API is open (the daemon binds 127.0.0.1 unless told otherwise). /health and
/metrics stay open: systemd, load balancers and Prometheus probe them without secrets.
"""
from __future__ import annotations

import hmac
import os

from aiohttp import web

from tokenflowd.api.errors import error_response

ENV_VAR = "TOKENFLOWD_API_KEY"
PROTECTED_PREFIX = "/v1/"


def load_api_keys(path: str | None, environ: dict[str, str] | None = None) -> tuple[bytes, ...]:
    env = os.environ if environ is None else environ
    keys = [k.strip() for k in env.get(ENV_VAR, "").split(",")]
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                keys += [line.strip() for line in f if not line.lstrip().startswith("#")]
        except OSError as e:
            raise ValueError(f"cannot read the API key file {path!r}: {e.strerror}") from None
        if not any(keys):
            raise ValueError(f"the API key file {path!r} holds no key")
    return tuple(k.encode() for k in keys if k)


def key_matches(given: bytes, keys: tuple[bytes, ...]) -> bool:
    """Compares against every key, whatever matches, so the time taken tells nothing."""
    found = False
    for key in keys:
        found |= hmac.compare_digest(given, key)
    return found


def auth_middleware(keys: tuple[bytes, ...]):
    @web.middleware
    async def check_key(request: web.Request, handler) -> web.StreamResponse:
        if keys and request.path.startswith(PROTECTED_PREFIX):
            header = request.headers.get("Authorization", "")
            scheme, _, given = header.partition(" ")
            if scheme.lower() != "bearer" or not given:
                return error_response(401, "this server needs an API key: send 'Authorization: Bearer KEY'",
                                      code="missing_api_key", headers={"WWW-Authenticate": "Bearer"})
            if not key_matches(given.strip().encode(), keys):
                return error_response(401, "the API key is not valid: check the key you sent",
                                      code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return check_key
