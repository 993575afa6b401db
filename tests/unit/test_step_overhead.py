"""Overlap scheduling hides the engine's host work behind the device: bench/step_overhead.py's
stand-in device is busy 10 ms a step, asynchronously, and the real step loop runs at batch 256.

A ratio, not a timed bound: overlapped, a step takes max(host, device) at best; it must stay
within a generous margin of that floor, and below the serial step (host + device)."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench"))

from step_overhead import run  # noqa: E402


def test_overlapped_steps_take_about_the_device_time_at_batch_256():
    off = run(256, 10.0, 40, overlap=False)
    on = run(256, 10.0, 40, overlap=True)
    floor = max(off["host_ms"], 10.0)
    assert on["wall_ms"] <= 1.5 * floor, (on, off)  # the bench: bench/results/step_overhead.json
    assert on["wall_ms"] < off["wall_ms"], (on, off)
    # and it is the overlap that did it: each step was launched while the one before still ran
    assert on["launched_behind"] >= on["steps"] - 1 and off["launched_behind"] == 0, (on, off)
