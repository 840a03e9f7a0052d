"""When a count of arrivals is a surge: beyond Poisson noise around the count that was expected, and
well above it. The one rule of the scheduler (a frontend's latest report against the mean of its
earlier ones, globalsched/workload.py) and of the frontends (a session's count in the current
window against what its planned rate would bring, frontend/early_report.py).

A Poisson count of mean ``e`` has standard deviation sqrt(e); ``SURGE_SIGMAS`` of them put a false
alarm below one in 30,000 windows at a steady rate, ``SURGE_MIN_EXTRA`` keeps a handful of requests
from counting as a surge where almost nothing was expected, and ``SURGE_RATIO`` keeps a large steady
rate's small drift (far beyond its tiny relative noise) from counting as one.
"""

from __future__ import annotations

import math

SURGE_SIGMAS = 4.0
SURGE_MIN_EXTRA = 3
SURGE_RATIO = 1.5


def is_surge(count: float, expected: float) -> bool:
    """Whether ``count`` arrivals, where ``expected`` were expected, are a surge (the module's rule)."""
    expected = max(expected, 0.0)
    return count > expected + SURGE_SIGMAS * math.sqrt(expected) + SURGE_MIN_EXTRA and count > SURGE_RATIO * expected
