"""The token-buffer model on hand-computed timelines."""
import pytest

from tokenflowd.buffer.tracker import TokenBuffer


def test_stalls_are_counted_when_the_buffer_runs_dry():
    b = TokenBuffer(reading_rate=2.0)
    assert b.buffer(0.0) == 0.0
    b.on_tokens(1, 0.0)  # first token: reading starts
    assert b.first_token_time == 0.0
    assert b.buffer(0.25) == pytest.approx(0.5)
    assert b.buffer(0.5) == 0.0 and b.buffer(0.9) == 0.0  # dry at 0.5
    b.on_tokens(1, 1.0)  # waited 0.5 s for it
    assert (b.num_stalls, b.stall_time) == (1, pytest.approx(0.5))
    assert b.buffer(1.0) == pytest.approx(1.0) and b.buffer(1.25) == pytest.approx(0.5)
    b.on_tokens(4, 3.0)  # dry from 1.5 to 3.0
    assert (b.num_stalls, b.stall_time) == (2, pytest.approx(2.0))
    assert b.buffer(3.0) == pytest.approx(4.0) and b.buffer(4.0) == pytest.approx(2.0)
    assert b.time_to_empty(4.0) == pytest.approx(1.0)
    assert b.stall_time_at(4.0) == pytest.approx(2.0)  # not dry yet
    assert b.stall_time_at(6.0) == pytest.approx(3.0)  # dry since 5.0, still waiting
    assert b.stall_time == pytest.approx(2.0)  # querying does not advance the model


def test_dry_for_is_the_current_silence_whether_or_not_the_model_was_advanced():
    b = TokenBuffer(reading_rate=2.0)
    assert b.dry_for(5.0) == 0.0  # no first token: nothing to wait on yet
    b.on_tokens(2, 0.0)  # dry at 1.0
    assert b.dry_for(0.5) == 0.0 and b.dry_for(3.0) == pytest.approx(2.0)
    b.advance(2.0)  # the model reads on into the stall
    assert b.dry_for(3.0) == pytest.approx(2.0)
    b.set_rate(4.0, 2.5)  # a new rate does not restart the stall
    assert b.dry_for(3.0) == pytest.approx(2.0)
    b.on_tokens(1, 3.0)
    assert b.dry_for(3.0) == 0.0 and b.dry_for(3.5) == pytest.approx(0.25)


def test_a_buffer_that_never_runs_dry_never_stalls():
    b = TokenBuffer(reading_rate=10.0)
    for i in range(100):
        b.on_tokens(1, i * 0.05)  # 20 tokens/s into a 10 tokens/s reader
    assert b.stall_time == 0.0 and b.num_stalls == 0
    assert b.buffer(99 * 0.05) == pytest.approx(100 - 10 * 99 * 0.05)


def test_rate_change_reads_the_past_at_the_old_rate():
    b = TokenBuffer(reading_rate=4.0)
    b.on_tokens(10, 0.0)
    b.set_rate(1.0, 1.0)  # read 4 by t=1
    assert b.buffer(1.0) == pytest.approx(6.0)
    assert b.buffer(3.0) == pytest.approx(4.0)
    b.on_tokens(1, 8.0)  # dry at t=7: one second of stall
    assert b.stall_time == pytest.approx(1.0)


@pytest.mark.parametrize("rate", [0.0, -1.0, float("inf"), float("nan")])
def test_rate_must_be_finite_and_positive(rate):
    with pytest.raises(ValueError, match="reading_rate"):
        TokenBuffer(rate)


def test_a_read_cursor_moves_the_reading_position_and_reading_goes_on_from_it():
    b = TokenBuffer(reading_rate=2.0)
    b.set_read(5, 0.0)  # before the first token: nothing to have read
    assert b.num_read == 0.0 and b.buffer(0.0) == 0.0
    b.on_tokens(20, 0.0)
    assert b.buffer(1.0) == pytest.approx(18.0)  # the model: 2 tokens/s
    b.set_read(10, 1.0)  # the reader is faster than modelled: it is at 10
    assert b.buffer(1.0) == pytest.approx(10.0) and b.buffer(2.0) == pytest.approx(8.0)
    b.set_read(9, 2.0)  # behind the model's 12: the model follows the cursor back
    assert b.buffer(2.0) == pytest.approx(11.0)
    b.set_read(50, 3.0)  # beyond what was delivered: capped, the buffer is dry
    assert b.num_read == 20.0 and b.buffer(3.0) == 0.0
    b.on_tokens(4, 5.0)  # dry from 3 to 5: a stall counted from the cursor
    assert (b.num_stalls, b.stall_time) == (1, pytest.approx(2.0))
    b.on_tokens(10, 6.0)
    b.set_read(22, 5.5)  # a report that arrives after the model moved on: read on at the rate since
    assert b.num_read == pytest.approx(23.0) and b.buffer(6.0) == pytest.approx(11.0)
