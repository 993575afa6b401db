"""`tokenflowd` command line. `tokenflowd generate "prompt"` streams a completion to the terminal."""
from __future__ import annotations

import argparse
import logging
import sys
import time

from tokenflowd.config.flags import engine_args, engine_config
from tokenflowd.engine.request import InvalidRequestError, SamplingParams
from tokenflowd.text.source import ModelLoadError


def cmd_generate(a: argparse.Namespace) -> int:
    from tokenflowd.engine.offline import Engine

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
                 "log_level", "coalesce_buffer", "coalesce_interval", "write_stall_timeout", "max_streams",
                 "max_connections", "header_timeout", "body_timeout", "keepalive_timeout", "api_servers", "web_ui")


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
    if engine.role != "both" and (server.api_servers or 1) > 1:
        print("tokenflowd: a prefill or decode node runs one API server process (--api-servers 1): its stores, its "
              "key log and its role are the front's, and a peer's calls must all reach the same one", file=sys.stderr)
        return 2
    missing = federation_missing(engine.role)
    if missing:
        print(f"tokenflowd: {missing}", file=sys.stderr)
        return 2
    from tokenflowd.daemon.serve import serve

    logging.getLogger().setLevel(server.log_level.upper())  # the flag's, else the environment's or file's
    return serve(server, engine, reload=lambda: serve_configs(a))


def federation_missing(role: str) -> str | None:
    """Why this node cannot take the role, or None: prefill and decode move KV over Mooncake's
    transfer engine, an optional extra."""
    import importlib.util

    if role == "both" or importlib.util.find_spec("mooncake") is not None:
        return None
    return (f"--role {role} moves KV between nodes over Mooncake's transfer engine, which is not installed: "
            "pip install 'tokenflowd[federation]' (on a CUDA node: pip install mooncake-transfer-engine; "
            "both need libibverbs1 and librdmacm1)")


def cmd_conductor(a: argparse.Namespace) -> int:
    import dataclasses

    from tokenflowd.federation.conductor.service import run
    from tokenflowd.federation.conductor.config import ConductorConfig

    try:
        config = ConductorConfig.load(a.config)
    except (OSError, ValueError, TypeError) as e:
        print(f"tokenflowd conductor: {e}", file=sys.stderr)
        return 2
    config = dataclasses.replace(config, **{k: v for k, v in (("host", a.host), ("port", a.port)) if v is not None})
    return run(config)


def cmd_federation_plan(a: argparse.Namespace) -> int:
    import asyncio
    import json

    from tokenflowd.federation.conductor.config import ConductorConfig
    from tokenflowd.federation.plan import fetch_states, plan_cluster, trace_lengths

    try:
        config = ConductorConfig.load(a.config)
        with open(a.trace, encoding="utf-8") as f:
            lengths, mean_tokens, mean_output = trace_lengths(f)
        states = asyncio.run(fetch_states(config.nodes, config.api_key))
        live = plan_cluster(states, config.remote, lengths, mean_tokens, mean_output,
                            a.tbt_slo if a.tbt_slo is not None else config.tbt_slo)
    except (OSError, ValueError, TypeError, KeyError) as e:
        print(f"tokenflowd federation plan: {e}", file=sys.stderr)
        return 2
    plan, silent = live.plan, [name for name, _ in config.nodes if name not in states]
    if a.json:
        print(json.dumps({**plan.to_dict(), "threshold": None if plan.threshold == float("inf") else plan.threshold,
                          "remote": live.remote, "local": live.local, "unreachable": silent,
                          "egress_measured_bytes_per_s": live.cluster.egress}))
        return 0
    t = "none (nothing offloaded)" if plan.threshold == float("inf") else f"{plan.threshold:.0f} tokens"
    print(f"nodes: {len(live.remote)} remote prefill ({', '.join(live.remote) or '-'}), {len(live.local)} local "
          f"({', '.join(live.local)})" + (f"; not answering: {', '.join(silent)}" if silent else ""))
    print(f"threshold t: {t}; offloaded {plan.offloaded:.1%} (mean {plan.l_long:.0f} tokens remote, "
          f"{plan.l_short:.0f} local)")
    print(f"local split: N_p {plan.n_prefill} / N_d {plan.n_decode}")
    print(f"Θ_prfaas {plan.theta_prfaas:.3g}, Θ_pd-p {plan.theta_pd_p:.3g}, Θ_pd-d {plan.theta_pd_d:.3g} req/s; "
          f"Λ_max {plan.throughput:.3g} req/s")
    print(f"egress at Λ_max: {plan.egress * 8 / 1e9:.3g} Gb/s of {live.cluster.egress * 8 / 1e9:.3g} Gb/s measured")
    return 0


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
    engine_args(g)
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
    v.add_argument("--no-web-ui", dest="web_ui", action="store_const", const=False,
                   help="serve no chat page at / (the API alone)")
    v.add_argument("--runtime-dir", help="where the private socket directory is made (default: the temp dir)")
    v.add_argument("--shutdown-timeout", type=float,
                   help="s open streams may take to finish after SIGTERM before they end with an error (default 30)")
    v.add_argument("--api-servers", type=int,
                   help="API server processes sharing the port (SO_REUSEPORT), each talking to every engine; "
                        "the limits above are split among them, but --max-streams and each key's max_concurrent "
                        "hold for all together (default: one per engine on a GPU box, 1 on CPU)")
    v.add_argument("--coalesce-buffer", type=float,
                   help="s of reading a client's modelled buffer must hold before its tokens are gathered into one "
                        "SSE event per --coalesce-interval (default 2)")
    v.add_argument("--coalesce-interval", type=float,
                   help="s a gathered token waits at most (default 0.25; 0: one event per token)")
    v.add_argument("--write-stall-timeout", type=float,
                   help="s a stream may wait for its client to read before its request is aborted (default 60)")
    v.add_argument("--max-streams", type=int, help="requests open at once, streamed or not; beyond: 429 (default: "
                                                   "no bound)")
    v.add_argument("--max-connections", type=int,
                   help="connections open at once; beyond: 503 (default: the open-file limit less 256)")
    v.add_argument("--header-timeout", type=float, help="s a request's line and headers may take (default 10)")
    v.add_argument("--body-timeout", type=float, help="s a request body may take; beyond: 408 (default 60)")
    v.add_argument("--keepalive-timeout", type=float, help="s an idle keep-alive connection stays open (default 75)")
    v.add_argument("--api-key-file", help="a file of API keys, one a line; with it (or TOKENFLOWD_API_KEY set) "
                                          "/v1/* needs 'Authorization: Bearer KEY'")
    v.add_argument("--print-config", action="store_true",
                   help="print the configuration the file, TOKENFLOWD_* variables and flags resolve to (TOML), then exit")
    engine_args(v)
    v.set_defaults(func=cmd_serve)
    c = sub.add_parser("config", parents=[common], help="configuration tools")
    csub = c.add_subparsers(dest="config_command", required=True)
    check = csub.add_parser("check", parents=[common], help="validate a config file and print what it resolves to")
    check.add_argument("file")
    check.set_defaults(func=cmd_config_check)
    d = sub.add_parser("conductor", parents=[common],
                       help="the global scheduler of a federated cluster: places each request on a prefill and a "
                            "decode node (Mooncake's Algorithm 1), rejects early under overload, proxies the stream")
    d.add_argument("--config", required=True, help="cluster.toml: [conductor] settings and [[nodes]] (name, url)")
    d.add_argument("--host", help="address to bind (default: the file's, else 127.0.0.1)")
    d.add_argument("--port", type=int, help="default: the file's, else 8000")
    d.set_defaults(func=cmd_conductor)
    f = sub.add_parser("federation", help="a federated cluster's planning (PrfaaS)")
    fsub = f.add_subparsers(dest="federation_command", required=True)
    plan = fsub.add_parser("plan", parents=[common],
                           help="PrfaaS's plan for the cluster as its nodes measure themselves: the threshold t above "
                                "which a prompt is prefilled remotely, the local prefill/decode split, the predicted "
                                "throughput")
    plan.add_argument("--config", required=True, help="cluster.toml; [[nodes]] with remote = true are the PrfaaS "
                                                      "prefill nodes")
    plan.add_argument("--trace", required=True, help="a Mooncake-format trace (JSON lines: input_length, "
                                                     "output_length, hash_ids) of the workload to plan for")
    plan.add_argument("--tbt-slo", type=float, help="s between tokens (default: the config's tbt_slo)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(func=cmd_federation_plan)
    from tokenflowd.sim.cli import add_commands as add_sim_commands

    add_sim_commands(sub, common)  # sim, calibrate
    return parser


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    daemon = a.command in ("serve", "conductor")
    level = (a.log_level or ("INFO" if daemon else "WARNING")).upper()
    # the daemons log to stdout, one line an event (journald under systemd); other commands to stderr
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stdout if daemon else sys.stderr)
    try:
        return a.func(a)
    except (ModelLoadError, InvalidRequestError, ValueError) as e:
        print(f"tokenflowd: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
