"""Re-planning one device type: every re-plan goes through the minimal-movement re-planner.

:func:`plan_type` is pure: it takes one device type's sessions, its backends and its
:class:`TypeState` (the current abstract plan, ``globalsched.planning.plan.Plan``, the re-planner's state and which
backend runs each planned GPU), and returns the next placement with the next state. It

1. drops the GPUs of backends that are gone (a lost node), and forces a re-plan when that happened,
   when backends joined, or when a session's SLO or minimum replicas changed; on a forced re-plan it
   also takes out the allocations of sessions whose profile moved by the drift threshold since they
   were planned (a measured profile replaced the table, a new table was uploaded): their batches and
   duty cycles were the old profile's, so they are placed again like a deficit, and a profile that
   got faster frees devices instead of only shrinking batches in place;
2. takes the extra replicas (below) out of the plan, then asks
   :func:`globalsched.planning.algorithms.replan.replan` for the next plan: it decides *whether* to re-plan
   (sessions changed, the epoch, a rate out of its band, after a cooldown) and repairs the plan
   in place, so a lost GPU's sessions are placed on the room left elsewhere or a new GPU, and nothing
   else moves;
3. adds replicas so that every session runs on at least its ``min_replicas`` GPUs when the backends
   allow (:func:`add_replicas`); a replica serves the same batch as the session's largest allocation,
   so each of them can carry the whole rate alone and losing one needs no re-plan; then fills the
   backends the plan leaves idle with spare replicas of the busiest sessions (:func:`add_spares`),
   which absorb bursts and steps at once and a lost backend without an outage, and which the device
   scaling policy neither counts as needed nor hesitates to drain;
4. keeps every GPU on the backend that ran it, gives new GPUs the free backends, and folds what
   does not fit onto the least-loaded backends (overcommitted, reported).

Time is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import AbstractSet, Callable, Mapping, Sequence

from common.measured_profile import EstimatorConfig
from globalsched.planning.plan import (GpuPlan, GpuSpec, Plan, PlanningError, PrefixGroup, SessionSpec,
                                       gpu_exec_breakdown, validate_plan)
from common.profile import Profile
from globalsched.planning.algorithms.config import PlannerConfig
from globalsched.planning.algorithms.replan import ReplanConfig, ReplanReason, ReplanState, match_ids, replan
from globalsched.planning.placement import BackendAssignment, BackendSlot, PlacedSession, Placement
from globalsched.planning.prefix_groups import planning_groups, solve_with_prefix_groups
from globalsched.planning.replicas import add_replicas, add_spares


# A session whose profile moved this much since it was planned is re-placed at the next re-plan (the
# measured-profile drift threshold: a smaller change keeps its allocations, which the re-planner resizes).
PROFILE_CHANGE = EstimatorConfig().drift_threshold


@dataclass(frozen=True)
class TypeState:
    """What re-planning one device type remembers between plans."""

    plan: Plan | None = None
    replan: ReplanState = field(default_factory=ReplanState)
    nodes: Mapping[int, str] = field(default_factory=dict)        # GPU id -> backend running it
    replicas: frozenset[tuple[int, str]] = frozenset()            # (GPU id, session) added by add_replicas
    signature: tuple = ()
    slots: frozenset[str] = frozenset()
    placement: Placement | None = None
    profiles: Mapping[str, Profile] = field(default_factory=dict)  # session -> the profile it was planned with
    spares: frozenset[int] = frozenset()                           # GPU ids holding only spare replicas

    @property
    def devices_in_force(self) -> int:
        """The devices the plan in force uses, its spare GPUs aside (0 before the first plan)."""
        return len(self.plan.gpus) - len(self.spares) if self.plan is not None else 0


@dataclass(frozen=True)
class TypeResult:
    placement: Placement
    devices: int                 # GPUs of the plan (before folding onto the backends there are)
    lower_bound: int
    lower_bound_throughput_only: int
    reason: ReplanReason         # NONE: the previous placement stands
    state: TypeState
    notes: tuple[str, ...] = ()
    bound_gpus: tuple[float, float] | None = None   # the plan's fractional bounds (Plan.bound_gpus)


def plan_type(specs: Sequence[SessionSpec], gpu: GpuSpec, slots: Sequence[BackendSlot],
              shares: Mapping[str, float | None], st: TypeState, *, now_s: float,
              min_replicas: Mapping[str, int], force: ReplanReason | None = None,
              previous: Mapping[str, frozenset[str]] = {}, config: ReplanConfig = ReplanConfig(),
              solver: str = "squishy", spares: bool = False, spare_overbook: float = 1.0) -> TypeResult:
    """The next placement of one device type's sessions (see the module docstring), and its state.

    ``min_replicas`` gives every session's replica count (at least 1); ``previous`` maps a backend to
    the sessions it ran (new GPUs go to the free backend that ran most of theirs); ``solver`` makes
    the first plan of the type, with prefix groups or without, whichever needs fewer devices
    (repairs are the re-planner's); ``spares``: fill idle backends with spare replicas, their
    executions up to ``spare_overbook`` times a spare GPU's duty cycle (globalsched/planning/plan.py,
    "Spare GPUs").
    """
    alive = frozenset(b.node_id for b in slots)
    grouped, groups = planning_groups(specs, shares)
    # An SLO that changes by itself is a query stage's budget, which follows the rates: judged by
    # the rate band like them (a model's SLO changes through LoadModel, which forces a re-plan).
    signature = tuple(sorted((s.name, min_replicas.get(s.name, 1), s.prefix_group or "") for s in specs))
    if signature != st.signature:
        force = force or ReplanReason.SESSIONS_CHANGED
    if alive != st.slots:
        force = ReplanReason.MEMBERSHIP
    current = st.plan
    if current is not None:
        kept = []
        for g in current.gpus:
            node = st.nodes.get(g.id)
            if node is not None and node not in alive:
                continue                         # a lost backend: its sessions become deficits
            kept.append(g)
        current = replace(current, gpus=tuple(kept))
        current = _strip_replicas(current, st.replicas)
        changed = profile_changes(st.profiles, specs)
        if changed and force is not None:    # re-placed from scratch: their batches and cycles were the old profile's
            current = _without_sessions(current, changed)
    if not specs:
        plan = Plan("replan", (), 0, 0.0)
        state, reason = st.replan, (ReplanReason.NONE if current is not None and not current.gpus
                                    and force is None else ReplanReason.SESSIONS_CHANGED)
    elif current is None:     # the better of the plans with and without prefix groups
        plan = solve_with_prefix_groups(specs, gpu, solver, config.planner, shares=shares)
        reason = ReplanReason.INITIAL
        state = ReplanState(now_s, tuple((s.name, s.rate_rps) for s in specs), (), reason, st.replan.replans + 1)
    else:
        try:
            plan, state = replan(current, grouped, gpu, now_s, st.replan, config, groups, force=force)
        except PlanningError:   # a prefix-grouped plan the re-planner cannot make: plan without groups
            plain = [SessionSpec(s.name, s.model, s.slo_ms, s.rate_rps, s.profile) for s in specs]
            plan, state = replan(current, plain, gpu, now_s, st.replan, config, force=force)
        reason = state.reason
        if reason is not ReplanReason.NONE and len(plan.gpus) > len(slots):
            plan = _unfolded(plan, current, specs, gpu, solver, config.planner, shares, len(slots))
    if reason is ReplanReason.NONE and st.placement is not None:
        return TypeResult(st.placement, _devices_needed(st.plan, specs, min_replicas, st.spares) if st.plan else 0,
                          st.plan.lower_bound if st.plan else 0,
                          (st.plan.lower_bound_throughput_only or 0) if st.plan else 0, reason, st,
                          bound_gpus=st.plan.bound_gpus if st.plan else None)
    wanted = {s.name: min_replicas.get(s.name, 1) for s in specs}
    plan, replicas = _with_replicas(plan, current, st, grouped, groups, gpu, wanted, len(slots), config.planner)
    free = len(slots) if spares else 0
    plan, replicas, spare_ids = _with_spares(plan, replicas, st, grouped, groups, gpu, free, config.planner,
                                             spare_overbook)
    notes: tuple[str, ...] = ()
    broken = validate_plan(plan, grouped, gpu, config.planner.margins_ms, groups, config.planner.burst_sigma,
                           spare_ids, spare_overbook)
    if broken:
        # A plan that breaks the validity rules is never distributed: a fresh one replaces it, and when
        # that one breaks them too, planning fails (the plan in force stays).
        fresh = solve_with_prefix_groups(specs, gpu, solver, config.planner, shares=shares)
        fresh = replace(fresh, gpus=tuple(match_ids(fresh.gpus, current)) if current is not None else fresh.gpus)
        fresh, replicas = _with_replicas(fresh, current, st, grouped, groups, gpu, wanted, len(slots),
                                          config.planner)
        fresh, replicas, spare_ids = _with_spares(fresh, replicas, st, grouped, groups, gpu, free, config.planner,
                                                  spare_overbook)
        still = validate_plan(fresh, grouped, gpu, config.planner.margins_ms, groups, config.planner.burst_sigma,
                              spare_ids, spare_overbook)
        if still:
            raise PlanningError(f"{gpu.name}: every plan made breaks the validity rules, none is distributed: "
                                f"{'; '.join(v.message for v in still[:3])}")
        notes = (f"{gpu.name}: the {reason.value} plan broke the validity rules ({broken[0].message}); "
                 f"a fresh plan replaced it",)
        plan = fresh
    by_name, by_group = {s.name: s for s in grouped}, {g.name: g for g in groups}
    placement, nodes = _assign(plan.gpus, slots, st.nodes, previous,
                               lambda g: gpu_exec_breakdown(g, by_name, by_group)[0], spare_ids)
    new = TypeState(plan, state, nodes, frozenset(replicas), signature, alive, placement,
                    {s.name: s.profile for s in specs}, spare_ids)
    return TypeResult(placement, _devices_needed(plan, specs, min_replicas, spare_ids), plan.lower_bound,
                      plan.lower_bound_throughput_only or 0, reason, new, notes, plan.bound_gpus)


def profile_changes(before: Mapping[str, Profile], specs: Sequence[SessionSpec],
                    threshold: float = PROFILE_CHANGE) -> frozenset[str]:
    """Sessions whose profile moved by at least ``threshold`` (relative, at some batch both profiles
    have) since they were planned."""
    out = set()
    for s in specs:
        old = before.get(s.name)
        if old is None or old is s.profile:
            continue
        n = min(old.max_batch, s.profile.max_batch)
        if old.max_batch != s.profile.max_batch or any(
                abs(s.profile.latency_ms(b) - old.latency_ms(b)) >= threshold * old.latency_ms(b)
                for b in range(1, n + 1)):
            out.add(s.name)
    return frozenset(out)


def _without_sessions(plan: Plan, names: frozenset[str]) -> Plan:
    gpus = []
    for g in plan.gpus:
        keep = tuple(a for a in g.sessions if a.session not in names)
        if keep:
            gpus.append(GpuPlan(g.id, g.duty_cycle_ms, keep, g.shared_prefixes))
    return replace(plan, gpus=tuple(gpus))


def _with_replicas(plan: Plan, current: Plan | None, st: TypeState, specs: Sequence[SessionSpec],
                   groups: Sequence[PrefixGroup], gpu: GpuSpec, wanted: Mapping[str, int], max_gpus: int,
                   planner: PlannerConfig) -> tuple[Plan, set[tuple[int, str]]]:
    plan = replace(plan, gpus=_fresh_ids(plan.gpus, current, st.plan))
    gpus, replicas = add_replicas(plan.gpus, specs, gpu, wanted, max_gpus, planner, st.plan, st.replicas, groups)
    return replace(plan, gpus=tuple(gpus)), replicas


def _unfolded(plan: Plan, current: Plan, specs: Sequence[SessionSpec], gpu: GpuSpec, solver: str,
              planner: PlannerConfig, shares: Mapping[str, float], backends: int) -> Plan:
    """A re-plan that needs more devices than the ``backends`` there are, so that some are folded onto
    busy ones (outside the plan's own model), replaced by a fresh plan that fits the backends: the
    re-planner's tolerated waste (``waste_gpus``) is a device the cluster does not have. The first
    start plans its models as their profiles arrive, the first ones alone, and kept the folded second
    device that the default configuration then warned about (issue 26); under constant load with
    ``--backends auto``, the waste kept asked for devices that were started and removed again.

    A fresh plan that still needs more devices than there are is no cure: it re-packs the cluster to
    save a device or two while it grows anyway (a step under ``--backends auto``), and the moves cost
    requests. Issue 24's traces at 100 devices in the simulator, by what replaces the re-plan:

    | rule | 5x step, auto: within SLO | constant load: scale reversals per 10 min |
    | --- | --- | --- |
    | any fresh plan needing fewer devices | 93.9% | 1 |
    | none | 96.8% | 4 |
    | a fresh plan that fits the backends (this) | 94.9% | 0 |
    """
    fresh = solve_with_prefix_groups(specs, gpu, solver, planner, shares=shares)
    if len(fresh.gpus) > backends or len(fresh.gpus) >= len(plan.gpus):
        return plan
    return replace(fresh, gpus=tuple(match_ids(fresh.gpus, current)))


def _devices_needed(plan: Plan, specs: Sequence[SessionSpec], min_replicas: Mapping[str, int],
                    spares: AbstractSet[int] = frozenset()) -> int:
    """The plan's GPUs but its spares (they only fill backends that are there), and at least the most
    replicas a session asks for (replicas are only added on backends that exist, so more backends
    are what lets them be placed)."""
    return max(len(plan.gpus) - len(spares), max((min_replicas.get(s.name, 1) for s in specs), default=0))


def _with_spares(plan: Plan, replicas: set[tuple[int, str]], st: TypeState, specs: Sequence[SessionSpec],
                 groups: Sequence[PrefixGroup], gpu: GpuSpec, slots: int, planner: PlannerConfig, overbook: float
                 ) -> tuple[Plan, set[tuple[int, str]], frozenset[int]]:
    """``plan`` with spare replicas on the ``slots`` backends it leaves idle (0: none)."""
    gpus, added, spares = add_spares(plan.gpus, specs, gpu, slots - len(plan.gpus), planner, st.plan, st.replicas,
                                     st.spares, groups, overbook)
    return replace(plan, gpus=tuple(gpus)), replicas | added, spares


def _fresh_ids(gpus: Sequence[GpuPlan], current: Plan | None, before: Plan | None) -> tuple[GpuPlan, ...]:
    """New GPUs renumbered past every id of ``before``: the re-planner numbers them after the GPUs it
    was given, which may reuse the id of a GPU taken out (a replica's, or a lost backend's) and so
    land on that GPU's backend."""
    if before is None:
        return tuple(gpus)
    given = {g.id for g in current.gpus} if current is not None else set()
    old = {g.id for g in before.gpus}
    fresh = max(old | {g.id for g in gpus} | {-1}) + 1
    out = []
    for g in gpus:
        if g.id in old and g.id not in given:
            g, fresh = GpuPlan(fresh, g.duty_cycle_ms, g.sessions, g.shared_prefixes), fresh + 1
        out.append(g)
    return tuple(out)


def _strip_replicas(plan: Plan, replicas: AbstractSet[tuple[int, str]]) -> Plan:
    """The plan without the replicas that :func:`add_replicas` added, except where a session has no
    other allocation left (its primary's backend was lost): that replica becomes its primary."""
    primaries: dict[str, int] = {}
    for g in plan.gpus:
        for a in g.sessions:
            if (g.id, a.session) not in replicas:
                primaries[a.session] = primaries.get(a.session, 0) + 1
    promoted: set[str] = set()
    gpus = []
    for g in plan.gpus:
        keep = []
        for a in g.sessions:
            if (g.id, a.session) in replicas and (primaries.get(a.session) or a.session in promoted):
                continue
            if (g.id, a.session) in replicas:
                promoted.add(a.session)
            keep.append(a)
        if keep:
            gpus.append(GpuPlan(g.id, g.duty_cycle_ms, tuple(keep), g.shared_prefixes))
    return replace(plan, gpus=tuple(gpus))


def _assign(gpus: Sequence[GpuPlan], slots: Sequence[BackendSlot], nodes_before: Mapping[int, str],
            previous: Mapping[str, frozenset[str]], exec_ms: Callable[[GpuPlan], float],
            spares: AbstractSet[int] = frozenset()) -> tuple[Placement, dict[int, str]]:
    """GPUs onto backends: each GPU stays on the backend that ran it; new GPUs (spare GPUs last) take
    the free backend that ran most of their sessions before (``previous``), else the first free one;
    the rest fold onto the least-loaded backends. ``exec_ms`` gives a GPU's execution per duty cycle;
    a backend that runs only ``spares`` is marked spare."""
    alive = [b.node_id for b in slots]
    nodes: dict[int, str] = {}
    used: set[str] = set()
    for g in gpus:
        n = nodes_before.get(g.id)
        if n in alive and n not in used:
            nodes[g.id] = n
            used.add(n)
    free = [n for n in alive if n not in used]
    folded: dict[str, list[GpuPlan]] = {n: [] for n in alive}
    overcommitted = 0
    # The plan's own GPUs first, the most sessions first; spare GPUs (several spares each) after them.
    for g in sorted((g for g in gpus if g.id not in nodes), key=lambda g: (g.id in spares, -len(g.sessions))):
        if free:
            names = g.session_names()
            best = max(free, key=lambda n: (len(names & previous.get(n, frozenset())), -free.index(n)))
            nodes[g.id] = best
            free.remove(best)
        else:
            target = min(alive, key=lambda n: (sum(len(x.sessions) for x in folded[n])
                                               + sum(len(x.sessions) for x in gpus if nodes.get(x.id) == n),
                                               alive.index(n)))
            folded[target].append(g)
            overcommitted += 1
    result = []
    for n in alive:
        mine = [g for g in gpus if nodes.get(g.id) == n] + folded[n]
        sessions: dict[str, PlacedSession] = {}
        for g in mine:
            for a in g.sessions:
                s = PlacedSession(a.session, a.batch, a.throughput, a.planned_load_rps)
                old = sessions.get(a.session)
                if old is not None:
                    s = PlacedSession(s.model, max(s.batch, old.batch), s.throughput_rps + old.throughput_rps,
                                      s.load_rps + old.load_rps)
                sessions[a.session] = s
        duty = max((g.duty_cycle_ms for g in mine), default=0.0)
        result.append(BackendAssignment(n, duty, tuple(sorted(sessions.values(), key=lambda s: s.model)),
                                        sum(exec_ms(g) for g in mine), bool(mine) and all(g.id in spares for g in mine)))
    return Placement(tuple(result), overcommitted, 0), nodes
