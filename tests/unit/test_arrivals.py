"""Requests that reach the front in one turn of its event loop are placed as one group."""
import asyncio

import pytest

from tokenflowd.daemon.api.arrivals import Arrivals


def test_arrivals_of_one_turn_are_placed_together_and_a_later_one_alone():
    groups = []

    def place(group):
        groups.append(list(group))
        return [f"engine for {a}" for a in group]

    async def main():
        arrivals = Arrivals(place)
        burst = await asyncio.gather(*(client(arrivals, a) for a in "abc"))
        later = await arrivals.add("d")
        return burst, later, arrivals

    async def client(arrivals, a):
        return await arrivals.add(a)

    burst, later, arrivals = asyncio.run(main())
    assert burst == ["engine for a", "engine for b", "engine for c"] and later == "engine for d"
    assert groups == [["a", "b", "c"], ["d"]]
    assert (arrivals.num_groups, arrivals.largest_group) == (2, 3)


def test_a_placement_error_reaches_every_request_of_the_group_and_a_cancelled_one_is_left_out():
    seen = []

    def place(group):
        seen.append(list(group))
        raise RuntimeError("no engine ready")

    async def main():
        arrivals = Arrivals(place)
        a, b = arrivals.add("a"), arrivals.add("b")
        b.cancel()
        with pytest.raises(RuntimeError, match="no engine ready"):
            await a
        return seen

    assert asyncio.run(main()) == [["a"]]
