"""bench/pool_query.py on a CPU, in small: the two processes start, every (prefix, rows) pair gets
its times, and the segment size follows from the measured α, B and k_comp. And the guards its GPU
run leans on: a holder that dies before it serves ends the bench at once with why, and --device cuda
where torch sees no GPU says so. No figure is checked for speed (the bench's own output is)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import pool_query  # noqa: E402


def test_the_cpu_bench_times_each_prefix_and_row_count_and_sizes_segments_from_its_measures(tmp_path):
    out = tmp_path / "pq.json"
    r = subprocess.run([sys.executable, str(BENCH / "pool_query.py"), "--prefix", "256,1024", "--rows", "1,4",
                        "--repeats", "3", "--bw-rows", "8", "--out", str(out)],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert [(row["prefix_tokens"], row["rows"]) for row in doc["rows"]] == [(256, 1), (256, 4), (1024, 1), (1024, 4)]
    for row in doc["rows"]:
        assert min(row["local_us"], row["shipped_us"], row["read_us"]) > 0, row
        assert row["query_added_us_per_layer"] == pytest.approx(row["shipped_us"] - row["local_us"], abs=0.2), row
    assert doc["threshold_tokens"] == pytest.approx(threshold_from(doc, doc), rel=0.002)  # from the rounded figures
    t = doc["threshold_tokens"]  # rounded to 0.1
    assert max(1, math.ceil((t - 0.1) / pool_query.PAGE)) <= doc["pages_per_segment"] <= \
        max(1, math.ceil((t + 0.1) / pool_query.PAGE))
    assert doc["payload_bytes"] == 2 * pool_query.HEADS * pool_query.HEAD_DIM * 4 + 4 * pool_query.HEADS


def threshold_from(link: dict, doc: dict) -> float:
    """The segment threshold rebuilt from a record's figures, as a reader of the record would."""
    k = doc["k_comp_ns_per_token"] * 1e-9
    return 2 * link["alpha_us"] * 1e-6 / k + doc["payload_bytes"] / (k * link["bandwidth_GBps"] * 1e9)


@pytest.mark.parametrize("bandwidth", [6.49e6, 0.0155e9, 5.944e9, 3.25e13])  # a loaded machine's few MB/s up
def test_the_recorded_figures_give_back_the_threshold_whatever_the_links_speed(bandwidth):
    costs = pool_query.SegmentCosts(alpha=131.07e-6, bandwidth=bandwidth, k_comp=127.5e-9,
                                    payload=pool_query.query_payload(pool_query.HEADS, pool_query.HEAD_DIM, 4))
    doc = {"k_comp_ns_per_token": pool_query.significant(costs.k_comp * 1e9), "payload_bytes": costs.payload}
    link = pool_query.link_figures(costs)
    assert link["threshold_tokens"] == pytest.approx(costs.threshold_tokens(), abs=0.05)
    assert threshold_from(link, doc) == pytest.approx(costs.threshold_tokens(), rel=0.002)


@pytest.mark.skipif(torch.cuda.is_available(), reason="its holder would start on this GPU")
def test_a_holder_that_dies_before_it_serves_ends_the_bench_at_once_with_why(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(SystemExit, match="did not start: it exited"):
        # on a CPU-only torch the holder's cache cannot go to cuda: it exits with a traceback
        pool_query.start_holder(["--address", f"ipc://{tmp_path}/q.sock", "--pages", "4", "--threads", "1",
                                 "--device", "cuda", "--export", str(tmp_path / "kv.cudaipc")], within=600.0)
    assert time.monotonic() - t0 < 300, "it waited out the limit instead of seeing the holder exit"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU")
def test_device_cuda_without_a_gpu_says_so(tmp_path):
    r = subprocess.run([sys.executable, str(BENCH / "pool_query.py"), "--device", "cuda", "--out",
                        str(tmp_path / "pq.json")], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "torch sees no CUDA device" in r.stderr
    assert not (tmp_path / "pq.json").exists()
