"""The certified lower bound on GPUs (DESIGN.md, "Lower bound"), reported with every plan.

A session serving ``rate`` requests/s needs at least ``rate * min l(b)/b`` GPU-seconds per second
over the batches b a plan may use: 2*l(b) within its SLO budget (duty + exec <= budget and
exec <= duty force it) and m(b) within the GPU's memory. Sessions of a prefix group are bounded
together (see :func:`prefix.group_lower_bound_gpus`) because sharing the prefix is cheaper. The sum,
rounded up, is at most the GPU count of every valid plan.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

from common.batching import saturated_batch
from common.plan import EPS_MS, GpuSpec, PrefixGroup, SessionSpec

from .batching import SessionModel, prepare
from .config import PlannerConfig
from .prefix import check_prefix_groups, group_lower_bound_gpus, prefix_models


def session_lower_bound_gpus(spec: SessionSpec, sm: SessionModel, gpu: GpuSpec | None) -> float:
    best = math.inf
    p = spec.profile
    for b in range(1, saturated_batch(p.latency_ms, sm.budget_ms, p.max_batch, EPS_MS) + 1):
        lat = p.latency_ms(b)
        if gpu is not None and p.memory_mb(b) > gpu.memory_mb + EPS_MS:
            continue  # memory need not grow monotonically with the batch
        best = min(best, lat / b)
    return spec.rate_rps * best / 1000.0


def lower_bound_gpus(sessions: Sequence[SessionSpec], gpu: GpuSpec | None = None,
                     config: PlannerConfig = PlannerConfig(),
                     prefix_groups: Iterable[PrefixGroup] = ()) -> float:
    """The fractional bound; raises PlanningError naming a session no plan can serve."""
    prefixes = prefix_models(prefix_groups)
    total = 0.0
    grouped: dict[str, list[SessionModel]] = {}
    for spec in sessions:
        sm = prepare(spec, gpu, config)
        if spec.prefix_group is not None:
            grouped.setdefault(spec.prefix_group, []).append(sm)
        else:
            total += session_lower_bound_gpus(spec, sm, gpu)
    check_prefix_groups(grouped, prefixes)
    for gname, members in grouped.items():
        total += group_lower_bound_gpus(members, prefixes[gname], gpu.memory_mb if gpu else None)
    return total


def lower_bound(sessions: Sequence[SessionSpec], gpu: GpuSpec | None = None,
                config: PlannerConfig = PlannerConfig(), prefix_groups: Iterable[PrefixGroup] = ()) -> int:
    """ceil of :func:`lower_bound_gpus` (with a hair of float slack so 3.0000000001 stays 3)."""
    return max(0, math.ceil(lower_bound_gpus(sessions, gpu, config, prefix_groups) - 1e-9))
