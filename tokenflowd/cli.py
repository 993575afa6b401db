"""`tokenflowd` command line. `tokenflowd generate "prompt"` streams a completion to the terminal."""
from __future__ import annotations

import argparse
import logging
import sys
import time

from tokenflowd.config import EngineConfig
from tokenflowd.text.source import ModelLoadError
from tokenflowd.engine.request import InvalidRequestError, SamplingParams


def _engine_args(p: argparse.ArgumentParser) -> None:
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
    g.add_argument("--offload", choices=["none", "write-back", "write-through"],
                   help="host KV tier: none (preempted KV is recomputed), write-back (written at preemption) "
                        "or write-through (written as it is computed; the default)")
    g.add_argument("--host-kv-memory", help="host KV tier size, e.g. 8GiB (default: 4x the device pool within a "
                                            "quarter of RAM per GPU; on CPU as large as the device pool); pinned on a GPU box")
    g.add_argument("--disk-kv-memory", help="disk KV tier size, e.g. 64GiB (default 0: none); host evictions of "
                                            "prefix pages spill to it")
    g.add_argument("--disk-kv-dir", help="directory of the disk tier's file (default: $STATE_DIRECTORY)")
    g.add_argument("--no-load-evict-overlap", action="store_true",
                   help="loads wait for evictions in flight (a benchmark baseline)")
    _policy_args(p)


def _policy_args(p: argparse.ArgumentParser) -> None:
    """Policy parameter flags (dests are _POLICY_FLAGS); shared by the engine commands and `sim`."""
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
_ENGINE_FLAGS = {
    "model": "model", "device": "device", "dtype": "dtype", "kv_cache_memory": "kv_cache_memory",
    "gpu_memory_utilization": "gpu_memory_utilization", "page_size": "page_size",
    "max_num_batched_tokens": "max_num_batched_tokens", "max_num_seqs": "max_num_seqs",
    "max_model_len": "max_model_len", "attention_backend": "attention_backend", "threads": "num_threads",
    "policy": "policy", "offload": "offload", "host_kv_memory": "host_kv_memory",
    "disk_kv_memory": "disk_kv_memory", "disk_kv_dir": "disk_kv_dir", "max_queue_delay": "max_queue_delay",
}


_POLICY_FLAGS = ("schedule_interval", "buffer_conservativeness", "stall_penalty", "working_set_lambda",
                 "critical_buffer", "max_stall", "expected_output_len", "andes_horizon", "andes_interval",
                 "andes_expected_ttft", "andes_max_preempt_fraction", "andes_memory_trigger")


def engine_config(a: argparse.Namespace, file_values: dict | None = None,
                  file_policy: dict | None = None) -> EngineConfig:
    """EngineConfig from the config file's [engine] and [policy] tables, overridden by the flags given."""
    from tokenflowd.config import PolicyConfig

    kw = dict(file_values or {})
    policy_kw = dict(file_policy or {})
    for flag in _POLICY_FLAGS:
        value = getattr(a, flag, None)
        if value is not None:
            policy_kw[flag] = value
    kw["policy_params"] = PolicyConfig(**policy_kw)
    for flag, key in _ENGINE_FLAGS.items():
        value = getattr(a, flag, None)
        if value is not None:
            kw[key] = value
    if getattr(a, "no_prefix_caching", False):
        kw["enable_prefix_caching"] = False
    if getattr(a, "no_cuda_graphs", False):
        kw["cuda_graphs"] = False
    if getattr(a, "no_load_evict_overlap", False):
        kw["load_evict_overlap"] = False
    return EngineConfig.resolve(**kw)


def cmd_generate(a: argparse.Namespace) -> int:
    from tokenflowd.engine.engine import Engine

    params = SamplingParams(
        max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
        seed=a.seed, stop=tuple(a.stop or ()), ignore_eos=a.ignore_eos,
    )
    engine = Engine(engine_config(a))
    if a.raw:
        kw = {"prompt": a.prompt}
    else:
        msgs = ([{"role": "system", "content": a.system}] if a.system else []) + [{"role": "user", "content": a.prompt}]
        kw = {"messages": msgs}
    t0 = time.perf_counter()
    first = None
    n = 0
    for out in engine.stream("cli", sampling_params=params, **kw):
        if first is None and out.token_ids:
            first = time.perf_counter() - t0
        n = out.num_output_tokens
        sys.stdout.write(out.text)
        sys.stdout.flush()
    total = time.perf_counter() - t0
    sys.stdout.write("\n")
    if a.stats:
        print(f"[{n} tokens, TTFT {first or 0:.3f} s, {n / total:.1f} tokens/s]", file=sys.stderr)
    return 0


_SERVER_FLAGS = ("host", "port", "engines", "served_model_name", "default_reading_rate", "max_reading_rate",
                 "max_waiting_requests", "max_body_size", "runtime_dir", "shutdown_timeout", "api_key_file",
                 "log_level")


def serve_configs(a: argparse.Namespace, environ: dict[str, str] | None = None):
    """(ServerConfig, EngineConfig) from the config file, then TOKENFLOWD_* variables, then the
    flags given: each later source wins, key by key."""
    import os

    from tokenflowd.config import ServerConfig, env_config, load_config_file, merge_sources, parse_size

    file = load_config_file(a.config) if getattr(a, "config", None) else {}
    merged = merge_sources(file, env_config(os.environ if environ is None else environ))
    server_kw = dict(merged["server"])
    for flag in _SERVER_FLAGS:
        value = getattr(a, flag, None)
        if value is not None:
            server_kw[flag] = parse_size(value) if flag == "max_body_size" else value
    return ServerConfig(**server_kw), engine_config(a, merged["engine"], merged["policy"])


def cmd_serve(a: argparse.Namespace) -> int:
    server, engine = serve_configs(a)
    if a.print_config:
        from tokenflowd.config import config_toml

        print(config_toml(server, engine), end="")
        return 0
    from tokenflowd.serve import serve

    logging.getLogger().setLevel(server.log_level.upper())  # the flag's, else the environment's or file's
    return serve(server, engine, reload=lambda: serve_configs(a))


def cmd_config_check(a: argparse.Namespace) -> int:
    """Validate a config file (with the TOKENFLOWD_* variables set now) and print what it resolves to."""
    from tokenflowd.config import config_toml

    server, engine = serve_configs(argparse.Namespace(config=a.file))
    print(config_toml(server, engine), end="")
    print(f"# {a.file}: ok", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenflowd", description=__doc__)
    log_help = "DEBUG, INFO, WARNING or ERROR (default: INFO for serve, WARNING otherwise)"
    parser.add_argument("--log-level", help=log_help)
    common = argparse.ArgumentParser(add_help=False)  # also accepted after the subcommand
    common.add_argument("--log-level", default=argparse.SUPPRESS, help=log_help)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", parents=[common], help="stream a completion of one prompt to the terminal")
    g.add_argument("prompt")
    g.add_argument("--raw", action="store_true", help="complete the text as is, without the chat template")
    g.add_argument("--system", default=None, help="a system message for the chat template")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="a stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--stats", action="store_true", help="print tokens, TTFT and speed to stderr")
    _engine_args(g)
    g.set_defaults(func=cmd_generate)

    v = sub.add_parser("serve", parents=[common], help="run the daemon: OpenAI-compatible HTTP API over engine processes")
    v.add_argument("--config", help="a TOML file with [server] and [engine] tables; flags override it")
    v.add_argument("--host", help="address to bind (default 127.0.0.1)")
    v.add_argument("--port", type=int, help="default 8000")
    v.add_argument("--engines", type=int, help="engine processes (default: one per visible GPU; 1 on CPU)")
    v.add_argument("--served-model-name", help="the model name clients send (default: the --model value)")
    v.add_argument("--default-reading-rate", type=float,
                   help="tokens/s assumed for clients that state no reading rate (default 20)")
    v.add_argument("--max-reading-rate", type=float,
                   help="tokens/s: a stated or learned reading rate above it is clamped to it (default 100)")
    v.add_argument("--max-waiting-requests", type=int,
                   help="requests waiting for their first token beyond which new ones get 429 (default 512)")
    v.add_argument("--max-queue-delay", type=float,
                   help="s: a request whose predicted time to first token (the queue ahead of it at the engine's "
                        "measured speed) exceeds it gets 429 with Retry-After at once (default: off)")
    v.add_argument("--max-body-size", help="largest request body, e.g. 4MiB (default); beyond: 413")
    v.add_argument("--runtime-dir", help="where the private socket directory is made (default: the temp dir)")
    v.add_argument("--shutdown-timeout", type=float,
                   help="s open streams may take to finish after SIGTERM before they end with an error (default 30)")
    v.add_argument("--api-key-file", help="a file of API keys, one a line; with it (or TOKENFLOWD_API_KEY set) "
                                          "/v1/* needs 'Authorization: Bearer KEY'")
    v.add_argument("--print-config", action="store_true",
                   help="print the configuration the file, TOKENFLOWD_* variables and flags resolve to (TOML), then exit")
    _engine_args(v)
    v.set_defaults(func=cmd_serve)
    c = sub.add_parser("config", parents=[common], help="configuration tools")
    csub = c.add_subparsers(dest="config_command", required=True)
    check = csub.add_parser("check", parents=[common], help="validate a config file and print what it resolves to")
    check.add_argument("file")
    check.set_defaults(func=cmd_config_check)
    from tokenflowd.sim.cli import add_commands as add_sim_commands

    add_sim_commands(sub, common)  # sim, calibrate
    return parser


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    level = (a.log_level or ("INFO" if a.command == "serve" else "WARNING")).upper()
    # serve logs to stdout, one line an event (journald under systemd); other commands to stderr
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stdout if a.command == "serve" else sys.stderr)
    try:
        return a.func(a)
    except (ModelLoadError, InvalidRequestError, ValueError) as e:
        print(f"tokenflowd: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
