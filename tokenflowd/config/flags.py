"""The engine and policy flags, shared by `tokenflowd serve`/`generate` (cli.py) and `tokenflowd
sim`/`calibrate` (sim/cli.py), and the EngineConfig they resolve to."""
from __future__ import annotations

import argparse

from tokenflowd.config import OFFLOAD_MODES, POOL_HAND_OFFS, EngineConfig


def engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags. Their defaults are None so that a config file's values show through;
    the real defaults are EngineConfig's (given in the help)."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", help="smollm2-135m (embedded, the default), a .gguf file, a Hugging Face "
                                   "directory, or dummy:<preset>")
    g.add_argument("--policy", help="scheduling policy: tokenflow (the default: buffer-aware, it preempts readers who "
                   "are far ahead for those about to stall or still waiting; with write-through offload a "
                   "preemption costs a copy), fcfs (first come, first served) or andes")
    g.add_argument("--device", help="auto (default), cpu, cuda or cuda:N")
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], help="default auto")
    g.add_argument("--quantization", choices=["auto", "none", "int4", "int8"],
                   help="weights at run time: none (the default: dequantized to --dtype), int4 (CPU: the "
                        "projections as group-wise int4 with torch's int4 kernel; a GGUF's Q4_0/Q4_1 exactly, "
                        "anything else quantized at load; faster decode at small batches, slower prefill), int8 "
                        "(CPU: the projections as int8 with one scale per row), or auto (int4 on a CPU for a "
                        "Q4_0/Q4_1 GGUF such as the embedded model, int8 for a Q8_0 one, else none)")
    g.add_argument("--kv-cache-memory",
                   help="KV cache size, e.g. 512MiB or 4GiB (default: 1GiB on CPU, a fraction of free GPU memory)")
    g.add_argument("--gpu-memory-utilization", type=float, help="default 0.9")
    g.add_argument("--page-size", type=int, help="tokens per KV page (default 16)")
    g.add_argument("--max-num-batched-tokens", type=int, help="token budget of one step (512 CPU, 8192 GPU)")
    g.add_argument("--max-num-seqs", type=int, help="default 256")
    g.add_argument("--max-model-len", type=int)
    g.add_argument("--attention-backend", choices=["auto", "torch", "flashinfer"], help="default auto")
    g.add_argument("--no-cuda-graphs", action="store_true")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--threads", type=int, help="CPU threads for torch")
    g.add_argument("--offload", choices=OFFLOAD_MODES,
                   help="host KV tier: none (preempted KV is recomputed), write-back (written at preemption) "
                        "or write-through (written as it is computed; the default)")
    g.add_argument("--host-kv-memory", help="host KV tier size, e.g. 8GiB (default: 4x the device pool within a "
                                            "quarter of RAM per GPU; on CPU as large as the device pool); pinned on a GPU box")
    g.add_argument("--disk-kv-memory", help="disk KV tier size, e.g. 64GiB (default 0: none); host evictions of "
                                            "prefix pages spill to it")
    g.add_argument("--disk-kv-dir", help="directory of the disk tier's file (default: $STATE_DIRECTORY)")
    g.add_argument("--pool-mode", choices=["off", "query", "read"],
                   help="one prefix cache across this node's engines: off (the default: each engine its own, "
                        "requests follow their prefixes), query (a peer's prefix pages stay there and each layer's "
                        "queries go to it; LSE-merged) or read (peers' caches mapped and read in place: shared memory "
                        "on a CPU, CUDA IPC between engines on one GPU or on GPUs with peer access; other peers are queried)")
    g.add_argument("--pool-read-rows", type=int,
                   help="read mode, a peer on another GPU: a request whose rows in a step are at least this many "
                        "attends the peer's pages in place over the link; fewer (decode) are sent to the peer "
                        "(default 1024; peers on this GPU or on a CPU are always read in place; 1: every row)")
    g.add_argument("--no-pool-ipc", action="store_true",
                   help="on a GPU: share nothing over CUDA IPC (where the container refuses it): read mode "
                        "exports no KV cache and query mode keeps its query rows in host memory; peers query "
                        "each other through the host, as /health reports")
    g.add_argument("--pool-segment-tokens", type=int,
                   help="tokens of a pool segment, a multiple of the page size (default: the break-even length "
                        "measured at start-up, logged)")
    g.add_argument("--pool-placement", choices=["home", "local"],
                   help="where the pool keeps a new segment: local (the default: where it was computed, and a "
                        "request goes where its prefix is unless that engine is much busier) or home (the engine "
                        "a prompt's segments are dealt round, in an order their keys hash to; the engine computing "
                        "it writes it there: --pool-hand-off)")
    g.add_argument("--pool-hand-off", choices=POOL_HAND_OFFS,
                   help="with --pool-placement home, when a new segment is written into its home: prompt (once "
                        "the request's prompt is computed), segment (as each is computed: the engine needs room "
                        "for one segment of a long prompt, not all of it, but the rest of the prompt reads the "
                        "segments gone before it through the pool) or auto (the default: segment by segment where "
                        "the prompt computed here is over a quarter of the engine's KV, else prompt)")
    g.add_argument("--no-pool-steal", action="store_true",
                   help="with the pool on, an idle engine takes no queued request from a busy one (by default the "
                        "engine with the longest queue gives it the last request that has started nothing)")
    g.add_argument("--no-pool-copy", action="store_true",
                   help="with the pool on, hot segments (heavy hitters) an engine reads on another are not copied "
                        "into it: each segment stays where it is (by default it is copied once, and read there)")
    g.add_argument("--role", choices=["both", "prefill", "decode"],
                   help="this node in a federated cluster (tokenflowd conductor): both (the default: prefill and "
                        "decode here), prefill (compute prompts and write their KV to decode nodes) or decode "
                        "(take KV from prefill nodes); prefill and decode need the federation extra")
    g.add_argument("--kv-host", help="the address this node's KV transfer engine listens on, reachable by its peer "
                                     "nodes (prefill and decode roles; default 127.0.0.1)")
    g.add_argument("--federation-peers", metavar="URL[,URL...]",
                   help="the nodes this node exchanges KV with, as the base URLs the conductor's [[nodes]] give: a "
                        "decode node takes KV only from the prefill nodes listed (needed with --role decode); a "
                        "request naming another node gets 403")
    g.add_argument("--kv-transfer-timeout", type=float,
                   help="s a KV transfer between nodes may take before it is given up and the prompt is computed "
                        "on the decode node (default 30)")
    g.add_argument("--overlap", choices=["on", "off"],
                   help="schedule and launch the next step while one runs, its tokens a step late (default: on a "
                        "GPU, off on a CPU; always off with --pool-mode or a federation role)")
    g.add_argument("--no-load-evict-overlap", action="store_true",
                   help="loads wait for evictions in flight (a benchmark baseline)")
    policy_args(p)


def policy_args(p: argparse.ArgumentParser) -> None:
    """Policy parameter flags (dests are POLICY_FLAGS); shared by the engine commands and `sim`."""
    q = p.add_argument_group("policy parameters (tokenflow, andes; defaults in PolicyConfig)")
    q.add_argument("--schedule-interval", type=float, help="s between buffer-balancing passes (default 0.5)")
    q.add_argument("--buffer-conservativeness", type=float,
                   help="μ >= 1: buffer a victim must hold, in multiples of its swap time (default 2)")
    q.add_argument("--stall-penalty", type=float, help="γ: utility cost of an empty buffer, in tokens (default 64)")
    q.add_argument("--working-set-lambda", type=float, help="λ of eq. 5, in [0, 1] (default 0.5)")
    q.add_argument("--critical-buffer", type=float,
                   help="T_critical: s of buffered reading below which the engine counts as stressed (default 1)")
    q.add_argument("--max-stall", type=float,
                   help="s a started stream may wait on an empty buffer before it comes back ahead of new "
                        "requests (default 10)")
    q.add_argument("--expected-output-len", type=int,
                   help="output tokens assumed for requests without max_tokens (default 1024)")
    q.add_argument("--andes-horizon", type=float, help="s Andes looks ahead (default 2)")
    q.add_argument("--andes-interval", type=float, help="s between Andes' knapsack passes (default 0.5)")
    q.add_argument("--andes-expected-ttft", type=float, help="s a reader expects to wait for a first token (default 1)")
    q.add_argument("--andes-max-preempt-fraction", type=float,
                   help="most of the batch one Andes pass may preempt (default 0.5)")
    q.add_argument("--andes-memory-trigger", type=float,
                   help="page use from which Andes chooses instead of FCFS (default 0.9)")


# flag (argparse dest) -> EngineConfig.resolve keyword, for flags whose names differ
ENGINE_FLAGS = {
    "model": "model", "device": "device", "dtype": "dtype", "quantization": "quantization",
    "kv_cache_memory": "kv_cache_memory",
    "gpu_memory_utilization": "gpu_memory_utilization", "page_size": "page_size",
    "max_num_batched_tokens": "max_num_batched_tokens", "max_num_seqs": "max_num_seqs",
    "max_model_len": "max_model_len", "attention_backend": "attention_backend", "threads": "num_threads",
    "policy": "policy", "offload": "offload", "host_kv_memory": "host_kv_memory",
    "disk_kv_memory": "disk_kv_memory", "disk_kv_dir": "disk_kv_dir", "max_queue_delay": "max_queue_delay",
    "pool_mode": "pool_mode", "pool_read_rows": "pool_read_rows", "pool_segment_tokens": "pool_segment_tokens",
    "pool_placement": "pool_placement", "pool_hand_off": "pool_hand_off",
    "role": "role", "kv_host": "kv_host", "kv_transfer_timeout": "kv_transfer_timeout",
    "federation_peers": "federation_peers",
}


POLICY_FLAGS = ("schedule_interval", "buffer_conservativeness", "stall_penalty", "working_set_lambda",
                 "critical_buffer", "max_stall", "expected_output_len", "andes_horizon", "andes_interval",
                 "andes_expected_ttft", "andes_max_preempt_fraction", "andes_memory_trigger")


def engine_config(a: argparse.Namespace, file_values: dict | None = None,
                  file_policy: dict | None = None) -> EngineConfig:
    """EngineConfig from the config file's [engine] and [policy] tables, overridden by the flags given."""
    from tokenflowd.config import PolicyConfig

    kw = dict(file_values or {})
    policy_kw = dict(file_policy or {})
    for flag in POLICY_FLAGS:
        value = getattr(a, flag, None)
        if value is not None:
            policy_kw[flag] = value
    kw["policy_params"] = PolicyConfig(**policy_kw)
    for flag, key in ENGINE_FLAGS.items():
        value = getattr(a, flag, None)
        if value is not None:
            kw[key] = value
    if getattr(a, "no_prefix_caching", False):
        kw["enable_prefix_caching"] = False
    if getattr(a, "no_cuda_graphs", False):
        kw["cuda_graphs"] = False
    if getattr(a, "no_pool_ipc", False):
        kw["pool_ipc"] = False
    if getattr(a, "no_pool_steal", False):
        kw["pool_steal"] = False
    if getattr(a, "no_pool_copy", False):
        kw["pool_copy"] = False
    if getattr(a, "no_load_evict_overlap", False):
        kw["load_evict_overlap"] = False
    if getattr(a, "overlap", None) is not None:
        kw["overlap"] = a.overlap == "on"
    return EngineConfig.resolve(**kw)
