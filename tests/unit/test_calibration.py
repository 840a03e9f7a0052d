"""The engine's estimate of a batch's time (backend/calibration.py): the median ratio of observed
batch times to the profile's l(b), robust to the odd slow batch."""

from __future__ import annotations

import pytest

from backend.calibration import MAX_FACTOR, Calibration


def test_no_batch_yet_means_the_profile():
    assert Calibration().factor == 1.0


def test_the_median_ratio_ignores_the_odd_outlier():
    c = Calibration()
    for observed in (5, 5, 5, 5, 80):          # one batch delayed by another process
        c.observe(10.0, observed)
    assert c.factor == 0.5


def test_only_the_last_window_counts():
    c = Calibration(window=3)
    for observed in (30, 30, 30, 10, 10, 10):
        c.observe(10.0, observed)
    assert c.factor == 1.0 and c.samples == 3


def test_meaningless_observations_are_left_out_and_ratios_bounded():
    c = Calibration()
    c.observe(10.0, 0.0)            # a stopped clock
    c.observe(0.0, 5.0)             # no profile figure
    assert c.samples == 0
    c.observe(1.0, 10_000.0)
    assert c.factor == MAX_FACTOR


def test_a_window_must_hold_a_batch():
    with pytest.raises(ValueError, match="window"):
        Calibration(window=0)
