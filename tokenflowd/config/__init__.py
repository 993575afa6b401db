"""Frozen, validated configuration. "auto" values are resolved before freezing."""
from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass, field

from tokenflowd.federation.peers import normal_url

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


POLICY_NAMES = ("fcfs", "andes", "tokenflow")  # --policy; buffer/__init__.py builds each (named here, not imported)

@dataclass(frozen=True)
class PolicyConfig:
    """Parameters of the scheduling policies (`--policy`). The TokenFlow paper (tokenflow.txt §4,
    §7.5) names them and gives ranges, not defaults, for most; the defaults here say why."""

    # tokenflow
    schedule_interval: float = 0.5  # s between buffer-balancing passes while stressed; §7.5: 0.5–1.5, shorter is slightly better
    buffer_conservativeness: float = 2.0  # μ ≥ 1: a victim's buffer must cover μ× its swap time (1 agile … 20 SGLang-like)
    stall_penalty: float = 64.0  # γ, in tokens: what an empty buffer costs in the utility (one interval of a fast reader ≈ 10–30)
    working_set_lambda: float = 0.5  # λ of eq. 5: how far the working set shrinks towards N_running
    critical_buffer: float = 1.0  # T_critical, s of reading: a buffer below it makes the engine "stressed"
    expected_output_len: int = 1024  # tokens assumed for the §7.1.3 value of a request with no max_tokens
    # s a started stream may wait on an empty buffer before it comes back ahead of new requests, even
    # when not every reader can be fed (Σr > Γ): bounds the silences of an overloaded engine (proxies
    # and clients give up after 60 s without a byte)
    max_stall: float = 10.0
    # andes
    andes_horizon: float = 2.0  # s: the look-ahead over which Andes compares QoE gains
    andes_max_preempt_fraction: float = 0.5  # Andes' cap on preemptions per pass, as a fraction of the batch
    andes_expected_ttft: float = 1.0  # s: when a reader expects its first token (Andes' expected TTFT)
    andes_interval: float = 0.5  # s between knapsack passes while memory is contended
    andes_memory_trigger: float = 0.9  # device-page use at which Andes starts choosing (its selective triggering)

    def __post_init__(self) -> None:
        for name in ("schedule_interval", "buffer_conservativeness", "stall_penalty", "critical_buffer", "max_stall",
                     "andes_horizon", "andes_expected_ttft", "andes_interval"):
            value = getattr(self, name)
            if not math.isfinite(value):  # inf passes every lower bound below, and no pass would ever run
                raise ValueError(f"{name} must be a finite number, got {value}")
        if not self.schedule_interval > 0:
            raise ValueError(f"schedule_interval must be above 0 s, got {self.schedule_interval}")
        if not self.buffer_conservativeness >= 1.0:
            raise ValueError(f"buffer_conservativeness (μ) must be >= 1, got {self.buffer_conservativeness}")
        if not self.stall_penalty >= 0:
            raise ValueError(f"stall_penalty (γ) must be >= 0, got {self.stall_penalty}")
        if not 0.0 <= self.working_set_lambda <= 1.0:
            raise ValueError(f"working_set_lambda (λ) must be in [0, 1], got {self.working_set_lambda}")
        if not self.critical_buffer >= 0:
            raise ValueError(f"critical_buffer must be >= 0 s, got {self.critical_buffer}")
        if not self.max_stall > 0:  # 0 would make every preempted reader "silent", however full its buffer
            raise ValueError(f"max_stall must be above 0 s, got {self.max_stall}")
        if self.expected_output_len < 1:
            raise ValueError("expected_output_len must be >= 1")
        if not self.andes_horizon > 0:
            raise ValueError(f"andes_horizon must be above 0 s, got {self.andes_horizon}")
        if not 0.0 < self.andes_max_preempt_fraction <= 1.0:
            raise ValueError("andes_max_preempt_fraction must be in (0, 1]")
        if not self.andes_expected_ttft >= 0:
            raise ValueError(f"andes_expected_ttft must be >= 0 s, got {self.andes_expected_ttft}")
        if not self.andes_interval > 0:
            raise ValueError(f"andes_interval must be above 0 s, got {self.andes_interval}")
        if not 0.0 <= self.andes_memory_trigger <= 1.0:
            raise ValueError(f"andes_memory_trigger must be in [0, 1], got {self.andes_memory_trigger}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine needs, concrete (no "auto" left). Build with `EngineConfig.resolve`."""

    model: str = "smollm2-135m"
    device: str = "cpu"
    dtype: str = "float32"  # torch dtype name
    # none | int4 (CPU: the projections as int4 weights, engine/model/quant.py); resolve's "auto" is int4 on a
    # CPU for a GGUF whose projections are Q4_0/Q4_1, else none. The default stays none: on a 2-core AVX2
    # CPU int4 decodes 1.6-2x faster at batch 1 but prefills 1.5x slower and batches of 16-32 no faster.
    quantization: str = "none"
    page_size: int = 16
    num_pages: int = 0  # 0: derived from kv_cache_memory when the engine starts
    kv_cache_memory: int | None = None  # bytes; None: gpu_memory_utilization of free GPU memory / 1 GiB on CPU
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = 512  # the token budget of one step
    max_num_seqs: int = 256
    max_model_len: int | None = None  # None: the model's context, capped by the KV pool
    enable_prefix_caching: bool = True
    attention_backend: str = "torch"  # torch | flashinfer
    # torch backend on a CPU: decodes read K/V in place through the C++ kernel (attention/cpu_kernels.py,
    # off also by TOKENFLOWD_CPU_KERNELS=0); off, or where it cannot be built: pages are gathered
    paged_kernel: bool = True
    cuda_graphs: bool = False
    # tokenflow: buffer-aware preemption (buffer/tokenflow.py): under bursts it beats fcfs on
    # effective throughput and tail TTFT (bench/sim_table1.py), and with write-through offload a
    # preemption costs a copy rather than a recompute
    policy: str = "tokenflow"
    policy_params: PolicyConfig = field(default_factory=PolicyConfig)
    seed: int = 0
    num_threads: int | None = None  # CPU intra-op threads; None: torch's default
    # The host KV tier (offload/): none (preempted KV is recomputed) | write-back | write-through
    offload: str = "write-through"
    host_kv_memory: int | None = None  # bytes; None: 4× the device pool within a quarter of RAM per GPU (CPU: 1×)
    disk_kv_memory: int = 0  # bytes of disk tier under disk_kv_dir; 0: none
    disk_kv_dir: str | None = None  # None: $STATE_DIRECTORY (systemd's StateDirectory=)
    load_evict_overlap: bool = True  # loads run while evictions are in flight (off: the ablation's baseline)
    # s: a request whose predicted time to first token exceeds it gets 429 at once (engine/admission.py); None: off
    max_queue_delay: float | None = None
    # The node's prefix-cache pool across engines (pool/): off (each engine its own cache, the
    # router follows prefixes), query (a request's prefix pages held by a peer stay there; its
    # query rows go to the peer each layer and come back as partial attention merged by LSE), or
    # read (the engine maps the peer's KV cache and attends to its pages in place; CPU only)
    pool_mode: str = "off"
    # tokens of a pool segment, the unit a request reads from one holder; 0: the threshold of
    # pool/segments.py with α, B and k_comp measured at start-up (logged)
    pool_segment_tokens: int = 0
    # where the pool keeps a new segment: home (the engine its key hashes to, pool/homes.py;
    # the engine that computed it puts it there) or local (where it was computed)
    pool_placement: str = "home"
    # Federation (federation/): both (prefill and decode here), prefill (prompts computed here have
    # their KV written to decode nodes, layer by layer) or decode (prompts' KV comes from prefill nodes)
    role: str = "both"
    kv_host: str = "127.0.0.1"  # where the KV transfer engine listens (prefill and decode roles)
    kv_transfer_timeout: float = 30.0  # s a transfer between nodes may take before it is given up
    # the nodes this node exchanges KV with (federation/peers.py), as base URLs: a decode node takes
    # KV only from the prefill nodes listed, whatever URL a request's header names
    federation_peers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.page_size <= 0 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a positive power of two, got {self.page_size}")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.num_pages < 0:
            raise ValueError(f"num_pages must be >= 0 (0: from kv_cache_memory), got {self.num_pages}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be above 0 bytes (leave it out for the default), "
                             f"got {self.kv_cache_memory}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1 (leave it out for torch's default), got {self.num_threads}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.quantization != "none" and self.device != "cpu":
            raise ValueError(f"{self.quantization} weights run on the CPU (torch's {self.quantization} CPU kernel); "
                             "on a GPU use quantization none")
        if self.attention_backend not in ("torch", "flashinfer"):
            raise ValueError(f"attention_backend must be torch or flashinfer, got {self.attention_backend!r}")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"device must be cpu or cuda[:N], got {self.device!r}")
        if self.device == "cpu" and (self.attention_backend == "flashinfer" or self.cuda_graphs):
            raise ValueError("flashinfer and CUDA graphs need a CUDA device")
        if self.cuda_graphs and self.attention_backend != "flashinfer":
            raise ValueError("CUDA graphs need the flashinfer attention backend")
        if self.attention_backend == "flashinfer" and self.dtype == "float32":
            raise ValueError("flashinfer kernels need bfloat16 or float16")
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICY_NAMES)}")
        if not isinstance(self.policy_params, PolicyConfig):
            raise ValueError("policy_params must be a PolicyConfig")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.offload not in ("none", "write-back", "write-through"):
            raise ValueError(f"offload must be none, write-back or write-through, got {self.offload!r}")
        if self.host_kv_memory is not None and self.host_kv_memory < 0:
            raise ValueError("host_kv_memory must be >= 0 bytes")
        if self.disk_kv_memory < 0:
            raise ValueError("disk_kv_memory must be >= 0 bytes")
        if self.disk_kv_memory and self.offload == "none":
            raise ValueError("a disk KV tier needs a host tier: set offload to write-through or write-back")
        if self.disk_kv_memory and not (self.disk_kv_dir or os.environ.get("STATE_DIRECTORY")):
            raise ValueError("disk_kv_memory needs disk_kv_dir (or systemd's STATE_DIRECTORY) to put its file in")
        if self.pool_mode not in ("off", "query", "read"):
            raise ValueError(f"pool_mode must be off, query or read, got {self.pool_mode!r}")
        if self.pool_segment_tokens < 0 or self.pool_segment_tokens % self.page_size:
            raise ValueError(f"pool_segment_tokens must be a multiple of page_size ({self.page_size}) or 0 (measured), "
                             f"got {self.pool_segment_tokens}")
        if self.pool_placement not in ("home", "local"):
            raise ValueError(f"pool_placement must be home or local, got {self.pool_placement!r}")
        if self.pool_mode != "off" and not self.enable_prefix_caching:
            raise ValueError("the pool shares prefix-cache pages: it needs prefix caching on")
        if self.pool_mode == "read" and self.device != "cpu":
            raise ValueError("pool_mode read maps peers' caches through host shared memory: on a GPU use "
                             "pool_mode query (CUDA IPC of the caches is not built)")
        if self.role not in ("both", "prefill", "decode"):
            raise ValueError(f"role must be both, prefill or decode, got {self.role!r}")
        if self.role != "both" and self.pool_mode != "off":
            raise ValueError("a prefill or decode node runs without the node's pool (pool_mode off)")
        bad = [url for url in self.federation_peers if normal_url(url) is None]
        if bad:
            raise ValueError(f"federation_peers must be the http(s) base URLs of nodes, such as http://10.0.0.1:8000; "
                             f"got {bad[0]!r}")
        if self.role == "decode" and not self.federation_peers:
            raise ValueError("a decode node takes KV only from the prefill nodes named by federation_peers "
                             "(--federation-peers URL[,URL...]): name them, as the conductor's [[nodes]] do")
        if self.role == "both" and self.federation_peers:
            raise ValueError("federation_peers are the prefill or decode nodes this node exchanges KV with: a node of "
                             "role both exchanges none (set --role, or leave the peers out)")
        if not 0 < self.kv_transfer_timeout < float("inf"):
            raise ValueError(f"kv_transfer_timeout must be a finite number of seconds above 0, "
                             f"got {self.kv_transfer_timeout}")
        if self.max_queue_delay is not None and not 0 < self.max_queue_delay < float("inf"):
            raise ValueError(f"max_queue_delay must be a finite number of seconds above 0 (leave it out to never "
                             f"shed load), got {self.max_queue_delay}")

    @classmethod
    def resolve(
        cls,
        *,
        device: str = "auto",
        dtype: str = "auto",
        attention_backend: str = "auto",
        cuda_graphs: bool | None = None,
        kv_cache_memory: str | int | None = None,
        host_kv_memory: str | int | None = None,
        disk_kv_memory: str | int = 0,
        quantization: str = "none",
        federation_peers: str | tuple[str, ...] | list[str] = (),
        **kw,
    ) -> "EngineConfig":
        """Turn user-level choices ("auto", "1GiB") into a concrete, frozen config."""
        from tokenflowd.config import platform

        device = platform.pick_device() if device == "auto" else device
        on_gpu = device.startswith("cuda")
        quantization = resolve_quantization(quantization, kw.get("model", cls.model), device)
        if dtype == "auto":
            dtype = "bfloat16" if on_gpu or platform.cpu_has_fast_bf16() else "float32"
        if attention_backend == "auto":
            attention_backend = "flashinfer" if on_gpu and platform.has_flashinfer() else "torch"
        if attention_backend == "flashinfer" and dtype == "float32":
            attention_backend = "torch"  # flashinfer has no fp32 kernels
        if cuda_graphs is None:
            cuda_graphs = on_gpu and attention_backend == "flashinfer"
        if "max_num_batched_tokens" not in kw:
            kw["max_num_batched_tokens"] = 8192 if on_gpu else 512
        mem = None if kv_cache_memory is None else parse_size(kv_cache_memory)
        return cls(
            device=device,
            dtype=dtype,
            attention_backend=attention_backend,
            cuda_graphs=cuda_graphs,
            kv_cache_memory=mem,
            host_kv_memory=None if host_kv_memory is None else parse_size(host_kv_memory),
            disk_kv_memory=parse_size(disk_kv_memory),
            quantization=quantization,
            federation_peers=resolve_peers(federation_peers),
            **kw,
        )


QUANTIZATIONS = ("none", "int4", "int8")


def resolve_peers(peers: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """"URL,URL" (a flag or an environment variable) or a list (TOML) -> the URLs in normal form (one
    spelling per node); a text that is no URL stays as it is, for the validation to name."""
    urls = peers.split(",") if isinstance(peers, str) else peers
    return tuple(dict.fromkeys(normal_url(u) or u for u in (u.strip() for u in urls) if u))


def resolve_quantization(asked: str, model: str, device: str) -> str:
    """"auto": on a CPU, int4 when the model is a GGUF whose projections are Q4_0/Q4_1 (its own numbers,
    at a seventh of fp32's bytes a step) and int8 when they are Q8_0 (requantized per row); otherwise
    none, with a log line where the file is quantized in a form without a twin here (K-quants), which
    is then dequantized. On a GPU "auto" is none, and int4/int8 are refused: the GPU keeps bf16."""
    if asked not in ("auto", *QUANTIZATIONS):
        raise ValueError(f"quantization must be auto or one of {', '.join(QUANTIZATIONS)}, got {asked!r}")
    if asked != "auto":
        return asked
    if device != "cpu":
        return "none"
    from tokenflowd.text.source import INT4_GGUF_TYPES, INT8_GGUF_TYPES, gguf_path, gguf_projection_types

    path = gguf_path(model)
    if path is None:
        return "none"
    types = gguf_projection_types(path)
    if types and types <= INT4_GGUF_TYPES:
        return "int4"
    if types and types <= INT8_GGUF_TYPES:
        return "int8"
    if types - {"F32", "F16", "BF16"}:
        logging.getLogger("tokenflowd.engine").info(
            "%s: its projections are %s, which have no int4 or int8 twin here: dequantized to the engine's "
            "dtype (--quantization int4 or int8 requantizes them)", path.name, ", ".join(sorted(types)))
    return "none"


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
    # front processes sharing the port (SO_REUSEPORT); None: one per engine on a GPU box, 1 on CPU
    api_servers: int | None = None
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
            raise ValueError("api_servers above 1 needs a fixed port: the front processes share it")
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


def load_config_file(path: str) -> dict[str, dict]:
    """A TOML file with [server], [engine] and [policy] tables whose keys are ServerConfig /
    EngineConfig / PolicyConfig fields (sizes may carry units: kv_cache_memory = "4GiB"), and
    an optional [auth] table (AuthConfig, returned as server["auth"]). Unknown tables or keys are errors."""
    import tomllib

    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ValueError(f"cannot read config file {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {path} is not valid TOML: {e}") from None
    known = _known_fields()
    out: dict[str, dict] = {"server": {}, "engine": {}, "policy": {}}
    for table, values in data.items():
        if table == "auth" and isinstance(values, dict):
            try:
                out["server"]["auth"] = AuthConfig.from_table(values)
            except ValueError as e:
                raise ValueError(f"{path}: {e}") from None
            continue
        if table not in known or not isinstance(values, dict):
            raise ValueError(f"{path}: unknown table [{table}]; use [server], [engine], [policy] and [auth]")
        for key, value in values.items():
            name = key.replace("-", "_")
            if name not in known[table]:
                raise ValueError(f"{path}: unknown key {key!r} in [{table}]; known: {', '.join(sorted(known[table]))}")
            if not _has_type(name, known[table][name], value):
                raise ValueError(f"{path}: [{table}] {key} must be {_type_name(name, known[table][name])}, "
                                 f"got {value!r}")
            out[table][name] = value
    if "max_body_size" in out["server"]:
        out["server"]["max_body_size"] = parse_size(out["server"]["max_body_size"])
    return out


# -- the environment and the merged view -----------------------------------------------------------
ENV_PREFIX = "TOKENFLOWD_"
ENV_NOT_CONFIG = {"TOKENFLOWD_API_KEY", "TOKENFLOWD_NODE_KEY"}  # secrets read by daemon/api/auth.py, not config fields


def _known_fields() -> dict[str, dict[str, str]]:
    """table -> field -> its annotation (a string: this module postpones annotations)."""
    from dataclasses import fields

    return {"server": {f.name: f.type for f in fields(ServerConfig) if f.name != "auth"},
            "engine": {f.name: f.type for f in fields(EngineConfig) if f.name != "policy_params"},
            "policy": {f.name: f.type for f in fields(PolicyConfig)}}


_SIZE_FIELDS = ("kv_cache_memory", "host_kv_memory", "disk_kv_memory", "max_body_size")  # a number of bytes, or a text with a unit


_TYPE_NAMES = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
               "tuple[str,": "a list of strings"}


def _type_name(name: str, annotation: str) -> str:
    return "a size such as 4GiB" if name in _SIZE_FIELDS else _TYPE_NAMES[annotation.split(" ")[0]]


def _has_type(name: str, annotation: str, value) -> bool:
    """A TOML value fits its field's declared type (ints pass for floats; no bool for a number)."""
    if name in _SIZE_FIELDS:
        return isinstance(value, (int, str)) and not isinstance(value, bool)
    kind = annotation.split(" ")[0]
    if kind == "tuple[str,":
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, str)


def _from_text(name: str, annotation: str, text: str):
    """A config value from an environment string, by its field's declared type."""
    if text == "" and "None" in annotation:
        return None
    try:
        if name in _SIZE_FIELDS:
            return parse_size(text)
        if annotation.startswith("tuple[str"):  # TOKENFLOWD_FEDERATION_PEERS=URL,URL
            return tuple(v.strip() for v in text.split(",") if v.strip())
        if annotation.startswith("bool"):
            if text.lower() not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ValueError
            return text.lower() in ("1", "true", "yes", "on")
        if annotation.startswith("int"):
            return int(text)
        if annotation.startswith("float"):
            return float(text)
    except ValueError:
        raise ValueError(f"{ENV_PREFIX}{name.upper()}={text!r} is not a valid {annotation.split(' ')[0]}") from None
    return text


def env_config(environ: dict[str, str]) -> dict[str, dict]:
    """TOKENFLOWD_<FIELD> variables (TOKENFLOWD_PORT=8001, TOKENFLOWD_POLICY=tokenflow,
    TOKENFLOWD_KV_CACHE_MEMORY=4GiB), in load_config_file's shape. Field names are unique over
    the three tables. An unknown TOKENFLOWD_ variable is an error: a typo must not pass silently."""
    known = _known_fields()
    out: dict[str, dict] = {"server": {}, "engine": {}, "policy": {}}
    for var, text in environ.items():
        if not var.startswith(ENV_PREFIX) or var in ENV_NOT_CONFIG:
            continue
        name = var[len(ENV_PREFIX):].lower()
        table = next((t for t, names in known.items() if name in names), None)
        if table is None:
            raise ValueError(f"unknown environment variable {var}: TOKENFLOWD_ variables name a config field, "
                             f"such as TOKENFLOWD_PORT or TOKENFLOWD_POLICY")
        out[table][name] = _from_text(name, known[table][name], text)
    return out


def merge_sources(*sources: dict[str, dict]) -> dict[str, dict]:
    """Tables merged key by key, later sources winning (file, then environment; flags go last)."""
    out: dict[str, dict] = {"server": {}, "engine": {}, "policy": {}}
    for src in sources:
        for table, values in src.items():
            out[table].update(values)
    return out


def config_toml(server: ServerConfig, engine: EngineConfig) -> str:
    """The resolved configuration as a TOML file `--config` reads back (None values left out)."""
    import dataclasses

    import tomli_w

    def table(obj) -> dict:
        skip = ("policy_params", "auth")
        return {k: v for k, v in dataclasses.asdict(obj).items() if v is not None and k not in skip}

    text = tomli_w.dumps({"server": table(server), "engine": table(engine), "policy": table(engine.policy_params)})
    if server.auth != AuthConfig():  # keys are secrets: say that there are some, never what they are
        text += (f"\n# [auth]: {len(server.auth.keys)} key grant(s) and default_max_priority = "
                 f"{server.auth.default_max_priority}, not printed (secrets)\n")
    return text
