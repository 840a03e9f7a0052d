"""Finding the largest offered rate that still passes: grow geometrically, then bisect.

``trial(rate) -> bool`` runs one open-loop load step. The search starts at ``start``, multiplies the
rate by ``growth`` while trials pass (up to ``max_rate``), halves it while they fail (down to
``start * min_fraction``, below which the answer is 0), then bisects the last passing / first failing
pair ``refine`` times. The answer is the largest rate that passed.
"""

from __future__ import annotations

from typing import Callable


def find_max_rate(trial: Callable[[float], bool], start: float, *, growth: float = 2.0, refine: int = 3,
                  max_rate: float = float("inf"), min_fraction: float = 1.0 / 64) -> float:
    if not start > 0:
        raise ValueError(f"start rate must be positive, got {start}")
    if growth <= 1.0:
        raise ValueError(f"growth must be > 1, got {growth}")
    lo, hi = 0.0, None
    rate = min(start, max_rate)
    while True:  # grow while passing
        if trial(rate):
            lo = rate
            if rate >= max_rate:
                return lo
            rate = min(rate * growth, max_rate)
        else:
            hi = rate
            break
    while lo == 0.0:  # shrink while failing
        rate = hi / growth
        if rate < start * min_fraction:
            return 0.0
        if trial(rate):
            lo = rate
        else:
            hi = rate
    for _ in range(refine):
        mid = (lo + hi) / 2.0
        if trial(mid):
            lo = mid
        else:
            hi = mid
    return lo
