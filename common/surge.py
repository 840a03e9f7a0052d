"""Poisson noise of request counts: when a count differs from the one expected, and when it is a
surge. The one rule of the scheduler and of the frontends:

- the scheduler's workload (globalsched/workload.py) finds a frontend's latest report a surge against
  the mean of its earlier ones;
- the planner (globalsched/planner.py) keeps a measured rate within noise of the rate planned at the
  planned rate (:func:`within_noise`), and takes a surge only if it is a surge against the rate
  planned too (:func:`is_surge`);
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

NOISE_SIGMAS = 4.0
NOISE_MIN_EXTRA = 3.0
SURGE_RATIO = 1.5


def noise_margin(expected: float, sigmas: float = NOISE_SIGMAS) -> float:
    """How far a Poisson count of mean ``expected`` may stray and still be noise."""
    return sigmas * math.sqrt(max(expected, 0.0)) + NOISE_MIN_EXTRA


def within_noise(count: float, expected: float, sigmas: float = NOISE_SIGMAS) -> bool:
    """Whether ``count`` arrivals may be Poisson noise around ``expected`` (either way)."""
    return abs(count - expected) <= noise_margin(expected, sigmas)


def is_surge(count: float, expected: float) -> bool:
    """Whether ``count`` arrivals, where ``expected`` were expected, are a surge: beyond noise above
    it and SURGE_RATIO times it."""
    expected = max(expected, 0.0)
    return count > expected + noise_margin(expected) and count > SURGE_RATIO * expected
