"""When the cluster re-plans: one pure step, ``call = should_replan(view, ...)``.

The scheduler's planning task (globalsched/planning/control_loop.py) asks the planner whenever something
may have changed: a node joined or left, a model or profile changed (the view's ``force``), a
workload report arrived (a frontend reports every period, and at once when a session's demand
surges: frontend/early_report.py), or the epoch timer ticked. This step says what such a call
means, in order:

1. **forced** (``view.force``): something the plan depends on changed: re-plan now;
2. **a demand surge** (a session's surging rate, with headroom, beyond the re-planner's band of the
   rate it is planned for): re-plan now, without the cooldown: capacity is needed at once;
3. **the cooldown** (``cooldown_s`` since the last plan, the backends unchanged): the plan stands;
4. **a fan-out drift** (a query's measured gamma outside the band of the one planned for), past the
   cooldown: re-plan, since the latency split depends on it;
5. otherwise the re-planner judges each device type by its epoch and its rate band
   (:func:`globalsched.planning.algorithms.replan.replan_reason`).

``nexus simulate`` reaches this through the planner, as the scheduler does. Time is the view's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from globalsched.planning.algorithms.replan import ReplanConfig, ReplanReason
from globalsched.planning.cluster_values import ClusterPlan, ClusterView
from globalsched.planning.placement import BackendSlot


@dataclass(frozen=True)
class ReplanCall:
    force: ReplanReason | None = None     # re-plan now for this reason (None: the re-planner judges)
    why: tuple[str, ...] = ()
    hold: bool = False                    # within the cooldown with nothing forced: the plan in force stands


def should_replan(view: ClusterView, plan: ClusterPlan | None, last_plan_s: float | None,
                  planned_backends: tuple[BackendSlot, ...], surges_rps: Mapping[str, float], replan: ReplanConfig,
                  rate_headroom: float = 0.0) -> ReplanCall:
    """What a call of the planner at ``view.now_s`` means (module docstring). ``plan``: the plan in
    force, made at ``last_plan_s`` for ``planned_backends``; ``surges_rps``: the surges that are surges
    against the rates planned (:func:`globalsched.planning.rate_judgement.real_surges`)."""
    force, why = view.force, view.why
    surge = demand_surge(surges_rps, plan, replan.band_high, rate_headroom)
    if surge and force is None:
        force, why = ReplanReason.DEMAND_SURGE, (*why, surge)
    if force is None and plan is not None and last_plan_s is not None and view.backends == planned_backends \
            and view.now_s - last_plan_s < replan.cooldown_s:
        return ReplanCall(hold=True)
    drift = gamma_drift(view.gammas, plan.planned_gammas if plan else {}, (replan.band_low, replan.band_high))
    if drift and force is None and plan is not None and (last_plan_s is None or view.now_s - last_plan_s >= replan.cooldown_s):
        force, why = ReplanReason.FAN_OUT_DRIFT, (*why, drift)
    return ReplanCall(force, why)


def demand_surge(surges_rps: Mapping[str, float], plan: ClusterPlan | None, band_high: float = ReplanConfig.band_high,
                 rate_headroom: float = 0.0) -> str:
    """Why demand outran the plan at once ("" when it did not): a session whose surging rate, with
    headroom, is beyond ``band_high`` times the rate it is planned for."""
    if plan is None:
        return ""
    headroom = 1.0 + rate_headroom
    for session, rate in sorted(surges_rps.items()):
        planned = plan.sessions[session].rate_rps if session in plan.sessions else \
            plan.planned_query_rates.get(session)
        if planned is not None and rate * headroom > band_high * planned:
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
