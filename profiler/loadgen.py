"""Open-loop Poisson load: request arrival times drawn up front, independent of how serving goes.

An open-loop generator never waits for responses, so a slow server faces the same arrivals as a
fast one (no coordinated omission). Drawing the whole schedule before a step starts keeps Python's
thread scheduling out of the arrival process: the harness admits a request to its queue as soon as
the clock passes its arrival time, and its latency is counted from that scheduled time.
"""

from __future__ import annotations

import numpy as np


def poisson_arrivals(rate_rps: float, duration_s: float, rng: np.random.Generator) -> np.ndarray:
    """Sorted arrival offsets (seconds, in [0, duration_s)) of a Poisson process of ``rate_rps``."""
    if rate_rps < 0 or duration_s <= 0:
        raise ValueError(f"need rate >= 0 and duration > 0 (got {rate_rps}, {duration_s})")
    if rate_rps == 0:
        return np.empty(0)
    expected = rate_rps * duration_s
    n = int(expected + 6 * np.sqrt(expected) + 16)
    times = np.cumsum(rng.exponential(1.0 / rate_rps, n))
    while times[-1] < duration_s:  # astronomically rare: extend
        more = times[-1] + np.cumsum(rng.exponential(1.0 / rate_rps, n))
        times = np.concatenate([times, more])
    return times[times < duration_s]
