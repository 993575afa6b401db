"""The engine's host work per decode step, and whether overlap scheduling hides it behind the device.

    python bench/step_overhead.py [--batches 1,64,256] [--device-ms 10] [--steps 200] [--out FILE.json]

The real step loop (EngineCore, the scheduler, the tokenflow policy, the KV manager's pages) runs
with a stand-in executor whose "device" is busy `--device-ms` per step, asynchronously: a launch
returns at once and the step ends D ms after the device is free, as a GPU's queue does; `collect`
sleeps until then. Each batch size runs with overlap off (schedule, compute, update in series: the
step takes host + D) and on (the next step is scheduled while one runs: max(host, D) is the floor).

Reported per batch: host ms per step (off: the step's wall time less D; on: the time the loop does
not spend waiting on the device), the step's wall time, and wall / max(host_off, D), the overlap's
efficiency (1.0: the device never waits). No GPU is involved: this proves the overlap, not a speed.
"""
from __future__ import annotations

import argparse
import json
import platform
import time

from tokenflowd.buffer import make_policy
from tokenflowd.config import PolicyConfig
from tokenflowd.engine.core import EngineCore
from tokenflowd.engine.executor import Executor, Launched
from tokenflowd.engine.request import Request, SamplingParams
from tokenflowd.engine.scheduler import ScheduledBatch, Scheduler
from tokenflowd.kv.manager import KVCacheManager
from tokenflowd.kv.pages import PagePool

PAGE = 16
PROMPT = 128
VOCAB = 32_000


class FakeDevice(Executor):
    """A device that computes each step in `seconds`, one after another, behind the host's back."""

    overlaps = True

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.free_at = 0.0  # when the device ends the last step queued on it
        self.waited = 0.0  # s the host spent waiting on it
        self.in_flight = 0  # steps launched and not yet collected
        self.num_behind = 0  # steps launched while the one before was not yet collected        self._last: list[int] = []  # the last launched step's tokens ("on the device")

    def _tokens(self, batch: ScheduledBatch) -> list[int | None]:
        out: list[int | None] = []
        for i, row in enumerate(batch.sampling):
            ids = batch.input_ids[i]
            last = self._last[batch.prev_sample[i]] if batch.prev_sample and batch.prev_sample[i] >= 0 else ids[-1]
            out.append(None if row is None else (last * 31 + 7) % VOCAB)  # a function of the input, as a model's
        self._last = [t for t in out if t is not None]
        return out

    def launch(self, batch: ScheduledBatch) -> Launched:
        self.num_behind += self.in_flight > 0  # launched before the step before was collected: overlapped
        self.in_flight += 1
        self.free_at = max(time.perf_counter(), self.free_at) + self.seconds
        return Launched(batch, work=(self.free_at, self._tokens(batch)), seconds=self.seconds)

    def collect(self, launched: Launched) -> list[int | None]:
        end, tokens = launched.work
        self.in_flight -= 1
        t0 = time.perf_counter()
        while (left := end - time.perf_counter()) > 0:
            time.sleep(left)
        self.waited += time.perf_counter() - t0
        return tokens

    def execute(self, batch: ScheduledBatch) -> list[int | None]:
        return self.collect(self.launch(batch))


def run(batch_size: int, device_ms: float, steps: int, overlap: bool) -> dict:
    dev = FakeDevice(device_ms / 1e3)
    num_pages = batch_size * ((PROMPT + 2 * steps + 64) // PAGE + 2)
    kv = KVCacheManager(PagePool(num_pages), PAGE)
    scheduler = Scheduler(kv, make_policy("tokenflow", PolicyConfig()), 8192, max(256, batch_size))
    core = EngineCore(dev, scheduler, max_model_len=PROMPT + 4 * steps + 256, vocab_size=VOCAB)
    core.overlap = overlap
    for i in range(batch_size):
        prompt = [(i * 7919 + k * 104729) % VOCAB for k in range(PROMPT)]
        core.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=3 * steps, temperature=0.0,
                                                                 ignore_eos=True)))
    while any(r.num_computed_tokens < PROMPT for r in scheduler.requests.values()):  # prefills
        core.step()
    for _ in range(5):
        core.step()
    dev.waited, dev.num_behind = 0.0, 0
    t0 = time.perf_counter()
    for _ in range(steps):
        core.step()
    wall = (time.perf_counter() - t0) / steps
    core.drain()
    return {"batch": batch_size, "overlap": overlap, "wall_ms": wall * 1e3,
            "host_ms": (wall - dev.waited / steps) * 1e3 if overlap else (wall - device_ms / 1e3) * 1e3,
            "device_ms": device_ms, "steps": steps, "launched_behind": dev.num_behind}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--device-ms", type=float, default=10.0)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out")
    a = ap.parse_args()
    rows = []
    print(f"{'batch':>5} {'host off':>9} {'wall off':>9} {'host on':>8} {'wall on':>8} {'on/max(host,D)':>15}")
    for b in (int(x) for x in a.batches.split(",")):
        off = run(b, a.device_ms, a.steps, False)
        on = run(b, a.device_ms, a.steps, True)
        floor = max(off["host_ms"], a.device_ms)
        row = {"batch": b, "off": off, "on": on, "on_over_floor": on["wall_ms"] / floor,
               "on_over_device": on["wall_ms"] / a.device_ms}
        rows.append(row)
        print(f"{b:>5} {off['host_ms']:>9.2f} {off['wall_ms']:>9.2f} {on['host_ms']:>8.2f} {on['wall_ms']:>8.2f} "
              f"{row['on_over_floor']:>15.3f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"machine": platform.processor() or platform.machine(), "device_ms": a.device_ms,
                       "steps": a.steps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
