"""Baselines for the benchmark: what squishy is measured against.

* :func:`nexus_published` - squishy as published: saturated GPUs, Nexus's residual rule, best-fit
  merging, **no memory check and no prefix sharing** (so its plans may overcommit memory; on
  workloads where memory binds they are not valid - that is the bug this project fixes).
* :func:`batch_oblivious` - the same packing with every session at batch 1.
* :func:`one_per_gpu` - Clipper / TF-Serving style: each session on GPUs of its own at the largest
  SLO-feasible batch (memory permitting), ceil(rate / throughput) of them.
* :func:`per_session_headroom` - the burst headroom of earlier releases, for comparison with the
  pooled one: every session planned for n + z*sqrt(n) arrivals per duty cycle of its saturated
  batch on its own (plan the returned sessions with ``burst_sigma=0``).
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

from globalsched.planning.plan import GpuPlan, GpuSpec, PlanningError, PrefixGroup, SessionSpec

from .batch_sizing import prepare, residual_config, residual_config_published, saturated
from .config import PlannerConfig
from .squishy import Order, pack, prepare_all, saturated_alloc


def nexus_published(sessions: Sequence[SessionSpec], gpu: GpuSpec, config: PlannerConfig = PlannerConfig(),
                    prefix_groups: Iterable[PrefixGroup] = ()) -> list[GpuPlan]:
    models, _ = prepare_all(sessions, gpu, config, (), check_memory=False, prefix_aware=False)
    return pack(models, {}, math.inf, residual_config_published, Order.OCCUPANCY, do_consolidate=False)


def batch_oblivious(sessions: Sequence[SessionSpec], gpu: GpuSpec, config: PlannerConfig = PlannerConfig(),
                    prefix_groups: Iterable[PrefixGroup] = ()) -> list[GpuPlan]:
    models, _ = prepare_all(sessions, gpu, config, (), prefix_aware=False, batch_cap=1)
    return pack(models, {}, gpu.memory_mb, residual_config, Order.OCCUPANCY, do_consolidate=False)


def one_per_gpu(sessions: Sequence[SessionSpec], gpu: GpuSpec, config: PlannerConfig = PlannerConfig(),
                prefix_groups: Iterable[PrefixGroup] = ()) -> list[GpuPlan]:
    models, _ = prepare_all(sessions, gpu, config, (), prefix_aware=False)
    plans: list[GpuPlan] = []
    for sm in models:
        sat = saturated(sm)
        if sat.load_rps <= 0:
            raise PlanningError(f"session {sm.name!r}: its saturated batch leaves no room for burst headroom")
        for _ in range(max(1, math.ceil(sm.rate_rps / sat.load_rps - 1e-9))):
            plans.append(GpuPlan(len(plans), sm.lat(sat.batch), (saturated_alloc(sm, sat),)))
    return plans


def per_session_headroom(sessions: Sequence[SessionSpec], gpu: GpuSpec | None, config: PlannerConfig,
                         z: float) -> list[SessionSpec]:
    """``sessions`` with rates raised to (n + z*sqrt(n)) * 1000/d, n = rate * d / 1000 arrivals per
    duty cycle d = l(b) of the saturated batch b: the per-session headroom of earlier releases."""
    out = []
    for spec in sessions:
        sm = prepare(spec, gpu, config, with_headroom=False)
        duty_ms = sm.lat(saturated(sm).batch)
        n = spec.rate_rps * duty_ms / 1000.0
        out.append(spec.with_rate((n + z * math.sqrt(n)) * 1000.0 / duty_ms if z > 0 and n > 0 else spec.rate_rps))
    return out
