"""What an engine process costs the machine, read from outside it (psutil): resident memory, CPU
time, threads and open file descriptors. /health and /metrics show them per engine, so that an
operator sees a leaking or spinning engine without logging into the box."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import psutil


@dataclass(frozen=True, slots=True)
class ProcessFigures:
    rss_bytes: int
    cpu_seconds: float  # user + system, since the process started
    threads: int
    open_fds: int  # files, sockets and pipes: what a leak of any of them grows

    def to_dict(self) -> dict:
        return asdict(self)


def process_figures(pid: int | None) -> ProcessFigures | None:
    """The figures of live process `pid`; None when there is none (exited, not started, not ours)."""
    if pid is None:
        return None
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            cpu = proc.cpu_times()
            return ProcessFigures(proc.memory_info().rss, cpu.user + cpu.system, proc.num_threads(),
                                  proc.num_fds() if hasattr(proc, "num_fds") else proc.num_handles())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
