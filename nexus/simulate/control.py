"""The simulated scheduler and the local device actuator, as thin shells around the production
decision code on the virtual clock. Nothing here decides what the real system decides elsewhere:

* the workload reports: :class:`globalsched.state.rate_reports.Workload`, the view's measured fields
  (:func:`globalsched.state.read_view.measured`) and the trigger (:class:`globalsched.planning.replan_trigger.ReplanTrigger`),
  with the planning task's coalescing delays (globalsched/planning/control_loop.py);
* the plan: :func:`globalsched.planning.planner.plan_cluster`, and the routes it gives
  (:meth:`globalsched.planning.cluster_values.ClusterPlan.routes`);
* the devices wanted and the backend to drain: :class:`globalsched.actuators.device_scaler.DeviceScaler`
  (the policy of globalsched/planning/scaling_policy.py) on its tick;
* what the local actuator does about them: :func:`nexus.local_scaler.next_step` on its poll;
* failure detection: :func:`globalsched.state.failure_detector.detect` on the reaper's tick.

What is modelled here is time: a plan is applied as the distribution applies it (the handover of
globalsched/actuators/handover.py: model tables to the backends, each loading and warming its new models, the
sessions whose backends are ready sent live (globalsched/actuators/early_routes.py), then routing tables to the
frontends, then the tables that release what the plan moved away), hops of
``control_hop_ms``, ``planning_ms`` per plan, heartbeats at the production pacing for the cluster's
size (globalsched/state/heartbeat_pacing.py), and a
scheduler stalled by a fault answers nothing until the stall ends: its timers and the reports sent
meanwhile run when it resumes, and the heartbeats sent meanwhile are lost (the nodes' RPCs time out).
A stall longer than the scheduler's keepalive timeout (common/grpc_util.py) can end the nodes' Attach
streams as it resumes: its own pings look unanswered (a race with reading the answers, seen on real
processes). Here every stream ends then, the worst case. Each end is judged by the production rule
(:func:`globalsched.state.failure_detector.paused_recently`, as globalsched/state/membership.py's
``attach`` does), and each node registers again, as common/registration.py does when its stream breaks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from common.grpc_util import KEEPALIVE_OPTIONS
from common.pb import control as pb
from frontend.routing import Route
from globalsched.planning.cluster_values import ClusterPlan, ClusterView, ModelView
from globalsched.planning.control_loop import COALESCE_S, REPAIR_COALESCE_S, may_supersede, supersede_after_s
from globalsched.actuators.device_scaler import TICK_S, DeviceScaler
from globalsched.state.failure_detector import DetectorConfig, DetectorState, detect, paused_recently
from globalsched.actuators.early_routes import EARLY_ROUTES_INTERVAL_S, EarlyRoutes
from globalsched.actuators.handover import (Handover, Unreleased, handover, pushed, released, superseded,
                                           unreleased_tables)
from globalsched.state.membership import Node
from globalsched.planning.placement import BackendSlot
from globalsched.planning.planner import PlannerSettings, PlannerState, plan_cluster
from globalsched.planning.replan_trigger import ReplanTrigger
from globalsched.planning.residency import requested_while_cold
from globalsched.planning.scaling_policy import ScalingConfig
from globalsched.state.heartbeat_pacing import pacing
from globalsched.state.read_view import measured, measured_apart_from_rates
from globalsched.state.rate_reports import Workload
from nexus.local_scaler import POLL_S, Drain, LocalBackend, Start, drains, next_step
from nexus.simulate.frontends import SimRoute
from nexus.status_model import ScalingStatus

# the scheduler's server gives up on a keepalive ping after this long: a longer stall can find one overdue
KEEPALIVE_TIMEOUT_S = dict(KEEPALIVE_OPTIONS)["grpc.keepalive_timeout_ms"] / 1000.0
REGISTER_AGAIN_S = 0.2      # a node whose Attach stream broke registers again after this (common/registration.py)


class SimScheduler:
    def __init__(self, sim) -> None:
        self.sim = sim
        config = sim.config.scheduler
        self.settings = PlannerSettings.from_config(config)
        self.workload = Workload()
        self.trigger = ReplanTrigger()
        self.state = PlannerState()
        self.plan: ClusterPlan | None = None
        self.epoch = 0
        self.nodes: dict[str, Node] = {}
        self.seen: dict[str, float] = {}            # node -> when it registered (its heartbeats follow)
        self.made: ClusterPlan | None = None       # the last plan made (in force, or being applied)
        self.making_plan = False                    # a plan is being made (planning_ms)
        self.applying: _Apply | None = None         # the plan being applied
        self.armed = False                          # a planning turn is scheduled
        self.leaving: list[str] = []                # Leave calls waiting for the next plan
        self.left_nodes: set[str] = set()
        self.stalls: list[tuple[float, float]] = []
        self.detector = DetectorState()
        # The production pacing for the cluster at its largest (the period does not follow the count
        # as the cluster grows and shrinks here: a closed form of each node's heartbeats needs one).
        paced = pacing((sim.config.backends or sim.config.max_backends) + sim.config.frontends,
                       config.heartbeat_interval_ms / 1000, config.node_timeout_s, config.max_heartbeats_per_s)
        self.heartbeat_s = paced.period_s
        self.detector_config = DetectorConfig(timeout_s=paced.timeout_s, interval_s=config.heartbeat_interval_ms / 1000)
        self.scaler = DeviceScaler(ScalingConfig.from_config(config),
                                   self.backends, self.workload.window_rates, clock=lambda: sim.now)
        self.models = tuple(ModelView(m.name, m.slo_ms, {sim.config.device_type: m.profile},
                                      min_replicas=m.min_replicas, expected_rate_rps=m.expected_rate_rps)
                            for m in sim.models)
        self.profiles = {m.name: m.profile for m in sim.models}
        self.slos = {m.name: m.slo_ms for m in sim.models}
        self.hop_s = sim.config.control_hop_ms / 1000.0
        self.decisions: dict[str, tuple[int, int, str]] = {}
        self.sent_table: dict[str, SimRoute] = {}   # the routing table last sent to the frontends
        self.unreleased: Unreleased = {}            # backends with a release step to come (handover.py)
        # What the frontends were sent early beyond sent_table, since it went: as SimRoutes, and as the
        # plan's routes (for the early routes of a plan that supersedes a make step).
        self.live_table: dict[str, SimRoute] = {}
        self.live_routes: dict[str, tuple] = {}

    def start(self, now: float) -> None:
        """The scheduler's timers, each on its own phase (real processes start them at unrelated times;
        on one grid, a decision on one timer would always meet the next on another at the same lag)."""
        replan = self.settings.replan
        phase = self.sim.rng.random
        self.sim.at(now + min(replan.epoch_s, replan.cooldown_s) * (1 + phase()), self._epoch_timer)
        self.sim.at(now + TICK_S * (1 + phase()), self._scaler_tick)
        self.sim.at(now + self.detector_config.interval_s * (1 + phase()), self._reaper)

    def backends(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.kind == pb.NODE_KIND_BACKEND]

    # ---- the stall fault ---------------------------------------------------------------------------

    def stall(self, now: float, duration_s: float) -> None:
        self.stalls.append((now, now + duration_s))
        if duration_s > KEEPALIVE_TIMEOUT_S:
            self.sim.at(now + duration_s, self._streams_end_at_resume)

    def _streams_end_at_resume(self, now: float) -> None:
        """The stall's end: every node's Attach stream ends (the keepalive race, at its worst), and each
        node that still lives registers again."""
        for node_id, node in list(self.nodes.items()):
            self.stream_ended(now, node_id)
            backend = self.sim.backends.get(node_id)
            if backend is None or backend.life.value == "up":      # a draining node never registers again
                self.sim.at(now + REGISTER_AGAIN_S + self.hop_s, self.register, node_id, node.kind)

    def stream_ended(self, now: float, node_id: str) -> None:
        """A node's Attach stream ended: it is removed at once, unless the scheduler itself was just
        paused, which may have ended it (globalsched/state/membership.py): its heartbeats decide then."""
        if self._stalled(now, self.stream_ended, node_id):
            return
        if node_id not in self.nodes:
            return
        if paused_recently(self.detector, now, self.detector_config):
            self.sim.log(now, "membership", f"{node_id}: its Attach stream ended just after the scheduler was "
                                            "paused; its heartbeats decide")
            return
        self.remove(now, node_id, "its Attach stream ended")

    def _stalled(self, now: float, fn: Callable, *args) -> bool:
        """Whether the scheduler is stalled at ``now``; if so ``fn(*args)`` runs when it resumes."""
        for start, end in self.stalls:
            if start <= now < end:
                self.sim.at(end, fn, *args)
                return True
        return False

    # ---- membership --------------------------------------------------------------------------------

    def register(self, now: float, node_id: str, kind: int) -> None:
        if self._stalled(now, self.register, node_id, kind):
            return
        config = self.sim.config
        self.nodes[node_id] = Node(node_id, kind, node_id, f"emulated:{config.device_type}"
                                   if kind == pb.NODE_KIND_BACKEND else "", config.device_type, config.memory_mb,
                                   last_seen=now)
        self.seen[node_id] = now
        self.sim.log(now, "membership", f"{node_id} registered")
        self.trigger.request(f"{node_id} registered at {node_id}", joined=True)
        self._arm(now)

    def remove(self, now: float, node_id: str, why: str) -> None:
        if self._stalled(now, self.remove, node_id, why):
            return
        if self.nodes.pop(node_id, None) is None:
            return
        self.sim.log(now, "membership", f"{node_id} removed: {why}")
        self.workload.forget(node_id)
        self.trigger.request(f"{node_id} left", membership=True)
        self._arm(now)

    def leave(self, node_id: str, now: float) -> None:
        """A draining backend's Leave; it is answered once a plan without the node is applied."""
        self.sim.at(now + self.hop_s, self._leave, node_id)

    def _leave(self, now: float, node_id: str) -> None:
        if self._stalled(now, self._leave, node_id):
            return
        if self.nodes.pop(node_id, None) is None:
            self._answer_leave(now, node_id)
            return
        self.sim.log(now, "membership", f"{node_id} leaves; moving its sessions")
        self.workload.forget(node_id)
        self.leaving.append(node_id)
        self.trigger.request(f"{node_id} leaves", membership=True)
        self._arm(now)

    def left(self, node_id: str) -> bool:
        return node_id in self.left_nodes

    def _answer_leave(self, now: float, node_id: str) -> None:
        def answered(at: float) -> None:
            self.left_nodes.add(node_id)
            self.sim.backends[node_id].kick(at)
        self.sim.at(now + self.hop_s, answered)

    def last_seen(self, node_id: str, now: float) -> float:
        """The node's latest heartbeat that reached the scheduler by ``now``: one every heartbeat
        period from its registration while it lives, less those sent while the scheduler stalled."""
        start, interval = self.seen[node_id], self.heartbeat_s
        end = now
        died = self.sim.died_s(node_id)
        if died is not None:
            end = min(end, died)
        t = start + math.floor(max(end - start, 0.0) / interval) * interval
        for s0, s1 in sorted(self.stalls, reverse=True):
            if s0 <= t < s1:
                t = start + math.floor(max(s0 - start, 0.0) / interval - 1e-9) * interval
        return max(t, start)

    def _reaper(self, now: float) -> None:
        if self._stalled(now, self._reaper):
            return
        self.sim.at(now + self.detector_config.interval_s, self._reaper)
        seen = {n: self.last_seen(n, now) for n in self.nodes}
        verdict, self.detector = detect(seen, self.detector, now, self.detector_config)
        if verdict.note:
            self.sim.log(now, "failure-detector", verdict.note)
        for node_id, why in verdict.removed:
            self.remove(now, node_id, why)

    # ---- reports and timers --------------------------------------------------------------------------

    def report(self, now: float, report: pb.WorkloadReport) -> None:
        if self._stalled(now, self.report, report):
            return
        if report.node_id not in self.nodes:
            return
        self.workload.report(report, now)
        cold = requested_while_cold(self.plan.cold, report) if self.plan is not None else []
        if cold:               # as the scheduler's ReportWorkload: re-plan now, to page them in
            self.trigger.request(f"{', '.join(cold)} requested while cold", requests_wait=True)
        else:
            self.trigger.evaluate()
        self._arm(now)

    def _epoch_timer(self, now: float) -> None:
        if self._stalled(now, self._epoch_timer):
            return
        replan = self.settings.replan
        self.sim.at(now + min(replan.epoch_s, replan.cooldown_s), self._epoch_timer)
        self.trigger.evaluate()
        self._arm(now)

    def _scaler_tick(self, now: float) -> None:
        if self._stalled(now, self._scaler_tick):
            return
        self.sim.at(now + TICK_S, self._scaler_tick)
        self._scale(now)

    def _scale(self, now: float) -> None:
        self._decided(now, self.scaler.evaluate())

    def _decided(self, now: float, decisions: dict) -> None:
        for t, d in decisions.items():
            key = (d.desired, d.registered, d.drain)
            if self.decisions.get(t) != key:
                self.decisions[t] = key
                self.sim.log(now, "scaling", f"{t}: {d.desired} desired, {d.registered} registered: {d.reason}",
                             desired=d.desired, registered=d.registered)

    # ---- planning and distribution ---------------------------------------------------------------

    def _arm(self, now: float) -> None:
        if self.armed or self.making_plan or not self.trigger.pending:
            return
        applying = self.applying
        if applying is not None:
            if applying.making.done:
                return                  # its routing tables are out: the next plan follows it
            waited = now - applying.started_s + 1e-9        # at the time looked for, not a rounding before
            if not may_supersede(waited, self.trigger.nodes_changed):
                after_s = supersede_after_s(self.trigger.nodes_changed)
                if after_s > waited and not applying.recheck:
                    applying.recheck = True
                    self.sim.at(applying.started_s + after_s, self._recheck, applying)
                return
        self.armed = True
        self.sim.at(now + (REPAIR_COALESCE_S if self.trigger.urgent else COALESCE_S), self._plan)

    def _recheck(self, now: float, applying: _Apply) -> None:
        applying.recheck = False
        if applying is self.applying:
            self._arm(now)

    def _plan(self, now: float) -> None:
        if self._stalled(now, self._plan):
            return
        self.armed = False
        requests = self.trigger.take()
        leaving, self.leaving = self.leaving, []
        view = ClusterView(now_s=now, backends=tuple(BackendSlot(n.node_id, n.device_type, n.memory_mb)
                                                     for n in self.backends()),
                           models=self.models, force=requests.force, why=requests.why,
                           **self._measured(now))
        plan, self.state = plan_cluster(view, self.state, self.settings)
        if plan is self.made:
            if self.applying is not None:
                self.applying.leaving += leaving
                return
            self._applied(now, plan, leaving)
            return
        self.made = plan
        self.making_plan = True
        self.epoch += 1
        reasons = ", ".join(f"{t} {r.value}" for t, r in sorted(plan.reasons.items()) if r.value != "none")
        self.sim.log(now, "plan", f"epoch {self.epoch}: {reasons or 'no device type changed'}"
                     + (f" ({'; '.join(plan.why)})" if plan.why else ""),
                     devices=plan.num_devices_planned, lower_bound=plan.lower_bound)
        self.sim.at(now + self.sim.config.planning_ms / 1000.0, self._push_model_tables, plan, self.epoch, leaving)

    def _measured(self, now: float) -> dict:
        """The view's measured fields: from the workload reports, or the rates the simulation was told
        to plan for (nexus/simulate/known_rates.py); the fan-outs and last requests are measured still
        (the reports' rates are then not read at all)."""
        if self.sim.known_rates is None:
            return measured(self.workload, now)
        return {**self.sim.known_rates.view_fields(now), **measured_apart_from_rates(self.workload, now)}

    def _push_model_tables(self, now: float, plan: ClusterPlan, epoch: int, leaving: list[str]) -> None:
        """As globalsched/actuators/distribution.py applies a plan: the handover's make tables to the backends,
        sessions live on their new routes as soon as their backends are made (early routes), the
        routing tables once every backend answered, then the release tables. The device scaler is
        told first: the devices the plan needs beyond the plan in force are asked for now. A plan made
        while another's make step ran supersedes it (globalsched/planning/control_loop.py); one made
        while another's routing tables went follows it."""
        self.making_plan = False
        old = self.applying
        if old is not None:
            if old.making.done:
                old.then = lambda at: self._push_model_tables(at, plan, epoch, leaving)
                return
            old.making.done = True
            superseded(self.unreleased, old.steps, old.epoch)
            leaving = old.leaving + leaving
            self.sim.log(now, "plan", f"epoch {epoch} supersedes epoch {old.epoch}'s make step "
                         f"after {now - old.started_s:.2f} s")
        self._decided(now, self.scaler.made(plan))
        steps = handover(self.plan, plan, unreleased_tables(self.unreleased))
        early = EarlyRoutes(self.plan if self.sent_table else None, plan,
                            [n for n in steps.make if n in self.nodes and n in self.sim.backends], self.live_routes)
        applying = self.applying = _Apply(plan, epoch, leaving, steps, _MakeStep(next_s=now), now)
        making = applying.making

        def made(at: float, node_id: str) -> None:
            if making.done:
                return
            early.answered(node_id)
            if early.due() and not making.armed:
                making.armed = True
                self.sim.at(max(at, making.next_s), self._push_early_routes, plan, epoch, early, making)

        def all_made(at: float) -> None:
            if making.done:
                return
            making.done = True
            self._push_routing_tables(at, applying)

        self._push_tables(now, plan, epoch, steps.make, all_made, made)

    def _push_early_routes(self, now: float, plan: ClusterPlan, epoch: int, early: EarlyRoutes,
                           making: _MakeStep) -> None:
        making.armed = False
        if making.done:
            return
        due = early.due()
        early.sent(due)
        making.next_s = now + EARLY_ROUTES_INTERVAL_S
        live = early.live()
        self.live_routes.update(live)
        self.live_table.update(self._routes(plan, live))
        table = {**self.sent_table, **self.live_table}
        self.sim.log(now, "routes", f"epoch {epoch}: {len(due)} session(s) live before the make step ended",
                     sessions=len(due))
        for f in self.sim.frontends:
            self.sim.at(now + self.hop_s, f.set_table, epoch, table)

    def _push_tables(self, now: float, plan: ClusterPlan, epoch: int, tables: dict,
                     then: Callable[[float], None], each: Callable[[float, str], None] | None = None) -> None:
        """Model tables to the backends named; ``each(at, node_id)`` as each answers (or at once for one
        that is gone), ``then(at)`` once every one answered."""
        pending = [0]

        def answered(at: float, node_id: str) -> None:
            pending[0] -= 1
            if each is not None:
                each(at, node_id)
            if pending[0] == 0:
                then(at)

        for node_id, sessions in tables.items():
            backend = self.sim.backends.get(node_id)
            if node_id not in self.nodes or backend is None:
                continue
            entries = {s.model: (s.batch, plan.sessions[s.model].slo_ms if s.model in plan.sessions
                                 else self.slos[s.model], self.profiles[plan.model_of(s.model)])
                       for s in sessions}
            pending[0] += 1
            self.sim.at(now + self.hop_s, self._load, backend, entries,
                        lambda at, node_id=node_id: answered(at, node_id), epoch, plan.cold)
        if pending[0] == 0:
            then(now)

    def _load(self, now: float, backend, entries: dict, answered: Callable[[float], None], epoch: int,
              cold: frozenset[str]) -> None:
        backend.update_table(now, entries, lambda at: self.sim.at(at + self.hop_s, answered), epoch, cold)

    def _routes(self, plan: ClusterPlan, placed=None) -> dict[str, SimRoute]:
        """The frontends' routes of ``plan``'s sessions (of those in ``placed``, routed as it says,
        where given)."""
        table = {}
        for session, routes in (plan.routes() if placed is None else placed).items():
            planned = plan.sessions.get(session)
            table[session] = SimRoute(tuple(Route(node, node, share, batch, duty) for node, share, batch, duty
                                            in routes if node in self.nodes),
                                      planned.rate_rps if planned is not None else 0.0)
        return table

    def _push_routing_tables(self, now: float, applying: _Apply) -> None:
        plan, epoch, steps = applying.plan, applying.epoch, applying.steps
        table = self._routes(plan)
        for session in plan.sessions:
            table.setdefault(session, SimRoute((), plan.sessions[session].rate_rps))
        for session in plan.cold:
            table[session] = SimRoute((), 0.0, cold=True)
        self.sent_table = table
        self.live_table, self.live_routes = {}, {}
        for f in self.sim.frontends:
            self.sim.at(now + self.hop_s, f.set_table, epoch, table)
        self.sim.at(now + 2 * self.hop_s, self._applied, plan, applying.leaving, applying)
        pushed(self.unreleased, steps, epoch)
        if steps.release:             # in the background, as the distribution releases
            self.sim.at(now + self.hop_s + steps.release_after_s, self._push_tables, plan, epoch, steps.release,
                        lambda at: released(self.unreleased, steps.release, epoch))

    def _applied(self, now: float, plan: ClusterPlan, leaving: list[str], applying: _Apply | None = None) -> None:
        if plan is not self.plan:
            self.plan = plan
            self._decided(now, self.scaler.applied(plan))
        for node_id in leaving:
            self._answer_leave(now, node_id)
        if applying is not None and applying is self.applying:
            self.applying = None
            if applying.then is not None:
                applying.then(now)
                return
        self._arm(now)


@dataclass
class _MakeStep:
    """One plan's make step, while the simulated distribution pushes early routes."""

    next_s: float               # the earliest time for the next early table
    armed: bool = False         # an early table is scheduled
    done: bool = False          # every backend answered (the plan's routing tables went), or a newer plan superseded it


@dataclass
class _Apply:
    """A plan being applied: its make step, then its routing tables."""

    plan: ClusterPlan
    epoch: int
    leaving: list[str]          # Leave calls answered once it is applied
    steps: Handover
    making: _MakeStep
    started_s: float
    recheck: bool = False       # a look at whether a newer plan may supersede it is scheduled
    then: Callable[[float], None] | None = None     # the next plan's push, made while its routing tables went


class SimActuator:
    """``nexus serve --backends auto``'s local scaler (nexus/local_scaler.py) on the virtual clock: it
    polls the scaler's decision every POLL_S and starts or drains backends by :func:`next_step`."""

    def __init__(self, sim, bounds: tuple[int, int]) -> None:
        self.sim = sim
        self.bounds = bounds
        self.last_desired: int | None = None

    def start(self, now: float) -> None:
        self.sim.at(now + POLL_S * (1 + self.sim.rng.random()), self.poll)    # its own phase (SimScheduler.start)

    def poll(self, now: float) -> None:
        sim = self.sim
        sim.at(now + POLL_S, self.poll)
        scheduler = sim.scheduler
        if any(start <= now < end for start, end in scheduler.stalls):
            return                     # GetStatus times out
        device_type = sim.config.device_type
        d = scheduler.scaler.decisions.get(device_type)
        if d is None:
            return
        plan = scheduler.plan
        decision = ScalingStatus(device_type, d.desired, d.registered, d.needed,
                                 plan.devices_needed.get(device_type, 0) if plan else 0, d.reason, d.drains)
        registered = {n.node_id: n.node_id for n in scheduler.backends()}
        local = [LocalBackend(b.node_id, b.node_id if b.node_id in registered else "", b.life.value == "draining")
                 for b in sim.backends.values() if b.alive]
        action = next_step(decision, local, registered, self.bounds)
        if isinstance(action, Start):
            for _ in range(action.count):
                backend = sim.start_backend(now)
                sim.log(now, "actuator", f"adding {backend.node_id}: {action.reason}")
        elif isinstance(action, Drain):
            for drain in drains(decision, local, registered, self.bounds):
                sim.log(now, "actuator", f"removing {drain.node_id}: {drain.reason}; draining it")
                sim.backends[drain.node_id].drain(now)
