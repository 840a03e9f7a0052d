"""The scheduler's planning task: when to re-plan, what to plan for, and pushing the result.

Every change that can alter the plan (a node joins or leaves, a model is uploaded, loaded or
unloaded, a profile arrives, a query's measured fan-out drifts out of its band) calls
:meth:`Planner.request_replan`, which forces a re-plan; workload reports and a timer call
:meth:`Planner.request_evaluation`, which lets the re-planner judge the rates (its epoch, band and
cooldown decide). One task plans, through :class:`globalsched.planning_loop.PlanningLoop` (the
minimal-movement re-planner, with minimum replicas), and hands the plan to
:class:`globalsched.distribution.Distribution`. A lost node is repaired at once.

What the planner derives along with the sessions (which model each session runs, its SLO and
rate, the latency split of each query) is kept here and read by the distribution and the status.

Planning runs on the event loop and reads the model database there: each read is one short SQLite
statement, never behind an upload (see globalsched/modeldb.py); writes run in threads.
"""

from __future__ import annotations

import asyncio
import logging
import time

from common.config import SchedulerConfig
from globalsched.algorithms.config import PlannerConfig
from globalsched.algorithms.replan import ReplanConfig, ReplanReason
from globalsched.cluster import MIN_PLANNED_RATE_RPS, ClusterPlan, SessionInput, plan_cluster
from globalsched.distribution import Distribution
from globalsched.membership import Membership
from globalsched.model_admin import ModelAdmin
from globalsched.placement import BackendSlot
from globalsched.planning_loop import PlanningLoop
from globalsched.query_sessions import plan_query_sessions
from globalsched.workload import Workload

log = logging.getLogger("nexus.scheduler")

# Nexus's epoch rules, from the re-planning policy's defaults: re-plan early when a rate leaves this
# band of the rate planned for, but not sooner than the cooldown after the last plan.
RATE_BAND = (ReplanConfig.band_low, ReplanConfig.band_high)
EARLY_REPLAN_COOLDOWN_S = ReplanConfig.cooldown_s
# What inputs() derives along with the sessions: kept as they were when the re-planner keeps the plan.
_PLAN_VIEW = ("planned_gammas", "session_models", "stage_sessions", "planned_query_rates", "session_slos",
              "query_plans")
COALESCE_S = 0.05               # bursts of changes become one plan
REPAIR_COALESCE_S = 0.005       # a lost node is repaired without delay


class Planner:
    def __init__(self, config: SchedulerConfig, membership: Membership, workload: Workload, admin: ModelAdmin,
                 distribution: Distribution) -> None:
        self.config = config
        self.membership = membership
        self.workload = workload
        self.admin = admin
        self.distribution = distribution
        # The path allowance is the planner's network margin: spent outside the device on every hop.
        self.planner_config = PlannerConfig(network_ms=config.path_allowance_ms, burst_sigma=config.burst_sigma)
        self.planning = PlanningLoop(ReplanConfig(epoch_s=config.epoch_s, planner=self.planner_config),
                                     config.min_replicas, config.solver)
        self.plan: ClusterPlan | None = None
        # Nodes ignore tables older than the last they applied; a restarted scheduler's epochs must be
        # newer than its previous life's, so they start from the wall clock in milliseconds.
        self.epoch = int(time.time() * 1000)
        self.last_plan_time = 0.0
        self.planned_query_rates: dict[str, float] = {}    # query -> rate with headroom
        self.stage_sessions: set[str] = set()              # "<query>/<stage>" sessions of the plan
        self.session_models: dict[str, str] = {}           # session -> model it runs
        self.session_slos: dict[str, float] = {}
        self.session_rates: dict[str, float] = {}          # session -> rate the current plan serves
        self.query_plans: dict = {}
        self.planned_gammas: dict[tuple[str, str, str], float] = {}
        self._replan = asyncio.Event()
        self._plan_lock = asyncio.Lock()
        self._force: ReplanReason | None = None

    # ---- triggers ----------------------------------------------------------------------------------

    def request_replan(self, why: str, membership: bool = False) -> None:
        """Re-plan now (forced: something the plan depends on changed)."""
        log.info("re-plan requested: %s", why)
        self._force = ReplanReason.MEMBERSHIP if membership or self._force is ReplanReason.MEMBERSHIP \
            else ReplanReason.SESSIONS_CHANGED
        self._replan.set()

    def request_evaluation(self) -> None:
        """Let the re-planner decide whether the plan still fits (rate band, epoch; after its cooldown)."""
        self._replan.set()

    def check_rate_band(self, now: float) -> None:
        """On a workload report: after the re-planner's cooldown, let it decide whether the plan still
        fits the rates (globalsched/planning_loop.py); a query's drifted fan-out re-plans at once."""
        if now - self.last_plan_time < EARLY_REPLAN_COOLDOWN_S:
            return
        why = self.plan_outdated(now)
        if why:
            self.request_replan(why)
        else:
            self.request_evaluation()

    def plan_outdated(self, now: float) -> str:
        """Why the current latency split no longer fits ("" when it still does): a measured gamma
        outside RATE_BAND of the one planned for. (Rates are the re-planner's to judge.)"""
        for key, gamma in self.workload.current_gammas(now).items():
            planned = self.planned_gammas.get(key)
            if planned is None or not (RATE_BAND[0] * planned <= gamma <= RATE_BAND[1] * planned):
                return f"gamma of {key[0]}: {key[1]}->{key[2]} is {gamma:.2f}, planned {planned}"
        return ""

    async def epoch_timer(self) -> None:
        """Now and then, let the re-planner judge the plan (its epoch, rate band and cooldown decide;
        a plan that still fits stands: re-planning on noise would move sessions and cost their queues)."""
        while True:
            await asyncio.sleep(min(self.config.epoch_s, EARLY_REPLAN_COOLDOWN_S))
            why = self.plan_outdated(time.monotonic())
            if why:
                self.request_replan(f"epoch: {why}")
            else:
                self.request_evaluation()

    async def run(self) -> None:
        """The planning task: one plan per burst of triggers."""
        self._replan.set()
        while True:
            await self._replan.wait()
            await asyncio.sleep(REPAIR_COALESCE_S if self._force is ReplanReason.MEMBERSHIP else COALESCE_S)
            self._replan.clear()
            try:
                await self.replan_once()
            except Exception:  # keep the scheduler alive; the next trigger tries again
                log.exception("re-planning failed")

    # ---- planning ----------------------------------------------------------------------------------

    def sessions_on(self, node_id: str) -> int:
        """Sessions the current plan runs on a backend."""
        if self.plan is None:
            return 0
        return sum(len(b.sessions) for p in self.plan.placements.values() for b in p.backends if b.node_id == node_id)

    async def repair_now(self) -> ClusterPlan:
        """Re-plan at once after a node left, whatever the re-planner's cooldowns say (Leave)."""
        self._force = ReplanReason.MEMBERSHIP
        return await self.replan_once()

    def inputs(self, now: float, device_types: list[str]) -> list[SessionInput]:
        """Model sessions from the database plus the stage sessions of every query, at planned rates:
        measured (or default) rates times 1 + ``rate_headroom``."""
        db, admin = self.admin.db, self.admin
        headroom = 1.0 + self.config.rate_headroom
        rates = {k: v * headroom for k, v in self.workload.planning_rates(now).items()}
        default_rate = self.config.default_rate_rps * headroom
        out = []
        models = {}
        for s in db.sessions():
            record = db.model(s.model)
            if admin.cannot_load(s.model, device_types):
                continue                         # routed with its reason, never placed again
            out.append(SessionInput(s.model, s.slo_ms, rates.get(s.model, default_rate),
                                    admin.profiles(s.model), record.prefix_group if record else "",
                                    db.prefix_share(s.model) if record and record.prefix_group else None))
            models[s.model] = s.model
        queries = admin.queries()
        profiles = {s.model: admin.profiles(s.model) for q in queries.values() for s in q.stages}
        gammas = self.workload.current_gammas(now)
        stage_sessions, self.query_plans = plan_query_sessions(
            queries, rates, gammas, profiles, device_types, self.config.latency_split, default_rate,
            self.planner_config)
        for q in queries.values():
            for st in q.stages:
                models[q.graph.session_name(st.name)] = st.model
        self.planned_gammas = {(q, *k.split("->")): g for q, plan in self.query_plans.items()
                               for k, g in plan.gammas.items()}
        self.session_models = models
        self.stage_sessions = {q.graph.session_name(st.name) for q in queries.values() for st in q.stages}
        self.planned_query_rates = {name: max(rates.get(name, default_rate), MIN_PLANNED_RATE_RPS) for name in queries}
        out += [s for s in stage_sessions if not admin.cannot_load(models[s.model], device_types)]
        self.session_slos = {s.model: s.slo_ms for s in out}
        self.session_rates = {s.model: max(s.rate_rps, MIN_PLANNED_RATE_RPS) for s in out}
        return out

    async def replan_once(self) -> ClusterPlan:
        async with self._plan_lock:     # the planner task and Leave never plan at the same time
            return await self._replan_locked()

    async def _replan_locked(self) -> ClusterPlan:
        now = time.monotonic()
        backends = [BackendSlot(n.node_id, n.device_type, n.memory_mb) for n in self.membership.backends()]
        counts: dict[str, int] = {}
        for b in backends:
            counts[b.device_type] = counts.get(b.device_type, 0) + 1
        saved = {name: getattr(self, name) for name in _PLAN_VIEW}
        sessions = self.inputs(now, sorted(counts, key=lambda t: (-counts[t], t)))
        previous: dict[str, frozenset[str]] = {}
        if self.plan is not None:
            for placement in self.plan.placements.values():
                for b in placement.backends:
                    previous[b.node_id] = frozenset(s.model for s in b.sessions)
        force, self._force = self._force, None
        self.planning.begin(now, self.admin.min_replicas(), force, previous)
        plan = plan_cluster(sessions, backends, previous, self.config.solver, self.planner_config,
                            solve_type=self.planning.solve_type)
        if force is None and self.plan is not None and not self.planning.changed:
            for name, value in saved.items():   # the re-planner kept the plan: so are its split and rates
                setattr(self, name, value)
            return self.plan
        self.session_rates = {s.model: max(s.rate_rps, MIN_PLANNED_RATE_RPS) for s in sessions}
        self.epoch += 1
        self.last_plan_time = now
        for placement in plan.placements.values():
            for b in placement.backends:
                log.info("epoch %d: %s duty cycle %.1f ms: %s", self.epoch, b.node_id, b.duty_cycle_ms,
                         ", ".join(f"{s.model} b={s.batch} {s.throughput_rps:.1f} rps" for s in b.sessions) or "idle")
        for note in plan.notes:
            log.warning(note)
        for model, why in plan.best_effort.items():
            log.warning("%s: %s", model, why)
        for model, device_type in plan.need_profile.items():
            self.admin.start_profiling(model, device_type)
        failed = await self.distribution.push_model_tables(plan, self)
        self.plan = plan
        await self.distribution.push_routing_tables(plan, failed, self)
        return plan
