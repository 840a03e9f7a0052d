"""The device's busy time over a window (backend/busy_time.py), against the sum over every batch."""

from __future__ import annotations

import random

import pytest

from backend.busy_time import BusyTime
from backend.engine import Engine
from common.batch_decision import SlidingWindowEarlyDrop


def _naive(batches: list[tuple[float, float]], since: float) -> float:
    return sum(min(seconds, end - since) for end, seconds in batches if end > since)


def _batches(rng: random.Random, n: int, start: float = 100.0) -> list[tuple[float, float]]:
    out, t = [], start
    for _ in range(n):
        t += rng.expovariate(1500.0)                    # idle before the batch
        seconds = rng.choice([0.0, rng.uniform(1e-5, 2e-3)])
        t += seconds
        out.append((t, seconds))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_every_window_is_the_sum_of_the_part_of_each_batch_after_its_start(seed):
    rng = random.Random(seed)
    busy = BusyTime(keep_s=60.0)
    batches = _batches(rng, 5000)
    for i, (end, seconds) in enumerate(batches):
        busy.record(end, seconds)
        if i % 97 == 0:
            for since in (end - 10.0, end - rng.uniform(0.0, 2.0), end, batches[rng.randrange(i + 1)][0] - 1e-4):
                assert busy.busy_since(since) == pytest.approx(_naive(batches[:i + 1], since), abs=1e-9)
    assert busy.total_s == pytest.approx(sum(s for _, s in batches))


def test_a_window_starting_inside_a_batch_counts_only_its_part_after_the_start():
    busy = BusyTime(keep_s=60.0)
    busy.record(10.0, 2.0)          # ran 8-10
    busy.record(13.0, 1.0)          # ran 12-13
    assert busy.busy_since(9.5) == pytest.approx(1.5)
    assert busy.busy_since(12.5) == pytest.approx(0.5)
    assert busy.busy_since(13.0) == 0.0 and busy.busy_since(20.0) == 0.0
    assert busy.busy_since(0.0) == pytest.approx(3.0)


def test_batches_older_than_it_keeps_are_forgotten_and_the_rest_still_count():
    rng = random.Random(7)
    busy = BusyTime(keep_s=1.0)
    batches = _batches(rng, 20000)                      # about 13 s: the list is compacted many times
    for end, seconds in batches:
        busy.record(end, seconds)
    last = batches[-1][0]
    assert len(busy._ends) - busy._head < 3000          # about 1 s of batches at 1,500 a second
    assert len(busy._ends) < 2 * 3000 + 1024
    for since in (last - 1.0, last - 0.5, last - 0.01):
        assert busy.busy_since(since) == pytest.approx(_naive(batches, since), abs=1e-9)
    assert busy.total_s == pytest.approx(sum(s for _, s in batches))


def test_no_batch_is_no_busy_time_and_a_bad_memory_is_refused():
    assert BusyTime(keep_s=10.0).busy_since(0.0) == 0.0
    with pytest.raises(ValueError, match="keep_s must be positive, got 0"):
        BusyTime(keep_s=0)


def test_the_engines_utilisation_is_its_busy_fraction_over_the_window():
    now = [0.0]
    engine = Engine(SlidingWindowEarlyDrop(), lambda: now[0], start=False)
    engine._busy.record(4.0, 1.0)
    engine._busy.record(9.0, 2.0)
    now[0] = 10.0
    assert engine.utilization(5.0) == pytest.approx(2.0 / 5.0)
    assert engine.utilization() == pytest.approx(3.0 / 10.0)
