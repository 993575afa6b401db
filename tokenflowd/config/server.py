"""The server's configuration: the HTTP front, its limits, API keys and priority rights."""
from __future__ import annotations

from dataclasses import dataclass, field

MIN_HEARTBEAT_INTERVAL = 0.01  # s: an idle engine wakes this often at most (below: a busy spin)
MAX_PRIORITY = 1000  # the largest |priority| a request may carry (openai_api/schema.py)


@dataclass(frozen=True)
class KeyGrant:
    """One API key of the [auth] table and what its requests may do. The key is a secret: it is
    never printed (`--print-config` leaves [auth] out) nor logged."""

    key: str
    role: str = "user"  # a label for the operator ("operator", "agent"); rights come from max_priority alone
    max_priority: int = 0  # the highest `priority` its requests may set; 0: none above the default
    max_concurrent: int | None = None  # requests it may have open at once; None: [auth] default_max_concurrent

    def __post_init__(self) -> None:
        if not isinstance(self.key, str) or not self.key or self.key != self.key.strip() or "," in self.key:
            raise ValueError("an [auth] key must be a non-empty string without surrounding spaces or commas")
        if not isinstance(self.role, str) or not self.role:
            raise ValueError(f"[auth] role must be a non-empty string, got {self.role!r}")
        if type(self.max_priority) is not int or not 0 <= self.max_priority <= MAX_PRIORITY:
            raise ValueError(f"[auth] max_priority must be an integer in [0, {MAX_PRIORITY}], "
                             f"got {self.max_priority!r}")
        _check_concurrency("max_concurrent", self.max_concurrent)


def _check_concurrency(name: str, value: object) -> None:
    if value is not None and (type(value) is not int or value < 1):
        raise ValueError(f"[auth] {name} must be an integer >= 1 (or absent: no bound), got {value!r}")


@dataclass(frozen=True)
class AuthConfig:
    """The config file's [auth] table: API keys with the scheduling rights of their requests.

        [auth]
        default_max_priority = 0          # keys not listed here (--api-key-file, TOKENFLOWD_API_KEY), or anyone
                                          # when no key is configured at all
        [auth.keys."sk-ops-1"]            # the key itself, as clients send it: keep the file 0600
        role = "operator"
        max_priority = 10                 # its requests may set priority up to 10
        max_concurrent = 64               # requests it may have open at once (default: default_max_concurrent)

    A request's `priority` above its caller's ceiling is refused (403); a request beyond its key's
    open requests, 429. Listed keys are API keys too: with any key configured, /v1/* needs one
    (daemon/api/auth.py). On an open API (no key) there is no per-caller bound: every caller is one."""

    keys: tuple[KeyGrant, ...] = ()
    default_max_priority: int = 0
    default_max_concurrent: int | None = None  # open requests per key for keys without their own; None: no bound

    def __post_init__(self) -> None:
        if not all(isinstance(g, KeyGrant) for g in self.keys):
            raise ValueError("auth keys must be KeyGrant entries")
        if len({g.key for g in self.keys}) != len(self.keys):
            raise ValueError("an [auth] key is listed twice")
        if type(self.default_max_priority) is not int or not 0 <= self.default_max_priority <= MAX_PRIORITY:
            raise ValueError(f"[auth] default_max_priority must be an integer in [0, {MAX_PRIORITY}], "
                             f"got {self.default_max_priority!r}")
        _check_concurrency("default_max_concurrent", self.default_max_concurrent)

    @classmethod
    def from_table(cls, table: dict) -> "AuthConfig":
        """The [auth] table as TOML parsed it; raises ValueError naming what is wrong."""
        unknown = set(table) - {"keys", "default_max_priority", "default_max_concurrent"}
        if unknown:
            raise ValueError(f"unknown key {sorted(unknown)[0]!r} in [auth]; known: default_max_concurrent, "
                             "default_max_priority, keys")
        keys = table.get("keys", {})
        if not isinstance(keys, dict):
            raise ValueError('[auth] keys must be a table of tables: [auth.keys."KEY"] with role and max_priority')
        grants = []
        for key, grant in keys.items():
            if not isinstance(grant, dict):
                raise ValueError(f'[auth.keys."…"] must be a table with role and max_priority, got {grant!r}')
            extra = set(grant) - {"role", "max_priority", "max_concurrent"}
            if extra:
                raise ValueError(f"unknown key {sorted(extra)[0]!r} in an [auth.keys] entry; known: role, "
                                 "max_priority, max_concurrent")
            grants.append(KeyGrant(key, grant.get("role", "user"), grant.get("max_priority", 0),
                                   grant.get("max_concurrent")))
        return cls(tuple(grants), table.get("default_max_priority", 0), table.get("default_max_concurrent"))


@dataclass(frozen=True)
class ServerConfig:
    """The supervisor and its HTTP front."""

    host: str = "127.0.0.1"
    port: int = 8000
    engines: int | None = None  # None: one per visible GPU, or 1 on CPU
    served_model_name: str | None = None  # the name /v1/models lists; None: the --model value
    default_reading_rate: float = 20.0  # tokens/s for clients that state none (a fast human reader)
    max_reading_rate: float = 100.0  # tokens/s: a stated or learned rate above it is clamped to it
    max_waiting_requests: int = 512  # requests without a first token yet, over all engines; beyond: 429
    max_body_size: int = 4 * 2**20  # bytes; beyond: 413
    heartbeat_interval: float = 0.5  # an idle engine reports this often
    heartbeat_timeout: float = 30.0  # an engine silent this long is killed and restarted
    restart_backoff_max: float = 30.0  # seconds between restarts of an engine that keeps failing
    # s an engine may take from spawn to ready (loading weights, warm-up); beyond, it is killed and
    # restarted with backoff. Large models on slow disks take minutes.
    engine_start_timeout: float = 600.0
    runtime_dir: str | None = None  # where the private 0700 socket directory is made; None: the temp dir
    shutdown_timeout: float = 30.0  # s open streams may take to finish after SIGTERM
    # s of silence after which an SSE stream gets a comment line (a reader the engine pauses must
    # not be cut off by a proxy's or client's read timeout); 0: never
    sse_keepalive: float = 15.0
    # Rate-aware coalescing: while a client's modelled buffer holds at least coalesce_buffer s of
    # reading, its tokens go out as one SSE event per coalesce_interval s; below it, one per token.
    # The engine's output holds them (engine/process/pacing.py): the front pays per event, not per token.
    coalesce_buffer: float = 2.0
    coalesce_interval: float = 0.25  # 0: every token its own event
    write_stall_timeout: float = 60.0  # s a stream's write may wait for its reader; then it is aborted
    max_streams: int | None = None  # requests open at once (streamed or not); beyond: 429. None: no bound
    # connections open at once; beyond: 503. None: the open-file limit less a reserve (serve.py)
    max_connections: int | None = None
    header_timeout: float = 10.0  # s a request head (line and headers) may take to arrive (slow-loris)
    body_timeout: float = 60.0  # s a request body may take to arrive; beyond: 408
    keepalive_timeout: float = 75.0  # s an idle keep-alive connection stays open
    # API server processes sharing the port (SO_REUSEPORT); None: one per engine on a GPU box, 1 on CPU
    api_servers: int | None = None
    web_ui: bool = True  # the chat page at / (daemon/api/web_ui.py)
    api_key_file: str | None = None  # one key a line; with TOKENFLOWD_API_KEY, /v1/* needs a key (else 401)
    log_level: str = "INFO"  # DEBUG | INFO | WARNING | ERROR; a SIGHUP reload changes it live
    auth: AuthConfig = field(default_factory=AuthConfig)  # the file's [auth] table: keys and their rights

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.engines is not None and self.engines < 1:
            raise ValueError(f"engines must be >= 1, got {self.engines}")
        if not 0 < self.default_reading_rate < float("inf"):
            raise ValueError(f"default_reading_rate must be a finite rate above 0 tokens/s, got {self.default_reading_rate}")
        if not 0 < self.max_reading_rate < float("inf"):
            raise ValueError(f"max_reading_rate must be a finite rate above 0 tokens/s, got {self.max_reading_rate}")
        if self.default_reading_rate > self.max_reading_rate:
            raise ValueError(f"default_reading_rate ({self.default_reading_rate}) is above max_reading_rate "
                             f"({self.max_reading_rate}): lower the default or raise the maximum")
        if not isinstance(self.auth, AuthConfig):
            raise ValueError("auth must be an AuthConfig (the [auth] table)")
        if self.max_waiting_requests < 1:
            raise ValueError("max_waiting_requests must be >= 1")
        if self.max_body_size < 1024:
            raise ValueError("max_body_size must be at least 1KiB")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ValueError(f"log_level must be DEBUG, INFO, WARNING or ERROR, got {self.log_level!r}")
        if not 0 <= self.sse_keepalive < float("inf"):
            raise ValueError(f"sse_keepalive must be a finite number of seconds >= 0 (0: off), got {self.sse_keepalive}")
        for name in ("coalesce_buffer", "coalesce_interval"):
            if not 0 <= getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {getattr(self, name)}")
        for name in ("write_stall_timeout", "header_timeout", "body_timeout", "keepalive_timeout"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be a finite number of seconds above 0, got {getattr(self, name)}")
        if self.api_servers is not None and (type(self.api_servers) is not int or not 1 <= self.api_servers <= 64):
            raise ValueError(f"api_servers must be an integer in [1, 64] (or unset), got {self.api_servers!r}")
        if self.api_servers is not None and self.api_servers > 1 and self.port == 0:
            raise ValueError("api_servers above 1 needs a fixed port: the API server processes share it")
        for name in ("max_streams", "max_connections"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 (or unset: no bound), got {value!r}")
        if not 0 <= self.shutdown_timeout < float("inf"):
            raise ValueError(f"shutdown_timeout must be a finite number of seconds >= 0, got {self.shutdown_timeout}")
        if not MIN_HEARTBEAT_INTERVAL <= self.heartbeat_interval < self.heartbeat_timeout < float("inf"):
            raise ValueError(f"heartbeat_interval must be at least {MIN_HEARTBEAT_INTERVAL} s (an idle engine wakes "
                             f"that often) and below heartbeat_timeout, itself finite; got {self.heartbeat_interval} "
                             f"and {self.heartbeat_timeout}")
        if not 0 < self.engine_start_timeout < float("inf"):
            raise ValueError(f"engine_start_timeout must be a finite number of seconds above 0, "
                             f"got {self.engine_start_timeout}")
        if not 0 <= self.restart_backoff_max < float("inf"):
            raise ValueError(f"restart_backoff_max must be a finite number of seconds >= 0, "
                             f"got {self.restart_backoff_max}")
