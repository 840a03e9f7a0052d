"""The scheduler's planner, a pure function: ``plan, state = plan_cluster(view, state, settings)``.

It takes a frozen :class:`globalsched.planning.cluster_values.ClusterView` (backends, served models, queries,
measured rates and fan-outs, what forced this call) and its own :class:`PlannerState`, and returns a
frozen :class:`globalsched.planning.cluster_values.ClusterPlan` and the next state. When the plan still fits (no
change forced, rates within the re-planner's bands, epoch not over, or within the cooldown) the
previous plan is returned itself (``plan is state.plan``) and nothing needs applying.

What it does, in order:

1. sessions: every served model at its measured rate (before its traffic has been measured over a
   whole rate window, at least the rate it was uploaded expecting; without either, the default
   rate), and the stage sessions
   of every query, whose SLOs are the latency split's budgets (globalsched/planning/query_sessions.py); all
   rates times 1 + ``rate_headroom``. Which rate each session is planned for is judged in
   globalsched/planning/rate_judgement.py. A measured rate within Poisson noise of the rate the plan in
   force was made for is that planned rate (:func:`settled_rates`): noise neither re-plans nor
   resizes batches. A session whose latest report is a drop beyond noise against its window's mean
   is planned for that latest rate (:func:`dropped_rates`): the mean lags a step down; the drop is
   held as a ceiling until the mean comes down to it (:func:`held_drops`). Models whose
   load attempts are spent on every present device type are left out (routed UNAVAILABLE with the
   reason by the distribution);
2. whether to re-plan at all is :func:`globalsched.planning.replan_policy.should_replan`'s (a change forced, a
   demand surge at once, the cooldown, a query's fan-out drift); a surging session's rate stays the
   floor of its planned rate until the window's mean catches up (:func:`held_surges`) if
   ``surge_floors`` is on; off (the default), a surge is planned for while it is the latest report,
   and bursts are left to the spare replicas pooled on the device headroom. A surge that the
   session's routes serve, its spares counted at their overbooked share, is no surge
   (:func:`unabsorbed_surges`);
3. each session goes to the device type of the most backends it has a profile for; one with no
   profile for any present type is listed in ``need_profile``; one whose SLO less the path allowance
   is below 2*l(1) on every type is served best effort at batch 1;
4. each device type is re-planned by globalsched/planning/plan_device_type.py (minimal movement, replicas,
   GPUs mapped onto backends); ``devices_needed`` reports how many devices each type's plan uses,
   which the device scaler compares with the backends registered;
5. a re-plan that nothing forced (the epoch, a rate) and that gives every node the tables it has
   (:func:`same_tables`) returns the previous plan itself: no epoch, no push to every node.

Nothing here reads a clock, a socket or the database.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

from common.config import SchedulerConfig
from globalsched.planning.plan import GpuSpec, SessionSpec
from globalsched.planning.algorithms.config import PlannerConfig
from globalsched.planning.algorithms.replan import ReplanConfig, ReplanReason
from globalsched.planning.cluster_values import (MIN_PLANNED_RATE_RPS, UNBOUNDED_MEMORY_MB, ClusterPlan, ClusterView, PlannedSession,
                                 SessionInput)
from globalsched.planning.placement import BackendAssignment, BackendSlot, PlacedSession, Placement
from globalsched.planning.plan_device_type import TypeState, plan_type
from globalsched.planning.query_sessions import plan_query_sessions
from globalsched.planning.rate_judgement import (dropped_rates, held_drops, held_surges, planned_rates, real_surges,
                                                 settled_rates, unabsorbed_surges)
from globalsched.planning.replan_policy import should_replan
from globalsched.planning.residency import choose_resident
from globalsched.planning.scaling_policy import headroom_devices
from globalsched.state.rate_reports import PLAN_RATE_WINDOW_S


@dataclass(frozen=True)
class PlannerSettings:
    """The planner's knobs, from the scheduler's configuration (:meth:`from_config`)."""

    replan: ReplanConfig = field(default_factory=ReplanConfig)
    solver: str = "squishy"             # the first plan of a device type; repairs are the re-planner's
    latency_split: str = "dp"
    default_rate_rps: float = 1.0       # a session nobody reported a rate for yet
    rate_headroom: float = 0.0          # plan for measured rates times 1 + this
    default_min_replicas: int = 1
    spare_replicas: bool = True         # idle backends hold replicas of the busiest sessions (plan_device_type.py)
    surge_floors: bool = False          # a surge is held as its session's floor (held_surges); off: never held
    spare_overbook: float = SchedulerConfig.spare_overbook   # a spare GPU may take this times its duty cycle (plan.py)
    # Z of a device type whose backends cannot hold the plan in force and ``device_headroom`` more
    # (:func:`type_burst_sigma`); None: always ``planner.burst_sigma``
    short_burst_sigma: float | None = None
    device_headroom: float = 0.0

    @classmethod
    def from_config(cls, config: SchedulerConfig) -> PlannerSettings:
        # The path allowance is the planner's network margin: spent outside the device on every hop.
        # --burst-sigma unset on a cluster of fixed size: no room of the devices' own while its idle
        # devices hold the spares of the device headroom, FIXED_BURST_SIGMA where they are too few
        # (always, with no spares to hold).
        adaptive = config.burst_sigma is None and not config.device_bounds.elastic and config.spare_replicas
        planner = PlannerConfig(network_ms=config.path_allowance_ms,
                                burst_sigma=0.0 if adaptive else config.resolved_burst_sigma)
        return cls(ReplanConfig(epoch_s=config.epoch_s, planner=planner), config.solver, config.latency_split,
                   config.default_rate_rps, config.rate_headroom, max(1, config.min_replicas), config.spare_replicas,
                   config.surge_floors, spare_overbook=config.spare_overbook,
                   short_burst_sigma=config.resolved_burst_sigma if adaptive else None,
                   device_headroom=config.device_headroom)

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
    # when each model's first requests were measured (see session_inputs)
    first_requests_s: Mapping[str, float] = field(default_factory=dict)
    # session -> (surging rate, when it surged): held as the planned floor (see held_surges)
    surge_floors: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    # session -> (dropped rate, when it dropped): held as the planned ceiling (see held_drops)
    drop_ceilings: Mapping[str, tuple[float, float]] = field(default_factory=dict)


def plan_cluster(view: ClusterView, state: PlannerState, settings: PlannerSettings = PlannerSettings()
                 ) -> tuple[ClusterPlan, PlannerState]:
    """The plan for ``view`` and the next state (see the module docstring)."""
    started = {name: view.now_s for name, rate in view.rates_rps.items() if rate > 0
               and name not in state.first_requests_s}
    if started:
        state = replace(state, first_requests_s={**state.first_requests_s, **started})
    first = state.first_requests_s
    planned_rps = planned_rates(state.plan, settings.rate_headroom)
    surges = unabsorbed_surges(real_surges(view.surges_rps, view.surge_windows_s, planned_rps), state.plan,
                               settings.spare_overbook)
    floors = held_surges(state.surge_floors, surges, view.rates_rps, view.rate_windows_s, view.now_s,
                         view.latest_reports, view.rate_dispersions)
    if not settings.surge_floors:           # planned for while it is the latest report, never held
        floors = {name: held for name, held in floors.items() if name in surges}
    if floors != state.surge_floors:
        state = replace(state, surge_floors=floors)
    ceilings = held_drops(state.drop_ceilings, dropped_rates(view.latest_reports, view.rates_rps, frozenset(surges),
                                                             view.rate_dispersions),
                          view.rates_rps, view.rate_windows_s, view.now_s, view.latest_reports, frozenset(surges),
                          view.rate_dispersions)
    if ceilings != state.drop_ceilings:
        state = replace(state, drop_ceilings=ceilings)
    call = should_replan(view, state.plan, state.last_plan_s, state.backends, surges, settings.replan,
                         settings.rate_headroom)
    if call.hold:
        return state.plan, state            # the re-planner's cooldown: nothing unforced changes yet
    force, why = call.force, call.why
    sigmas = type_burst_sigmas(settings, state, view.backends)
    sessions, planned, queries = session_inputs(view, settings, planned_rps, first, surges,
                                                {name: rate for name, (rate, _) in floors.items()},
                                                {name: rate for name, (rate, _) in ceilings.items()}, sigmas)
    placed, types = place_sessions(sessions, view.backends, state, view.now_s, force, settings,
                                   {m.name: m.min_replicas for m in view.models}, view.rates_rps, view.last_requested_s,
                                   sigmas)
    changed = any(r is not ReplanReason.NONE for r in placed.reasons.values())
    if force is None and state.plan is not None and not changed:
        return state.plan, replace(state, types=types, backends=view.backends)
    query_plans, query_rates, gammas = queries
    plan = replace(placed, sessions=planned, query_plans=query_plans, planned_query_rates=query_rates,
                   planned_gammas=gammas, why=why)
    if force is None and state.plan is not None and same_tables(plan, state.plan):
        # An epoch or a rate re-planned to what runs already: nothing to tell the nodes.
        return state.plan, replace(state, types=types, last_plan_s=view.now_s, backends=view.backends)
    return plan, replace(state, plan=plan, types=types, last_plan_s=view.now_s, backends=view.backends)


def adopted_state(state: PlannerState, now_s: float) -> PlannerState:
    """The state of a plan in force taken over by another process (a standby that now leads): its
    times, read on the old leader's monotonic clock, become ``now_s``. Cool-downs start again, so
    nothing moves at once; a surge floor or a drop ceiling is held for a whole hold again; a model's first requests are
    measured anew, as they are, by the new leader."""
    types = {}
    for device_type, ts in state.types.items():
        replan = replace(ts.replan, last_replan_s=None if ts.replan.last_replan_s is None else now_s,
                         moved_at_s=tuple((s, now_s) for s, _ in ts.replan.moved_at_s))
        types[device_type] = replace(ts, replan=replan)
    return replace(state, types=types, last_plan_s=None if state.last_plan_s is None else now_s,
                   first_requests_s={m: now_s for m in state.first_requests_s},
                   surge_floors={s: (rate, now_s) for s, (rate, _) in state.surge_floors.items()},
                   drop_ceilings={s: (rate, now_s) for s, (rate, _) in state.drop_ceilings.items()})


def same_tables(new: ClusterPlan, old: ClusterPlan) -> bool:
    """Whether ``new`` gives every node the tables ``old`` gave (the same backends running the same
    sessions at the same batches, throughputs and duty cycles; the same sessions, query splits and
    unplaced models routed alike), so that applying it would change nothing. Only for re-plans nothing
    forced: a forced one may bring what the plan does not show (a new model file or profile)."""
    return ({t: p.backends for t, p in new.placements.items()} == {t: p.backends for t, p in old.placements.items()}
            and new.sessions == old.sessions and new.query_plans == old.query_plans
            and new.planned_query_rates == old.planned_query_rates and new.unplaced == old.unplaced
            and new.need_profile == old.need_profile and new.best_effort == old.best_effort)


def session_inputs(view: ClusterView, settings: PlannerSettings, planned_rps: Mapping[str, float] = {},
                   first_requests_s: Mapping[str, float] = {}, surges_rps: Mapping[str, float] | None = None,
                   floors_rps: Mapping[str, float] = {}, ceilings_rps: Mapping[str, float] | None = None,
                   burst_sigmas: Mapping[str, float] = {}
                   ) -> tuple[list[SessionInput], dict[str, PlannedSession], tuple[dict, dict, dict]]:
    """The sessions to place (model sessions and query stages, rates with headroom), every planned
    session by name, and the queries' (plans, planned rates, planned gammas). ``planned_rps``: the
    rates the plan in force was made for (:func:`planned_rates`), which measurements within noise
    of them keep (:func:`settled_rates`); ``surges_rps``: the surges beyond noise (:func:`real_surges`;
    default: the view's); ``floors_rps``: the surges held (:func:`held_surges`), below which no
    session's measured rate is planned; ``ceilings_rps``: the drops held (:func:`held_drops`; default:
    the view's latest drops, :func:`dropped_rates`), above which none is, but for a floor;
    ``burst_sigmas``: the Z of each device type's next plan (:func:`type_burst_sigmas`), which a
    query's split on that type prices (``settings.planner``'s where absent).

    A model uploaded with an expected rate is planned for it until its requests have been measured
    for a whole rate window (``first_requests_s``: when each model's first ones were), and for the
    larger of it and the measured rate meanwhile. Frontends report every model they route, at zero
    before any client sends: a plan made for those zeros would meet the first requests with the
    smallest batches, and one made for the first window's mean, half zeros, with half the capacity."""
    headroom = 1.0 + settings.rate_headroom
    surging = frozenset(view.surges_rps if surges_rps is None else surges_rps)
    measured = settled_rates(view.rates_rps, view.rate_windows_s, planned_rps, surging)
    if ceilings_rps is None:
        ceilings_rps = dropped_rates(view.latest_reports, view.rates_rps, surging, view.rate_dispersions)
    for name, rate in ceilings_rps.items():
        measured[name] = min(measured.get(name, rate), rate)
    rates = {k: max(v, floors_rps.get(k, 0.0)) * headroom for k, v in measured.items()}
    default_rate = settings.default_rate_rps * headroom
    present = view.device_types()
    out: list[SessionInput] = []
    for m in view.models:
        if present and set(present) <= m.unloadable_on:
            continue                         # routed with its reason, never placed again
        since = first_requests_s.get(m.name)
        if m.expected_rate_rps > 0 and (since is None or view.now_s - since < PLAN_RATE_WINDOW_S):
            rate = max(m.expected_rate_rps * headroom, rates.get(m.name, 0.0) if since is not None else 0.0)
        else:
            rate = rates.get(m.name, default_rate)
        out.append(SessionInput(m.name, m.slo_ms, rate, m.profiles, m.prefix_group, m.prefix_share))
    profiles = {name: m.profiles for name, m in view.stage_models.items()}
    stage_sessions, query_plans = plan_query_sessions(view.queries, rates, view.gammas, profiles, present,
                                                      settings.latency_split, default_rate, settings.planner,
                                                      burst_sigmas)
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
                   min_replicas: Mapping[str, int] = {}, demand: Mapping[str, float] = {},
                   last_requested_s: Mapping[str, float] = {}, burst_sigmas: Mapping[str, float] | None = None
                   ) -> tuple[ClusterPlan, dict[str, TypeState]]:
    """Place ``sessions`` on ``backends``, one device type at a time (steps 3 and 4 of the module
    docstring). ``min_replicas`` per session, 0 or absent for the default. Only the sessions the
    type's memory holds are placed, the most recently requested first (``last_requested_s``; then
    ``demand``, measured rates); the rest are cold (globalsched/planning/residency.py). The plan carries the placement only; :func:`plan_cluster`
    adds the sessions' and queries' views. ``burst_sigmas``: each type's Z (:func:`type_burst_sigmas`,
    computed here where not given)."""
    config = settings.planner
    margins_ms = config.margins_ms
    sigmas = type_burst_sigmas(settings, state, backends) if burst_sigmas is None else burst_sigmas
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
    cold: dict[str, str] = {}
    for device_type in list(chosen):
        before = {name for node_id in (b.node_id for b in by_type[device_type]) for name in previous.get(node_id, ())}
        chosen[device_type], cold_here, too_large = choose_resident(chosen[device_type], by_type[device_type],
                                                                    device_type, demand, before, last_requested_s)
        cold.update(cold_here)
        unplaced.update(cold_here)
        unplaced.update(too_large)
    replicas = {s.model: max(1, min_replicas.get(s.model, 0) or settings.default_min_replicas) for s in sessions}
    placements: dict[str, Placement] = {}
    types: dict[str, TypeState] = {}
    needed: dict[str, int] = {}
    bounds: dict[str, int] = {}
    fractional: dict[str, tuple[float, float]] = {}
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
        type_state = state.types.get(device_type, TypeState())
        sigma = sigmas[device_type]
        replan_config = settings.replan if sigma == config.burst_sigma else \
            replace(settings.replan, planner=replace(config, burst_sigma=sigma))
        result = plan_type(specs, gpu, slots, {s.model: s.prefix_share for s in group}, type_state, now_s=now_s,
                           min_replicas=replicas, force=force, previous=previous, config=replan_config,
                           solver=settings.solver, spares=settings.spare_replicas,
                           spare_overbook=settings.spare_overbook)
        types[device_type] = result.state
        if sigma != config.burst_sigma and len(slots) > type_state.devices_in_force:
            # Said where idle backends are there but too few (a cluster sized to its plan keeps the
            # room as it always did), in the same words while it holds: the control loop logs a note once.
            notes.append(f"{device_type}: too few backends for the plan's devices and "
                         f"{settings.device_headroom:.0%} more for spares: its plans keep burst room on every "
                         f"device (Z = {sigma:g})")
        needed[device_type], bounds[device_type] = result.devices, result.lower_bound
        if result.bound_gpus is not None:
            fractional[device_type] = result.bound_gpus
        throughput_bound += result.lower_bound_throughput_only
        reasons[device_type] = result.reason
        notes.extend(result.notes)
        if result.placement.overcommitted:
            notes.append(f"{device_type}: the plan needs {result.devices} devices, {len(slots)} registered; "
                         f"{result.placement.overcommitted} folded onto busy backends")
        placements[device_type] = result.placement
    for device_type, group in infeasible.items():
        placements[device_type] = _add_best_effort(placements[device_type], group, device_type)
    plan = ClusterPlan(placements, unplaced, need_profile, best_effort=best_effort, cold=frozenset(cold),
                       num_devices_planned=sum(needed.values()), lower_bound=sum(bounds.values()),
                       lower_bound_throughput_only=throughput_bound,
                       solver=settings.solver, notes=tuple(notes), devices_needed=needed, lower_bounds=bounds,
                       reasons=reasons, bound_gpus=fractional)
    return plan, types


def type_burst_sigmas(settings: PlannerSettings, state: PlannerState, backends: Sequence[BackendSlot]
                      ) -> dict[str, float]:
    """device type -> :func:`type_burst_sigma` of its next plan, for every type with ``backends``."""
    registered: dict[str, int] = {}
    for b in backends:
        registered[b.device_type] = registered.get(b.device_type, 0) + 1
    return {t: type_burst_sigma(settings, state.types.get(t, TypeState()), n) for t, n in registered.items()}


def type_burst_sigma(settings: PlannerSettings, st: TypeState, registered: int) -> float:
    """Z, the burst room each device of a type keeps for its own sessions in the next plan.

    ``settings.planner.burst_sigma``, unless ``settings.short_burst_sigma`` is set (``--burst-sigma``
    unset on a cluster of fixed size) and the ``registered`` backends cannot hold the plan in force,
    spares aside, with the device headroom an elastic cluster would ask for beside it (rounded as the
    scaling policy rounds it, and at least one device: a plan of one device on one backend has no
    spare): then that. Bursts go to the spares on the idle devices while they are
    enough, as on an elastic cluster; where they are too few, a burst has no spare to go to, and a
    traffic query's split on two idle devices dropped 3.75% of its queries without room of the
    devices' own (benchmarks/elastic.md). Judged on the plan in force, whose Z made it: a plan with
    room needs more devices than one without, so a load between the two thresholds keeps the Z it
    has, and no re-plan is forced by a change of Z (the next one takes it)."""
    if settings.short_burst_sigma is None or st.plan is None:
        return settings.planner.burst_sigma
    in_force = st.devices_in_force
    if in_force + max(1, headroom_devices(in_force, settings.device_headroom)) <= registered:
        return settings.planner.burst_sigma
    return settings.short_burst_sigma


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
