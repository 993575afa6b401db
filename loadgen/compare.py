"""`tokenflowd-loadgen compare`: one seeded workload against two endpoints, A then B.

Both runs get the same requests (prompts, lengths, arrival schedule, reading rates, abandon
points); only the model name in the body may differ (--model-b). The table shows both summaries
and B/A; the JSON holds {"config", "runs": {label_a: doc, label_b: doc}, "ratios": {key: B/A}};
--plot-dir gets each run's plots in a subfolder named by its label, and ttft_cdf.png with both
runs overlaid.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from loadgen.measure import (
    client_config,
    measure,
    report_failures,
    requests_for,
    resolve_model,
    run_config,
    workload_from_args,
)
from loadgen.report import SLO, document, dumps, format_table, ratios


def cmd_compare(a: argparse.Namespace) -> int:
    if a.label_a == a.label_b:
        raise ValueError(f"--label-a and --label-b must differ, both are {a.label_a!r}")
    w = workload_from_args(a)
    slo = SLO(a.slo_ttft, a.slo_rebuffer)
    targets = ((a.label_a, a.base_url, a.model), (a.label_b, a.base_url_b, a.model_b or a.model))
    docs, results = {}, {}
    for label, base_url, model in targets:
        model = resolve_model(a, base_url, model)
        cfg = client_config(a, base_url)
        result = measure(requests_for(a, w, model), cfg, label, a.quiet)
        report_failures(result)
        docs[label] = document(run_config(a, w, url=cfg.url, model=model), result, slo)
        results[label] = result
    summaries = {label: doc["summary"] for label, doc in docs.items()}
    print(format_table(summaries))
    out = {"config": run_config(a, w), "runs": docs,
           "ratios": ratios(summaries[a.label_a], summaries[a.label_b], tuple(summaries[a.label_a]))}
    if a.out:
        Path(a.out).write_text(dumps(out))
        print(f"[loadgen] wrote {a.out}", file=sys.stderr)
    if a.plot_dir:
        from loadgen.plots import plot_run, plot_ttft_cdf

        root = Path(a.plot_dir)
        for label, result in results.items():
            plot_run(result.records, root / label, label)
        plot_ttft_cdf({label: r.records for label, r in results.items()}, root / "ttft_cdf.png")
        print(f"[loadgen] wrote plots under {root}", file=sys.stderr)
    served = all(any(r.outcome in ("completed", "abandoned") for r in res.records) for res in results.values())
    return 0 if served else 1
