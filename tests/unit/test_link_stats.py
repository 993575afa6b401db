"""A link's measured bandwidth (federation/transport.py LinkStats): bytes over the time the link was
busy, so that writes in flight together are not counted as many seconds, and a link that slows
shows it once its recent transfers are the slow ones."""
from __future__ import annotations

import pytest

from tokenflowd.federation.delivery import Delivery
from tokenflowd.federation.transport import KVTransport, LinkStats


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


class _Transport(KVTransport):
    """Only the bookkeeping: the figures a transport reports from its writes and TCP's samples."""

    endpoint = "me:1"
    register = unregister = submit_write = close = None


def test_what_tcp_delivered_stands_for_the_link_once_it_measured_it():
    t = _Transport()
    with t._links_lock:
        t.links["peer:1"] = LinkStats()
        for i in range(10):  # writes the kernel took in 5 ms each: 160 MB/s by their own time
            t.links["peer:1"].add(800_000, i * 0.07, i * 0.07 + 0.005)
            t.egress.add(800_000, i * 0.07, i * 0.07 + 0.005)
    assert t.bandwidth("peer:1") > 100e6
    hosts = {"peer:1": "10.0.0.2", "peer:3": "10.0.0.2", "peer:2": "10.0.0.3"}
    for i, nbytes in enumerate([250_000, 240_000, 260_000, 250_000]):  # 20 ms busy intervals: 12.5 MB/s
        slow, other = Delivery(nbytes, 0.02, True, True), Delivery(20_000, 0.02, False, True)
        t._delivering({"peer:1": slow, "peer:3": slow, "peer:2": other}, hosts, 0.1 * i)
    t._delivering({"peer:1": Delivery(100_000, 0.02, False, False)}, hosts, 0.5)  # the tail: not busy
    assert t.bandwidth("peer:1") == pytest.approx(12.5e6)
    assert t.bandwidths() == pytest.approx({"peer:1": 12.5e6, "peer:3": 12.5e6})  # peer:2 never set the pace
    # two peers on one host share its sockets and count once; the other host's bytes count too
    assert t.egress_bandwidth() == pytest.approx(13.5e6)


def test_the_writes_figure_stands_where_tcp_saw_no_busy_interval_lately():
    t = _Transport()
    hosts = {"peer:1": "10.0.0.2"}
    t._delivering({"peer:1": Delivery(120_000, 0.02, True, True)}, hosts, 1.0)  # a slow link, measured by TCP
    with t._links_lock:
        t.links["peer:1"] = LinkStats()
        t.links["peer:1"].add(1_000_000, 0.5, 1.0)
    assert t.bandwidth("peer:1") == pytest.approx(6e6)
    t._delivering({"peer:1": Delivery(2_000_000, 0.02, False, False)}, hosts, 5.0)  # not busy: not counted
    assert t.bandwidth("peer:1") == pytest.approx(6e6)
    with t._links_lock:  # the link became fast: the kernel drains each write between two samples
        for i in range(5):
            t.links["peer:1"].add(10_000_000, 5.0 + i, 5.01 + i)
    assert t.bandwidth("peer:1") == pytest.approx(1e9)
