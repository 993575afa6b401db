"""The client's real reading rate: send-side backpressure and the read cursor, in both directions
(daemon/api/rates.py), and the rate a request starts with."""
import pytest

from tokenflowd.daemon.api.generation import RateMonitor
from tokenflowd.daemon.api.rates import choose_rate


def test_a_blocked_slow_reader_gets_its_measured_rate():
    m = RateMonitor(initial_rate=20.0, window=2.0)
    t = 0.0
    reported = []
    for _ in range(30):  # 5 tokens/s, each write blocked most of its 0.2 s
        t += 0.2
        r = m.observe(1, 0.15, t)
        if r is not None:
            reported.append(r)
    assert reported and reported[0] == pytest.approx(5.0, rel=0.15)
    assert len(reported) == 1  # it stays put while the rate holds
    assert m.source == "backpressure"


def test_unblocked_writes_bring_the_initial_rate_back():
    m = RateMonitor(initial_rate=20.0, window=1.0, initial_source="learned")
    assert m.observe(0, 0.0, 0.0) is None  # the first write opens the window
    assert m.observe(2, 0.9, 1.0) == pytest.approx(2.0)
    assert m.observe(30, 0.0, 2.0) == 20.0
    assert m.source == "learned"


def test_a_fast_reader_keeps_its_rate():
    m = RateMonitor(initial_rate=10.0, window=1.0)
    assert all(m.observe(1, 0.0, i * 0.05) is None for i in range(1, 200))  # 20 tokens/s taken, never blocked


def test_a_client_that_blocks_at_a_higher_pace_is_raised_but_never_past_the_maximum():
    m = RateMonitor(initial_rate=10.0, window=1.0, max_rate=50.0)
    assert m.observe(0, 0.0, 0.0) is None
    assert m.observe(30, 0.8, 1.0) == pytest.approx(30.0)  # paced by the client at 30 tokens/s: its rate
    assert m.observe(200, 0.8, 2.0) == 50.0  # 200 tokens/s taken while blocked: clamped
    assert m.observe(500, 0.0, 3.0) is None  # unblocked: a lower bound on the transport, never a raise


def test_the_read_cursor_sets_the_rate_up_and_down_and_silences_backpressure():
    m = RateMonitor(initial_rate=20.0, window=2.0, max_rate=100.0)
    assert m.on_read(0, 100, 0.0) is None  # the first report only anchors the pace
    assert m.on_read(8, 200, 1.0) is None  # under a window
    assert m.on_read(16, 300, 2.0) == pytest.approx(8.0)  # 16 tokens in 2 s, always with tokens in hand
    assert m.source == "read_cursor" and m.num_read == 16
    assert m.observe(5, 1.9, 10.0) is None and m.observe(5, 1.9, 13.0) is None  # blocked: ignored now
    assert m.current == pytest.approx(8.0)
    assert m.on_read(76, 400, 4.0) == pytest.approx(30.0)  # a faster reader is raised
    assert m.on_read(1000, 2000, 6.0) == 100.0  # never past the maximum
    assert m.on_read(1000, 2000, 8.0) == pytest.approx(0.1)  # a reader that stopped is slow, not at rate 0


def test_a_reader_that_caught_up_gives_only_a_lower_bound():
    m = RateMonitor(initial_rate=20.0, window=2.0)
    m.on_read(10, 10, 0.0)
    # It read all 20 delivered by t=2 (it may have waited for them): 5 tokens/s is a lower bound.
    assert m.on_read(20, 20, 2.0) is None and m.current == 20.0
    assert m.on_read(100, 100, 4.0) == pytest.approx(40.0)  # a lower bound above the rate raises it


def test_the_starting_rate_is_stated_clamped_then_learned_then_default():
    stated = choose_rate(1e6, 6.0, 20.0, 100.0)
    assert (stated.reading_rate, stated.source, stated.stated, stated.clamped) == (100.0, "stated", 1e6, True)
    slow = choose_rate(7.5, 6.0, 20.0, 100.0)
    assert (slow.reading_rate, slow.source, slow.clamped) == (7.5, "stated", False)
    learned = choose_rate(None, 6.0, 20.0, 100.0)
    assert (learned.reading_rate, learned.source, learned.stated, learned.clamped) == (6.0, "learned", None, False)
    assert choose_rate(None, 300.0, 20.0, 100.0).reading_rate == 100.0
    default = choose_rate(None, None, 20.0, 100.0)
    assert (default.reading_rate, default.source) == (20.0, "default")
