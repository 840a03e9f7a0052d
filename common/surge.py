"""Poisson noise of request counts: when a count differs from the one expected, and when it is a
surge. The one rule of the scheduler and of the frontends:

- the scheduler's workload (globalsched/state/rate_reports.py) finds a frontend's latest report a surge against
  the mean of its earlier ones;
- the planner (globalsched/planning/planner.py) keeps a measured rate within noise of the rate planned at the
  planned rate (:func:`within_noise`), takes a surge only if it is a surge against the rate
  planned too (:func:`is_surge`), and a session's latest report as its rate when it is a drop, the
  mirror of a surge, against the window's mean, beyond the noise of the session's own counts
  (:func:`is_drop`, with its :func:`dispersion`);
- the device scaling policy (globalsched/actuators/device_scaler.py) takes a session's measured rate as
  outrunning its planned capacity only beyond the noise of its window's counts, bursts included
  (:func:`dispersion`);
- a frontend (frontend/early_report.py) reports at once when a session's count in the current window
  is a surge against what its planned rate would bring.

A Poisson count of mean ``e`` has standard deviation sqrt(e); ``NOISE_SIGMAS`` of them put a false
alarm below one in 30,000 windows at a steady rate (with a hundred sessions judged at every
evaluation, about one evaluation in 160 passes for noise; at 2 sigma nearly every one did),
``NOISE_MIN_EXTRA`` keeps a handful of requests from counting where almost nothing was expected, and
``SURGE_RATIO`` keeps a large steady rate's small drift (far beyond its tiny relative noise) from
counting as a surge.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

NOISE_SIGMAS = 4.0
NOISE_MIN_EXTRA = 3.0
SURGE_RATIO = 1.5


def noise_margin(expected: float, sigmas: float = NOISE_SIGMAS, dispersion: float = 1.0) -> float:
    """How far a Poisson count of mean ``expected`` may stray and still be noise; a bursty count's
    variance is ``dispersion`` times its mean (:func:`dispersion`), and so its margin wider."""
    return sigmas * math.sqrt(max(expected, 0.0) * max(dispersion, 1.0)) + NOISE_MIN_EXTRA


def dispersion(counts: Sequence[tuple[float, float]]) -> float | None:
    """The index of dispersion of ``counts`` (requests, seconds) of one rate: the variance of the counts
    about the rate over them, per request expected (Pearson's chi-square per degree of freedom), at
    least 1 (Poisson). Gamma arrivals of coefficient of variation c give about c squared; a step or a
    single burst among the counts gives much more. None with fewer than two counts: not known."""
    seconds = sum(w for _, w in counts)
    if len(counts) < 2 or seconds <= 0:
        return None
    rate = sum(n for n, _ in counts) / seconds
    if rate <= 0:
        return 1.0
    chi2 = sum((n - rate * w) ** 2 / (rate * w) for n, w in counts if w > 0)
    return max(chi2 / (len(counts) - 1), 1.0)


def dispersion_of_sums(requests: float, seconds: float, squares: float, counts: int) -> float | None:
    """:func:`dispersion` of ``counts`` counts, each over a positive number of seconds, from their
    running sums: ``requests`` (sum of n), ``seconds`` (sum of w) and ``squares`` (sum of n * n / w).
    The chi-square about the rate r = requests / seconds, sum (n - r w)^2 / (r w), is
    squares / r - 2 requests + r seconds. What a window kept up to date count by count costs: O(1)."""
    if counts < 2 or seconds <= 0:
        return None
    if requests <= 0:
        return 1.0
    rate = requests / seconds
    chi2 = squares / rate - 2 * requests + rate * seconds
    return max(chi2 / (counts - 1), 1.0)


def within_noise(count: float, expected: float, sigmas: float = NOISE_SIGMAS, dispersion: float = 1.0) -> bool:
    """Whether ``count`` arrivals may be noise around ``expected`` (either way): Poisson noise, or that of
    counts whose variance is ``dispersion`` times their mean."""
    return abs(count - expected) <= noise_margin(expected, sigmas, dispersion)


def is_surge(count: float, expected: float) -> bool:
    """Whether ``count`` arrivals, where ``expected`` were expected, are a surge: beyond noise above
    it and SURGE_RATIO times it."""
    expected = max(expected, 0.0)
    return count > expected + noise_margin(expected) and count > SURGE_RATIO * expected


def is_drop(count: float, expected: float, dispersion: float = 1.0) -> bool:
    """Whether ``count`` arrivals, where ``expected`` were expected, are a drop: beyond noise below it
    (of counts whose variance is ``dispersion`` times their mean: :func:`dispersion`) and below it by
    SURGE_RATIO (a surge's mirror). Where a handful is expected, nothing is a drop."""
    expected = max(expected, 0.0)
    return count < expected - noise_margin(expected, dispersion=dispersion) and count * SURGE_RATIO < expected


def surges_of(counts: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """:func:`is_surge` of each pair of ``counts`` and ``expected`` (arrays): the same rule, for the
    scheduler's workload, which judges thousands of sessions' reports at a time."""
    expected = np.maximum(expected, 0.0)
    return (counts > expected + NOISE_SIGMAS * np.sqrt(expected) + NOISE_MIN_EXTRA) & (counts > SURGE_RATIO * expected)


def dispersions_of_sums(requests: np.ndarray, seconds: np.ndarray, squares: np.ndarray,
                        counts: np.ndarray) -> np.ndarray:
    """:func:`dispersion_of_sums` of each session's sums (arrays); NaN where it is not known."""
    with np.errstate(divide="ignore", invalid="ignore"):
        rate = requests / seconds
        chi2 = squares / rate - 2 * requests + rate * seconds
        out = np.maximum(chi2 / (counts - 1), 1.0)
    out = np.where(requests <= 0, 1.0, out)
    return np.where((counts < 2) | (seconds <= 0), np.nan, out)
