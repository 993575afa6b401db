"""Open requests counted across API server processes (daemon/api/open_counts.py)."""
from __future__ import annotations

import multiprocessing

from tokenflowd.daemon.api.open_counts import OpenCounts, SharedOpenCounts

KEY_A, KEY_B = "00000000000000a1", "00000000000000b2"


def test_one_front_counts_in_memory():
    c = OpenCounts()
    assert c.open(KEY_A, 3, 2) is None and c.open(KEY_A, 3, 2) is None
    assert c.open(KEY_A, 3, 2) == "key"
    assert c.open(KEY_B, 3, None) is None
    assert c.open(KEY_B, 3, None) == "streams" and c.total() == 3
    c.close(KEY_A)
    assert c.open(KEY_A, 3, 2) is None


def test_fronts_share_the_bounds_and_a_restarted_front_starts_clear(tmp_path):
    path = tmp_path / "open-counts"
    SharedOpenCounts.create(path, 2)
    one, two = SharedOpenCounts(path, 2, 1), SharedOpenCounts(path, 2, 2)
    assert one.open(KEY_A, 5, 2) is None
    assert two.open(KEY_A, 5, 2) is None
    assert one.open(KEY_A, 5, 2) == "key" and two.open(KEY_A, 5, 2) == "key"  # 2 open across both
    assert two.open(KEY_B, 5, 3) is None and one.open(KEY_B, 5, 3) is None
    assert one.open("", 5, None) is None  # no key, no key bound: the total only
    assert two.open(KEY_B, 5, 3) == "streams" and one.total() == two.total() == 5
    one.close(KEY_A)
    assert two.open(KEY_A, 6, 2) is None  # the place front 1 freed
    SharedOpenCounts.clear(path, 2, 2)  # front 2 died: its requests were aborted with it
    assert one.total() == 2 and one.open(KEY_A, 5, 2) is None
    again = SharedOpenCounts(path, 2, 2)  # its successor
    assert again.open(KEY_B, 5, 2) is None  # KEY_B's place held by dead front 2 is free again
    assert one.total() == 4


def _open_many(path, front: int, n: int, out) -> None:
    counts = SharedOpenCounts(path, 2, front)
    out.put(sum(counts.open(KEY_A, None, 100) is None for _ in range(n)))


def test_two_processes_never_take_more_than_the_bound_together(tmp_path):
    path = tmp_path / "open-counts"
    SharedOpenCounts.create(path, 2)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_open_many, args=(path, k, 500, out)) for k in (1, 2)]
    for p in procs:
        p.start()
    got = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(60)
    assert sum(got) == 100
