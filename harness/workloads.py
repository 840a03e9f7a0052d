"""Synthetic workloads the benchmarks share: issue 18's long tail of models.

:func:`long_tail` is the workload that ``benchmarks/plan_quality.py`` plans offline and
``benchmarks/long_tail.py`` serves on emulated GPUs, so that both speak of the same sessions for a
seed: Zipf rates (the model of rank r gets a share proportional to 1/r**s), GPU-like profiles
l(b) = alpha*b + beta with alpha in [1, 3] ms per item and beta in [3, 8] ms (l(1) a few ms),
SLOs uniform in a range, memory 300 MB + 10 MB per item.
"""

from __future__ import annotations

import random

from globalsched.planning.plan import SessionSpec
from common.profile import Profile

TAIL_MAX_BATCH = 32
TAIL_ALPHA_MS = (1.0, 3.0)      # per item
TAIL_BETA_MS = (3.0, 8.0)       # per batch
TAIL_MEMORY_MB = (300.0, 10.0)  # base, per item


def zipf_rates(n: int, total_rps: float, exponent: float = 1.0) -> list[float]:
    """``n`` rates adding up to ``total_rps``, the one of rank r (from 1) proportional to 1/r**exponent."""
    if n < 1 or not total_rps > 0 or exponent < 0:
        raise ValueError(f"need n >= 1, total_rps > 0 and exponent >= 0; got {n}, {total_rps}, {exponent}")
    weights = [1 / (i + 1) ** exponent for i in range(n)]
    scale = total_rps / sum(weights)
    return [w * scale for w in weights]


def long_tail(n: int, total_rps: float, slo_ms: tuple[float, float], seed: int, *, device_type: str = "",
              exponent: float = 1.0) -> list[SessionSpec]:
    """Issue 18's long tail: ``n`` models ``m0``..., Zipf rates adding up to ``total_rps``, profiles
    l(b) = 3-8 ms + 1-3 ms per item up to batch 32 on ``device_type``, SLOs uniform in ``slo_ms``
    (rounded to 0.1 ms). The same seed gives the same sessions."""
    rng = random.Random(seed)
    return [SessionSpec(f"m{i}", f"m{i}", round(rng.uniform(*slo_ms), 1), rate,
                        Profile.linear(rng.uniform(*TAIL_ALPHA_MS), rng.uniform(*TAIL_BETA_MS), TAIL_MAX_BATCH,
                                       *TAIL_MEMORY_MB, device_type=device_type))
            for i, rate in enumerate(zipf_rates(n, total_rps, exponent))]
