"""Which segments are hot (pool/heat.py): decayed read counts, the top ⌈N ln N⌉ + N of them read at
least twice per engine."""
from tokenflowd.pool.heat import SegmentHeat, num_heavy_hitters


def test_a_segment_turns_hot_at_the_read_that_makes_it_one_not_at_the_next_refresh():
    heat, n = SegmentHeat(), 2  # 4 hitters of at least 4 reads
    assert num_heavy_hitters(n) == 4
    heat.hit(b"a", 0.0)
    assert not heat.is_heavy(b"a", n, 0.0)  # (the set is made here, with a alone in it)
    for t in (0.1, 0.2, 0.3, 0.4, 0.5):  # a new prefix read in a burst within the refresh period
        heat.hit(b"b", t)
    assert heat.is_heavy(b"b", n, 0.5) and not heat.is_heavy(b"a", n, 0.5)


def test_only_the_hottest_are_hitters_and_they_cool_down():
    heat, n = SegmentHeat(half_life=10.0), 2
    for i, key in enumerate([b"a", b"b", b"c", b"d", b"e"]):
        for _ in range(5 + i):
            heat.hit(key, 0.0)
    assert [k for k in (b"a", b"b", b"c", b"d", b"e") if heat.is_heavy(k, n, 0.0)] == [b"b", b"c", b"d", b"e"]
    heat.hit(b"a", 0.0)
    heat.hit(b"a", 0.0)  # a now has 7 reads: hotter than b's 6, it takes b's place at once
    assert heat.is_heavy(b"a", n, 0.0) and not heat.is_heavy(b"b", n, 0.0)
    assert not heat.is_heavy(b"e", n, 30.0), "9 reads 3 half-lives ago are about 1"


def test_the_hitters_are_the_hottest_counts_at_every_moment_as_a_full_ranking_would_find_them():
    import random

    rng, heat, n, half_life = random.Random(0), SegmentHeat(half_life=5.0), 4, 5.0
    counts: dict[bytes, tuple[float, float]] = {}  # key -> (decayed count, as of)
    keys = [bytes([i]) for i in range(60)]
    now = 0.0
    heat.is_heavy(keys[0], n, now)
    for _ in range(3000):
        now += rng.expovariate(20.0)
        key = keys[min(int(rng.paretovariate(1.2)) - 1, 59)]  # a few hot, many cold
        heat.hit(key, now)
        c, at = counts.get(key, (0.0, now))
        counts[key] = (c * 0.5 ** ((now - at) / half_life) + 1.0, now)
        value = {k: c * 0.5 ** ((now - at) / half_life) for k, (c, at) in counts.items()}
        ranked = sorted(value, key=value.__getitem__, reverse=True)[: num_heavy_hitters(n)]
        want = {k for k in ranked if value[k] >= 2 * n}
        got = {k for k in keys if heat.is_heavy(k, n, now)}
        assert got == want, (now, got ^ want)


def test_a_segment_counted_once_is_forgotten_so_memory_follows_the_recent_prompts():
    heat = SegmentHeat(half_life=1.0)
    heat.is_heavy(b"", 8, 0.0)
    for i in range(20_000):  # a new segment every 10 ms: each prompt's own
        heat.hit(i.to_bytes(4, "big"), i * 0.01)
    # a count of 1 falls under FORGET after 6.6 half-lives (664 segments here); the sweep may lag by as many
    assert len(heat._scores) <= 2 * 664, len(heat._scores)


def test_a_count_halves_every_half_life_and_is_zero_for_a_key_never_counted():
    heat = SegmentHeat(half_life=10.0)
    for _ in range(8):
        heat.hit(b"a", 0.0)
    assert abs(heat.count(b"a", 0.0) - 8.0) < 1e-9 and abs(heat.count(b"a", 20.0) - 2.0) < 1e-9
    heat.hit(b"a", 20.0)
    assert abs(heat.count(b"a", 20.0) - 3.0) < 1e-9 and heat.count(b"b", 20.0) == 0.0
