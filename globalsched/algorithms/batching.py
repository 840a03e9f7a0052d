"""Per-session batching arithmetic: SLO budget, saturated GPUs, residual duty cycles.

A :class:`SessionModel` is a session prepared for planning on one GPU kind: the SLO budget after
margins, the batch sizes it may use (memory permitting) and its latency/memory tables. Building one
raises :class:`~common.plan.PlanningError` naming the session when no plan could ever serve it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from common.batching import saturated_batch
from common.plan import EPS_MS, GpuSpec, PlanningError, SessionSpec

from .config import PlannerConfig


@dataclass(frozen=True)
class SessionModel:
    name: str
    rate_rps: float
    budget_ms: float              # SLO less margins: duty cycle + execution must fit in it
    latency_ms: tuple[float, ...]  # index b-1
    memory_mb: tuple[float, ...]
    max_batch: int                # largest batch usable (profile, memory, batch cap)
    group: str | None             # prefix group, None when planning without prefix sharing

    def lat(self, batch: int) -> float:
        return self.latency_ms[batch - 1]

    def mem(self, batch: int) -> float:
        return self.memory_mb[batch - 1]


def prepare(spec: SessionSpec, gpu: GpuSpec | None, config: PlannerConfig, *, check_memory: bool = True,
            batch_cap: int | None = None, prefix_aware: bool = True, with_headroom: bool = True) -> SessionModel:
    """The planning view of ``spec``; PlanningError when even batch 1 cannot meet its SLO or memory.
    ``with_headroom=False`` keeps the session's own rate (the lower bound's view)."""
    p = spec.profile
    budget = spec.slo_ms - config.margins_ms
    l1 = p.latency_ms(1)
    if 2 * l1 > budget + EPS_MS:
        extra = f" less margins {config.margins_ms:g} ms" if config.margins_ms else ""
        raise PlanningError(f"session {spec.name!r}: SLO {spec.slo_ms:g} ms{extra} is below 2*l(1) = "
                            f"{2 * l1:g} ms; no plan can serve it")
    max_batch = p.max_batch if batch_cap is None else min(p.max_batch, batch_cap)
    if check_memory and gpu is not None:
        if p.memory_mb(1) > gpu.memory_mb + EPS_MS:
            raise PlanningError(f"session {spec.name!r}: needs {p.memory_mb(1):g} MB at batch 1, more than "
                                f"the GPU's {gpu.memory_mb:g} MB")
        for b in range(2, max_batch + 1):  # largest b such that every batch up to b fits
            if p.memory_mb(b) > gpu.memory_mb + EPS_MS:
                max_batch = b - 1
                break
    sm = SessionModel(spec.name, spec.rate_rps, budget,
                      tuple(r.latency_ms for r in p.rows), tuple(r.memory_mb for r in p.rows),
                      max_batch, spec.prefix_group if prefix_aware else None)
    if with_headroom and config.burst_sigma > 0:
        batch, _ = saturated(sm)
        sm = dataclasses.replace(sm, rate_rps=burst_rate_rps(spec.rate_rps, sm.lat(batch), config.burst_sigma))
    return sm


def burst_rate_rps(rate_rps: float, duty_ms: float, sigma: float) -> float:
    """The rate to provision so that a duty cycle covers a Poisson burst: n + sigma*sqrt(n) arrivals
    per cycle instead of their mean n = rate * duty.

    Relative to the rate this is 1 + sigma/sqrt(n): large for sessions whose saturated batch holds a
    few requests (one extra arrival overflows them into the next cycle, past their SLO) and small
    for large ones. ``prepare`` applies it with the duty cycle of the session's saturated batch.
    """
    n = rate_rps * duty_ms / 1000.0
    if sigma <= 0 or n <= 0:
        return rate_rps
    return (n + sigma * math.sqrt(n)) * 1000.0 / duty_ms


def saturated(sm: SessionModel) -> tuple[int, float]:
    """(batch, throughput_rps) of one GPU running only this session at duty cycle l(b), 2*l(b) <= budget.

    The batch maximises throughput b*1000/l(b); for profiles whose throughput grows with the batch
    (every GPU-like profile) that is DESIGN.md's "largest b with 2*l(b) <= SLO".
    """
    best_b, best_t = 1, 1000.0 / sm.lat(1)
    for b in range(2, usable_batch(sm) + 1):
        lat = sm.lat(b)
        t = b * 1000.0 / lat
        if t >= best_t:
            best_b, best_t = b, t
    return best_b, best_t


def batch_for(sm: SessionModel, rate_rps: float, duty_ms: float) -> int | None:
    """Smallest batch serving ``rate_rps`` at ``duty_ms`` (b*1000/d >= rate), None beyond max_batch."""
    b = max(1, math.ceil(duty_ms * rate_rps / 1000.0 - 1e-9))
    if b * 1000.0 / duty_ms < rate_rps * (1 - 1e-12):
        b += 1
    return b if b <= sm.max_batch else None


def residual_config(sm: SessionModel, rate_rps: float) -> tuple[int, float]:
    """(batch, duty_ms) serving ``rate_rps`` alone on a shared GPU at the lowest occupancy l(b)/d.

    For each batch b the longest duty cycle allowed is min(b*1000/rate, budget - l(b)); it must be at
    least l(b). Unlike the published rule (d = b/rate only), low rates keep batch 1 with the duty
    cycle capped by the SLO instead of becoming infeasible.
    """
    best: tuple[float, int, float] | None = None
    for b in range(1, sm.max_batch + 1):
        lat = sm.lat(b)
        if 2 * lat > sm.budget_ms + EPS_MS:
            break  # latency only grows with the batch
        d = min(b * 1000.0 / rate_rps, sm.budget_ms - lat)
        if d < lat - EPS_MS:
            continue
        occ = lat / d
        if best is None or occ < best[0] - 1e-12:
            best = (occ, b, d)
    assert best is not None, "prepare() guarantees batch 1 fits"
    return best[1], best[2]


def residual_config_published(sm: SessionModel, rate_rps: float) -> tuple[int, float]:
    """Nexus's rule: the largest b with b*1000/rate + l(b) <= SLO, duty cycle b*1000/rate.

    When no batch qualifies (a rate so low that 1000/rate + l(1) > SLO, or so close to a saturated
    GPU's that l(b) > b/rate) it falls back to :func:`residual_config`, which caps the duty cycle by
    the SLO: the smallest change that keeps the plan valid.
    """
    for b in range(sm.max_batch, 0, -1):
        d = b * 1000.0 / rate_rps
        if d + sm.lat(b) <= sm.budget_ms + EPS_MS and sm.lat(b) <= d + EPS_MS:
            return b, d
    return residual_config(sm, rate_rps)


def min_cost_ms_per_request(sm: SessionModel) -> float:
    """min over usable b with 2*l(b) <= budget of l(b)/b: GPU-milliseconds one request needs at best."""
    return min((sm.lat(b) / b for b in range(1, usable_batch(sm) + 1)), default=math.inf)


def usable_batch(sm: SessionModel) -> int:
    """The saturated batch (:func:`common.batching.saturated_batch`, the rule the backend serves
    with) against the SLO budget, up to the session's max batch; 0 when even batch 1 misses."""
    return saturated_batch(sm.lat, sm.budget_ms, sm.max_batch, EPS_MS)
