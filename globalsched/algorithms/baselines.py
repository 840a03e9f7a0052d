"""Baselines for the benchmark: what squishy is measured against.

* :func:`nexus_published` - squishy as published: saturated GPUs, Nexus's residual rule, best-fit
  merging, **no memory check and no prefix sharing** (so its plans may overcommit memory; on
  workloads where memory binds they are not valid - that is the bug this project fixes).
* :func:`batch_oblivious` - the same packing with every session at batch 1.
* :func:`one_per_gpu` - Clipper / TF-Serving style: each session on GPUs of its own at the largest
  SLO-feasible batch (memory permitting), ceil(rate / throughput) of them.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

from common.plan import GpuPlan, GpuSpec, PrefixGroup, SessionAlloc, SessionSpec

from .batching import residual_config, residual_config_published, saturated
from .config import PlannerConfig
from .squishy import Order, pack, prepare_all


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
        batch, thr = saturated(sm)
        for _ in range(max(1, math.ceil(sm.rate_rps / thr - 1e-9))):
            plans.append(GpuPlan(len(plans), sm.lat(batch), (SessionAlloc(sm.name, batch, thr),)))
    return plans
