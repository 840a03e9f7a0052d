"""Property test of the scheduler's planner (globalsched/planning/planner.py) over sequences of changes.

Random workloads (1-15 sessions, linear and sub-linear profiles, SLOs from just above 2*l(1) to
20 times it, rates over three orders of magnitude, prefix groups sometimes) go through steps that
change rates, lose or add backends (a forced MEMBERSHIP re-plan), add and remove sessions and change
minimum replicas, with burst headroom off and on and with a path allowance. After every step:

* :func:`plan_cluster` returns (it never raises: a scheduler whose planning fails keeps its old
  plan and never adapts);
* every device type's abstract plan keeps the validity rules, burst headroom included, for the
  rates it was planned for, and serves the current rates unless the re-planner kept it (a rate
  within its band, or the cooldown);
* no plan needed the fallback of ``plan_type`` (a plan breaking the rules replaced by a fresh one:
  a safety net, never a path a correct re-planner takes);
* a backend's batches fit its duty cycle (a spare backend's, ``spare_overbook`` times it) unless the
  plan is overcommitted or it serves a session best effort; a plan never uses fewer devices than its
  lower bound.

Examples are derandomized (a fixed set, the same in CI) and the steps short, so that it runs in
seconds; ``PLANNER_PROPERTY_EXAMPLES`` raises the count, and ``PLANNER_PROPERTY_SEED`` explores
other examples, when hunting for bugs by hand.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from globalsched.planning.plan import EPS_MS, GpuSpec, SessionSpec, ViolationKind, validate_plan
from common.profile import BatchLatency, Profile
from globalsched.planning.algorithms.config import PlannerConfig
from globalsched.planning.algorithms.replan import ReplanConfig, ReplanReason
from globalsched.planning.cluster_values import MIN_PLANNED_RATE_RPS, ClusterView, ModelView
from globalsched.planning.placement import BackendSlot
from globalsched.planning.planner import PlannerSettings, PlannerState, plan_cluster
from globalsched.planning.prefix_groups import planning_groups

DEVICE = "t4"
_SEED = os.environ.get("PLANNER_PROPERTY_SEED")
SETTINGS = settings(max_examples=int(os.environ.get("PLANNER_PROPERTY_EXAMPLES", "40")), deadline=None,
                    derandomize=_SEED is None, database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@dataclass(frozen=True)
class Model:
    name: str
    profile: Profile
    slo_ms: float
    rate_rps: float
    group: str        # "" or a prefix group
    active: bool      # served from the start (the others may be added by a step)


@dataclass(frozen=True)
class Step:
    dt_s: float       # time since the previous step (across cooldowns and epochs)
    op: str           # rates | lose | join | add | remove | replicas | idle
    index: int        # which model / backend the op is about (modulo their count)
    factors: tuple[float, ...]  # rates: each model's rate times its factor (1: unchanged)


@st.composite
def profiles(draw: st.DrawFn) -> Profile:
    """l(b) = beta + alpha*b^e: linear (e = 1) or sub-linear (GPU-like batching gains); memory
    growing with the batch."""
    n = draw(st.integers(1, 32))
    alpha, beta = draw(st.floats(0.05, 4.0)), draw(st.floats(0.2, 12.0))
    e = 1.0 if draw(st.booleans()) else draw(st.floats(0.4, 0.95))
    base_mb, per_item_mb = draw(st.floats(50, 2000)), draw(st.floats(0, 40))
    return Profile(tuple(BatchLatency(b, beta + alpha * b ** e, base_mb + per_item_mb * b) for b in range(1, n + 1)),
                   DEVICE)


@st.composite
def scenarios(draw: st.DrawFn):
    burst_sigma = draw(st.sampled_from([0.0, 1.5]))
    network_ms = draw(st.sampled_from([0.0, 5.0]))
    default_replicas = draw(st.sampled_from([1, 1, 2]))
    memory_mb = draw(st.sampled_from([16000.0, 16000.0, 4000.0]))
    use_groups = draw(st.booleans())
    models = []
    for i in range(draw(st.integers(1, 15))):
        p = draw(profiles())
        floor = 2 * p.latency_ms(1) + network_ms
        slo = floor * draw(st.sampled_from([0.9, 1.0, 1.05, 1.3, 2.0, 4.0, 8.0, 20.0]))   # 0.9: best effort
        rate = 10 ** draw(st.floats(-0.3, 3.3))            # 0.5 to 2,000 req/s
        group = draw(st.sampled_from(["", "", "g0", "g1"])) if use_groups else ""
        models.append(Model(f"m{i}", p, slo, rate, group, i == 0 or draw(st.integers(0, 4)) > 0))
    factor = st.one_of(st.just(1.0), st.floats(0.3, 3.0), st.sampled_from([0.1, 0.9, 1.05, 10.0]))
    steps = draw(st.lists(st.builds(
        Step, st.sampled_from([0.5, 2.0, 3.0, 6.0, 40.0]),
        st.sampled_from(["rates", "rates", "rates", "lose", "join", "add", "remove", "replicas", "idle"]),
        st.integers(0, 30), st.lists(factor, min_size=len(models), max_size=len(models)).map(tuple)),
        min_size=1, max_size=12))
    return burst_sigma, network_ms, default_replicas, memory_mb, draw(st.integers(1, 8)), models, steps


class Cluster:
    """The world the planner sees, changed step by step; the planner's state threads through."""

    def __init__(self, scenario) -> None:
        burst_sigma, network_ms, default_replicas, self.memory_mb, n_backends, models, self.steps = scenario
        self.planner = PlannerConfig(network_ms=network_ms, burst_sigma=burst_sigma)
        self.settings = PlannerSettings(ReplanConfig(cooldown_s=1.0, epoch_s=5.0, planner=self.planner),
                                        default_min_replicas=default_replicas)
        self.models = {m.name: m for m in models}
        self.active = [m.name for m in models if m.active]
        self.rates = {m.name: m.rate_rps for m in models}
        self.min_replicas: dict[str, int] = {}
        self.backends = [BackendSlot(f"b{i}", DEVICE, self.memory_mb) for i in range(n_backends)]
        self.joined = n_backends
        self.now_s = 0.0
        self.state = PlannerState()

    def apply(self, step: Step) -> ReplanReason | None:
        self.now_s += step.dt_s
        names = sorted(self.models)
        name = names[step.index % len(names)]
        if step.op == "rates":
            for n, f in zip(names, step.factors):
                self.rates[n] = max(0.2, self.rates[n] * f)
        elif step.op == "lose" and len(self.backends) > 1:
            self.backends.pop(step.index % len(self.backends))
            return ReplanReason.MEMBERSHIP
        elif step.op == "join":
            self.backends.append(BackendSlot(f"b{self.joined}", DEVICE, self.memory_mb))
            self.joined += 1
            return ReplanReason.MEMBERSHIP
        elif step.op == "add" and name not in self.active:        # model administration asks for a
            self.active.append(name)                                  # plan, as the scheduler's does
            return ReplanReason.SESSIONS_CHANGED
        elif step.op == "remove" and len(self.active) > 1 and name in self.active:
            self.active.remove(name)
            return ReplanReason.SESSIONS_CHANGED
        elif step.op == "replicas":
            self.min_replicas[name] = 1 + step.index % 2
            return ReplanReason.SESSIONS_CHANGED
        return None

    def view(self, force: ReplanReason | None) -> ClusterView:
        models = tuple(ModelView(n, self.models[n].slo_ms, {DEVICE: self.models[n].profile},
                                 self.models[n].group, min_replicas=self.min_replicas.get(n, 0))
                       for n in sorted(self.active))
        return ClusterView(self.now_s, tuple(self.backends), models,
                           rates_rps={n: self.rates[n] for n in self.active}, force=force)

    def plan(self, force: ReplanReason | None):
        plan, self.state = plan_cluster(self.view(force), self.state, self.settings)
        return plan

    def specs(self, rates: dict[str, float], cold: frozenset[str] = frozenset()) -> list[SessionSpec]:
        """The sessions of the device type as the planner builds them (best-effort ones left out, and
        ``cold`` ones, which the devices' memory does not hold: globalsched/planning/residency.py)."""
        out = []
        for n in sorted(self.active):
            if n in cold:
                continue
            m = self.models[n]
            if 2 * m.profile.latency_ms(1) > m.slo_ms - self.planner.margins_ms:
                continue
            out.append(SessionSpec(n, n, m.slo_ms, max(rates.get(n, 0.0), MIN_PLANNED_RATE_RPS), m.profile,
                                   m.group or None))
        return out


def check(cluster: Cluster, plan, where: str) -> None:
    for note in plan.notes:
        assert "validity rules" not in note, f"{where}: {note}"
    ts = cluster.state.types.get(DEVICE)
    if ts is None or ts.plan is None:
        return
    gpu = GpuSpec(DEVICE, min(b.memory_mb for b in cluster.backends))
    planned = dict(ts.replan.planned_rates)
    grouped, groups = planning_groups(cluster.specs(planned, plan.cold), {})
    overbook = cluster.settings.spare_overbook
    broken = validate_plan(ts.plan, grouped, gpu, cluster.planner.margins_ms, groups, cluster.planner.burst_sigma,
                           ts.spares, overbook)
    assert not broken, f"{where}: the plan breaks the rules for its planned rates: {[v.message for v in broken[:4]]}"
    assert ts.plan.num_gpus >= ts.plan.lower_bound
    kept = ts.replan.last_replan_s != cluster.now_s      # the re-planner kept its plan: band or cooldown
    current, _ = planning_groups(cluster.specs(cluster.rates, plan.cold), {})
    under = [v for v in validate_plan(ts.plan, current, gpu, cluster.planner.margins_ms, groups)
             if v.kind is ViolationKind.UNDER_SERVED]
    assert kept or not under, f"{where}: a new plan under-serves the current rates: {[v.message for v in under]}"
    placement = plan.placements[DEVICE]
    if placement.overcommitted or plan.best_effort:
        return
    for b in placement.backends:
        room_ms = b.duty_cycle_ms * (overbook if b.spare else 1.0)
        assert b.exec_ms <= room_ms + EPS_MS or not b.sessions, \
            f"{where}: backend {b.node_id} runs {b.exec_ms} ms of batches in a {b.duty_cycle_ms} ms duty cycle"


def run(scenario) -> None:
    cluster = Cluster(scenario)
    check(cluster, cluster.plan(None), "initial plan")
    for i, step in enumerate(cluster.steps):
        force = cluster.apply(step)
        check(cluster, cluster.plan(force), f"step {i} ({step})")


@SETTINGS
@given(scenarios())
def test_every_plan_of_a_changing_cluster_keeps_the_rules(scenario):
    run(scenario)
