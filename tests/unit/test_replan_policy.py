"""When the cluster re-plans (globalsched/planning/replan_policy.py): forced changes and surges at once, the
cooldown otherwise, a fan-out drift after it."""

from globalsched.planning.algorithms.replan import ReplanConfig, ReplanReason
from globalsched.planning.cluster_values import ClusterPlan, ClusterView, PlannedSession
from globalsched.planning.placement import BackendSlot
from globalsched.planning.replan_policy import demand_surge, should_replan

BACKENDS = (BackendSlot("be-0", "t4", 16000.0),)
PLAN = ClusterPlan({}, {}, {}, sessions={"m": PlannedSession("m", "m", 100.0, 50.0)},
                   planned_gammas={("q", "a", "b"): 2.0})
CONFIG = ReplanConfig(cooldown_s=5.0)


def call(now_s, *, force=None, surges=None, gammas=None, backends=BACKENDS, last_plan_s=10.0):
    view = ClusterView(now_s, backends=backends, force=force, why=("why",) if force else (),
                       gammas=gammas if gammas is not None else {("q", "a", "b"): 2.0})
    return should_replan(view, PLAN, last_plan_s, BACKENDS, surges or {}, CONFIG)


def test_within_the_cooldown_the_plan_stands_unless_forced_or_surging():
    assert call(12.0).hold
    forced = call(12.0, force=ReplanReason.MEMBERSHIP)
    assert not forced.hold and forced.force is ReplanReason.MEMBERSHIP and forced.why == ("why",)
    surge = call(12.0, surges={"m": 200.0})
    assert surge.force is ReplanReason.DEMAND_SURGE and "demand surge: m at 200 rps, planned for 50" in surge.why


def test_past_the_cooldown_the_re_planner_judges_and_a_fan_out_drift_forces():
    assert call(16.0) == type(call(16.0))()                  # nothing forced: the bands and the epoch decide
    drift = call(16.0, gammas={("q", "a", "b"): 3.0})
    assert drift.force is ReplanReason.FAN_OUT_DRIFT and "gamma of q: a->b is 3.00, planned 2.0" in drift.why
    assert call(12.0, gammas={("q", "a", "b"): 3.0}).hold    # not within the cooldown


def test_changed_backends_end_the_hold():
    assert not call(12.0, backends=BACKENDS + (BackendSlot("be-1", "t4", 16000.0),)).hold


def test_a_surge_within_the_band_is_no_reason():
    assert demand_surge({"m": 54.0}, PLAN) == ""             # 1.08x the planned 50
    assert demand_surge({"m": 56.0}, PLAN) != ""             # beyond 1.1x
    assert demand_surge({"m": 56.0}, None) == ""             # no plan yet: the first plan is made anyway
