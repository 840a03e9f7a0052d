"""Co-location slowdown: how much slower a model's batches run when it shares a device.

Measured by the multi-tenant harness as, for one model, the mean execution time of its batches while
co-located divided by the mean execution time of batches *of the same sizes* while it had the device
to itself (sizes weighted by how often they ran co-located; a size never seen alone is compared with
the dedicated profile's mean). The factor saved in the report is ``max(1, measured)``: a plan never
assumes sharing makes a model faster. The scheduler inflates l(b) of sessions that share a device
with :func:`apply_colocation_slowdown`.
"""

from __future__ import annotations

import math

from common.profile import Profile


def measured_slowdown(dedicated: dict[int, tuple[int, float]], colocated: dict[int, tuple[int, float]],
                      profile: Profile | None = None) -> float | None:
    """Ratio of co-located to dedicated batch execution time (``batch -> (count, total ms)`` maps)."""
    num = den = 0.0
    for b, (n_co, total_co) in colocated.items():
        if n_co == 0:
            continue
        if b in dedicated and dedicated[b][0] > 0:
            ref = dedicated[b][1] / dedicated[b][0]
        elif profile is not None and b <= profile.max_batch and profile.rows[b - 1].mean_ms:
            ref = profile.rows[b - 1].mean_ms
        else:
            continue
        num += total_co
        den += n_co * ref
    return num / den if den > 0 else None


def merge_exec(into: dict[int, tuple[int, float]], more: dict[int, tuple[int, float]]) -> None:
    for b, (n, t) in more.items():
        n0, t0 = into.get(b, (0, 0.0))
        into[b] = (n0 + n, t0 + t)


def apply_colocation_slowdown(profile: Profile, factor: float) -> Profile:
    """``profile`` with every latency figure multiplied by ``factor`` (>= 1), for a shared device.

    ``meta["colocation_slowdown"]`` records the factor applied (factors compose when applied twice).
    """
    if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor >= 1.0):
        raise ValueError(f"co-location slowdown must be a finite number >= 1, got {factor!r}")

    scaled = profile.scaled(factor)
    meta = dict(profile.meta)
    meta["colocation_slowdown"] = float(meta.get("colocation_slowdown", 1.0)) * factor
    return Profile(scaled.rows, profile.device_type, meta)


def slowdowns_from_report(report: dict) -> dict[str, float]:
    """``model name -> slowdown`` from a ``nexus profile multitenant`` JSON report (also keyed by
    the model's sha256)."""
    result: dict[str, float] = {}
    for m in report.get("models", []):
        factor = float(m["slowdown"])
        result[m["name"]] = factor
        if m.get("model_sha256"):
            result[m["model_sha256"]] = factor
    return result


__all__ = ["apply_colocation_slowdown", "measured_slowdown", "merge_exec", "slowdowns_from_report"]
