"""The one rate search (common/rate_search.py), with the settings of each of its users: ``nexus bench``
(double, then bisect to a tolerance), vs_triton (also halve from a failing start, down to a floor),
the profiler's ramps (a cap and a fixed number of bisections), the serving benchmark's ramp (grow by a
factor up to a last rate, no bisection). Pure: the "load test" is a threshold."""

from __future__ import annotations

import asyncio

import pytest

from common.rate_search import max_passing_rate, max_passing_rate_async, rate_steps


def search(threshold: float, start: float, **kw) -> tuple[float, list[float]]:
    tried: list[float] = []

    def passes(rate: float) -> bool:
        tried.append(rate)
        return rate <= threshold

    return max_passing_rate(passes, start, **kw), tried


def test_doubles_then_bisects_to_the_tolerance():
    best, tried = search(137.0, 10.0, rel_tol=0.02, max_steps=30)
    assert 137.0 * 0.98 <= best <= 137.0
    assert tried[:5] == [10.0, 20.0, 40.0, 80.0, 160.0]


def test_a_known_upper_rate_is_tried_second_and_is_the_answer_when_it_passes():
    best, tried = search(137.0, 10.0, hi=1000.0, rel_tol=0.02, max_steps=30)
    assert tried[:2] == [10.0, 1000.0] and 137.0 * 0.98 <= best <= 137.0
    assert search(137.0, 10.0, hi=100.0)[0] == 100.0


def test_without_a_floor_a_failing_start_is_zero():
    best, tried = search(137.0, 200.0, hi=400.0)
    assert best == 0.0 and tried == [200.0]


def test_with_a_floor_a_failing_start_is_halved_until_one_passes():
    best, tried = search(30.0, 300.0, rel_tol=0.05, max_steps=20, floor=5.0)
    assert tried[:4] == [300.0, 150.0, 75.0, 37.5]
    assert best <= 30.0 and (37.5 - best <= 0.05 * best or 30.0 - best < 0.05 * best)
    best, tried = search(0.0, 40.0, max_steps=20, floor=5.0)
    assert best == 0.0 and tried == [40.0, 20.0, 10.0, 5.0]


def test_max_steps_bounds_every_phase():
    for start, threshold in ((10.0, 1e9), (10.0, 137.0), (300.0, 1.0)):
        _, tried = search(threshold, start, max_steps=4, floor=0.001)
        assert len(tried) == 4
    assert search(1e9, 10.0, max_steps=4)[0] == 80.0


def test_the_profilers_ramp_caps_growth_and_refines_a_fixed_number_of_times():
    best, tried = search(123.4, 10.0, refine=6, floor=10.0 / 64)
    assert 123.4 * 0.97 < best <= 123.4 and len(tried) == 5 + 6
    assert search(-1.0, 10.0, refine=3, floor=10.0 / 64)[0] == 0.0
    assert search(1e9, 10.0, refine=3, max_rate=50.0) == (50.0, [10.0, 20.0, 40.0, 50.0])
    assert 0 < search(1.0, 10.0, refine=3, floor=10.0 / 64)[0] <= 1.0


def test_a_ramp_without_bisection_stops_at_the_first_failure():
    ramp = [10.0]
    for _ in range(6):
        ramp.append(ramp[-1] * 1.07)
    last = ramp[-1]
    best, tried = search(13.5, 10.0, growth=1.07, max_rate=last, refine=0)
    assert tried == ramp[:6] and tried[-1] > 13.5
    assert best == tried[-2]
    assert search(1e9, 10.0, growth=1.07, max_rate=last, refine=0)[0] == last


def test_a_bracket_is_bisected_without_trying_its_ends():
    best, tried = search(137.0, 1.0, bracket=(1.0, 1000.0), refine=14)
    assert 1.0 not in tried and 1000.0 not in tried and len(tried) == 14
    assert 137.0 * 0.99 < best <= 137.0
    assert search(-1.0, 1.0, bracket=(1.0, 1000.0), refine=5)[0] == 1.0    # the lower end stands


def test_the_async_driver_and_the_generator_agree():
    async def passes(rate: float) -> bool:
        await asyncio.sleep(0)
        return rate <= 137.0

    assert asyncio.run(max_passing_rate_async(passes, 10.0, rel_tol=0.02)) == search(137.0, 10.0, rel_tol=0.02)[0]
    steps = rate_steps(10.0)
    assert next(steps) == 10.0 and steps.send(True) == 20.0


@pytest.mark.parametrize("kw, message", [
    ({"start": 0.0}, "start rate must be positive"),
    ({"growth": 1.0}, "growth must be > 1"),
    ({"hi": 5.0}, "need start < hi"),
    ({"max_steps": 0}, "max_steps must be >= 1"),
    ({"rel_tol": -0.1}, "rel_tol and refine must be >= 0"),
    ({"bracket": (5.0, 20.0)}, "needs lo = start < hi"),
])
def test_bad_settings_are_refused(kw, message):
    kw = {"start": 10.0, **kw}
    with pytest.raises(ValueError, match=message):
        max_passing_rate(lambda r: True, **kw)
