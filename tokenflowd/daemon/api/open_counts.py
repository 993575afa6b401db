"""Requests open at once, in total (--max-streams) and per API key (max_concurrent).

One API server process counts in memory (`OpenCounts`). With --api-servers N the bounds are the
server's, not each front's: a key split N ways would get N times its bound, or be refused while
under it when the kernel's SO_REUSEPORT hash sends most of its connections to one front. So the
fronts share one table (`SharedOpenCounts`), a file in the daemon's private runtime directory that
each maps into memory:

    row 0            [ -            | front 1 | front 2 | ... | front N ]   every open request
    row r (1..R-1)   [ key identity | front 1 | front 2 | ... | front N ]   a key's open requests

Each front writes only its own column. Opening a request reads a row's sum and adds to its own
cell under an exclusive flock on the file, so two fronts cannot both take the last place; closing
one takes its own cell down without the lock. A key's row is found by probing from its identity
(a 64-bit hash) and claimed under the lock. A front that starts clears its column: what its
previous process left open was aborted with it. If every row is claimed (more keys than rows), a
key beyond them is counted by each front alone, and a warning says so once.
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("tokenflowd.api")

OPEN_COUNTS = "open-counts"  # the table's file in the runtime directory
_CELL = 8  # int64
ROWS = 4096


class OpenCounts:
    """One front's count: in memory."""

    def __init__(self) -> None:
        self.by_key: dict[str, int] = {}
        self._total = 0

    def total(self) -> int:
        return self._total

    def open(self, identity: str, max_total: int | None, max_key: int | None) -> str | None:
        """Count a request of `identity` open unless a bound is reached: None when counted, else
        which bound refused it ("streams" or "key")."""
        if max_total is not None and self._total >= max_total:
            return "streams"
        if max_key is not None and self.by_key.get(identity, 0) >= max_key:
            return "key"
        self._total += 1
        self.by_key[identity] = self.by_key.get(identity, 0) + 1
        return None

    def close(self, identity: str) -> None:
        self._total -= 1
        left = self.by_key.pop(identity) - 1
        if left:
            self.by_key[identity] = left


class SharedOpenCounts(OpenCounts):
    """Front `front` (1..fronts) of `fronts`, on the table at `path` (made by `create`)."""

    def __init__(self, path: Path, fronts: int, front: int) -> None:
        super().__init__()
        self.fronts, self.column = fronts, front
        self._fd = os.open(path, os.O_RDWR)
        self._map = mmap.mmap(self._fd, ROWS * (fronts + 1) * _CELL)
        self._cells = memoryview(self._map).cast("q")
        self._rows: dict[str, int | None] = {}  # identity -> its row (None: the table is full)
        self._warned = False
        with self._locked():
            self._clear_column()

    @staticmethod
    def create(path: Path, fronts: int) -> None:
        """A zeroed table for `fronts` fronts (the supervisor of the fronts, before it starts them)."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, ROWS * (fronts + 1) * _CELL)
        finally:
            os.close(fd)

    @classmethod
    def clear(cls, path: Path, fronts: int, front: int) -> None:
        """Front `front` is gone, and its requests were aborted: its places are free (the supervisor
        of the fronts, at once, rather than when its successor starts)."""
        cls(path, fronts, front).close_table()

    def close_table(self) -> None:
        self._cells.release()
        self._map.close()
        os.close(self._fd)

    def _clear_column(self) -> None:
        cells = self._cells
        for row in range(ROWS):
            cells[self._at(row, self.column)] = 0

    def _at(self, row: int, front: int) -> int:
        return row * (self.fronts + 1) + front

    def _sum(self, row: int) -> int:
        start = self._at(row, 1)
        return sum(self._cells[start:start + self.fronts])

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _row(self, identity: str) -> int | None:
        """The row of `identity`, claimed if new (call under the lock)."""
        if identity in self._rows:
            return self._rows[identity]
        tag = int(identity, 16) if identity else 0
        tag = tag & 0x7FFF_FFFF_FFFF_FFFF or 1  # 0 marks a free row
        cells, found = self._cells, None
        for i in range(ROWS - 1):
            row = 1 + (tag + i) % (ROWS - 1)
            at = self._at(row, 0)
            if cells[at] == tag:
                found = row
                break
            if cells[at] == 0:
                cells[at] = tag
                found = row
                break
        if found is None and not self._warned:
            self._warned = True
            log.warning("more API keys than the %d rows of the shared open-request table: max_concurrent of the "
                        "others is counted by each API server process alone", ROWS - 1)
        self._rows[identity] = found
        return found

    def total(self) -> int:
        return self._sum(0)

    def open(self, identity: str, max_total: int | None, max_key: int | None) -> str | None:
        if max_total is None and max_key is None:
            self._add(identity, None, 1)
            return None
        with self._locked():
            row = self._row(identity) if max_key is not None else None
            if max_total is not None and self._sum(0) >= max_total:
                return "streams"
            if max_key is not None:
                held = self._sum(row) if row is not None else self.by_key.get(identity, 0)
                if held >= max_key:
                    return "key"
            self._add(identity, row, 1)
        return None

    def close(self, identity: str) -> None:
        self._add(identity, self._rows.get(identity), -1)

    def _add(self, identity: str, row: int | None, n: int) -> None:
        cells, column = self._cells, self.column
        cells[self._at(0, column)] += n
        if row is not None:
            cells[self._at(row, column)] += n
        left = self.by_key.get(identity, 0) + n
        if left:
            self.by_key[identity] = left
        else:
            self.by_key.pop(identity, None)
