"""The scheduler's planner, a pure function: ``plan, state = plan_cluster(view, state, settings)``.

It takes a frozen :class:`globalsched.cluster.ClusterView` (backends, served models, queries,
measured rates and fan-outs, what forced this call) and its own :class:`PlannerState`, and returns a
frozen :class:`globalsched.cluster.ClusterPlan` and the next state. When the plan still fits (no
change forced, rates within the re-planner's bands, epoch not over, or within the cooldown) the
previous plan is returned itself (``plan is state.plan``) and nothing needs applying.

What it does, in order:

1. sessions: every served model at its measured rate (before its traffic has been measured over a
   whole rate window, at least the rate it was uploaded expecting; without either, the default
   rate), and the stage sessions
   of every query, whose SLOs are the latency split's budgets (globalsched/query_sessions.py); all
   rates times 1 + ``rate_headroom``. Models whose load attempts are spent on every present device
   type are left out (routed UNAVAILABLE with the reason by the distribution);
2. a query's measured fan-out that left the band of the one planned for forces a re-plan (after the
   re-planner's cooldown): the latency split depends on it; a session whose demand surged beyond
   the band of its planned rate forces one at once (cold start: capacity cannot wait for an epoch);
3. each session goes to the device type of the most backends it has a profile for; one with no
   profile for any present type is listed in ``need_profile``; one whose SLO less the path allowance
   is below 2*l(1) on every type is served best effort at batch 1;
4. each device type is re-planned by globalsched/planning_loop.py (minimal movement, replicas,
   GPUs mapped onto backends); ``devices_needed`` reports how many devices each type's plan uses,
   which the device scaler compares with the backends registered.

Nothing here reads a clock, a socket or the database.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

from common.config import SchedulerConfig
from common.plan import GpuSpec, SessionSpec
from globalsched.algorithms.config import PlannerConfig
from globalsched.algorithms.replan import ReplanConfig, ReplanReason
from globalsched.cluster import (MIN_PLANNED_RATE_RPS, UNBOUNDED_MEMORY_MB, ClusterPlan, ClusterView, PlannedSession,
                                 SessionInput)
from globalsched.placement import BackendAssignment, BackendSlot, PlacedSession, Placement
from globalsched.planning_loop import TypeState, plan_type
from globalsched.query_sessions import plan_query_sessions


@dataclass(frozen=True)
class PlannerSettings:
    """The planner's knobs, from the scheduler's configuration (:meth:`from_config`)."""

    replan: ReplanConfig = field(default_factory=ReplanConfig)
    solver: str = "squishy"             # the first plan of a device type; repairs are the re-planner's
    latency_split: str = "dp"
    default_rate_rps: float = 1.0       # a session nobody reported a rate for yet
    rate_headroom: float = 0.0          # plan for measured rates times 1 + this
    default_min_replicas: int = 1

    @classmethod
    def from_config(cls, config: SchedulerConfig) -> PlannerSettings:
        # The path allowance is the planner's network margin: spent outside the device on every hop.
        planner = PlannerConfig(network_ms=config.path_allowance_ms, burst_sigma=config.burst_sigma)
        return cls(ReplanConfig(epoch_s=config.epoch_s, planner=planner), config.solver, config.latency_split,
                   config.default_rate_rps, config.rate_headroom, max(1, config.min_replicas))

    @property
    def planner(self) -> PlannerConfig:
        return self.replan.planner


@dataclass(frozen=True)
class PlannerState:
    """What the planner remembers between calls: the plan in force and each device type's state."""

    plan: ClusterPlan | None = None
    types: Mapping[str, TypeState] = field(default_factory=dict)
    last_plan_s: float | None = None
    backends: tuple[BackendSlot, ...] = ()      # those the plan was made for


def plan_cluster(view: ClusterView, state: PlannerState, settings: PlannerSettings = PlannerSettings()
                 ) -> tuple[ClusterPlan, PlannerState]:
    """The plan for ``view`` and the next state (see the module docstring)."""
    force, why = view.force, view.why
    surge = demand_surge(view.surges_rps, state.plan, settings)
    if surge and force is None:
        force, why = ReplanReason.SESSIONS_CHANGED, (*why, surge)     # no cooldown: capacity is needed now
    if force is None and state.plan is not None and state.last_plan_s is not None and view.backends == state.backends \
            and view.now_s - state.last_plan_s < settings.replan.cooldown_s:
        return state.plan, state            # the re-planner's cooldown: nothing unforced changes yet
    drift = gamma_drift(view.gammas, state.plan.planned_gammas if state.plan else {})
    if drift and force is None and state.plan is not None and \
            (state.last_plan_s is None or view.now_s - state.last_plan_s >= settings.replan.cooldown_s):
        force, why = ReplanReason.SESSIONS_CHANGED, (*why, drift)
    sessions, planned, queries = session_inputs(view, settings)
    placed, types = place_sessions(sessions, view.backends, state, view.now_s, force, settings,
                                   {m.name: m.min_replicas for m in view.models})
    changed = any(r is not ReplanReason.NONE for r in placed.reasons.values())
    if force is None and state.plan is not None and not changed:
        return state.plan, replace(state, types=types, backends=view.backends)
    query_plans, query_rates, gammas = queries
    plan = replace(placed, sessions=planned, query_plans=query_plans, planned_query_rates=query_rates,
                   planned_gammas=gammas, why=why)
    return plan, PlannerState(plan, types, view.now_s, view.backends)


def demand_surge(surges_rps: Mapping[str, float], plan: ClusterPlan | None, settings: PlannerSettings) -> str:
    """Why demand outran the plan at once ("" when it did not): a session whose surging rate, with
    headroom, is beyond the re-planner's band of the rate it is planned for."""
    if plan is None:
        return ""
    headroom = 1.0 + settings.rate_headroom
    for session, rate in sorted(surges_rps.items()):
        planned = plan.sessions[session].rate_rps if session in plan.sessions else \
            plan.planned_query_rates.get(session)
        if planned is not None and rate * headroom > settings.replan.band_high * planned:
            return f"demand surge: {session} at {rate:.0f} rps, planned for {planned:.0f}"
    return ""


def gamma_drift(measured: Mapping[tuple[str, str, str], float], planned: Mapping[tuple[str, str, str], float],
                band: tuple[float, float] = (ReplanConfig.band_low, ReplanConfig.band_high)) -> str:
    """Why the latency split no longer fits ("" when it does): a measured fan-out outside ``band``
    of the one planned for, or an edge planned for none."""
    for key, gamma in measured.items():
        was = planned.get(key)
        if was is None or not (band[0] * was <= gamma <= band[1] * was):
            return f"gamma of {key[0]}: {key[1]}->{key[2]} is {gamma:.2f}, planned {was}"
    return ""


def session_inputs(view: ClusterView, settings: PlannerSettings
                   ) -> tuple[list[SessionInput], dict[str, PlannedSession], tuple[dict, dict, dict]]:
    """The sessions to place (model sessions and query stages, rates with headroom), every planned
    session by name, and the queries' (plans, planned rates, planned gammas)."""
    headroom = 1.0 + settings.rate_headroom
    rates = {k: v * headroom for k, v in view.rates_rps.items()}
    default_rate = settings.default_rate_rps * headroom
    present = view.device_types()
    out: list[SessionInput] = []
    for m in view.models:
        if present and set(present) <= m.unloadable_on:
            continue                         # routed with its reason, never placed again
        measured = rates.get(m.name)
        if m.expected_rate_rps > 0:          # the operator's word until the traffic has been measured
            rate = max(m.expected_rate_rps * headroom, measured or 0.0)
        else:
            rate = default_rate if measured is None else measured
        out.append(SessionInput(m.name, m.slo_ms, rate, m.profiles, m.prefix_group, m.prefix_share))
    profiles = {name: m.profiles for name, m in view.stage_models.items()}
    stage_sessions, query_plans = plan_query_sessions(view.queries, rates, view.gammas, profiles, present,
                                                      settings.latency_split, default_rate, settings.planner)
    stage_model = {q.graph.session_name(st.name): st.model for q in view.queries.values() for st in q.stages}
    planned = {s.model: PlannedSession(s.model, s.model, s.slo_ms, max(s.rate_rps, MIN_PLANNED_RATE_RPS))
               for s in out}
    for s in stage_sessions:
        model = stage_model[s.model]
        planned[s.model] = PlannedSession(s.model, model, s.slo_ms, max(s.rate_rps, MIN_PLANNED_RATE_RPS))
        unloadable = view.stage_models[model].unloadable_on if model in view.stage_models else frozenset()
        if not (present and set(present) <= unloadable):
            out.append(s)
    gammas = {(q, *k.split("->")): g for q, p in query_plans.items() for k, g in p.gammas.items()}
    query_rates = {name: max(rates.get(name, default_rate), MIN_PLANNED_RATE_RPS) for name in view.queries}
    return out, planned, (query_plans, query_rates, gammas)


def place_sessions(sessions: Sequence[SessionInput], backends: Sequence[BackendSlot], state: PlannerState,
                   now_s: float, force: ReplanReason | None = None, settings: PlannerSettings = PlannerSettings(),
                   min_replicas: Mapping[str, int] = {}) -> tuple[ClusterPlan, dict[str, TypeState]]:
    """Place ``sessions`` on ``backends``, one device type at a time (steps 3 and 4 of the module
    docstring). ``min_replicas`` per session, 0 or absent for the default. The plan carries the
    placement only; :func:`plan_cluster` adds the sessions' and queries' views."""
    config = settings.planner
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
    previous: dict[str, frozenset[str]] = {}
    if state.plan is not None:
        for placement in state.plan.placements.values():
            for b in placement.backends:
                previous[b.node_id] = frozenset(s.model for s in b.sessions)
    replicas = {s.model: max(1, min_replicas.get(s.model, 0) or settings.default_min_replicas) for s in sessions}
    placements: dict[str, Placement] = {}
    types: dict[str, TypeState] = {}
    needed: dict[str, int] = {}
    bounds: dict[str, int] = {}
    throughput_bound = 0
    reasons: dict[str, ReplanReason] = {}
    notes = []
    for device_type, group in chosen.items():
        slots = by_type[device_type]
        memory = min(b.memory_mb for b in slots)
        gpu = GpuSpec(name=device_type, memory_mb=memory if memory > 0 else UNBOUNDED_MEMORY_MB)
        specs = [SessionSpec(name=s.model, model=s.model, slo_ms=s.slo_ms,
                             rate_rps=max(s.rate_rps, MIN_PLANNED_RATE_RPS),
                             profile=s.profiles[device_type], prefix_group=s.prefix_group or None)
                 for s in group]
        result = plan_type(specs, gpu, slots, {s.model: s.prefix_share for s in group},
                           state.types.get(device_type, TypeState()), now_s=now_s, min_replicas=replicas,
                           force=force, previous=previous, config=settings.replan, solver=settings.solver)
        types[device_type] = result.state
        needed[device_type], bounds[device_type] = result.devices, result.lower_bound
        throughput_bound += result.lower_bound_throughput_only
        reasons[device_type] = result.reason
        notes.extend(result.notes)
        if result.placement.overcommitted:
            notes.append(f"{device_type}: the plan needs {result.devices} devices, {len(slots)} registered; "
                         f"{result.placement.overcommitted} folded onto busy backends")
        placements[device_type] = result.placement
    for device_type, group in infeasible.items():
        placements[device_type] = _add_best_effort(placements[device_type], group, device_type)
    plan = ClusterPlan(placements, unplaced, need_profile, best_effort=best_effort,
                       num_devices_planned=sum(needed.values()), lower_bound=sum(bounds.values()),
                       lower_bound_throughput_only=throughput_bound,
                       solver=settings.solver, notes=tuple(notes), devices_needed=needed, lower_bounds=bounds,
                       reasons=reasons)
    return plan, types


def _add_best_effort(placement: Placement, sessions: Sequence[SessionInput], device_type: str) -> Placement:
    """Sessions no plan can serve within their SLO, at batch 1 on the backends running the fewest
    sessions (beyond the plan's duty cycles: the device's execution says so)."""
    backends = list(placement.backends)
    for s in sessions:
        i = min(range(len(backends)), key=lambda k: len(backends[k].sessions))
        b = backends[i]
        backends[i] = BackendAssignment(b.node_id, b.duty_cycle_ms,
                                        b.sessions + (PlacedSession(s.model, 1, max(s.rate_rps, MIN_PLANNED_RATE_RPS)),),
                                        b.exec_ms + s.profiles[device_type].latency_ms(1))
    return Placement(tuple(backends), placement.overcommitted, placement.moved)
