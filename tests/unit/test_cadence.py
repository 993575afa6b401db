"""Reading rates learned from a conversation's cadence (daemon/api/cadence.py), on synthetic timelines."""
import pytest

from tokenflowd.daemon.api.cadence import CadenceEstimator, ConversationKeys, ExpiringLRU


def converse(est: CadenceEstimator, user: str | None, turns: list[tuple[float, float, float, int]],
             messages: list[tuple[str, str]] | None = None) -> list[float | None]:
    """Each turn: (request time, first token, last token, reply tokens). Returns the estimate each
    request got. With `messages`, turns are chained by conversation keys (replies are 'r<i>')."""
    got = []
    msgs = list(messages or [])
    for i, (t_req, t_first, t_end, n) in enumerate(turns):
        keys = ConversationKeys.of("caller", msgs) if messages is not None else None
        lookup = est.on_request(t_req, user, keys)
        got.append(lookup.reading_rate)
        reply = f"r{i}"
        est.on_reply(lookup.owner, t_first, t_end, n, user=user, reply_key=keys.reply(reply) if keys else None)
        if messages is not None:
            msgs += [("assistant", reply), ("user", f"q{i + 1}")]
    return got


def reader_turns(rate: float, num_tokens: int, num_turns: int, stream_time: float = 1.0, think: float = 0.0):
    """A reader at `rate` who reads as the reply streams and sends the next turn `think` s after
    finishing: L / (t_next − t_first) = rate when it does not think."""
    turns, t = [], 0.0
    for _ in range(num_turns):
        t_first = t + 0.2
        turns.append((t, t_first, t_first + stream_time, num_tokens))
        t = t_first + max(num_tokens / rate, stream_time) + think
    return turns


def test_a_reader_who_replies_right_after_reading_is_learned_exactly():
    est = CadenceEstimator()
    got = converse(est, "user:alice", reader_turns(6.0, 32, 4))
    assert got[0] is None  # nothing learned before the first reply
    assert got[1:] == [pytest.approx(6.0)] * 3


def test_thinking_time_puts_the_bound_below_the_rate():
    est = CadenceEstimator()
    turns = reader_turns(6.0, 60, 6, think=5.0)
    got = converse(est, "user:bob", turns)
    bound = 60 / (10.0 + 5.0)  # L / (reading + thinking)
    assert got[-1] == pytest.approx(bound) and got[-1] < 6.0


def test_one_turn_sent_without_reading_does_not_set_the_estimate():
    est = CadenceEstimator(max_rate=100.0)
    turns = [(0.0, 0.2, 1.2, 40), (8.2, 8.4, 9.4, 40),
             (9.5, 9.7, 10.7, 40),  # "regenerate", 0.1 s after the reply ended: 40 / 1.1 s
             (17.7, 17.9, 18.9, 40), (25.9, 26.1, 27.1, 40)]
    got = converse(est, "user:carol", turns)
    assert got[:2] == [None, pytest.approx(5.0)]
    assert got[2] == pytest.approx(40 / 1.1)  # two bounds: the largest
    assert got[3:] == [pytest.approx(5.0)] * 2  # three or more: the second largest, the outlier dropped


def test_short_replies_and_long_gaps_give_no_bound_and_the_rate_is_clamped():
    est = CadenceEstimator(min_reply_tokens=16, max_gap=600.0, min_rate=1.0, max_rate=50.0)
    assert converse(est, "user:d", [(0, 0.1, 0.2, 3), (10, 10.1, 10.5, 3)]) == [None, None]  # 3 tokens: nothing
    assert converse(est, "user:e", [(0, 0.1, 0.5, 40), (700, 700.1, 700.5, 40)]) == [None, None]  # away 11 min
    assert converse(est, "user:f", [(0, 0.1, 0.2, 40), (0.3, 0.4, 0.5, 40)])[1] == 50.0  # 200 tokens/s: clamped
    assert converse(est, "user:g", [(0, 0.1, 0.5, 20), (500, 500.1, 500.5, 20)])[1] == 1.0  # 0.04: the floor


def test_conversations_without_a_user_are_chained_by_their_messages():
    est = CadenceEstimator()
    first = [("system", "be brief"), ("user", "q0")]
    got = converse(est, None, reader_turns(8.0, 48, 4), messages=first)
    assert got == [None, pytest.approx(8.0), pytest.approx(8.0), pytest.approx(8.0)]
    # Another conversation with the same system prompt learns nothing from this one.
    other = ConversationKeys.of("caller", [("system", "be brief"), ("user", "something else")])
    assert est.on_request(100.0, None, other).reading_rate is None


def test_conversation_keys_match_the_reply_the_client_sends_back_tidied():
    turn1 = ConversationKeys.of("k", [("user", "Hi   there\n")])
    filed = turn1.reply("Hello!  How can I help?\n")
    turn2 = ConversationKeys.of("k", [("user", "Hi there"), ("assistant", " Hello! How can I help?"), ("user", "x")])
    assert turn2.follows == filed
    assert ConversationKeys.of("other-key", [("user", "Hi there"), ("assistant", "Hello! How can I help?"),
                                             ("user", "x")]).follows != filed  # scoped to the caller
    assert ConversationKeys.of("k", [("user", "Hi there")]).follows is None


def test_a_turn_filed_under_both_keys_counts_once():
    est = CadenceEstimator()
    keys = ConversationKeys.of("c", [("user", "q")])
    est.on_request(0.0, "user:h", keys)
    est.on_reply("user:h", 0.5, 1.0, 30, user="user:h", reply_key=keys.reply("a"))
    nxt = ConversationKeys.of("c", [("user", "q"), ("assistant", "a"), ("user", "q2")])
    assert est.on_request(5.5, "user:h", nxt).reading_rate == pytest.approx(30 / 5.0)
    other_tab = ConversationKeys.of("c", [("user", "new topic")])
    assert est.on_request(6.0, "user:h", other_tab).reading_rate == pytest.approx(6.0)  # no second bound
    assert len(est._bounds.get("user:h", 6.0)) == 1


def test_the_lru_is_bounded_and_forgets_what_expires():
    lru = ExpiringLRU(capacity=3, ttl=10.0)
    for i in range(5):
        lru.put(f"k{i}", i, float(i))
    assert len(lru) == 3 and lru.get("k0", 5.0) is None and lru.get("k1", 5.0) is None
    assert lru.get("k4", 5.0) == 4
    lru.put("k2", 22, 6.0)  # a write refreshes and moves it to the young end
    assert lru.get("k3", 13.5) is None and lru.get("k2", 13.5) == 22  # k3 written at 3: expired
    lru.put("k5", 5, 30.0)  # every old entry is expired at once
    assert len(lru) == 1 and lru.pop("k5", 30.0) == 5 and len(lru) == 0
    est = CadenceEstimator(capacity=2, ttl=3600.0)
    for u in ("a", "b", "c"):
        converse(est, f"user:{u}", reader_turns(6.0, 32, 2))
    assert est.estimate("user:a", 20.0) is None and est.estimate("user:c", 20.0) == pytest.approx(6.0)
    assert est.estimate("user:c", 20.0 + 3601.0) is None  # an hour without a turn: forgotten
