"""Prefix groups for planning: the shared prefix's tables and its place in the lower bound.

Semantics (globalsched/planning/plan.py): on a GPU that shares group G's prefix, its members run the prefix once
on their combined batch B and then their suffixes, so the GPU spends
``l_p(B) + sum (l_i(b_i) - l_p(b_i))`` and holds ``m_p(B) + sum (m_i(b_i) - m_p(b_i))``. The prefix's
weights are therefore counted once per GPU and its fixed cost is paid once per cycle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping

from globalsched.planning.plan import EPS_MS, PlanningError, PrefixGroup

from .batch_sizing import SessionModel


@dataclass(frozen=True)
class PrefixModel:
    name: str
    latency_ms: tuple[float, ...]  # index B-1
    memory_mb: tuple[float, ...]

    @property
    def max_batch(self) -> int:
        return len(self.latency_ms)

    def lat(self, batch: int) -> float:
        return self.latency_ms[batch - 1] if batch > 0 else 0.0

    def mem(self, batch: int) -> float:
        return self.memory_mb[batch - 1] if batch > 0 else 0.0

    def suffix_lat(self, sm: SessionModel, batch: int) -> float:
        return max(0.0, sm.lat(batch) - self.lat(batch))

    def suffix_mem(self, sm: SessionModel, batch: int) -> float:
        return max(0.0, sm.mem(batch) - self.mem(batch))


def prefix_models(groups: Iterable[PrefixGroup]) -> dict[str, PrefixModel]:
    return {g.name: PrefixModel(g.name, tuple(r.latency_ms for r in g.profile.rows),
                                tuple(r.memory_mb for r in g.profile.rows)) for g in groups}


def group_lower_bound_gpus(members: list[SessionModel], prefix: PrefixModel, memory_mb: float | None) -> float:
    """Fractional GPUs any plan needs for a prefix group's members (sound with or without sharing).

    Each request costs at least the prefix's best per-item time (batches B with 2*l_p(B) within the
    loosest member budget, memory permitting) plus its own suffix's best per-item time (2*suffix(b)
    within its budget): a GPU's cycle must hold l_p(B) + the suffixes, and duty + exec <= budget
    forces exec <= budget/2. Running a member alone costs l_i(b) = l_p(b) + suffix(b), no less.
    """
    loosest = max(m.budget_ms for m in members)
    prefix_cost = math.inf
    for b in range(1, prefix.max_batch + 1):
        if 2 * prefix.lat(b) > loosest + EPS_MS:
            break
        if memory_mb is not None and prefix.mem(b) > memory_mb + EPS_MS:
            continue  # memory need not grow monotonically
        prefix_cost = min(prefix_cost, prefix.lat(b) / b)
    total = 0.0
    for m in members:
        suffix_cost = math.inf
        for b in range(1, len(m.latency_ms) + 1):  # suffixes need not grow monotonically
            s = prefix.suffix_lat(m, b)
            if 2 * s <= m.budget_ms + EPS_MS:
                suffix_cost = min(suffix_cost, s / b)
        total += m.rate_rps * (prefix_cost + suffix_cost) / 1000.0
    return total


def check_prefix_groups(members_of: Mapping[str, list[SessionModel]], prefixes: Mapping[str, PrefixModel]) -> None:
    """PlanningError unless every group is known and its prefix costs no more than each member."""
    for gname, members in members_of.items():
        if gname not in prefixes:
            raise PlanningError(f"session {members[0].name!r}: unknown prefix group {gname!r}")
        p = prefixes[gname]
        for m in members:
            if p.max_batch < len(m.latency_ms):
                raise PlanningError(f"session {m.name!r}: prefix group {gname!r} profile stops at batch "
                                    f"{p.max_batch}, below the model's {len(m.latency_ms)}")
            for b in range(1, len(m.latency_ms) + 1):
                if p.lat(b) > m.lat(b) + EPS_MS or p.mem(b) > m.mem(b) + EPS_MS:
                    raise PlanningError(f"session {m.name!r}: prefix group {gname!r} costs more than the "
                                        f"whole model at batch {b}")
