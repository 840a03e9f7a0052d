"""The scheduler's view of the cluster and one planning step, as a pure function.

:func:`plan_cluster` takes everything the scheduler knows (sessions, profiles, rates, backends, the
previous placement) and returns a :class:`ClusterPlan`: per backend the sessions to load with their
batches, per model the backends that serve it, and for every session that cannot be placed, why.
The service (``globalsched/service.py``) turns that into RPCs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from common.profile import Profile
from globalsched.placement import BackendAssignment, BackendSlot, PlacedSession, Placement, assign_backends

if TYPE_CHECKING:
    from common.plan import GpuSpec, SessionSpec
    from globalsched.algorithms.config import PlannerConfig

MIN_PLANNED_RATE_RPS = 1.0
UNBOUNDED_MEMORY_MB = 1e12  # a backend that reports no memory limit


@dataclass(frozen=True)
class SessionInput:
    model: str
    slo_ms: float
    rate_rps: float
    profiles: Mapping[str, Profile]      # by device type
    prefix_group: str = ""
    prefix_share: float | None = None     # fraction of the model's weights in its group's prefix


@dataclass(frozen=True)
class ClusterPlan:
    placements: Mapping[str, Placement]               # by device type
    unplaced: Mapping[str, str]                       # model -> reason
    need_profile: Mapping[str, str]                   # model -> device type to profile it on
    best_effort: Mapping[str, str] = field(default_factory=dict)  # model -> why it cannot meet its SLO
    num_devices_planned: int = 0
    lower_bound: int = 0
    solver: str = ""
    notes: tuple[str, ...] = field(default=())

    def backends_of(self, model: str) -> list[tuple[str, float]]:
        """(node id, throughput share) of every backend serving ``model``."""
        out = []
        for placement in self.placements.values():
            for b in placement.backends:
                for s in b.sessions:
                    if s.model == model:
                        out.append((b.node_id, s.throughput_rps))
        return out


def plan_cluster(sessions: Sequence[SessionInput], backends: Sequence[BackendSlot],
                 previous: Mapping[str, frozenset[str]], solver: str = "squishy",
                 config: PlannerConfig | None = None, solve_type: "SolveType | None" = None) -> ClusterPlan:
    """Plan every session onto the registered backends, one device type at a time.

    A session is planned on the device type of the most backends it has a profile for. A session
    with no profile for any present device type is listed in ``need_profile`` (the service asks a
    backend of that type to profile it); one whose SLO, less ``config.margins_ms`` (the path
    allowance), is below 2*l(1) on every type is served best effort at batch 1.

    ``solve_type(device_type, specs, gpu, slots, prefix_shares) -> (placement, devices planned,
    lower bound)`` plans one device type; by default a fresh solve with ``solver`` whose devices are
    matched to the backends that ran the same sessions before (``previous``). The scheduler passes
    its re-planning loop instead (globalsched/planning_loop.py).
    """
    from common.plan import GpuSpec, SessionSpec
    from globalsched.algorithms.config import PlannerConfig

    config = config or PlannerConfig()
    margins_ms = config.margins_ms

    by_type: dict[str, list[BackendSlot]] = {}
    for b in backends:
        by_type.setdefault(b.device_type, []).append(b)
    types_by_size = sorted(by_type, key=lambda t: (-len(by_type[t]), t))
    unplaced: dict[str, str] = {}
    need_profile: dict[str, str] = {}
    best_effort: dict[str, str] = {}
    infeasible: dict[str, list[SessionInput]] = {}
    chosen: dict[str, list[SessionInput]] = {t: [] for t in by_type}
    for s in sessions:
        if not backends:
            unplaced[s.model] = "no backend is registered"
            continue
        usable = [t for t in types_by_size if t in s.profiles]
        if not usable:
            need_profile[s.model] = types_by_size[0]
            unplaced[s.model] = (f"no profile for device type {types_by_size[0]!r} "
                                 f"(profiles: {sorted(s.profiles) or 'none'})")
            continue
        feasible = [t for t in usable if 2 * s.profiles[t].latency_ms(1) <= s.slo_ms - margins_ms]
        if not feasible:
            t = usable[0]
            less = f" less the {margins_ms:g} ms path allowance" if margins_ms else ""
            best_effort[s.model] = (f"SLO {s.slo_ms:g} ms{less} is below 2*l(1) = "
                                    f"{2 * s.profiles[t].latency_ms(1):.1f} ms on {t}; served best effort at batch 1")
            infeasible.setdefault(t, []).append(s)
            continue
        chosen[feasible[0]].append(s)
    placements: dict[str, Placement] = {}
    planned = 0
    bound = 0
    notes = []
    solve_type = solve_type or _solve_type(solver, config, previous)
    for device_type, group in chosen.items():
        slots = by_type[device_type]
        memory = min(b.memory_mb for b in slots)
        gpu = GpuSpec(name=device_type, memory_mb=memory if memory > 0 else UNBOUNDED_MEMORY_MB)
        specs = [SessionSpec(name=s.model, model=s.model, slo_ms=s.slo_ms,
                             rate_rps=max(s.rate_rps, MIN_PLANNED_RATE_RPS),
                             profile=s.profiles[device_type], prefix_group=s.prefix_group or None)
                 for s in group]
        placement, n_devices, lb = solve_type(device_type, specs, gpu, slots, {s.model: s.prefix_share for s in group})
        planned += n_devices
        bound += lb
        if placement.overcommitted:
            notes.append(f"{device_type}: the plan needs {n_devices} devices, {len(slots)} registered; "
                         f"{placement.overcommitted} folded onto busy backends")
        placements[device_type] = placement
    for device_type, group in infeasible.items():
        placements[device_type] = _add_best_effort(placements[device_type], group)
    return ClusterPlan(placements, unplaced, need_profile, best_effort=best_effort, num_devices_planned=planned,
                       lower_bound=bound, solver=solver, notes=tuple(notes))


def _add_best_effort(placement: Placement, sessions: Sequence[SessionInput]) -> Placement:
    backends = list(placement.backends)
    for s in sessions:
        i = min(range(len(backends)), key=lambda k: len(backends[k].sessions))
        b = backends[i]
        backends[i] = BackendAssignment(b.node_id, b.duty_cycle_ms,
                                        b.sessions + (PlacedSession(s.model, 1, max(s.rate_rps, MIN_PLANNED_RATE_RPS)),))
    return Placement(tuple(backends), placement.overcommitted, placement.moved)


SolveType = Callable[[str, Sequence["SessionSpec"], "GpuSpec", Sequence[BackendSlot], Mapping[str, "float | None"]],
                     tuple[Placement, int, int]]


def _solve_type(solver: str, config: "PlannerConfig", previous: Mapping[str, frozenset[str]]) -> SolveType:
    """A fresh solve per device type (prefix groups where they pay), matched to the backends."""
    def solve_type(device_type, specs, gpu, slots, shares):
        from globalsched.prefix_groups import solve_with_prefix_groups   # a prefix group's members share its prefix

        if not specs:
            return assign_backends([], slots, previous), 0, 0
        plan = solve_with_prefix_groups(specs, gpu, solver, config, shares=shares)
        device_plans = [(g.duty_cycle_ms, tuple(PlacedSession(a.session, a.batch, a.throughput) for a in g.sessions))
                        for g in plan.gpus]
        return assign_backends(device_plans, slots, previous), len(plan.gpus), plan.lower_bound
    return solve_type
