"""PNG plots of a run (matplotlib, Agg backend: no display needed).

    timelines.png   tokens received over time, one step line per request (a sample of at most 40),
                    from its arrival; × where a client left early (abandoned, timeout, error)
    buffer.png      unread tokens in each sampled reader's buffer over time, and the mean over all
                    requests (tokenflowd.buffer.tracker.TokenBuffer replayed on the token times)
    ttft_cdf.png    share of requests with a first token within t; several runs overlaid (compare)
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from loadgen.client import RequestRecord
from tokenflowd.buffer.tracker import TokenBuffer

MAX_LINES = 40
GRID_POINTS = 400


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def sample(records: Sequence[RequestRecord], k: int) -> list[RequestRecord]:
    """At most k records, evenly spaced in arrival order (deterministic)."""
    if len(records) <= k:
        return list(records)
    idx = np.linspace(0, len(records) - 1, k).round().astype(int)
    return [records[i] for i in idx]


def buffer_curve(token_times: Sequence[float], reading_rate: float, grid: np.ndarray) -> np.ndarray:
    """Unread tokens at each grid time (grid non-decreasing)."""
    buf = TokenBuffer(reading_rate)
    out = np.zeros(len(grid))
    j = 0
    for i, t in enumerate(grid):
        while j < len(token_times) and token_times[j] <= t:
            buf.on_tokens(1, token_times[j])
            j += 1
        out[i] = buf.buffer(t)
    return out


def plot_timelines(records: Sequence[RequestRecord], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 5))
    for r in sample(records, MAX_LINES):
        start = r.scheduled if r.arrival is None else r.arrival
        ys = np.arange(len(r.token_times) + 1)
        line, = ax.step([start, *r.token_times], ys, where="post", linewidth=0.9)
        if r.outcome != "completed":
            ax.plot([r.token_times[-1] if r.token_times else start], [ys[-1]], "x", color=line.get_color())
    ax.set_xlabel("time since the run's start (s)")
    ax.set_ylabel("tokens received")
    ax.set_title(f"Per-request token timelines ({min(len(records), MAX_LINES)} of {len(records)} requests)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_buffers(records: Sequence[RequestRecord], path: Path, num_sampled: int = 8) -> None:
    plt = _pyplot()
    # a reader keeps reading after its last token: run the grid until the last buffer has drained
    ends = [r.token_times[-1] + len(r.token_times) / r.reading_rate for r in records if r.token_times]
    grid = np.linspace(0.0, max(ends, default=1.0), GRID_POINTS)
    curves = {r.request_id: buffer_curve(r.token_times, r.reading_rate, grid) for r in records}
    fig, ax = plt.subplots(figsize=(9, 5))
    for r in sample(records, num_sampled):
        ax.plot(grid, curves[r.request_id], linewidth=0.8, alpha=0.7,
                label=f"{r.request_id} ({r.reading_rate:g} tok/s)")
    ax.plot(grid, np.mean(list(curves.values()), axis=0), color="black", linewidth=2.0, label="mean, all requests")
    ax.set_xlabel("time since the run's start (s)")
    ax.set_ylabel("unread tokens in the client's buffer")
    ax.set_title("Client buffer occupancy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_ttft_cdf(runs: Mapping[str, Sequence[RequestRecord]], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 5))
    for label, records in runs.items():
        ttfts = np.sort([r.ttft for r in records if r.ttft is not None])
        # share of all requests: ones that never got a token keep the curve below 1
        ax.step(np.concatenate([[0.0], ttfts]), np.arange(len(ttfts) + 1) / max(len(records), 1), where="post",
                label=f"{label} ({len(ttfts)}/{len(records)} served)")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("share of requests")
    ax.set_ylim(0, 1.02)
    ax.set_title("TTFT CDF")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_run(records: Sequence[RequestRecord], out_dir: Path, label: str = "run") -> list[Path]:
    """The three plots of one run into out_dir; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "timelines.png", out_dir / "buffer.png", out_dir / "ttft_cdf.png"]
    plot_timelines(records, paths[0])
    plot_buffers(records, paths[1])
    plot_ttft_cdf({label: records}, paths[2])
    return paths
