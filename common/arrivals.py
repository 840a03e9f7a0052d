"""Open-loop request arrivals: the times are drawn up front, independent of how serving goes.

An open-loop generator never waits for responses, so a slow server faces the same arrivals as a
fast one (no coordinated omission). :func:`arrival_times` is the one arrival process of the project:
the load generator of ``nexus bench`` and the benchmarks, the profiler's multi-tenant harness and
the discrete-event simulation of :mod:`backend.simulate` all draw from it.

The process is a renewal process of mean rate ``rate_rps`` whose gaps have coefficient of variation
``cv`` (standard deviation over mean): ``cv=1`` is a Poisson process (exponential gaps), ``cv=0``
evenly spaced arrivals, and any other ``cv`` Gamma-distributed gaps of shape ``1/cv**2``; above 1
arrivals come in bursts (a CV of 2-4 is what production traces show at short time scales).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def arrival_times(rate_rps: float, duration_s: float, rng: np.random.Generator | int = 0, *,
                  cv: float = 1.0) -> np.ndarray:
    """Sorted arrival offsets (seconds, in ``[0, duration_s)``) of the process described above.

    ``rng`` is a numpy Generator or an integer seed; the same one gives the same arrivals. A rate or
    a duration of 0 gives no arrival; a negative or non-finite argument is a ValueError.
    """
    for name, value in (("rate_rps", rate_rps), ("duration_s", duration_s), ("cv", cv)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {value}")
    if rate_rps == 0 or duration_s == 0:
        return np.zeros(0)
    if not isinstance(rng, np.random.Generator):
        rng = np.random.default_rng(rng)
    mean_gap = 1.0 / rate_rps
    if cv == 1.0:
        def gaps(n: int) -> np.ndarray:
            return rng.exponential(mean_gap, n)
    elif cv == 0.0:
        def gaps(n: int) -> np.ndarray:
            return np.full(n, mean_gap)
    else:
        shape = 1.0 / (cv * cv)

        def gaps(n: int) -> np.ndarray:
            return rng.gamma(shape, mean_gap / shape, n)
    # One draw covers the window but for a 6-sigma excess of arrivals; a longer one draws again.
    expected = rate_rps * duration_s
    chunk = int(expected + 6 * max(cv, 1.0) * math.sqrt(expected) + 16)
    parts: list[np.ndarray] = []
    last = 0.0
    while last < duration_s:
        t = last + np.cumsum(gaps(chunk))
        parts.append(t)
        last = float(t[-1])
    times = np.concatenate(parts)
    return times[times < duration_s]


def step_arrival_times(steps: Sequence[tuple[float, float]], rng: np.random.Generator | int = 0, *,
                       cv: float = 1.0) -> np.ndarray:
    """Sorted arrival offsets of a rate that changes in steps: ``steps`` lists ``(duration_s, rate_rps)``
    in order, each step the process above (a renewal process restarted at the step's start)."""
    if not isinstance(rng, np.random.Generator):
        rng = np.random.default_rng(rng)
    parts, start = [], 0.0
    for duration_s, rate_rps in steps:
        parts.append(start + arrival_times(rate_rps, duration_s, rng, cv=cv))
        start += duration_s
    return np.concatenate(parts) if parts else np.zeros(0)
