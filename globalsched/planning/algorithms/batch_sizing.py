"""Per-session batching arithmetic: SLO budget, saturated GPUs, residual duty cycles.

A :class:`SessionModel` is a session prepared for planning on one GPU kind: the SLO budget after
margins, the batch sizes it may use (memory permitting), its latency/memory tables, the marginal
cost of an extra item at each batch and the burst headroom's ``z`` (:mod:`globalsched.planning.headroom`: a
device keeps room for the pooled burst of its sessions; the packers check it per device through
:class:`globalsched.planning.algorithms.gpuload.GpuLoad`). Building one raises
:class:`~globalsched.planning.plan.PlanningError` naming the session when no plan could ever serve it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

from common.batch_decision import saturated_batch
from globalsched.planning.headroom import BurstSums, BurstTerm, lone_session_load_items, marginal_ms_per_item
from globalsched.planning.plan import EPS_MS, GpuSpec, PlanningError, SessionSpec

from .config import PlannerConfig

MEMO_SIZE = 1 << 14     # memoised per-session results (a few thousand sessions, a few rates each)


@dataclass(frozen=True)
class SessionModel:
    name: str
    rate_rps: float
    budget_ms: float              # SLO less margins: duty cycle + execution must fit in it
    latency_ms: tuple[float, ...]  # index b-1
    memory_mb: tuple[float, ...]
    max_batch: int                # largest batch usable (profile, memory, batch cap)
    group: str | None             # prefix group, None when planning without prefix sharing
    marginal_ms: tuple[float, ...] = ()  # c(b) of globalsched.planning.headroom, index b-1
    burst_sigma: float = 0.0      # z of the pooled burst headroom; 0: none

    def lat(self, batch: int) -> float:
        return self.latency_ms[batch - 1]

    def marginal(self, batch: int) -> float:
        return self.marginal_ms[batch - 1] if self.marginal_ms else 0.0

    def burst_term(self, batch: int, load_rps: float) -> BurstTerm:
        return BurstTerm(batch, load_rps, self.marginal(batch))

    def lone_excess_ms(self, batch: int, load_rps: float, duty_ms: float, exact: bool = False) -> float:
        """H of a device running only this load (0 without headroom). By default by the several-
        session expansion: a residual is planned so that it stays feasible when others join it (the
        exact lone quantile would let it fill a GPU that then takes nobody); ``exact``: the lone
        quantile that validation applies to a device with one session."""
        if self.burst_sigma <= 0:
            return 0.0
        sums = BurstSums()
        sums.add(self.burst_term(batch, load_rps))
        return sums.excess_ms(duty_ms, self.burst_sigma, exact_lone=exact)

    def mem(self, batch: int) -> float:
        return self.memory_mb[batch - 1]


def prepare(spec: SessionSpec, gpu: GpuSpec | None, config: PlannerConfig, *, check_memory: bool = True,
            batch_cap: int | None = None, prefix_aware: bool = True, with_headroom: bool = True) -> SessionModel:
    """The planning view of ``spec``; PlanningError when even batch 1 cannot meet its SLO or memory.
    ``with_headroom=False`` plans without burst headroom (the lower bound's view)."""
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
    lats = tuple(r.latency_ms for r in p.rows)
    z = config.burst_sigma if with_headroom else 0.0
    marginal: tuple[float, ...] = ()
    if z > 0:
        marginal = _marginals(lats, budget)
    return SessionModel(spec.name, spec.rate_rps, budget, lats, tuple(r.memory_mb for r in p.rows),
                        max_batch, spec.prefix_group if prefix_aware else None, marginal, z)


@functools.lru_cache(maxsize=MEMO_SIZE)
def _marginals(latency_ms: tuple[float, ...], budget_ms: float) -> tuple[float, ...]:
    """c(b) of every batch of a profile (index b-1) within ``budget_ms``; memoised by value: every plan
    prepares every session again, and the same profiles come back."""
    lat = latency_ms.__getitem__
    largest = saturated_batch(lambda b: lat(b - 1), budget_ms, len(latency_ms), EPS_MS)
    return tuple(marginal_ms_per_item(lambda b: lat(b - 1), b, largest) for b in range(1, len(latency_ms) + 1))


class Saturated(NamedTuple):
    """One GPU running only a session at duty cycle l(batch): its throughput, and the load it may
    carry (the throughput, less the burst headroom's share when headroom is on)."""

    batch: int
    throughput_rps: float
    load_rps: float


def saturated(sm: SessionModel) -> Saturated:
    """The saturated GPU of docs/planning.md: duty cycle l(b), 2*l(b) <= budget, b maximising the load.

    Without headroom the load is the throughput b*1000/l(b); for profiles whose throughput grows
    with the batch (every GPU-like profile) that is docs/planning.md's "largest b with 2*l(b) <= SLO".
    With headroom a lone session cannot pool its bursts: it carries the n arrivals per cycle that
    :func:`globalsched.planning.headroom.lone_session_load_items` allows (P(Poisson(n) > b) at most the target,
    exactly; the earlier per-session rule n + z*sqrt(n) <= b approximated it).
    """
    if sm.burst_sigma <= 0:  # the load is the throughput (the hot path of every plan without headroom)
        best_b, best_t = 1, 1000.0 / sm.lat(1)
        for b in range(2, usable_batch(sm) + 1):
            t = b * 1000.0 / sm.lat(b)
            if t >= best_t:
                best_b, best_t = b, t
        return Saturated(best_b, best_t, best_t)
    best = Saturated(1, 1000.0 / sm.lat(1), 0.0)
    best = best._replace(load_rps=_saturated_load(sm, 1, best.throughput_rps))
    for b in range(2, usable_batch(sm) + 1):
        t = b * 1000.0 / sm.lat(b)
        load = _saturated_load(sm, b, t)
        if load >= best.load_rps:
            best = Saturated(b, t, load)
    return best


def _saturated_load(sm: SessionModel, batch: int, throughput_rps: float) -> float:
    if sm.burst_sigma <= 0 or sm.marginal(batch) <= 0:
        return throughput_rps
    return throughput_rps * lone_session_load_items(batch, sm.burst_sigma) / batch


def batch_for(sm: SessionModel, rate_rps: float, duty_ms: float) -> int | None:
    """Smallest batch serving ``rate_rps`` at ``duty_ms`` (b*1000/d >= rate), None beyond max_batch."""
    b = max(1, math.ceil(duty_ms * rate_rps / 1000.0 - 1e-9))
    if b * 1000.0 / duty_ms < rate_rps * (1 - 1e-12):
        b += 1
    return b if b <= sm.max_batch else None


@functools.lru_cache(maxsize=MEMO_SIZE)
def residual_config(sm: SessionModel, rate_rps: float) -> tuple[int, float]:
    """(batch, duty_ms) serving ``rate_rps`` alone on a shared GPU at the lowest occupancy
    (l(b) + H)/d, H the burst headroom of that lone load (0 without headroom).

    For each batch b the longest duty cycle allowed is min(b*1000/rate, budget - l(b) - H); it must
    be at least l(b) + H. Unlike the published rule (d = b/rate only), low rates keep batch 1 with
    the duty cycle capped by the SLO instead of becoming infeasible. With headroom H is the
    several-session figure (:meth:`SessionModel.lone_excess_ms`), or, when no batch fits by it, the
    exact lone one (the residual then keeps a GPU of its own). Raises PlanningError when no batch
    fits either way (a budget too tight for even one item's burst). Memoised by value: a re-plan asks
    again for the sessions and rates the previous plans asked for (a rate within noise of the planned
    one is the planned one), and the search with headroom bisects the duty cycle of every batch.
    """
    best = _residual_config(sm, rate_rps, exact=False)
    if best is None and sm.burst_sigma > 0:
        best = _residual_config(sm, rate_rps, exact=True)
    if best is None:
        raise PlanningError(f"session {sm.name!r}: no batch leaves room for its burst headroom within its SLO "
                            f"budget {sm.budget_ms:g} ms at {rate_rps:g} req/s; lower --burst-sigma")
    return best


def _residual_config(sm: SessionModel, rate_rps: float, exact: bool) -> tuple[int, float] | None:
    best: tuple[float, int, float] | None = None
    for b in range(1, sm.max_batch + 1):
        lat = sm.lat(b)
        if 2 * lat > sm.budget_ms + EPS_MS:
            break  # latency only grows with the batch
        d = min(b * 1000.0 / rate_rps, sm.budget_ms - lat)
        if sm.burst_sigma > 0:
            d = _longest_duty_with_headroom(sm, b, rate_rps, d, exact)
            if d is None:
                continue
            occ = (lat + sm.lone_excess_ms(b, rate_rps, d, exact)) / d
        else:
            if d < lat - EPS_MS:
                continue
            occ = lat / d
        if best is None or occ < best[0] - 1e-12:
            best = (occ, b, d)
    return None if best is None else (best[1], best[2])


def lone_fits(sm: SessionModel, batch: int, rate_rps: float, duty_ms: float, exact: bool = False,
              slack_ms: float = EPS_MS) -> bool:
    """Whether a device running only this load at (batch, duty) keeps every rule, headroom included
    (H as :meth:`SessionModel.lone_excess_ms` computes it), within ``slack_ms`` (the validator's)."""
    lat = sm.lat(batch)
    h = sm.lone_excess_ms(batch, rate_rps, duty_ms, exact)
    return lat + h <= duty_ms + slack_ms and duty_ms + lat + h <= sm.budget_ms + slack_ms


def _longest_duty_with_headroom(sm: SessionModel, batch: int, rate_rps: float, hi_ms: float,
                                exact: bool) -> float | None:
    """The longest d <= ``hi_ms`` at which the lone load fits (:func:`lone_fits`), None if none does.

    d + l + H(d) grows with d, so ``hi_ms`` (at most the SLO's limit) meets that part. The d >= l with
    l + H(d) <= d are [l, a] and [a', inf) (d - H(d) is the minimum of d and a convex function of
    d), so when ``hi_ms`` fails it lies in (a, a') and the answer is a: bisection on [l, hi]. The
    bisection keeps the rules with no slack: a duty cycle on the validator's EPS_MS edge was refused
    by the packer's own check of the same rules, summed in another order (an empty GPU refused a
    residual at 1,000 devices in the simulator, benchmarks/elastic.md).
    """
    lo = sm.lat(batch)
    if hi_ms < lo - EPS_MS:
        return None
    if lone_fits(sm, batch, rate_rps, hi_ms, exact):
        return hi_ms
    if not lone_fits(sm, batch, rate_rps, lo, exact):
        return None
    for _ in range(40):
        mid = (lo + hi_ms) / 2
        if lone_fits(sm, batch, rate_rps, mid, exact, slack_ms=0.0):
            lo = mid
        else:
            hi_ms = mid
    return lo


def residual_config_published(sm: SessionModel, rate_rps: float) -> tuple[int, float]:
    """Nexus's rule: the largest b with b*1000/rate + l(b) <= SLO, duty cycle b*1000/rate.

    When no batch qualifies (a rate so low that 1000/rate + l(1) > SLO, or so close to a saturated
    GPU's that l(b) > b/rate) it falls back to :func:`residual_config`, which caps the duty cycle by
    the SLO: the smallest change that keeps the plan valid.
    """
    for b in range(sm.max_batch, 0, -1):
        d = b * 1000.0 / rate_rps
        if d + sm.lat(b) <= sm.budget_ms + EPS_MS and sm.lat(b) <= d + EPS_MS and lone_fits(sm, b, rate_rps, d):
            return b, d
    return residual_config(sm, rate_rps)


def usable_batch(sm: SessionModel) -> int:
    """The saturated batch (:func:`common.batch_decision.saturated_batch`, the rule the backend serves
    with) against the SLO budget, up to the session's max batch; 0 when even batch 1 misses."""
    return saturated_batch(sm.lat, sm.budget_ms, sm.max_batch, EPS_MS)
