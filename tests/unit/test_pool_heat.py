"""Which segments are hot (pool/heat.py): decayed read counts, the top ⌈N ln N⌉ + N of them read at
least twice per engine."""
from tokenflowd.pool.heat import SegmentHeat, num_heavy_hitters


def test_a_segment_turns_hot_at_the_read_that_makes_it_one_not_at_the_next_refresh():
    heat, n = SegmentHeat(refresh=1.0), 2  # 4 hitters of at least 4 reads
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
