"""`tokenflowd-loadgen` (also `python -m loadgen`): bursts of streaming clients that read at human
speed, against any OpenAI-compatible endpoint. `run` is the default command.

    tokenflowd-loadgen --base-url http://127.0.0.1:8000 --num-prompts 200 --lengths sharegpt \\
        --reading-rate 15:0.4,20:0.6 --seed 1 --out result.json --plot-dir plots/
    tokenflowd-loadgen --burst-size 50 --burst-period 20 --num-prompts 200 --slo-ttft 2 --slo-rebuffer 1
    tokenflowd-loadgen --request-rate 4 --burstiness 0.5 --abandon-fraction 0.1 --timeout 30
    tokenflowd-loadgen --dataset-name mooncake --num-prompts 300 --time-scale 0.1 --max-prompt-len 4096
    tokenflowd-loadgen --dataset-name burstgpt --dataset-path BurstGPT_1.csv --time-scale 0.05
    tokenflowd-loadgen compare --base-url http://127.0.0.1:8000 --base-url-b http://127.0.0.1:8001 \\
        --label-a fcfs --label-b tokenflow --num-prompts 100 --out both.json --plot-dir plots/

Flags shared with `vllm bench serve` have its names: --base-url, --model, --num-prompts,
--request-rate, --burstiness, --max-concurrency, --seed, --dataset-name, --dataset-path.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from loadgen.compare import cmd_compare
from loadgen.measure import (
    client_config,
    measure,
    report_failures,
    requests_for,
    resolve_model,
    run_config,
    workload_from_args,
)
from loadgen.report import SLO, document, dumps, format_table
from loadgen.workload import DATASETS, ENDPOINTS

COMMANDS = ("run", "compare")


def _rate(text: str) -> float:
    v = float(text)  # accepts inf
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be above 0 (or inf), got {text}")
    return v


def _common_args() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    t = p.add_argument_group("target")
    t.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000)")
    t.add_argument("--endpoint", default="/v1/completions", choices=ENDPOINTS,
                   help="/v1/completions (token-id prompts, the default) or /v1/chat/completions (text prompts)")
    t.add_argument("--model", help="the model name to send (default: the first one GET /v1/models lists)")
    t.add_argument("--api-key", help="sent as Authorization: Bearer KEY")
    t.add_argument("--no-reading-rate-field", action="store_true",
                   help="leave `reading_rate` out of the body (for servers that refuse unknown fields)")
    t.add_argument("--vocab-size", type=int, default=49152,
                   help="token ids of prompts are drawn below this (default 49152, the embedded model's)")
    w = p.add_argument_group("workload")
    w.add_argument("--dataset-name", default="random", choices=DATASETS,
                   help="random: synthetic lengths (--lengths); synthetic: shared long contexts (--contexts); "
                        "mooncake: the Mooncake trace; burstgpt: a CSV")
    w.add_argument("--contexts", help="synthetic: documents | sessions | system-prompt (TokenLake's kind of "
                                      "workload, the published shapes), with :KEY=VALUE overrides of "
                                      "context_tokens, uses, active, scale (documents:scale=0.05:active=4); "
                                      "contexts are whole --block-tokens blocks")
    w.add_argument("--dataset-path", help="mooncake: conversation_trace.jsonl (default: the shared copy); "
                                          "burstgpt: a CSV with columns Timestamp,Model,Request tokens,"
                                          "Response tokens,Total tokens,Log Type")
    w.add_argument("--num-prompts", type=int, help="requests (default: --burst-size if given, else 100)")
    w.add_argument("--lengths", default="SL",
                   help="random dataset: SL | LL | sharegpt | normal:IN:SD:OUT:SD | lognormal:IN:SIGMA:OUT:SIGMA | "
                        "fixed:IN:OUT (default SL: normal, 512 in / 1024 out)")
    w.add_argument("--request-rate", type=_rate,
                   help="requests/s; inf = one burst (the default for random; traces replay their timestamps)")
    w.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the gaps at a finite --request-rate: 1 Poisson, <1 burstier (default 1)")
    w.add_argument("--burst-size", type=int, help="requests per burst")
    w.add_argument("--burst-period", type=float, help="s between bursts of --burst-size (repeated bursts)")
    w.add_argument("--reading-rate", default="20", help="tokens/s the readers read: 15, or a mix 15:0.4,20:0.6")
    w.add_argument("--seed", type=int, default=0, help="workload seed: prompts, lengths, arrivals, rates (default 0)")
    w.add_argument("--time-scale", type=float, default=1.0, help="trace arrivals × this (below 1 replays faster)")
    w.add_argument("--max-prompt-len", type=int, help="trace datasets: truncate longer prompts to this many tokens")
    w.add_argument("--block-tokens", type=int, default=512,
                   help="mooncake: tokens per prefix block (default 512, the trace's); fewer scale every prompt "
                        "down by that share and keep which prefixes requests share")
    w.add_argument("--output-scale", type=float, default=1.0,
                   help="trace datasets: output lengths times this (default 1; a small CPU box: e.g. 0.1)")
    c = p.add_argument_group("clients")
    c.add_argument("--max-concurrency", type=int, help="streams open at once (default: no bound)")
    c.add_argument("--timeout", type=float, default=60.0,
                   help="s without a byte (first token included) before a client gives up; inf: never (default 60)")
    c.add_argument("--abandon-fraction", type=float, default=0.0,
                   help="share of clients (seeded) that close their stream after a seeded share of its tokens")
    o = p.add_argument_group("metrics and output")
    o.add_argument("--slo-ttft", type=float, help="s: the TTFT bound for SLO attainment and goodput")
    o.add_argument("--slo-rebuffer", type=float, help="s: the per-request stall bound for SLO attainment and goodput")
    o.add_argument("--out", help="write the result JSON here")
    o.add_argument("--plot-dir", help="write timelines.png, buffer.png and ttft_cdf.png here")
    o.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenflowd-loadgen", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    common = _common_args()
    sub.add_parser("run", parents=[common], help="drive one endpoint (the default command)")
    c = sub.add_parser("compare", parents=[common], help="the same seeded workload against two endpoints, one "
                                                         "after the other, with B/A ratios")
    c.add_argument("--base-url-b", required=True, help="the second server (B)")
    c.add_argument("--model-b", help="the model name for B (default: --model, else B's first listed model)")
    c.add_argument("--label-a", default="A", help="A's name in the table and the JSON (default A)")
    c.add_argument("--label-b", default="B", help="B's name (default B)")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in (*COMMANDS, "-h", "--help"):
        argv.insert(0, "run")
    return build_parser().parse_args(argv)


def cmd_run(a: argparse.Namespace) -> int:
    w = workload_from_args(a)
    slo = SLO(a.slo_ttft, a.slo_rebuffer)
    model = resolve_model(a, a.base_url, a.model)
    cfg = client_config(a, a.base_url)
    result = measure(requests_for(a, w, model), cfg, "loadgen", a.quiet)
    report_failures(result)
    doc = document(run_config(a, w, url=cfg.url, model=model), result, slo)
    print(format_table({"run": doc["summary"]}))
    if a.out:
        Path(a.out).write_text(dumps(doc))
        print(f"[loadgen] wrote {a.out}", file=sys.stderr)
    if a.plot_dir:
        from loadgen.plots import plot_run

        paths = plot_run(result.records, Path(a.plot_dir))
        print(f"[loadgen] wrote {', '.join(map(str, paths))}", file=sys.stderr)
    return 0 if any(r.outcome in ("completed", "abandoned") for r in result.records) else 1


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        if a.command == "compare":
            return cmd_compare(a)
        return cmd_run(a)
    except (ValueError, OSError) as e:
        print(f"tokenflowd-loadgen: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
