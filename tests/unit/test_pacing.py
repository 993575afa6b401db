"""Rate-aware coalescing at the engine's output (engine/process/pacing.py), on a simulated clock."""
from __future__ import annotations

from tokenflowd.buffer.tracker import TokenBuffer
from tokenflowd.engine.process.pacing import DeltaPacer
from tokenflowd.protocol import Coalesce, Delta

C = Coalesce(buffer=2.0, interval=0.25)


def _run(pacer: DeltaPacer, rid: str, n: int, rate: float, step: float = 0.01) -> list[tuple[float, list[int]]]:
    """One token every 1/rate s (steps of `step` s in between); (time, tokens) of what goes out."""
    out: list[tuple[float, list[int]]] = []
    t, k = 0.0, 0
    while k < n or pacer.next_release() is not None:
        due = k / rate
        deltas = []
        if k < n and t >= due - 1e-9:
            deltas = [Delta(rid, [k], "length" if k == n - 1 else None)]
            k += 1
        out += [(t, d.token_ids) for d in pacer.pace(deltas, t) if d.token_ids]
        t = round(t + step, 6)
    return out


def test_a_reader_far_ahead_gets_its_tokens_in_batches_in_order_and_never_runs_dry():
    pacer = DeltaPacer()
    pacer.track("a", 5.0, C)
    out = _run(pacer, "a", 200, rate=20.0)
    tokens = [i for _, ids in out for i in ids]
    assert tokens == list(range(200))  # none lost, none repeated, in order
    assert len(out) * 3 <= 200
    buf = TokenBuffer(5.0)
    for t, ids in out:
        buf.on_tokens(len(ids), t)
    assert buf.stall_time == 0.0 and buf.num_stalls == 0
    waits = [t - k / 20.0 for t, ids in out for k in ids]
    assert max(waits) <= C.interval + 0.011  # a held token waits one interval (and a step), not more


def test_a_reader_with_little_in_hand_gets_every_step_at_once():
    pacer = DeltaPacer()
    pacer.track("fast", 100.0, C)
    pacer.track("off", 5.0, None)  # stream_options.coalesce false
    out = _run(pacer, "fast", 50, rate=20.0) + _run(pacer, "off", 50, rate=20.0)
    assert [ids for _, ids in out] == [[i] for i in range(50)] * 2


def test_the_end_an_abort_and_a_slower_rate_release_or_drop_what_is_held():
    pacer = DeltaPacer()
    pacer.track("a", 1.0, C)
    pacer.track("b", 1.0, C)
    t = 0.0
    for k in range(3):  # the first 3 go out: the buffer is below 2 s of reading
        assert pacer.pace([Delta("a", [k]), Delta("b", [k])], t) == [Delta("a", [k]), Delta("b", [k])]
        t += 0.01
    assert pacer.pace([Delta("a", [3]), Delta("b", [3])], t) == []  # both held now
    pacer.forget("b")  # aborted: what it held is dropped
    out = pacer.pace([Delta("a", [4], "stop", num_cached_tokens=7)], t + 0.01)
    assert out == [Delta("a", [3, 4], "stop", num_cached_tokens=7)]  # the end takes what was held
    assert pacer.next_release() is None

    pacer.track("c", 1.0, C)
    assert pacer.pace([Delta("c", [0]), Delta("c", [1])], 0.0) == [Delta("c", [0]), Delta("c", [1])]
    assert pacer.pace([Delta("c", [2])], 0.0) == []  # 2 s in hand at 1 token/s
    pacer.set_read("c", 2, 0.0)  # the reader's cursor: it has read all it got
    assert pacer.pace([Delta("c", [3])], 0.01) == [Delta("c", [2, 3])]  # below the mark: out at once
    pacer.set_rate("c", 0.5, 0.02)
    assert pacer.pace([Delta("c", [4])], 0.03) == []  # 2 tokens in hand at 0.5/s: 4 s, held
    assert pacer.next_release() == 0.03 + C.interval
    assert pacer.pace([], 0.03 + C.interval) == [Delta("c", [4])]


def test_untracked_requests_pass_through_untouched():
    pacer = DeltaPacer()
    deltas = [Delta("x", [1]), Delta("y", [], "rejected", "no")]
    assert pacer.pace(deltas, 0.0) is deltas
