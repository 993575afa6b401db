"""One measured run of the load generator, as both commands (cli.py's run, compare.py) build it
from their arguments: the workload, the client's config, the served model, the request bodies,
the run itself with a progress bar, and what the result file records of it."""
from __future__ import annotations

import argparse
import asyncio
import math
import sys
from collections import Counter

from loadgen.client import ClientConfig, RequestRecord, RunResult, run_blocking, served_model
from loadgen.workload import BodyFormat, LoadRequest, LoadWorkload, describe, load_requests
from tokenflowd.sim.workload import parse_context_shape, parse_lengths, parse_reading_rates


def workload_from_args(a: argparse.Namespace) -> LoadWorkload:
    num = a.num_prompts if a.num_prompts is not None else (a.burst_size or 100)
    return LoadWorkload(dataset=a.dataset_name, num_prompts=num, request_rate=a.request_rate,
                        burstiness=a.burstiness, burst_size=a.burst_size, burst_period=a.burst_period,
                        lengths=parse_lengths(a.lengths), reading_rates=parse_reading_rates(a.reading_rate),
                        seed=a.seed, dataset_path=a.dataset_path, time_scale=a.time_scale,
                        max_prompt_len=a.max_prompt_len, output_scale=a.output_scale, block_tokens=a.block_tokens,
                        abandon_fraction=a.abandon_fraction,
                        contexts=parse_context_shape(a.contexts) if a.contexts else None)


def _headers(a: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    return (("Authorization", f"Bearer {a.api_key}"),) if a.api_key else ()


def client_config(a: argparse.Namespace, base_url: str) -> ClientConfig:
    timeout = None if math.isinf(a.timeout) else a.timeout
    return ClientConfig(base_url.rstrip("/") + a.endpoint, timeout, a.max_concurrency, _headers(a))


def resolve_model(a: argparse.Namespace, base_url: str, model: str | None) -> str:
    return model or asyncio.run(served_model(base_url, dict(_headers(a))))


def requests_for(a: argparse.Namespace, w: LoadWorkload, model: str) -> list[LoadRequest]:
    fmt = BodyFormat(a.endpoint, model, a.vocab_size, not a.no_reading_rate_field)
    return load_requests(w, fmt)


def measure(loads: list[LoadRequest], cfg: ClientConfig, label: str, quiet: bool) -> RunResult:
    """One run, with a progress bar on stderr (when it is a terminal and not --quiet)."""
    from tqdm import tqdm

    counts: Counter[str] = Counter()
    with tqdm(total=len(loads), desc=label, unit="req", file=sys.stderr,
              disable=quiet or not sys.stderr.isatty()) as bar:
        def on_done(rec: RequestRecord) -> None:
            counts[rec.outcome] += 1
            bar.set_postfix(counts, refresh=False)
            bar.update(1)

        return run_blocking(loads, cfg, on_done)


def run_config(a: argparse.Namespace, w: LoadWorkload, **extra) -> dict:
    args = {k: v for k, v in vars(a).items() if k not in ("api_key",)}
    return {"args": args, "workload": describe(w), **extra}


def report_failures(result: RunResult) -> None:
    bad = [r for r in result.records if r.outcome in ("error", "timeout")]
    if bad:
        print(f"[loadgen] {len(bad)} of {len(result.records)} requests failed; first: {bad[0].request_id}: "
              f"{bad[0].error}", file=sys.stderr)
