"""The one arrival process (common/arrivals.py): Poisson, evenly spaced and bursty Gamma arrivals."""

from __future__ import annotations

import math

import numpy as np
import pytest

from common.arrivals import arrival_times


def test_poisson_arrivals_count_gaps_and_counts_per_second():
    rate, total = 500.0, 40.0
    t = arrival_times(rate, total, np.random.default_rng(1))
    expected = rate * total
    assert abs(len(t) - expected) < 4 * math.sqrt(expected)
    assert np.all(np.diff(t) > 0) and t[0] >= 0 and t[-1] < total
    gaps = np.diff(t)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV = 1
    per_s = np.bincount(t.astype(int), minlength=int(total))
    assert per_s.var() / per_s.mean() == pytest.approx(1.0, abs=0.5)  # Poisson counts: variance ~ mean


def test_the_same_seed_gives_the_same_arrivals_and_an_int_seed_is_a_generator():
    a = arrival_times(1000.0, 10.0, 5)
    assert np.array_equal(a, arrival_times(1000.0, 10.0, np.random.default_rng(5)))
    assert not np.array_equal(a, arrival_times(1000.0, 10.0, 6))
    assert len(arrival_times(0.5, 0.001, 0)) <= 1


@pytest.mark.parametrize("cv", [0.5, 2.0, 4.0])
def test_gamma_gaps_have_the_mean_rate_and_the_coefficient_of_variation(cv):
    rate, total = 200.0, 400.0
    t = arrival_times(rate, total, 3, cv=cv)
    gaps = np.diff(t)
    assert len(t) / total == pytest.approx(rate, rel=0.1)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.1)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)
    assert np.all(gaps >= 0) and t[-1] < total


def test_cv_zero_is_evenly_spaced():
    t = arrival_times(100.0, 1.0, 0, cv=0.0)
    assert len(t) == 99 or len(t) == 100
    assert np.allclose(np.diff(t), 0.01)


def test_a_window_longer_than_one_draw_is_filled():
    # CV 4 bursts leave long quiet gaps: the window is still covered to its end.
    t = arrival_times(50.0, 200.0, 7, cv=4.0)
    assert t[-1] > 150.0 and np.all(np.diff(t) >= 0)


def test_nothing_to_draw_and_bad_arguments():
    assert len(arrival_times(0.0, 1.0, 1)) == 0
    assert len(arrival_times(10.0, 0.0, 1)) == 0
    for bad in ({"rate_rps": -1.0}, {"duration_s": -1.0}, {"cv": -0.5}, {"rate_rps": math.inf}, {"cv": math.nan}):
        args = {"rate_rps": 10.0, "duration_s": 1.0, **bad}
        name = next(iter(bad))
        with pytest.raises(ValueError, match=f"{name} must be a finite number >= 0"):
            arrival_times(args["rate_rps"], args["duration_s"], 0, cv=args["cv"] if "cv" in args else 1.0)


def test_a_stepped_rate_has_each_steps_rate_within_its_window():
    from common.arrivals import step_arrival_times

    t = step_arrival_times([(20.0, 50.0), (20.0, 250.0), (20.0, 50.0)], 7, cv=2.0)
    assert np.all(np.diff(t) >= 0) and t[0] >= 0 and t[-1] < 60.0
    counts = [np.count_nonzero((t >= a) & (t < a + 20.0)) for a in (0.0, 20.0, 40.0)]
    assert counts[0] / 20 == pytest.approx(50, rel=0.35) and counts[2] / 20 == pytest.approx(50, rel=0.35)
    assert counts[1] / 20 == pytest.approx(250, rel=0.2)
    assert len(step_arrival_times([], 0)) == 0
    with pytest.raises(ValueError):
        step_arrival_times([(10.0, -1.0)], 0)
