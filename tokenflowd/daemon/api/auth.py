"""API keys: `Authorization: Bearer KEY` on /v1/*, checked in constant time; and what a key may do.

Keys come from `--api-key-file` (one a line; blank lines and `#` comments skipped), from the
TOKENFLOWD_API_KEY environment variable (comma-separated), so a systemd unit can hand them over
with LoadCredential= or EnvironmentFile= without putting them on the command line, and from the
config file's [auth] table (config.AuthConfig), which also grants rights. With no key configured
the API is open (the daemon binds 127.0.0.1 unless told otherwise). /health and /metrics stay
open: systemd, load balancers and Prometheus probe them without secrets.

Rights: a request's `priority` above 0 jumps the queue ahead of everyone else's, so it is honoured
only up to its key's `max_priority` ([auth.keys."KEY"]; keys not listed there, and everyone on an
open API, get `[auth] default_max_priority`, 0 unless the operator says otherwise); above it the
request is refused with a 403 that says what the key may send. A priority below 0 is anyone's:
it only puts the caller's own request behind the others (an agent yielding to people). A key
may also be bounded in the requests it has open at once (`max_concurrent`; daemon/api/app.py answers 429).

/federation/* (daemon/api/federation.py) is the cluster's own: the conductor's polls and the nodes'
orders to each other, which compute prompts, write KV into a node's prefix cache and list its
cached pages' keys. With keys configured it takes only keys of [auth] role "node"
(`[auth.keys."KEY"] role = "node"`): a client's key, however privileged, is refused (403). A node
sends its own key to its peers from TOKENFLOWD_NODE_KEY; the conductor from its config's api_key.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from dataclasses import dataclass

from aiohttp import web

from tokenflowd.config import AuthConfig
from tokenflowd.openai_api.errors import error_response

ENV_VAR = "TOKENFLOWD_API_KEY"
NODE_KEY_ENV_VAR = "TOKENFLOWD_NODE_KEY"  # the key this node sends to its peers' /federation/*
PROTECTED_PREFIX = ("/v1/", "/federation/")
FEDERATION_PREFIX = "/federation/"
NODE_ROLE = "node"  # the [auth] role of the keys of a cluster's nodes and its conductor


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent a request, as its API key says."""

    identity: str  # a digest of the key: names the caller (ownership, cadence) without revealing it; "" if open
    role: str  # the [auth] grant's label; "user" for keys without one, "anonymous" on an open API
    max_priority: int  # the highest `priority` its requests may set
    max_concurrent: int | None = None  # requests it may have open at once (None: no bound)


CALLER = web.RequestKey("caller", Caller)


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


def exposure_warning(host: str, table: "KeyTable") -> str | None:
    """What to warn an operator of at start: /v1/* open to anyone on a non-loopback address."""
    if not table.open:
        return None
    try:
        local = ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: only "localhost" is known to stay on the machine
        local = host == "localhost"
    if local:
        return None
    return (f"listening on {host} with no API key: anyone who can reach it may generate text, set reading "
            f"rates and priorities; set --api-key-file, TOKENFLOWD_API_KEY or [auth] keys, or bind to 127.0.0.1")


def node_key(environ: dict[str, str] | None = None) -> str | None:
    """The key this node sends to its peers' /federation/* (None: none, an open cluster)."""
    key = (os.environ if environ is None else environ).get(NODE_KEY_ENV_VAR, "").strip()
    return key or None


def key_matches(given: bytes, keys: tuple[bytes, ...]) -> bool:
    """Compares against every key, whatever matches, so the time taken tells nothing."""
    found = False
    for key in keys:
        found |= hmac.compare_digest(given, key)
    return found


class KeyTable:
    """Every configured key and the caller it names. A key in both the plain lists and [auth]
    gets its [auth] grant."""

    def __init__(self, plain_keys: tuple[bytes, ...], auth: AuthConfig) -> None:
        default = auth.default_max_concurrent
        callers = {key: Caller(_identity(key), "user", auth.default_max_priority, default) for key in plain_keys}
        for grant in auth.keys:
            key = grant.key.encode()
            concurrent = grant.max_concurrent if grant.max_concurrent is not None else default
            callers[key] = Caller(_identity(key), grant.role, grant.max_priority, concurrent)
        self._entries = tuple(callers.items())
        self.anonymous = Caller("", "anonymous", auth.default_max_priority)

    @property
    def open(self) -> bool:
        """No key configured: anyone may call /v1/*."""
        return not self._entries

    def resolve(self, given: bytes) -> Caller | None:
        """The caller `given` names, or None. Compares against every key (constant time)."""
        found = None
        for key, caller in self._entries:
            if hmac.compare_digest(given, key):
                found = caller
        return found


def _identity(key: bytes) -> str:
    return hashlib.sha256(b"tokenflowd-caller:" + key).hexdigest()[:16]


def priority_refusal(caller: Caller, priority: int) -> str | None:
    """Why `caller` may not set `priority`, or None when it may (always for priority <= 0)."""
    if priority <= caller.max_priority:
        return None
    who = "requests without an API key" if caller.role == "anonymous" else "this key"
    if caller.max_priority == 0:
        return (f"priority {priority} needs an API key allowed priorities up to at least {priority}; {who} may not "
                f"set priority above 0 (send 0 or a negative priority, or use a key an operator granted "
                f"max_priority in the config's [auth] table)")
    return (f"priority {priority} is above what {who} may set ({caller.max_priority}): send at most "
            f"{caller.max_priority}, or ask an operator to raise max_priority for this key in [auth]")


def auth_middleware(table: KeyTable):
    @web.middleware
    async def check_key(request: web.Request, handler) -> web.StreamResponse:
        if request.path.startswith(PROTECTED_PREFIX):
            if table.open:
                request[CALLER] = table.anonymous
            else:
                header = request.headers.get("Authorization", "")
                scheme, _, given = header.partition(" ")
                if scheme.lower() != "bearer" or not given:
                    return error_response(401, "this server needs an API key: send 'Authorization: Bearer KEY'",
                                          code="missing_api_key", headers={"WWW-Authenticate": "Bearer"})
                caller = table.resolve(given.strip().encode())
                if caller is None:
                    return error_response(401, "the API key is not valid: check the key you sent",
                                          code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                if request.path.startswith(FEDERATION_PREFIX) and caller.role != NODE_ROLE:
                    return error_response(403, f"{FEDERATION_PREFIX}* is for the cluster's nodes and conductor: "
                                               f'send a key granted role = "{NODE_ROLE}" in the [auth] table',
                                          code="not_a_node")
                request[CALLER] = caller
        return await handler(request)

    return check_key
