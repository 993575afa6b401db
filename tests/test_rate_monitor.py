"""Send-side backpressure → the client's real reading rate."""
import pytest

from tokenflowd.api.generation import RateMonitor


def test_a_blocked_slow_reader_gets_its_measured_rate():
    m = RateMonitor(stated_rate=20.0, window=2.0)
    t = 0.0
    reported = []
    for _ in range(30):  # 5 tokens/s, each write blocked most of its 0.2 s
        t += 0.2
        r = m.observe(1, 0.15, t)
        if r is not None:
            reported.append(r)
    assert reported and reported[0] == pytest.approx(5.0, rel=0.15)
    assert len(reported) == 1  # it stays put while the rate holds


def test_unblocked_writes_bring_the_stated_rate_back():
    m = RateMonitor(stated_rate=20.0, window=1.0)
    assert m.observe(0, 0.0, 0.0) is None  # the first write opens the window
    assert m.observe(2, 0.9, 1.0) == pytest.approx(2.0)
    assert m.observe(30, 0.0, 2.0) == 20.0


def test_a_fast_reader_keeps_its_rate():
    m = RateMonitor(stated_rate=10.0, window=1.0)
    assert all(m.observe(1, 0.0, i * 0.05) is None for i in range(1, 200))
