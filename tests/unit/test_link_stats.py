"""A link's measured bandwidth (federation/transport.py LinkStats): bytes over the time the link was
busy, so that writes in flight together are not counted as many seconds, and a link that slows
shows it once its recent transfers are the slow ones."""
from __future__ import annotations

from tokenflowd.federation.transport import LinkStats


def test_overlapping_writes_count_the_busy_time_once():
    link = LinkStats()
    for i in range(30):  # a layer-wise prefill: 30 writes of 1 MB in flight together over 1 s
        link.add(1_000_000, 0.0, 0.5 + i / 60)
    assert abs(link.bandwidth - 30e6 / (0.5 + 29 / 60)) < 1
    link.add(1_000_000, 2.0, 2.5)  # and an idle gap is not busy time
    assert abs(link.bandwidth - 31e6 / (0.5 + 29 / 60 + 0.5)) < 1


def test_a_slower_link_shows_once_its_recent_transfers_are_the_slow_ones():
    link = LinkStats()
    for i in range(20):
        link.add(10_000_000, i, i + 0.01)  # 1 GB/s
    assert link.bandwidth > 0.9e9
    link.add(10_000_000, 20.0, 21.0)  # 10 MB/s: the earlier fast ones mostly left the window
    assert link.bandwidth < 50e6
    assert link.peak >= 0.99e9 and link.bytes == 210_000_000
