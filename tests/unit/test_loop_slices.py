"""common/loop_slices.py: work written as steps runs in one piece (drain) or hands the event loop back
between slices (run_in_slices, LoopSlices), with the same result."""

from __future__ import annotations

import asyncio

from common.loop_slices import LoopSlices, drain, run_in_slices
from tests.loop_turns import with_turns


def _steps(items, seen):
    total = 0
    for x in items:
        seen.append(x)
        total += x
        yield
    return total


def test_drain_and_slices_give_the_same_result_and_slices_let_other_work_run():
    seen = []
    assert drain(_steps([1, 2, 3], seen)) == 6 and seen == [1, 2, 3]

    async def main(slice_s):
        return await with_turns(run_in_slices(_steps(range(10), []), slice_s))

    whole, whole_ticks = asyncio.run(main(60.0))
    sliced, sliced_ticks = asyncio.run(main(0.0))
    assert whole == sliced == 45
    assert whole_ticks == 0 and sliced_ticks >= 10


def test_a_slice_ends_by_the_clock():
    now = [0.0]
    slices = LoopSlices(0.01, clock=lambda: now[0])

    async def main():
        yielded = 0
        for t in (0.005, 0.009, 0.011, 0.015, 0.0215):
            now[0] = t
            before = slices.ends
            await slices.due()
            yielded += slices.ends != before
        return yielded

    assert asyncio.run(main()) == 2       # at 0.011 (a slice to 0.021), then at 0.0215


def test_a_slice_ends_after_its_items():
    slices = LoopSlices(60.0, max_items=3)

    async def main():
        handed_back = 0
        for _ in range(7):
            before = slices.items
            await slices.due()
            handed_back += slices.items == 0 and before == 2
        return handed_back

    assert asyncio.run(main()) == 2      # after the 3rd and the 6th item


def test_a_slice_of_no_items_is_refused():
    import pytest

    with pytest.raises(ValueError, match="max_items must be at least 1, not 0"):
        LoopSlices(max_items=0)
