"""Cost per million inferences, and shared against dedicated serving.

With a device price P per hour, a device serving r requests per second costs
``P / (3600 * r) * 1e6`` per million inferences.

For a co-located point where models i = 1..N are served at rates r_i on ONE shared device, and each
model's dedicated peak (one device to itself) is R_i:

- *sharing efficiency* e = sum_i r_i / R_i: the dedicated-device capacity the shared device stands in
  for. e = 1 is the straight line between dedicated peaks (as good as time-slicing), e > 1 means
  co-location serves more than dedicated devices would per device-hour, e < 1 means interference.
- cost per million, shared: P / (3600 * sum_i r_i) * 1e6;
- cost per million, dedicated at peak: the same mix served by dedicated devices run at their peak
  (fractional devices): P * e / (3600 * sum_i r_i) * 1e6;
- cost change of shared versus dedicated = shared / dedicated - 1 = 1/e - 1 (negative: sharing is
  cheaper);
- for reference, dedicated with whole devices (each model on devices of its own, as without
  multi-tenancy): P * k / (3600 * sum_i r_i) * 1e6 with k = sum_i ceil(r_i / R_i).
"""

from __future__ import annotations

import math


def cost_per_million(price_per_hour: float, rate_rps: float) -> float | None:
    """Price of a million inferences on one device serving ``rate_rps`` (None at zero rate)."""
    if rate_rps <= 0:
        return None
    return price_per_hour / (3600.0 * rate_rps) * 1e6


def sharing_efficiency(rates: dict[str, float], peaks: dict[str, float]) -> float:
    return sum(rates[n] / peaks[n] for n in rates if peaks.get(n, 0) > 0)


def compare_point(price_per_hour: float, rates: dict[str, float], peaks: dict[str, float]) -> dict:
    """The cost figures of one co-located point (see the module docstring)."""
    total = sum(rates.values())
    e = sharing_efficiency(rates, peaks)
    whole = sum(math.ceil(rates[n] / peaks[n] - 1e-9) for n in rates if rates[n] > 0 and peaks.get(n, 0) > 0)
    shared = cost_per_million(price_per_hour, total)
    dedicated = shared * e if shared is not None else None
    dedicated_whole = shared * whole if shared is not None else None
    return {
        "total_rps": total,
        "efficiency": e,
        "cost_per_million_shared": shared,
        "cost_per_million_dedicated": dedicated,
        "cost_change_vs_dedicated": (1.0 / e - 1.0) if e > 0 else None,
        "dedicated_devices_whole": whole,
        "cost_per_million_dedicated_whole": dedicated_whole,
        "cost_change_vs_dedicated_whole": (1.0 / whole - 1.0) if whole > 0 else None,
    }
