"""The device scaling policy (globalsched/planning/scaling_policy.py) on a fake clock: up at once, down after a
cool-down to the window's need, the cheapest devices drained first, bounds, no flapping."""

from __future__ import annotations

import math
import numpy as np
import pytest

from common.config import ConfigError, DeviceBounds, SchedulerConfig
from globalsched.actuators.device_scaler import PERSIST_EVERY_S, persist_due
from globalsched.planning.scaling_policy import ScalingConfig, ScalingState, TypeDemand, TypeHistory, desired_devices


class Policy:
    def __init__(self, **config) -> None:
        self.config = ScalingConfig(**config)
        self.state = ScalingState()

    def at(self, now: float, **demand):
        d = TypeDemand("t4", **demand)
        decisions, self.state = desired_devices({"t4": d}, self.state, self.config, now)
        return decisions["t4"]


def test_a_plan_that_folds_sessions_scales_up_at_once():
    policy = Policy(cooldown_s=60)
    d = policy.at(0.0, needed=4, registered=1, folded=3)
    assert d.desired == 4 and "3 plan devices folded onto busy backends: add 3" in d.reason


def test_demand_that_outruns_the_plans_capacity_scales_up_before_the_plan_does():
    policy = Policy(cooldown_s=60)
    assert policy.at(0.0, needed=2, registered=2, capacity_rps=100, demand_rps=105).desired == 2   # within 1.1
    d = policy.at(1.0, needed=2, registered=2, capacity_rps=100, demand_rps=250)
    assert d.desired == 5 and "demand 250 rps outruns the 100 rps the plan's batches serve (x2.50)" in d.reason


def _one_backend_plan():
    from globalsched.planning.cluster_values import ClusterPlan, PlannedSession
    from globalsched.state.membership import Node
    from globalsched.planning.placement import BackendAssignment, PlacedSession, Placement

    plan = ClusterPlan({"t4": Placement((BackendAssignment("be-1", 20.0, (PlacedSession("a", 2, 100.0, 2.0),
                                                                           PlacedSession("b", 2, 100.0, 2.0))),),
                                        0, 0)}, {}, {}, devices_needed={"t4": 1},
                       sessions={n: PlannedSession(n, n, 100.0, 2.0) for n in "ab"})
    return plan, [Node("be-1", 2, "127.0.0.1:1", "emulated:t4", "t4")]


def _window(counts, now=10.0, window_ms=2000):
    """A workload fed one frontend's 2 s counts of session "a", the last at ``now``."""
    from common.pb import control
    from globalsched.state.rate_reports import Workload

    workload = Workload()
    for i, n in enumerate(counts):
        at = now - 2.0 * (len(counts) - 1 - i)
        workload.report(control.WorkloadReport(node_id="fe", rates=[control.SessionRate(
            model="a", rate_rps=n / 2.0, requests=n, window_ms=window_ms)]), at)
    return workload.window_rates(now)


def test_demand_is_each_session_at_its_capacity_unless_its_window_outruns_it_beyond_noise():
    """A device planned for 2 rps that serves 100 needs nothing more at 19 rps; a session whose window
    outruns its capacity beyond noise is not absorbed by another's idle room."""
    from globalsched.actuators.device_scaler import demands

    plan, backends = _one_backend_plan()
    quiet = demands(plan, backends, _window([38, 40, 36, 42, 38]))["t4"]
    assert (quiet.capacity_rps, quiet.demand_rps) == (200.0, 200.0)
    hot = demands(plan, backends, _window([600, 590, 610, 605, 595]))["t4"]     # 300 rps, steady
    assert hot.demand_rps == 400.0 and hot.move_cost == {"be-1": 4.0}
    assert Policy().at(0.0, needed=1, registered=1, capacity_rps=hot.capacity_rps, demand_rps=hot.demand_rps).desired == 2


def test_a_single_burst_report_adds_no_device_the_plan_does_not_use():
    """Gamma arrivals of CV 3-4: a 2 s report of several times the mean. The smoothed rate followed it
    (demand 441 rps where 200 were offered, devices added for bursts); the window's counts show it as
    noise of their own dispersion, and only a sustained excess counts."""
    from common.surge import dispersion
    from globalsched.actuators.device_scaler import demands, outrunning_rps

    plan, backends = _one_backend_plan()
    burst = _window([120, 110, 130, 115, 900])        # ~60 rps, then one 2 s report at 450 rps
    assert burst["a"].rate_rps == pytest.approx(137.5) and burst["a"].dispersion > 100
    assert demands(plan, backends, burst)["t4"].demand_rps == 200.0
    assert Policy().at(0.0, needed=1, registered=1, capacity_rps=200.0, demand_rps=200.0).desired == 1
    # Gamma arrivals of CV 3 disperse their counts beyond Poisson.
    rng = np.random.default_rng(3)
    counts = [float(rng.poisson(rng.gamma(1 / 9, 9 * 300.0))) for _ in range(5)]
    assert dispersion([(n, 2.0) for n in counts]) > 1.0
    assert dispersion([(10.0, 2.0)]) is None and dispersion([(0.0, 2.0), (0.0, 2.0)]) == 1.0
    from globalsched.state.rate_reports import WindowRate
    assert outrunning_rps(WindowRate(150.0, 10.0, 1.0), 100.0) == 150.0        # Poisson: 1,500 vs 1,000 + 130
    assert outrunning_rps(WindowRate(150.0, 10.0, 16.0), 100.0) is None        # CV 4: a margin 4x wider
    assert outrunning_rps(WindowRate(150.0, 10.0, None), 100.0) is None        # one count: left to the plan
    assert outrunning_rps(None, 100.0) is None
    # after a step down the mean still outruns, but the latest report is within what the plan serves
    # (10 counted in 0.5 s where the plan's 8 rps give 4, within 4 * 2 + 3): not demand; a latest
    # report beyond it is (300 where 50)
    assert outrunning_rps(WindowRate(30.0, 10.0, 1.0, latest_rps=10.0, latest_s=0.5), 8.0) is None
    assert outrunning_rps(WindowRate(150.0, 10.0, 1.0, latest_rps=150.0, latest_s=2.0), 100.0) == 150.0
    assert outrunning_rps(WindowRate(150.0, 10.0, 1.0, latest_rps=100.0, latest_s=2.0), 100.0) is None


def _many_sessions_plan(n: int, rate_rps: float):
    """A plan of ``n`` sessions, each planned for ``rate_rps`` and served at that on a backend of its own."""
    from globalsched.planning.cluster_values import ClusterPlan, PlannedSession
    from globalsched.state.membership import Node
    from globalsched.planning.placement import BackendAssignment, PlacedSession, Placement

    names = [f"m{i}" for i in range(n)]
    backends = tuple(BackendAssignment(f"be-{m}", 20.0, (PlacedSession(m, 2, rate_rps, rate_rps),)) for m in names)
    plan = ClusterPlan({"t4": Placement(backends, 0, 0)}, {}, {}, devices_needed={"t4": n},
                       sessions={m: PlannedSession(m, m, 100.0, rate_rps) for m in names})
    return plan, [Node(f"be-{m}", 2, "127.0.0.1:1", "emulated:t4", "t4") for m in names], names


def test_a_step_across_every_session_scales_up_though_no_session_is_beyond_its_own_noise():
    """A 2x step over 40 sessions planned for 10 rps: each one's latest 2 s report counts 40 where its
    plan expects 20 (within its noise, 4 * sqrt(20) + 3), and its window's mean still holds the counts
    from before. Summed, 1,600 against 800 is far beyond noise: the devices for the step start now,
    not as the plan follows the means."""
    from globalsched.actuators.device_scaler import demands
    from globalsched.state.rate_reports import WindowRate

    plan, backends, names = _many_sessions_plan(40, 10.0)
    stepped = {m: WindowRate(10.0, 10.0, 1.0, latest_rps=20.0, latest_s=2.0) for m in names}
    t4 = demands(plan, backends, stepped)["t4"]
    assert t4.demand_rps == 400.0                 # no session outruns its capacity on its own
    assert t4.latest_ratio == pytest.approx(2.0)
    d = Policy(cooldown_s=10).at(0.0, needed=40, registered=40, capacity_rps=t4.capacity_rps,
                                 demand_rps=t4.demand_rps, latest_ratio=t4.latest_ratio)
    assert d.desired == 80
    assert "the latest reports are x2.00 the rates planned (a step): 80 for the plan's 40" in d.reason
    # a ratio within the policy's outrun ratio (1.1) adds nothing
    assert Policy(cooldown_s=10).at(0.0, needed=40, registered=40, latest_ratio=1.05).desired == 40


def test_a_step_grows_the_plan_as_its_bound_grows_not_as_its_rates():
    """A plan made for the default rate, 1 rps a session, is mostly the sessions' fixed costs: 100
    sessions of 50 ms SLO pay 14 GPUs where their requests alone need 1. The first reports at 3.6x
    that rate ask for as many devices as the bound grows (its fixed costs are paid), not 3.6x the
    plan's: a constant load's cold start asked for 51 (85 with the headroom) where the next plan used 20."""
    from dataclasses import replace

    from common.profile import Profile
    from globalsched.actuators.device_scaler import demands
    from globalsched.planning.algorithms import lower_bound_gpus, solve
    from globalsched.planning.plan import GpuSpec, SessionSpec
    from globalsched.state.rate_reports import WindowRate

    tail = [SessionSpec(f"t{i}", "m", 50.0, 1.0, Profile.linear(1.0, 5.0, 8)) for i in range(100)]
    made = solve(tail, GpuSpec("g", 1e9))
    tight, per_request = made.bound_gpus
    assert (made.lower_bound, made.lower_bound_throughput_only) == (14, 1)
    for ratio in (1.5, 3.6, 10.0):
        # the estimate is never below the bound of the plan at those rates
        assert lower_bound_gpus([replace(s, rate_rps=ratio * s.rate_rps) for s in tail]) \
            <= tight + (ratio - 1) * per_request + 1e-9
        d = Policy(cooldown_s=10).at(0.0, needed=made.num_gpus, registered=made.num_gpus, latest_ratio=ratio,
                                     bound_gpus=made.bound_gpus)
        assert d.desired == math.ceil(made.num_gpus * (1 + (ratio - 1) * per_request / tight) - 1e-9)
        assert made.num_gpus < d.desired <= made.num_gpus + 2        # proportionally: 23, 54 and 150
    d = Policy(cooldown_s=10).at(0.0, needed=made.num_gpus, registered=made.num_gpus, latest_ratio=3.6,
                                 bound_gpus=made.bound_gpus)
    assert f"x3.60 the rates planned (a step), the plan's bound x{1 + 2.6 * per_request / tight:.2f}" in d.reason
    # the cluster plan's bounds of a type reach its demand
    plan, backends, names = _many_sessions_plan(40, 10.0)
    plan = replace(plan, bound_gpus={"t4": (40.0, 10.0)})
    t4 = demands(plan, backends, {m: WindowRate(10.0, 10.0, 1.0, latest_rps=20.0, latest_s=2.0) for m in names})["t4"]
    assert t4.bound_gpus == (40.0, 10.0) and t4.latest_ratio == pytest.approx(2.0)
    d = Policy(cooldown_s=10).at(0.0, needed=40, registered=40, latest_ratio=t4.latest_ratio, bound_gpus=t4.bound_gpus)
    assert d.desired == 50      # 40 * (1 + (2 - 1) * 10 / 40)


def test_one_sessions_burst_or_a_steady_load_in_the_latest_reports_is_no_step():
    """One bursty session's report at 10x its plan among 39 quiet ones, dispersed as CV 3 counts are:
    noise in the sum. A load within the plan, or within the windows' means above it, latest reports of
    unknown seconds, and sessions the plan has no rate for, are none."""
    from globalsched.actuators.device_scaler import demands, latest_ratio
    from globalsched.state.rate_reports import WindowRate

    plan, backends, names = _many_sessions_plan(40, 10.0)
    quiet = {m: WindowRate(8.0, 10.0, 9.0, latest_rps=8.0, latest_s=2.0) for m in names}
    assert demands(plan, backends, quiet)["t4"].latest_ratio == 1.0
    burst = dict(quiet, m0=WindowRate(12.0, 10.0, 9.0, latest_rps=100.0, latest_s=2.0))
    assert demands(plan, backends, burst)["t4"].latest_ratio == 1.0
    # Every session a little above its plan, in Poisson noise, is a step: 960 counted against
    # 800 + 4 * sqrt(800) + 3.
    planned = {m: 10.0 for m in names}
    assert latest_ratio(planned, {m: WindowRate(8.0, 10.0, 1.0, latest_rps=12.0, latest_s=2.0) for m in names}) \
        == pytest.approx(1.2)
    assert latest_ratio(planned, {m: WindowRate(8.0, 10.0, 1.0) for m in names}) == 1.0
    # A plan that lags a constant load (made from the first seconds' counts) is no step: the latest
    # reports do not outrun the windows' means.
    assert latest_ratio(planned, {m: WindowRate(20.0, 10.0, 1.0, latest_rps=20.0, latest_s=2.0) for m in names}) \
        == 1.0
    # Only sessions with a planned rate and a report count: an unplanned one's 1,000 rps is not a step.
    rates = {m: WindowRate(8.0, 10.0, 1.0, latest_rps=10.0, latest_s=2.0) for m in names}
    rates["new"] = WindowRate(1000.0, 10.0, 1.0, latest_rps=1000.0, latest_s=2.0)
    assert latest_ratio(dict(planned, new=0.0), rates) == 1.0


def test_a_plan_that_lags_the_load_in_the_means_and_the_latest_reports_alike_removes_nothing():
    """The constant-load trace, seed 3: the plan in force was made for 675 rps while the windows still
    filled, the means and the latest reports said 1,000; a removal on its need was followed 0.2 s
    later by four devices more (benchmarks/elastic.md)."""
    from globalsched.actuators.device_scaler import demands, lag_ratio
    from globalsched.state.rate_reports import WindowRate

    plan, backends, names = _many_sessions_plan(40, 10.0)
    lagged = {m: WindowRate(15.0, 10.0, 1.0, latest_rps=15.0, latest_s=2.0) for m in names}
    assert demands(plan, backends, lagged)["t4"].lag_ratio == pytest.approx(1.5)
    policy = Policy(cooldown_s=10)
    policy.at(0.0, needed=36, registered=36)
    kept = policy.at(11.0, needed=24, registered=36, lag_ratio=1.5)
    assert kept.desired == 36 and kept.drains == ()
    assert "12 surplus over the window's 24, but the load is x1.50 the rates planned (the plan lags it): kept" \
        in kept.reason
    # Once a plan has caught up, its need goes as any other's.
    assert policy.at(11.5, needed=24, registered=36, lag_ratio=1.0).desired == 26
    # It only keeps: a lagging plan adds no device.
    assert Policy(cooldown_s=10).at(0.0, needed=24, registered=24, lag_ratio=1.5).desired == 24
    planned = {m: 10.0 for m in names}
    # After a step down the means lag above a plan made from the latest reports: that plan is followed.
    assert lag_ratio(planned, {m: WindowRate(30.0, 10.0, 1.0, latest_rps=10.0, latest_s=2.0) for m in names}) == 1.0
    # Within the noise of the counts (4,400 against 4,000 over the windows, dispersed as CV 3 counts
    # are), or with no latest report, it is no lag.
    assert lag_ratio(planned, {m: WindowRate(11.0, 10.0, 9.0, latest_rps=11.0, latest_s=2.0) for m in names}) == 1.0
    assert lag_ratio(planned, {m: WindowRate(15.0, 10.0, 1.0) for m in names}) == 1.0
    # Sessions the plan has no rate for do not count.
    assert lag_ratio(dict(planned, new=0.0), {"new": WindowRate(900.0, 10.0, 1.0, latest_rps=900.0, latest_s=2.0)}) \
        == 1.0


def test_a_plan_that_needs_more_devices_is_asked_for_when_made_and_one_that_needs_fewer_once_applied():
    """At a step the plan's push took 3-4 s while the devices it folded onto busy backends waited
    (benchmarks/elastic.md). A plan that needs fewer must not drain a backend the plan in force still
    routes to."""
    import asyncio
    from dataclasses import replace

    from globalsched.actuators.device_scaler import DeviceScaler
    from globalsched.state.membership import Node

    plan, _ = _one_backend_plan()
    nodes = [Node("be-1", 2, "127.0.0.1:1", "emulated:t4", "t4")]
    clock = [0.0]
    scaler = DeviceScaler(ScalingConfig(cooldown_s=10), lambda: list(nodes), lambda now: {}, clock=lambda: clock[0])
    asyncio.run(scaler.apply(plan, 1))
    assert scaler.decisions["t4"].desired == 1
    bigger = replace(plan, devices_needed={"t4": 3})
    scaler.made(bigger)                                   # not applied yet: its devices are asked for now
    assert scaler.decisions["t4"].desired == 3 and "the plan uses 3" in scaler.decisions["t4"].reason
    assert scaler.plan is plan and scaler.coming is bigger
    nodes += [Node(f"be-{i}", 2, f"127.0.0.1:{i}", "emulated:t4", "t4") for i in (2, 3)]
    asyncio.run(scaler.apply(bigger, 2))
    assert scaler.coming is None and scaler.decisions["t4"].desired == 3
    clock[0] = 20.0
    scaler.made(plan)                                     # needs 1: the plan in force still needs 3
    assert scaler.decisions["t4"].desired == 3 and scaler.decisions["t4"].drain == ""
    asyncio.run(scaler.apply(plan, 3))
    clock[0] = 31.0                                       # a cool-down after the plan needing 1 was applied
    down = scaler.evaluate()["t4"]
    assert down.desired == 1 and down.drain in ("be-2", "be-3")


def test_the_window_remembers_the_need_of_a_plan_being_applied_while_the_plan_in_force_holds_the_devices():
    """After a step down in the simulator, plans superseded each other for seconds while the plan in
    force still needed the peak's devices; the window remembered that need, and the removal a
    cool-down later stopped there (67 devices kept for a plan using 26: benchmarks/elastic.md)."""
    policy = Policy(cooldown_s=10)
    assert policy.at(0.0, needed=10, registered=10).desired == 10
    coming = TypeDemand("t4", needed=4, registered=10)
    cost = {f"be-{i}": float(i) for i in range(10)}
    held = policy.at(1.0, needed=10, registered=10, coming=coming, move_cost=cost)
    assert held.desired == 10 and held.needed == 10 and held.drains == ()
    assert "(the plan being applied: the plan uses 4)" in held.reason
    # Past the cool-down, a coming plan not yet applied still removes nothing the plan in force uses.
    assert policy.at(10.5, needed=10, registered=10, coming=coming, move_cost=cost).desired == 10
    policy.at(11.0, needed=4, registered=10, move_cost=cost)       # applied
    down = policy.at(20.5, needed=4, registered=10, move_cost=cost)
    assert down.desired == 4 and down.drains == tuple(f"be-{i}" for i in range(6))


def test_a_scale_up_under_way_is_remembered_though_the_plan_being_applied_needs_fewer():
    """The constant load's cold start (seed 2): the first reports asked the plan in force for 40
    devices; the plan being applied needed 22 by its own reports. The window remembered 22, so when
    that plan was applied the desired count fell to 22 while 18 devices were starting, and rose again
    as they registered: two scale reversals, and an HPA would have stopped the pods it was starting."""
    policy = Policy(cooldown_s=10)
    assert policy.at(0.0, needed=22, registered=22).desired == 22
    up = policy.at(0.5, needed=40, registered=22, coming=TypeDemand("t4", needed=22, registered=22))
    assert up.desired == 40 and "add 18" in up.reason
    applied = policy.at(1.5, needed=22, registered=22)        # applied; the devices are still starting
    assert applied.desired == 40 and "40 needed within the 10 s window: 18 to come" in applied.reason
    assert policy.at(2.0, needed=22, registered=40).desired == 40   # registered: held for the cool-down


def test_the_scalers_window_holds_what_the_coming_plan_needs_once_it_is_applied():
    import asyncio
    from dataclasses import replace

    from globalsched.actuators.device_scaler import DeviceScaler
    from globalsched.state.membership import Node

    plan, _ = _one_backend_plan()
    big = replace(plan, devices_needed={"t4": 3})
    nodes = [Node(f"be-{i}", 2, f"127.0.0.1:{i}", "emulated:t4", "t4") for i in (1, 2, 3)]
    clock = [0.0]
    scaler = DeviceScaler(ScalingConfig(cooldown_s=10), lambda: list(nodes), lambda now: {}, clock=lambda: clock[0])
    asyncio.run(scaler.apply(big, 1))
    clock[0] = 5.0
    assert scaler.made(plan)["t4"].desired == 3            # the plan in force still needs 3
    clock[0] = 8.0
    asyncio.run(scaler.apply(plan, 2))
    clock[0] = 10.5                                         # a cool-down after the first decision
    down = scaler.evaluate()["t4"]
    assert down.desired == 1 and len(down.drains) == 2


def test_surplus_goes_at_once_to_the_windows_largest_need_after_the_cool_down():
    policy = Policy(cooldown_s=60)
    cost = {"be-a": 30.0, "be-b": 0.0, "be-c": 12.0, "be-d": 0.0, "be-e": 5.0}
    assert policy.at(0.0, needed=5, registered=5, move_cost=cost).desired == 5
    held = policy.at(10.0, needed=2, registered=5, move_cost=cost)
    assert held.desired == 5 and "held for the 60 s cool-down" in held.reason and held.drain == ""
    assert policy.at(59.0, needed=2, registered=5, move_cost=cost).desired == 5     # 5 still in the window
    first = policy.at(70.5, needed=2, registered=5, move_cost=cost)
    assert first.desired == 2 and "remove 3 (the most needed within it: 2)" in first.reason
    assert first.drain == "be-b" and "(be-b: idle; then be-d, be-e)" in first.reason   # idle, first by name
    # The whole surplus is named at once, the cheapest to move first: they drain together (one at a
    # time, 46 devices took 24 s to go after a step down in the simulator).
    assert first.drains == ("be-b", "be-d", "be-e")
    # Named again, fewer each time, as they leave.
    cost.pop("be-b")
    second = policy.at(75.0, needed=2, registered=4, move_cost=cost)
    assert second.desired == 2 and second.drains == ("be-d", "be-e") and "removing 2 more to 2" in second.reason
    cost.pop("be-d")
    third = policy.at(80.0, needed=2, registered=3, move_cost=cost)
    assert third.desired == 2 and third.drains == ("be-e",) and "its sessions carry 5 rps" in third.reason
    cost.pop("be-e")
    assert policy.at(85.0, needed=2, registered=2, move_cost=cost).desired == 2
    assert policy.at(300.0, needed=2, registered=2, move_cost=cost).desired == 2
    assert policy.at(301.0, needed=3, registered=2, move_cost=cost).desired == 3     # up again at once


def test_a_need_that_falls_beyond_the_tolerance_after_a_removal_goes_before_the_next_cool_down():
    """After a step down, the first removal came while the window still held the step's need; the
    devices that the window let go seconds later waited for a whole cool-down (the simulator)."""
    def removed_once() -> Policy:
        policy = Policy(cooldown_s=10)
        policy.at(0.0, needed=50, registered=60)        # first seen: a cool-down before anything goes
        policy.at(5.0, needed=48, registered=60)
        first = policy.at(10.5, needed=30, registered=60)   # the window holds 48: 48 + 4
        assert first.desired == 52 and "remove 8" in first.reason
        assert policy.at(11.0, needed=30, registered=52).desired == 52      # the window still holds 48
        return policy

    early = removed_once().at(15.6, needed=30, registered=52)     # 48 left the window: 30 + 3
    assert early.desired == 33 and "remove 19 (the most needed within it: 30" in early.reason
    # 45 is below 90% of 52, but its removal (to 45 + 4) is within the tolerance: it waits
    policy = removed_once()
    small = policy.at(15.6, needed=45, registered=52)
    assert small.desired == 52 and "next removal" in small.reason
    assert policy.at(20.6, needed=45, registered=52).desired == 49     # a cool-down after the last
    # nor does a removal under way let another one come early
    going = removed_once()
    assert going.at(11.5, needed=30, registered=58).desired == 52
    assert going.at(15.6, needed=30, registered=55).desired == 52


def test_the_survivors_absorb_the_largest_need_of_the_window():
    """The N/(N-1) check for any number removed: never below what the window needed, headroom included."""
    policy = Policy(cooldown_s=60, headroom=0.5)
    policy.at(0.0, needed=6, registered=9)
    policy.at(30.0, needed=2, registered=9)               # 2 with 50% headroom: 3
    down = policy.at(61.0, needed=1, registered=9)         # 1 (one device gets no headroom); the window held 3
    assert down.desired == 3 and down.needed == 1


def test_a_need_that_comes_back_within_the_window_cancels_the_scale_down():
    policy = Policy(cooldown_s=60)
    policy.at(0.0, needed=3, registered=3)
    policy.at(20.0, needed=1, registered=3)
    policy.at(40.0, needed=3, registered=3)           # a burst within the window
    assert policy.at(70.0, needed=1, registered=3).desired == 3
    assert policy.at(101.0, needed=1, registered=3).desired == 1


def test_a_surplus_within_the_tolerance_is_kept_so_a_count_that_wavers_does_not_flap():
    policy = Policy(cooldown_s=10)                        # kept while the need is 90% of the count
    policy.at(0.0, needed=35, registered=35)
    kept = policy.at(11.0, needed=32, registered=35)
    assert kept.desired == 35 and "3 surplus over the window's 32, within the 10% tolerance: kept" in kept.reason
    assert policy.at(30.0, needed=35, registered=35).desired == 35                 # and no device to add
    # a real drop goes, down to the need and its tolerance (25 + 2), which the wavering then stays within
    policy.at(40.0, needed=25, registered=35)
    down = policy.at(51.0, needed=25, registered=35)
    assert down.desired == 27 and "remove 8 (the most needed within it: 25, and 2 within the 10% tolerance)" \
        in down.reason
    assert policy.at(70.0, needed=27, registered=27).desired == 27
    assert policy.at(90.0, needed=25, registered=27).desired == 27
    # the tolerance is of the count, as the HPA's ratio: a plan wavering between 31 and 28 devices keeps
    # 31 (28 + 10% of 28, rounded down, is 30: the rule of the need alone removed one, and the plan asked
    # for it again 45 s later, two reversals in the simulator's constant load)
    waver = Policy(cooldown_s=10)
    waver.at(0.0, needed=31, registered=31)
    assert waver.at(12.0, needed=28, registered=31).desired == 31
    lower = Policy(cooldown_s=10)
    lower.at(0.0, needed=31, registered=31)
    assert lower.at(12.0, needed=27, registered=31).desired == 29               # 27 < 27.9: 27 + 2
    small = Policy(cooldown_s=10)
    small.at(0.0, needed=10, registered=10)
    assert small.at(11.0, needed=9, registered=10).desired == 10                # 9 of 10: within 10%
    assert small.at(22.0, needed=8, registered=10).desired == 8
    exact = Policy(cooldown_s=10, down_tolerance=0.0)
    exact.at(0.0, needed=33, registered=33)
    assert exact.at(11.0, needed=32, registered=33).desired == 32


def test_a_device_asked_for_is_still_desired_while_it_starts_though_the_need_fell_back():
    """The window's largest need holds the desired count up as well as down: a gauge that dipped
    while the device it asked for was starting would have an HPA remove that pod."""
    policy = Policy(cooldown_s=10)
    policy.at(0.0, needed=25, registered=25)
    assert policy.at(1.0, needed=26, registered=25).desired == 26
    starting = policy.at(2.0, needed=25, registered=25)
    assert starting.desired == 26 and "26 needed within the 10 s window: 1 to come" in starting.reason
    assert policy.at(3.0, needed=25, registered=26).desired == 26
    assert policy.at(12.0, needed=25, registered=26).desired == 26               # within the tolerance


def test_a_scale_up_under_way_keeps_its_count_while_the_need_wavers():
    """A step's reports and its plans asked for 25, 21, 25 and 21 devices within 2 s while they started,
    and the actuator started them a poll at a time. The count asked for stands while its need is in
    the window; after it, the need of now is what is asked."""
    policy = Policy(cooldown_s=10)
    assert policy.at(0.0, needed=25, registered=10).desired == 25
    wavered = policy.at(0.5, needed=21, registered=10)
    assert wavered.desired == 25 and "add 15 (25 asked for within the 10 s window)" in wavered.reason
    assert policy.at(1.0, needed=20, registered=20).desired == 25      # 20 came; 5 more to come
    assert policy.at(1.5, needed=21, registered=20).desired == 25
    assert policy.at(12.0, needed=21, registered=20).desired == 21     # the 25 left the window


@pytest.mark.parametrize("tolerance", [-0.1, 1.0, 2.5])
def test_a_tolerance_outside_0_to_1_is_refused_naming_the_flag(tolerance):
    with pytest.raises(ConfigError) as refused:
        SchedulerConfig(scale_down_tolerance=tolerance).validate()
    assert str(refused.value) == f"--scale-down-tolerance: expected at least 0 and below 1, got {tolerance}"
    assert ScalingConfig.from_config(SchedulerConfig(scale_down_tolerance=0.1)).down_tolerance == 0.1


def test_bounds_cap_and_floor_the_desired_count_and_say_so():
    policy = Policy(bounds=DeviceBounds.parse("t4=2", "t4=3"))
    capped = policy.at(0.0, needed=6, registered=3, folded=3)
    assert capped.desired == 3 and "capped at --max-devices 3 (3 plan devices folded onto busy backends)" in capped.reason
    floor = Policy(bounds=DeviceBounds.parse("2", ""), cooldown_s=5).at(0.0, needed=0, registered=0)
    assert floor.desired == 2 and "--min-devices 2" in floor.reason


def test_headroom_adds_spare_devices():
    assert Policy(headroom=0.5).at(0.0, needed=4, registered=4).desired == 6


@pytest.mark.parametrize("headroom, needed, desired", [
    (0.3, 1, 1), (0.3, 2, 3), (0.3, 3, 4), (0.3, 4, 5), (0.3, 5, 7), (0.3, 10, 13), (0.3, 82, 107),
    (0.6, 1, 1), (0.6, 2, 3), (0.6, 3, 5), (0.6, 4, 6), (0.6, 10, 16), (0.6, 82, 131)])
def test_the_headroom_is_rounded_to_the_nearest_device_and_one_device_gets_none(headroom, needed, desired):
    """A single device is not doubled, even where its headroom rounds to a whole device (0.6 of one)."""
    decision = Policy(headroom=headroom).at(0.0, needed=needed, registered=needed)
    assert decision.desired == desired
    assert (f"{headroom:.0%} headroom" in decision.reason) == (desired > needed), decision.reason


@pytest.mark.parametrize("low, high, message", [
    ("two", "", "--min-devices: expected N or TYPE=N[,TYPE=N...], got 'two'"),
    ("", "t4=-1", "--max-devices: expected a device type and a count of at least 0, got 't4=-1'"),
    ("t4=4", "t4=2", "--min-devices: t4=4 is above --max-devices 2"),
    ("t4=1,t4=2", "", "--min-devices: 't4' given twice"),
])
def test_bad_device_bounds_are_refused_naming_the_flag(low, high, message):
    with pytest.raises(ConfigError) as refused:
        SchedulerConfig(min_devices=low, max_devices=high).validate()
    assert str(refused.value) == message


def test_device_bounds_per_type_and_for_every_type():
    bounds = DeviceBounds.parse("1,t4=2", "cpu=4")
    assert bounds.of("t4") == (2, 1 << 30) and bounds.of("cpu") == (1, 4) and bounds.of("v100") == (1, 1 << 30)


def test_a_scheduler_that_just_started_waits_a_cool_down_before_removing_anything():
    """Backends re-register with a restarted scheduler before its first plan: they are not surplus yet."""
    policy = Policy(cooldown_s=60)
    assert policy.at(0.0, needed=0, registered=4).desired == 4
    assert policy.at(30.0, needed=1, registered=4).desired == 4
    assert policy.at(61.0, needed=1, registered=4).desired == 1


def test_backends_that_come_back_are_not_removed_beyond_the_removal_decided():
    """Registered backends that missed heartbeats under load and re-registered: the count desired while
    they were away is no licence to remove more than the removal in progress aimed at."""
    policy = Policy(cooldown_s=60)
    policy.at(0.0, needed=5, registered=5)
    assert policy.at(70.0, needed=4, registered=5).desired == 4             # one removal
    assert policy.at(71.0, needed=2, registered=1).desired == 2             # four lost their registration
    back = policy.at(72.0, needed=2, registered=5)                          # ... and are back
    assert back.desired == 4                                                # the removal decided: one
    assert policy.at(131.0, needed=2, registered=4).desired == 2            # the next, a cool-down later


def test_a_changed_decision_is_stored_at_once_and_the_needs_history_at_most_every_few_seconds():
    """A leader killed right after its devices changed must leave the new count for its standby: the
    state was kept only every PERSIST_EVERY_S, and a standby adopted 'no device type yet'."""
    empty = ScalingState()
    two = ScalingState({"t4": TypeHistory(needs=((1.0, 2),), desired=2)})
    two_later = ScalingState({"t4": TypeHistory(needs=((1.0, 2), (1.5, 2)), desired=2)})
    three = ScalingState({"t4": TypeHistory(needs=((1.0, 2), (1.5, 3)), desired=3)})
    assert persist_due(empty, None, 0.0)                          # never stored
    assert not persist_due(two, two, 100.0)                       # nothing changed
    assert persist_due(two, empty, 0.1)                           # a type appeared: at once
    assert persist_due(three, two, 0.1)                           # its count changed: at once
    assert not persist_due(two_later, two, 0.1)                   # only needs moved: wait
    assert persist_due(two_later, two, PERSIST_EVERY_S)


def test_window_rates_add_up_the_frontends_and_follow_each_ones_reports():
    """Each frontend's part is kept until its own next report or until a count ages out: a report from
    one frontend changes the sum at once, and the other's part still counts."""
    from common.pb import control
    from globalsched.state.rate_reports import PLAN_RATE_WINDOW_S, Workload

    def report(workload, node, n, at):
        workload.report(control.WorkloadReport(node_id=node, rates=[control.SessionRate(
            model="a", rate_rps=n / 2.0, requests=n, window_ms=2000)]), at)

    workload = Workload()
    report(workload, "fe-1", 20, 10.0)
    report(workload, "fe-2", 40, 10.0)
    first = workload.window_rates(10.5)["a"]
    assert first.rate_rps == 30.0 and first.window_s == 2.0
    assert workload.window_rates(10.6)["a"] == first                     # nothing changed: the same answer
    report(workload, "fe-1", 60, 12.0)                                     # fe-1 now counts (20 + 60) / 4 s
    second = workload.window_rates(12.1)["a"]
    assert second.rate_rps == 20.0 + 20.0 and second.window_s == 2.0
    workload.forget("fe-2")
    assert workload.window_rates(12.2)["a"].rate_rps == 20.0
    assert "a" not in workload.window_rates(12.0 + PLAN_RATE_WINDOW_S + 60.0)   # every count aged out


def test_dispersion_from_running_sums_is_the_dispersion_of_the_counts():
    """The window rates keep each history's sums up to date count by count (O(1) per report); the
    statistic is the same as common/surge.py's over the counts themselves."""
    import random

    from common.surge import dispersion, dispersion_of_sums

    rng = random.Random(7)
    for _ in range(200):
        counts = [(rng.choice([0, 1, 3, 40, 200]) + rng.randint(0, 5), rng.choice([0.5, 1.0, 2.0, 2.7]))
                  for _ in range(rng.randint(1, 8))]
        sums = (sum(n for n, _ in counts), sum(w for _, w in counts), sum(n * n / w for n, w in counts), len(counts))
        expected, got = dispersion(counts), dispersion_of_sums(*sums)
        assert (expected is None) == (got is None), counts
        if expected is not None:
            assert got == pytest.approx(expected, rel=1e-9), counts
    assert dispersion_of_sums(0, 4.0, 0.0, 2) == 1.0 and dispersion_of_sums(5, 2.0, 12.5, 1) is None


def test_window_rates_age_out_the_oldest_counts_between_reports():
    from common.pb import control
    from globalsched.state.rate_reports import PLAN_RATE_WINDOW_S, Workload

    workload = Workload()
    for i, n in enumerate([100, 0, 0]):                 # a burst, then quiet: 2 s counts at 0, 2, 4 s
        workload.report(control.WorkloadReport(node_id="fe", rates=[control.SessionRate(
            model="a", rate_rps=n / 2.0, requests=n, window_ms=2000)]), 2.0 * i)
    early = workload.window_rates(4.5)["a"]
    assert early.rate_rps == pytest.approx(100 / 6.0) and early.window_s == 6.0 and early.dispersion > 10
    later = workload.window_rates(0.01 + PLAN_RATE_WINDOW_S)["a"]     # the burst's count aged out
    assert later.rate_rps == 0.0 and later.window_s == 4.0 and later.dispersion == 1.0
