"""Squishy bin packing (Nexus, SOSP'19) with the checks its code lacks.

1. Saturated GPUs: each session gets floor(rate / T) GPUs running only it at the batch b that
   maximises throughput T = b*1000/l(b) under 2*l(b) <= budget (budget = SLO - margins) and memory.
2. Residual loads: the rest of each rate becomes a load with its own (batch, duty cycle); loads are
   merged best-fit into the GPU they fill most, the merged duty cycle being the smaller of the two
   and every batch recomputed as ceil(d*rate). A merge is kept only if executions fit the duty
   cycle, every SLO holds, *and memory fits* (Nexus's code never checks memory). With prefix groups,
   a load goes preferably to a GPU already batching its prefix, where the prefix runs once on the
   combined batch and its memory is counted once.
3. Consolidation (this project): GPUs are visited from the emptiest; one whose every load fits on
   the other GPUs is dissolved. A load that fits nowhere under the min-duty rule may still fit
   once a GPU's duty cycle is re-timed (every member's batch recomputed at another cycle length,
   :meth:`GpuLoad.refit`); the eight emptiest GPUs are tried that way.

Loads are visited either by decreasing occupancy l(b)/d (Nexus, docs/planning.md) or by increasing duty
cycle (this project: a load then never shortens the duty cycle of the GPU it joins, so the GPUs that
run long cycles keep them, which is where per-batch overheads are cheapest; about 3% fewer GPUs on
the benchmark, and every merge check is O(1)). :func:`squishy` runs the published order with the published
residual rule and the duty order with ours, both memory-checked, and keeps the plan with fewer GPUs,
so it never needs more GPUs than the published algorithm does whenever that one's plan fits memory.

With burst headroom (``PlannerConfig.burst_sigma``, globalsched/planning/headroom.py) a saturated GPU carries the
load a lone session may (``Saturated.load_rps``, below its throughput), residual loads take their
headroom into their own batch and duty cycle, and every merge keeps the pooled rule
(:class:`~globalsched.planning.algorithms.gpuload.GpuLoad`); allocations report their loads.
"""

from __future__ import annotations

import enum
import math
from typing import Callable, Iterable, Mapping, Sequence

from globalsched.planning.plan import GpuPlan, GpuSpec, PrefixGroup, SessionAlloc, SessionSpec

from .batch_sizing import Saturated, SessionModel, prepare, residual_config, residual_config_published, saturated
from .config import PlannerConfig
from .gpuload import GpuLoad, Member, best_fit, refit_fit
from .prefix import PrefixModel, check_prefix_groups, prefix_models

REFIT_TRIES = 8  # GPUs re-timed per load when consolidating and no merge at the smaller duty fits

RuleFn = Callable[[SessionModel, float], "tuple[int, float]"]


class ResidualRule(str, enum.Enum):
    """How a residual load picks its own batch and duty cycle."""

    OURS = "ours"            # lowest occupancy, SLO-capped duty cycle for low rates
    PUBLISHED = "published"  # Nexus: largest b with b/rate + l(b) <= SLO


class Order(str, enum.Enum):
    """The order residual loads are placed in."""

    OCCUPANCY = "occupancy"  # decreasing l(b)/d: Nexus, docs/planning.md
    DUTY = "duty"            # increasing duty cycle: this project


RULES: dict[ResidualRule, RuleFn] = {
    ResidualRule.OURS: residual_config, ResidualRule.PUBLISHED: residual_config_published}


def saturated_split(sm: SessionModel, rate_rps: float | None = None) -> tuple[int, Saturated, float]:
    """(number of saturated GPUs, their configuration, residual rate) for ``rate_rps`` (default the
    session's rate); each saturated GPU carries ``Saturated.load_rps``."""
    rate = sm.rate_rps if rate_rps is None else rate_rps
    sat = saturated(sm)
    n = math.floor(rate / sat.load_rps + 1e-9) if sat.load_rps > 0 else 0
    residual = rate - n * sat.load_rps
    if residual <= rate * 1e-9:
        residual = 0.0
    return n, sat, max(0.0, residual)


def saturated_alloc(sm: SessionModel, sat: Saturated) -> SessionAlloc:
    """The allocation of a saturated GPU; it reports its load only when headroom makes it differ."""
    return SessionAlloc(sm.name, sat.batch, sat.throughput_rps, sat.load_rps if sm.burst_sigma > 0 else None)


def place_residuals(loads: list[GpuLoad], items: Iterable[tuple[SessionModel, float]], rule: RuleFn,
                    prefixes: Mapping[str, PrefixModel], capacity_mb: float, order: Order) -> None:
    """Best-fit each (session, residual rate) into ``loads`` in ``order``; new GPUs as needed."""
    prepared = []
    for sm, rate in items:
        batch, duty = rule(sm, rate)
        key = -sm.lat(batch) / duty if order is Order.OCCUPANCY else duty
        prepared.append((key, sm.name, sm, rate, batch, duty))
    prepared.sort(key=lambda t: (t[0], t[1]))
    for _, _, sm, rate, batch, duty in prepared:
        fit = best_fit(loads, sm, rate, duty)
        if fit is not None:
            fit[0].commit(fit[1])
            continue
        load = GpuLoad(duty, prefixes, capacity_mb)
        ok = load.add_at_batch(Member(sm, rate, batch, duty))
        assert ok, f"a residual of {sm.name} does not fit an empty GPU"
        loads.append(load)


def consolidate(loads: list[GpuLoad], max_occupancy: float = 0.9) -> list[GpuLoad]:
    """Dissolve GPUs whose loads all fit elsewhere, emptiest first; returns the surviving loads."""
    alive = list(loads)
    for victim in sorted(loads, key=lambda l: l.occupancy):
        if victim.occupancy > max_occupancy:
            break
        others = [l for l in alive if l is not victim]
        saved: dict[int, GpuLoad] = {}
        ok = True
        for m in sorted(victim.members, key=lambda m: -m.sm.lat(m.batch) / victim.duty_ms):
            fit = (best_fit(others, m.sm, m.rate_rps, m.pref_duty_ms)
                   or refit_fit(others, m.sm, m.rate_rps, m.pref_duty_ms, REFIT_TRIES))
            if fit is None:
                ok = False
                break
            target, token = fit
            saved.setdefault(id(target), target.copy())
            target.commit(token)
        if ok:
            alive = others
        else:
            for l in others:
                if id(l) in saved:
                    l.commit(saved[id(l)])
    return alive


def pack(models: Sequence[SessionModel], prefixes: Mapping[str, PrefixModel], capacity_mb: float,
         rule: RuleFn, order: Order, do_consolidate: bool) -> list[GpuPlan]:
    """Saturated GPUs, then residuals best-fit, then (optionally) consolidation; ids 0..n-1."""
    plans: list[GpuPlan] = []
    residuals: list[tuple[SessionModel, float]] = []
    for sm in models:
        n, sat, residual = saturated_split(sm)
        for _ in range(n):
            plans.append(GpuPlan(len(plans), sm.lat(sat.batch), (saturated_alloc(sm, sat),)))
        if residual > 0:
            residuals.append((sm, residual))
    loads: list[GpuLoad] = []
    place_residuals(loads, residuals, rule, prefixes, capacity_mb, order)
    if do_consolidate:
        loads = consolidate(loads)
    for load in loads:
        plans.append(load.to_gpu_plan(len(plans)))
    return plans


def prepare_all(sessions: Sequence[SessionSpec], gpu: GpuSpec, config: PlannerConfig,
                prefix_groups: Iterable[PrefixGroup], *, check_memory: bool = True, prefix_aware: bool = True,
                batch_cap: int | None = None) -> tuple[list[SessionModel], dict[str, PrefixModel]]:
    """Planning views of ``sessions`` and the prefix tables; PlanningError naming a session that
    cannot be served or whose prefix group is unknown or costs more than its model."""
    models = [prepare(s, gpu, config, check_memory=check_memory, batch_cap=batch_cap, prefix_aware=prefix_aware)
              for s in sessions]
    prefixes = prefix_models(prefix_groups) if prefix_aware else {}
    grouped: dict[str, list[SessionModel]] = {}
    for m in models:
        if m.group is not None:
            grouped.setdefault(m.group, []).append(m)
    check_prefix_groups(grouped, prefixes)
    return models, prefixes


def squishy(sessions: Sequence[SessionSpec], gpu: GpuSpec, config: PlannerConfig = PlannerConfig(),
            prefix_groups: Iterable[PrefixGroup] = ()) -> list[GpuPlan]:
    """Memory- and prefix-aware squishy packing with consolidation: the better of our variant and
    the published one (both memory-checked)."""
    models, prefixes = prepare_all(sessions, gpu, config, prefix_groups)
    best: list[GpuPlan] | None = None
    for rule, order in ((ResidualRule.OURS, Order.DUTY), (ResidualRule.PUBLISHED, Order.OCCUPANCY)):
        plans = pack(models, prefixes, gpu.memory_mb, RULES[rule], order, do_consolidate=True)
        if best is None or len(plans) < len(best):
            best = plans
    assert best is not None
    return best
