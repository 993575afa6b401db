"""The copier in virtual time, for the simulator: the host tier's bookkeeping runs for real (the
offload manager, its frontiers and pins); only the bytes do not move.

Each lane is one host link direction at the cost model's effective bandwidth; a job starts when
the lane is free (after the jobs before it) and ends nbytes / bandwidth later. Copies run beside
the steps: a job submitted before a step may end during it, and the next schedule() sees it.
"""
from __future__ import annotations

from tokenflowd.kv.copier import LOAD, WRITE, Copier, CopyJob
from tokenflowd.sim.clock import VirtualClock


class SimCopier(Copier):
    def __init__(self, bandwidth: float, clock: VirtualClock) -> None:
        super().__init__(None, None, bandwidth)
        self.rate = bandwidth
        self.clock = clock  # wait() moves it forward to the job's end
        self._lane_free_at = {WRITE: 0.0, LOAD: 0.0}

    def _start(self, job: CopyJob) -> None:
        start = max(self.clock.now, self._lane_free_at[job.lane])
        job.seconds = job.nbytes / self.rate
        job._events = start + job.seconds  # the virtual time it ends
        self._lane_free_at[job.lane] = job._events

    def _finished(self, job: CopyJob) -> bool:
        return self.clock.now >= job._events

    def _wait(self, job: CopyJob) -> None:
        self.clock.now = max(self.clock.now, job._events)
