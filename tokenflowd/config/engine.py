"""The engine's and the policy's configuration, and its resolution: "auto" values (device, dtype,
attention backend, CUDA graphs, quantization) become concrete ones before the config freezes."""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field

from tokenflowd.config.values import normal_url, parse_size

# --pool-hand-off: when a new segment goes into its home (pool/hand_off.py decides by these names)
POOL_HAND_OFFS = ("auto", "prompt", "segment")
# --offload: the host KV tier behind the device pool (kv/offloader.py unpacks them: NO_OFFLOAD, ...)
OFFLOAD_MODES = ("none", "write-back", "write-through")
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
    # chosen by "auto" (resolve): start-up picks torch without a report for a model flashinfer
    # cannot run; asked for by name, that is a reported step down (engine/startup.py)
    attention_auto: bool = False
    # torch backend on a CPU: decodes read K/V in place through the C++ kernel (attention/cpu_kernels.py,
    # off also by TOKENFLOWD_CPU_KERNELS=0); off, or where it cannot be built: pages are gathered
    paged_kernel: bool = True
    # flashinfer: the model's layers run plain ops beside it instead of its fused kernels
    # (engine/model/fused.py); set by start-up where the fused ones failed its check
    plain_layer_ops: bool = False
    cuda_graphs: bool = False
    # overlap scheduling (engine/core.py): the next step is scheduled and launched while one runs,
    # its tokens a step late; off where the node's pool or federation hooks run (engine/process)
    overlap: bool = False
    # tokenflow: buffer-aware preemption (buffer/tokenflow.py): under bursts it beats fcfs on
    # effective throughput and tail TTFT (bench/sim_table1.py), and with write-through offload a
    # preemption costs a copy rather than a recompute
    policy: str = "tokenflow"
    policy_params: PolicyConfig = field(default_factory=PolicyConfig)
    seed: int = 0
    num_threads: int | None = None  # CPU intra-op threads; None: torch's default
    # The host KV tier (offload/): none (preempted KV is recomputed) | write-back | write-through
    offload: str = "write-through"
    host_kv_memory: int | None = None  # bytes; None: 4× the device pool within its engine's share of a quarter of RAM (CPU: 1×)
    engines_on_node: int = 1  # the engines of this node (set by the launcher): they share the node's RAM
    disk_kv_memory: int = 0  # bytes of disk tier under disk_kv_dir; 0: none
    disk_kv_dir: str | None = None  # None: $STATE_DIRECTORY (systemd's StateDirectory=)
    load_evict_overlap: bool = True  # loads run while evictions are in flight (off: the ablation's baseline)
    # s: a request whose predicted time to first token exceeds it gets 429 at once (engine/admission.py); None: off
    max_queue_delay: float | None = None
    # The node's prefix-cache pool across engines (pool/): off (each engine its own cache, the
    # router follows prefixes), query (a request's prefix pages held by a peer stay there; its
    # query rows go to the peer each layer and come back as partial attention merged by LSE), or
    # read (the engine maps the peer's KV cache and attends to its pages in place: shared memory on a
    # CPU, CUDA IPC between engines on one GPU or on GPUs with peer access; a peer it cannot map is
    # queried through the host)
    pool_mode: str = "off"
    # read mode, a peer on another GPU (its pages reached over NVLink or PCIe): a request whose rows
    # in a step are at least this many attends the peer's pages in place; fewer (a decode step's
    # row) are sent to the peer, as in query mode, where reading a long prefix over the link would
    # take longer than the peer's attention over it. 1024: about where attention over a page takes as
    # long as reading it over NVLink on an A100 or H200 in 16-bit KV (sim/node.py link_ridge_rows).
    # Peers on this engine's GPU, or on a CPU (the same memory), are read in place whatever the rows.
    # 1: every row in place
    pool_read_rows: int = 1024
    # on a GPU: read mode exports the KV cache over CUDA IPC for its peers (on its GPU or one with
    # peer access to it; the engines then see the node's other GPUs: launcher.py), and query mode
    # its query buffers (false: they query each other through the host, for a container that
    # refuses IPC)
    pool_ipc: bool = True
    # tokens of a pool segment, the unit a request reads from one holder; 0: the threshold of
    # pool/segments.py with α, B and k_comp measured at start-up (logged)
    pool_segment_tokens: int = 0
    # where the pool keeps a new segment: local (where it was computed; a request goes where its prefix
    # is unless that engine is much busier) or home (a prompt's segments dealt round the engines in
    # an order their keys hash to, pool/homes.py segment_homes; the engine computing it writes it there)
    pool_placement: str = "local"
    # placement home: when the engine computing a new segment writes it into its home: once the
    # request's whole prompt is computed (prompt), or as each segment is computed (segment: the
    # engine needs room for a segment of the prompt, not all of it, and the rest of the prompt
    # attends to what went through the pool's path), or segment by segment only where the prompt
    # computed here is over a quarter of the engine's KV (auto; pool/hand_off.py)
    pool_hand_off: str = "auto"
    # an idle engine takes the last queued request that has started nothing from the engine with the
    # longest queue (pool/steal.py; the front asks: protocol.Withdraw)
    pool_steal: bool = True
    # a heavy hitter an engine reads on another is copied into it once, and read there from then on
    # (daemon/router.py `_copy`, pool/member.py `copy_in`; TokenLake §4.3)
    pool_copy: bool = True
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
        if self.offload not in OFFLOAD_MODES:
            raise ValueError(f"offload must be one of {', '.join(OFFLOAD_MODES)}, got {self.offload!r}")
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
        if self.pool_read_rows < 1:
            raise ValueError(f"pool_read_rows must be at least 1, got {self.pool_read_rows}")
        if self.pool_segment_tokens < 0 or self.pool_segment_tokens % self.page_size:
            raise ValueError(f"pool_segment_tokens must be a multiple of page_size ({self.page_size}) or 0 (measured), "
                             f"got {self.pool_segment_tokens}")
        if self.pool_placement not in ("home", "local"):
            raise ValueError(f"pool_placement must be home or local, got {self.pool_placement!r}")
        if self.pool_hand_off not in POOL_HAND_OFFS:
            names = f"{', '.join(POOL_HAND_OFFS[:-1])} or {POOL_HAND_OFFS[-1]}"
            raise ValueError(f"pool_hand_off must be {names}, got {self.pool_hand_off!r}")
        if self.pool_mode != "off" and not self.enable_prefix_caching:
            raise ValueError("the pool shares prefix-cache pages: it needs prefix caching on")
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
        overlap: bool | None = None,
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
        attention_auto = attention_backend == "auto" or kw.pop("attention_auto", False)
        if attention_auto:
            attention_backend = "flashinfer" if on_gpu and platform.has_flashinfer() else "torch"
        if attention_backend == "flashinfer" and dtype == "float32":
            attention_backend = "torch"  # flashinfer has no fp32 kernels
        if cuda_graphs is None:
            cuda_graphs = on_gpu and attention_backend == "flashinfer"
        if overlap is None:
            overlap = on_gpu or OVERLAP_ON_CPU
        if "max_num_batched_tokens" not in kw:
            kw["max_num_batched_tokens"] = 8192 if on_gpu else 512
        mem = None if kv_cache_memory is None else parse_size(kv_cache_memory)
        return cls(
            device=device,
            dtype=dtype,
            attention_backend=attention_backend,
            attention_auto=attention_auto,
            cuda_graphs=cuda_graphs,
            overlap=overlap,
            kv_cache_memory=mem,
            host_kv_memory=None if host_kv_memory is None else parse_size(host_kv_memory),
            disk_kv_memory=parse_size(disk_kv_memory),
            quantization=quantization,
            federation_peers=resolve_peers(federation_peers),
            **kw,
        )


QUANTIZATIONS = ("none", "int4", "int8")
# overlap scheduling's default on a CPU (on a GPU it is on): off, as on the CPUs measured it was no
# faster than serial steps (bench/results/cpu_overlap.json): the model's threads take every core
OVERLAP_ON_CPU = False


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
