"""The scheduler's pure planner (globalsched/planning/planner.py over globalsched/planning/plan_device_type.py) on a fake
clock: a lost backend is repaired moving nothing else, minimum replicas are placed and survive a loss
without a re-plan, and rates are judged by the re-planner's band and cooldown. Spare replicas (which
fill idle backends) are off here but where a test is about them: the other tests place sessions on
backends and expect the rest idle."""

from __future__ import annotations

import argparse
import math

import numpy as np
import pytest

from globalsched.planning.plan import GpuPlan, GpuSpec, Plan, PrefixGroup, SessionAlloc, SessionSpec, validate_plan
from common.config import FIXED_BURST_SIGMA, SchedulerConfig, add_arguments, from_args
from common.profile import Profile
from globalsched.planning.algorithms.config import PlannerConfig
from globalsched.planning.algorithms.lower_bound import bounds_gpus
from globalsched.planning.algorithms.replan import ReplanConfig, ReplanReason
from globalsched.planning.cluster_values import MIN_PLANNED_RATE_RPS, ClusterView, ModelView, SessionInput
from globalsched.planning.placement import BackendSlot
from globalsched.planning.plan_device_type import TypeState
from globalsched.planning.planner import PlannerSettings, PlannerState, plan_cluster, same_tables, type_burst_sigma
from globalsched.planning.rate_judgement import (dropped_rates, held_drops, held_surges, real_surges, settled_rates,
                                                 unabsorbed_surges)
from globalsched.planning.replicas import _SpareRoom, _with, add_replicas, add_spares
from globalsched.planning.prefix_groups import planning_groups

PROFILE = Profile.linear(2.0, 10.0, 32, memory_base_mb=100, memory_per_item_mb=1, device_type="gpu")


def _slots(*names: str) -> list[BackendSlot]:
    return [BackendSlot(n, "gpu", 16000.0) for n in names]


class Loop:
    """Threads the planner's state from call to call, as the planning task does."""

    def __init__(self, settings: PlannerSettings = PlannerSettings(spare_replicas=False)) -> None:
        self.settings = settings
        self.state = PlannerState()
        self.changed = False

    def plan(self, sessions: list[SessionInput], slots, now: float, min_replicas=None, force=None, surges=None,
             window_s: float = 0.0, expected=None, surge_window_s: float = 0.0, latest=None, dispersions=None):
        view = ClusterView(now, tuple(slots),
                           tuple(ModelView(s.model, s.slo_ms, s.profiles, min_replicas=(min_replicas or {}).get(s.model, 0),
                                           expected_rate_rps=(expected or {}).get(s.model, 0.0))
                                 for s in sessions),
                           rates_rps={s.model: s.rate_rps for s in sessions}, surges_rps=surges or {}, force=force,
                           rate_windows_s={s.model: window_s for s in sessions} if window_s else {},
                           surge_windows_s={m: surge_window_s for m in surges or {}} if surge_window_s else {},
                           latest_reports=latest or {}, rate_dispersions=dispersions or {})
        before = self.state.plan
        plan, self.state = plan_cluster(view, self.state, self.settings)
        self.changed = plan is not before
        return plan


def _loop(surge_floors: bool = False, **replan) -> Loop:
    return Loop(PlannerSettings(ReplanConfig(**replan), spare_replicas=False, surge_floors=surge_floors))


def _where(plan) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for placement in plan.placements.values():
        for b in placement.backends:
            for s in b.sessions:
                out.setdefault(s.model, set()).add(b.node_id)
    return out


def test_a_lost_backend_is_repaired_and_nothing_else_moves():
    loop = _loop(cooldown_s=5.0, epoch_s=30.0)
    # Each session nearly fills a GPU on its own: one backend each.
    sessions = [SessionInput(f"m{i}", 100.0, 300.0, {"gpu": PROFILE}) for i in range(3)]
    slots = _slots("a", "b", "c", "d")
    before = _where(loop.plan(sessions, slots, 0.0))
    assert all(len(nodes) == 1 for nodes in before.values()) and len(set().union(*before.values())) == 3
    [lost] = before["m0"]
    repaired = loop.plan(sessions, [s for s in slots if s.node_id != lost], 1.0, force=ReplanReason.MEMBERSHIP)
    after = _where(repaired)       # within the cooldown
    assert repaired.reasons["gpu"] is ReplanReason.MEMBERSHIP
    assert lost not in set().union(*after.values())
    assert after["m0"] and lost not in after["m0"]
    for name in ("m1", "m2"):
        assert after[name] == before[name]


def test_min_replicas_are_placed_and_a_replica_loss_needs_no_move():
    loop = _loop()
    sessions = [SessionInput("twin", 100.0, 50.0, {"gpu": PROFILE}), SessionInput("solo", 100.0, 50.0, {"gpu": PROFILE})]
    slots = _slots("a", "b", "c")
    plan = loop.plan(sessions, slots, 0.0, {"twin": 2})
    where = _where(plan)
    assert len(where["twin"]) == 2 and len(where["solo"]) == 1
    shares = [share for _, share in plan.backends_of("twin")]
    assert shares[0] == shares[1] >= 50.0          # each replica alone carries the whole rate
    survivor, lost = sorted(where["twin"])
    after = _where(loop.plan(sessions, [s for s in slots if s.node_id != lost], 1.0, {"twin": 2},
                             force=ReplanReason.MEMBERSHIP))
    assert survivor in after["twin"] and len(after["twin"]) == 2    # kept where it ran, a new replica added
    assert after["solo"] == where["solo"] or lost in where["solo"]


def test_the_cluster_default_applies_and_replicas_stop_at_the_backends_there_are():
    loop = Loop(PlannerSettings(default_min_replicas=3, spare_replicas=False))
    sessions = [SessionInput("m", 100.0, 50.0, {"gpu": PROFILE})]
    where = _where(loop.plan(sessions, _slots("a", "b"), 0.0))
    assert where["m"] == {"a", "b"}


def test_rates_are_judged_by_the_band_after_the_cooldown():
    loop = _loop(cooldown_s=5.0, epoch_s=30.0)
    slots = _slots("a", "b", "c")
    base = [SessionInput("m", 100.0, 200.0, {"gpu": PROFILE})]
    loop.plan(base, slots, 0.0)
    assert loop.changed
    doubled = [SessionInput("m", 100.0, 400.0, {"gpu": PROFILE})]
    loop.plan(doubled, slots, 2.0)
    assert not loop.changed                                 # out of band, but within the cooldown
    loop.plan([SessionInput("m", 100.0, 210.0, {"gpu": PROFILE})], slots, 6.0)    # within the band
    assert not loop.changed
    plan = loop.plan(doubled, slots, 7.0)
    assert loop.changed and plan.reasons["gpu"] in (ReplanReason.RATE_BAND, ReplanReason.OVERLOAD)
    assert sum(share for _, share in plan.backends_of("m")) >= 400.0
    loop.plan(doubled, slots, 13.0, force=ReplanReason.SESSIONS_CHANGED)    # the service forces a change
    assert loop.changed


def test_the_first_plan_uses_the_configured_solver_and_repairs_use_the_re_planner():
    loop = Loop(PlannerSettings(solver="cpsat", spare_replicas=False))
    sessions = [SessionInput(f"m{i}", 100.0, 300.0, {"gpu": PROFILE}) for i in range(2)]
    slots = _slots("a", "b", "c")
    first = loop.plan(sessions, slots, 0.0)
    before = _where(first)
    assert first.reasons["gpu"] is ReplanReason.INITIAL and len(set().union(*before.values())) == 2
    [lost] = before["m0"]
    repaired = loop.plan(sessions, [s for s in slots if s.node_id != lost], 1.0, force=ReplanReason.MEMBERSHIP)
    after = _where(repaired)
    assert repaired.reasons["gpu"] is ReplanReason.MEMBERSHIP
    assert after["m1"] == before["m1"] and lost not in after["m0"]


def test_replicas_stay_where_they_are_across_re_plans():
    loop = _loop(cooldown_s=5.0, epoch_s=30.0)
    slots = _slots("a", "b", "c", "d")
    sessions = [SessionInput("twin", 100.0, 100.0, {"gpu": PROFILE}), SessionInput("other", 100.0, 300.0, {"gpu": PROFILE})]
    before = _where(loop.plan(sessions, slots, 0.0, {"twin": 2}))
    assert len(before["twin"]) == 2
    grown = [SessionInput("twin", 100.0, 150.0, {"gpu": PROFILE}), SessionInput("other", 100.0, 450.0, {"gpu": PROFILE})]
    after = _where(loop.plan(grown, slots, 10.0, {"twin": 2}))      # out of band, after the cooldown
    assert loop.changed
    assert after["twin"] == before["twin"]
    assert before["other"] <= after["other"]


def test_a_demand_surge_is_planned_for_within_the_cooldown():
    loop = _loop(cooldown_s=5.0, epoch_s=30.0)
    slots = _slots("a", "b", "c", "d")
    loop.plan([SessionInput("m", 100.0, 60.0, {"gpu": PROFILE})], slots, 0.0)
    stepped = [SessionInput("m", 100.0, 600.0, {"gpu": PROFILE})]
    loop.plan(stepped, slots, 1.0)
    assert not loop.changed                                  # an excursion of the mean waits for the cooldown
    plan = loop.plan(stepped, slots, 1.5, surges={"m": 600.0})
    assert loop.changed and plan.why == ("demand surge: m at 600 rps, planned for 60",)
    assert sum(share for _, share in plan.backends_of("m")) >= 600.0


def test_a_replica_on_a_gpu_of_its_own_keeps_the_burst_headroom_its_primary_pooled():
    # The primary carries 0.455 arrivals per cycle at batch 1, which its 15 ms budget absorbs only
    # because "spread"'s batch on the same GPU covers its burst; a copy alone on a new GPU would break
    # the SLO (10 + 3.9 + a 1.9 ms burst > 15), so the replica is re-timed for that load alone.
    planner = PlannerConfig(network_ms=5.0, burst_sigma=1.5)
    tight = SessionSpec("tight", "mt", 20.0, 45.5, Profile.linear(1.861, 2.025, 32))
    spread = SessionSpec("spread", "ms", 50.0, 17.1, Profile.linear(2.572, 2.061, 32))
    shared = GpuPlan(0, 10.0, (SessionAlloc("tight", 1, 100.0, 45.5), SessionAlloc("spread", 1, 100.0, 17.1)))
    gpu = GpuSpec("gpu", 16000.0)
    gpus, added = add_replicas([shared], [tight, spread], gpu, {"tight": 2, "spread": 1}, 2, planner)
    assert added == {(1, "tight")}
    plan = Plan("replan", tuple(gpus), 0, 0.0)
    assert validate_plan(plan, [tight, spread], gpu, planner.margins_ms, burst_sigma=1.5) == []
    [replica] = gpus[1].sessions
    assert replica.planned_load_rps == 45.5 and gpus[1].duty_cycle_ms < 10.0


def test_a_replica_no_gpu_can_run_alone_is_not_added():
    # 320 req/s at batch 4 within a 40 ms SLO: no lone cycle absorbs its burst (the primary given here
    # does not either), and the only other GPU runs the session already: it keeps one replica.
    planner = PlannerConfig(burst_sigma=1.5)
    heavy = SessionSpec("heavy", "mh", 40.0, 320.0, Profile.linear(0.5, 10.0, 4))
    primary = GpuPlan(0, 12.5, (SessionAlloc("heavy", 4, 320.0, 320.0),))
    gpus, added = add_replicas([primary], [heavy], GpuSpec("gpu", 16000.0), {"heavy": 2}, 2, planner)
    assert gpus == [primary] and added == set()


def test_a_replica_joining_a_shared_prefix_is_checked_with_the_groups_execution():
    # GPU 0 batches the prefix of s0-s2: every member waits for the group's 9.5 ms, 50 + 9.5 <= 60.
    # s3 alone would fit (50 + 5.9), but as a member the group takes 12.2 ms and breaks every SLO.
    specs = [SessionSpec(f"s{i}", f"m{i}", 60.0, 20.0, Profile.linear(1.0 + i * 0.3, 4.0, 32), "g") for i in range(4)]
    grouped, groups = planning_groups(specs, {})
    shared = GpuPlan(0, 50.0, tuple(SessionAlloc(f"s{i}", 1, 20.0) for i in range(3)), ("g",))
    alone = GpuPlan(1, 50.0, (SessionAlloc("s3", 1, 20.0),))
    gpu = GpuSpec("gpu", 16000.0)
    gpus, added = add_replicas([shared, alone], grouped, gpu, {"s3": 2}, 2, PlannerConfig(), groups=groups)
    assert added == set() and gpus == [shared, alone]
    assert validate_plan(Plan("replan", (shared, alone), 0, 0.0), grouped, gpu, 0.0, groups) == []


def test_a_rate_within_poisson_noise_of_the_planned_one_is_the_planned_one():
    planned = {"slow": 0.3, "busy": 100.0, "new": 5.0}
    windows = {"slow": 10.0, "busy": 10.0}
    # 6 requests where 3 were expected: noise; 1,300 where 1,000 were: 9.5 sigma, a change
    assert settled_rates({"slow": 0.6, "busy": 130.0}, windows, planned) == {"slow": 0.3, "busy": 130.0}
    assert settled_rates({"busy": 110.0}, windows, planned) == {"busy": 100.0}          # 3.2 sigma: noise
    assert settled_rates({"busy": 110.0}, {}, planned) == {"busy": 110.0}               # no counts: as measured
    assert settled_rates({"busy": 110.0}, windows, planned, {"busy"}) == {"busy": 110.0}  # a surge: as measured
    assert settled_rates({"other": 7.0}, windows, planned) == {"other": 7.0}            # not planned yet


def test_a_long_tail_measured_with_poisson_noise_keeps_its_plan_and_a_step_beyond_noise_re_plans():
    """Sessions of 0.3 to 3 requests/s counted over 10 s swing far outside the [0.8, 1.1] band by
    noise alone: judged as measured they re-plan at every evaluation after the cooldown; judged
    against the noise of their counts the plan stands. A real step still re-plans."""
    rng = np.random.default_rng(7)
    true = {f"m{i}": 0.3 + 0.06 * i for i in range(40)}
    slots = _slots("a", "b", "c", "d")

    def measured(rates):
        return [SessionInput(name, 150.0, rng.poisson(rate * 10.0) / 10.0, {"gpu": PROFILE})
                for name, rate in rates.items()]

    plain, settled = _loop(cooldown_s=5.0, epoch_s=300.0), _loop(cooldown_s=5.0, epoch_s=300.0)
    first = [SessionInput(name, 150.0, rate, {"gpu": PROFILE}) for name, rate in true.items()]
    plain.plan(first, slots, 0.0)
    plan = settled.plan(first, slots, 0.0, window_s=10.0)
    replans = 0
    for t in range(6, 60, 6):
        sample = measured(true)
        plain.plan(sample, slots, float(t))
        replans += plain.changed
        assert settled.plan(sample, slots, float(t), window_s=10.0) is plan
    assert replans >= 8
    stepped = dict(true, m0=6.0)             # 60 requests where 3 were expected
    after = settled.plan(measured(stepped), slots, 66.0, window_s=10.0)
    assert settled.changed and after.sessions["m0"].rate_rps > 3.0
    assert all(after.sessions[n].rate_rps == plan.sessions[n].rate_rps for n in true if n != "m0")  # the rest stand


def test_an_expected_rate_holds_while_frontends_report_zero_and_through_the_first_window_of_requests():
    loop = _loop(cooldown_s=5.0, epoch_s=30.0)
    slots = _slots("a", "b", "c")
    expected = {"m": 400.0}

    def at(rate: float) -> list[SessionInput]:
        return [SessionInput("m", 100.0, rate, {"gpu": PROFILE})]

    for now in (0.0, 10.0, 40.0):        # no client yet: every report says 0 requests/s
        plan = loop.plan(at(0.0), slots, now, expected=expected)
        assert plan.sessions["m"].rate_rps == 400.0 and sum(share for _, share in plan.backends_of("m")) >= 400.0
    assert loop.plan(at(200.0), slots, 80.0, expected=expected).sessions["m"].rate_rps == 400.0  # a first window
    assert loop.plan(at(900.0), slots, 81.0, expected=expected, surges={"m": 900.0}).sessions["m"].rate_rps == 900.0
    assert loop.plan(at(50.0), slots, 100.0, expected=expected).sessions["m"].rate_rps == 50.0   # measured now
    assert loop.plan(at(0.0), slots, 140.0, expected=expected).sessions["m"].rate_rps == MIN_PLANNED_RATE_RPS


def test_an_epoch_that_re_plans_to_the_tables_in_force_is_no_new_plan():
    loop = _loop(cooldown_s=5.0, epoch_s=30.0)
    slots = _slots("a", "b", "c")
    sessions = [SessionInput(f"m{i}", 100.0, 100.0 * (i + 1), {"gpu": PROFILE}) for i in range(3)]
    first = loop.plan(sessions, slots, 0.0)
    assert loop.plan(sessions, slots, 31.0) is first and not loop.changed       # the epoch: the same tables
    assert loop.state.last_plan_s == 31.0                                          # judged now: cooldown anew
    forced = loop.plan(sessions, slots, 40.0, force=ReplanReason.SESSIONS_CHANGED)  # may bring a new file
    assert loop.changed and forced is not first and same_tables(forced, first)
    grown = [SessionInput("m0", 100.0, 300.0, {"gpu": PROFILE}), *sessions[1:]]
    assert loop.plan(grown, slots, 80.0) is not forced and loop.changed


def test_a_surge_within_noise_of_the_planned_rate_is_no_surge():
    assert real_surges({"m": 6.0}, {"m": 2.0}, {"m": 5.3}) == {}             # 12 requests where 10.6 were planned
    assert real_surges({"m": 60.0}, {"m": 2.0}, {"m": 5.3}) == {"m": 60.0}   # 120 where 10.6 were: a surge
    assert real_surges({"m": 6.0}, {}, {"m": 5.3}) == {"m": 6.0}             # no window known: a surge
    assert real_surges({"m": 6.0}, {"m": 2.0}, {}) == {"m": 6.0}             # not planned yet: a surge
    loop = _loop(cooldown_s=5.0, epoch_s=30.0)
    slots = _slots("a", "b", "c")
    expected = {"m": 5.3}
    plan = loop.plan([SessionInput("m", 100.0, 0.0, {"gpu": PROFILE})], slots, 0.0, expected=expected)
    # The first report of its traffic is a surge against the zeros reported before: noise around the plan.
    same = loop.plan([SessionInput("m", 100.0, 6.0, {"gpu": PROFILE})], slots, 1.0, expected=expected,
                     surges={"m": 6.0}, surge_window_s=2.0)
    assert same is plan
    surged = loop.plan([SessionInput("m", 100.0, 60.0, {"gpu": PROFILE})], slots, 2.0, expected=expected,
                       surges={"m": 60.0}, surge_window_s=2.0)
    assert loop.changed and surged.sessions["m"].rate_rps == 60.0 and surged.why[0].startswith("demand surge: m")



def test_a_surge_is_held_until_the_windows_mean_catches_up_or_a_window_has_passed():
    """A 5x step: the surge re-plans at once; when the surging report ages out the window's mean,
    still holding counts from before the step, does not take the capacity back. A burst (the next
    report back down) is not held. (With ``--surge-floors``; off by default.)"""
    loop = _loop(surge_floors=True, cooldown_s=1.0, epoch_s=300.0)
    slots = _slots(*"abcdefgh")

    def at(rate: float, now: float, surge: float | None = None, latest: float | None = None):
        return loop.plan([SessionInput("m", 100.0, rate, {"gpu": PROFILE})], slots, now, window_s=10.0,
                         surges={"m": surge} if surge else None, surge_window_s=2.0,
                         latest={"m": (latest, 2.0)} if latest else None)

    before = at(60.0, 0.0)
    stepped = at(300.0, 2.0, surge=300.0)
    assert loop.changed and stepped.sessions["m"].rate_rps == 300.0
    assert loop.state.surge_floors == {"m": (300.0, 2.0)}
    # The surge aged out: the 10 s mean is 108 rps (two seconds of 300 among 60s), beyond noise below
    # it, while the latest reports go on at the step's rate (within noise of it).
    assert at(108.0, 4.0, latest=280.0) is stepped and at(204.0, 8.0, latest=310.0) is stepped
    assert loop.state.surge_floors == {"m": (300.0, 2.0)}
    # The mean caught up within noise (2,900 counted where 3,000 were held): the floor goes, the plan stays.
    assert at(290.0, 10.0, latest=290.0) is stepped and loop.state.surge_floors == {}
    # Without the latest reports known, a surge is held a whole window, then the mean is planned.
    at(300.0, 20.0)
    burst = at(900.0, 30.0, surge=900.0)
    assert burst.sessions["m"].rate_rps == 900.0
    assert at(400.0, 35.0) is burst and at(400.0, 39.9) is burst          # held: 10 s since the surge
    after = at(400.0, 40.5)
    assert loop.state.surge_floors == {} and after.sessions["m"].rate_rps == 400.0
    # A burst: the next report is back at 300 rps (600 requests where 1,800 were held): not held.
    assert at(1000.0, 45.0, surge=1000.0).sessions["m"].rate_rps == 1000.0
    assert loop.state.surge_floors == {"m": (1000.0, 45.0)}
    assert at(450.0, 47.0, latest=300.0).sessions["m"].rate_rps == 450.0 and loop.state.surge_floors == {}
    assert before.sessions["m"].rate_rps == 60.0


def test_a_step_down_is_planned_for_from_the_latest_report_not_the_lagging_mean():
    """The window's mean lags a step down: at 5x down it came down over 8-20 s in the simulator. A
    latest report beyond noise below the mean and below it by the surge ratio is planned for."""
    # 2 s of 60 rps where the mean says 300: 120 counted where 600 were expected: a drop
    assert dropped_rates({"m": (60.0, 2.0)}, {"m": 300.0}) == {"m": 60.0}
    # within noise (540 where 600), or beyond it but not by the ratio (450 where 600: 1.33x): none
    assert dropped_rates({"m": (270.0, 2.0)}, {"m": 300.0}) == {}
    assert dropped_rates({"m": (225.0, 2.0)}, {"m": 300.0}) == {}
    # a small session's silence is within its noise (0 where 6 were expected); a surging one is not
    # judged; one without a mean or a window known is left as measured
    assert dropped_rates({"s": (0.0, 2.0)}, {"s": 3.0}) == {}
    assert dropped_rates({"m": (60.0, 2.0)}, {"m": 300.0}, surging=frozenset({"m"})) == {}
    assert dropped_rates({"m": (60.0, 2.0)}, {}) == {} and dropped_rates({"m": (60.0, 0.0)}, {"m": 300.0}) == {}
    loop = _loop(cooldown_s=1.0, epoch_s=300.0)
    slots = _slots(*"abcdefgh")

    def at(rate: float, now: float, latest: float | None = None):
        return loop.plan([SessionInput("m", 100.0, rate, {"gpu": PROFILE})], slots, now, window_s=10.0,
                         latest={"m": (latest, 2.0)} if latest else None)

    high = at(300.0, 0.0, latest=300.0)
    assert high.sessions["m"].rate_rps == 300.0
    # two seconds after a step to 60 the mean still says 252 (out of the re-planner's band): the plan
    # is made for the 60 of the latest report, not for 252
    down = at(252.0, 3.0, latest=60.0)
    assert loop.changed and down.sessions["m"].rate_rps == 60.0
    # without the latest report, or with one within noise of the mean, the mean is planned
    assert at(252.0, 5.0, latest=250.0).sessions["m"].rate_rps == 252.0


def test_a_bursty_sessions_lull_is_no_drop_but_its_step_down_is():
    """A session of 115 requests/s with Gamma arrivals counted none in one 0.2 s report: beyond
    Poisson noise (23 expected, a margin of 22), so it was planned for that report's 0 (1 request/s,
    the planned minimum) and placed again a report later. A drop is judged beyond the noise of the session's own counts."""
    assert dropped_rates({"m": (0.0, 0.2)}, {"m": 115.0}) == {"m": 0.0}               # Poisson's noise
    assert dropped_rates({"m": (0.0, 0.2)}, {"m": 115.0}, dispersions={"m": 9.0}) == {}   # its own
    assert dropped_rates({"m": (0.0, 0.2)}, {"m": 115.0}, dispersions={"n": 9.0}) == {"m": 0.0}
    # a 5x step down over 2 s is beyond a dispersion of 4 (46 counted where 230, a margin of 124)
    assert dropped_rates({"m": (23.0, 2.0)}, {"m": 115.0}, dispersions={"m": 4.0}) == {"m": 23.0}
    loop = _loop(cooldown_s=1.0, epoch_s=300.0)
    slots = _slots(*"abcdefgh")

    def at(now: float, dispersion: float | None):
        return loop.plan([SessionInput("m", 100.0, 115.0, {"gpu": PROFILE})], slots, now, window_s=10.0,
                         latest={"m": (0.0, 0.2)}, dispersions={"m": dispersion} if dispersion else None)

    assert at(0.0, 9.0).sessions["m"].rate_rps == 115.0 and loop.state.drop_ceilings == {}
    assert at(3.0, None).sessions["m"].rate_rps < 115.0 and "m" in loop.state.drop_ceilings


def test_a_drop_is_held_as_a_ceiling_until_the_mean_comes_down_or_the_traffic_comes_back():
    """``nexus serve`` (reports every 0.5 s) after a step from 110 to 8 requests/s: the next latest
    report, by noise no drop against the lagging mean, planned the mean again: 2, 1, 2, 1 devices."""
    loop = _loop(cooldown_s=0.5, epoch_s=300.0)
    slots = _slots(*"abcdefgh")

    def at(mean: float, now: float, latest: float):
        return loop.plan([SessionInput("m", 100.0, mean, {"gpu": PROFILE})], slots, now, window_s=10.0,
                         latest={"m": (latest, 0.5)})

    assert at(110.0, 0.0, latest=110.0).sessions["m"].rate_rps == 110.0
    # 4 counted in 0.5 s where 55 were expected: a drop, held
    assert at(100.0, 1.0, latest=8.0).sessions["m"].rate_rps == 8.0
    assert loop.state.drop_ceilings == {"m": (8.0, 1.0)}
    # 5 where 25: not a drop against a mean of 50 by itself, but the mean (500 counted where the
    # ceiling gives 80) has not come down to it, and 10 rps is within noise of 8: held
    assert at(50.0, 2.0, latest=10.0).sessions["m"].rate_rps == 8.0
    # the mean came down within noise of it (110 where 80): the ceiling goes, and the plan made for 8
    # stands, as any within noise of its rate does
    assert at(11.0, 6.0, latest=9.0).sessions["m"].rate_rps == 8.0 and loop.state.drop_ceilings == {}
    # the traffic came back (50 counted where the ceiling gives 4): the ceiling goes, the mean is planned
    at(110.0, 20.0, latest=110.0)
    at(100.0, 21.0, latest=8.0)
    assert loop.state.drop_ceilings == {"m": (8.0, 21.0)}
    assert at(60.0, 22.0, latest=100.0).sessions["m"].rate_rps == 60.0 and loop.state.drop_ceilings == {}


def test_held_drops_go_after_a_window_or_a_surge_and_a_lower_drop_replaces_one():
    ceilings = held_drops({}, {"m": 60.0}, {"m": 300.0}, {"m": 10.0}, 0.0)
    assert ceilings == {"m": (60.0, 0.0)}
    assert held_drops(ceilings, {"m": 80.0}, {"m": 250.0}, {"m": 10.0}, 2.0) == ceilings
    assert held_drops(ceilings, {"m": 40.0}, {"m": 250.0}, {"m": 10.0}, 2.0) == {"m": (40.0, 2.0)}
    assert held_drops(ceilings, {}, {"m": 250.0}, {"m": 10.0}, 9.9) == ceilings
    assert held_drops(ceilings, {}, {"m": 250.0}, {"m": 10.0}, 10.0) == {}              # a window passed
    assert held_drops(ceilings, {}, {"m": 250.0}, {"m": 10.0}, 2.0, surging=frozenset({"m"})) == {}
    assert held_drops(ceilings, {}, {}, {}, 2.0) == {}                                    # no longer reported


def test_a_held_drop_is_judged_by_the_noise_of_the_sessions_own_counts():
    """A bursty session's drop is judged beyond the noise of counts as dispersed as its own
    (dropped_rates); its release is too: a burst within that noise is no return of the traffic."""
    ceilings = {"m": (60.0, 0.0)}
    came_back = {"m": (100.0, 2.0)}        # 200 counted where the ceiling gives 120
    assert held_drops(ceilings, {}, {"m": 250.0}, {"m": 10.0}, 2.0, came_back) == {}
    assert held_drops(ceilings, {}, {"m": 250.0}, {"m": 10.0}, 2.0, came_back, dispersions={"m": 16.0}) == ceilings
    # The window's mean (1,000 counted where the ceiling gives 600) came down within that noise.
    assert held_drops(ceilings, {}, {"m": 100.0}, {"m": 10.0}, 2.0) == ceilings
    assert held_drops(ceilings, {}, {"m": 100.0}, {"m": 10.0}, 2.0, dispersions={"m": 25.0}) == {}


def test_without_surge_floors_a_surge_is_planned_for_while_it_is_the_latest_report_and_never_held():
    """``--no-surge-floors`` (the default): the step's surge re-plans at once, as with floors; once its
    report is no longer the latest, the window's mean is planned (the spares on --device-headroom's
    devices, pooled over every session, absorb what it leaves)."""
    loop = _loop(cooldown_s=1.0, epoch_s=300.0)
    slots = _slots(*"abcdefgh")

    def at(rate: float, now: float, surge: float | None = None, latest: float | None = None):
        return loop.plan([SessionInput("m", 100.0, rate, {"gpu": PROFILE})], slots, now, window_s=10.0,
                         surges={"m": surge} if surge else None, surge_window_s=2.0,
                         latest={"m": (latest, 2.0)} if latest else None)

    at(60.0, 0.0)
    stepped = at(300.0, 2.0, surge=300.0)
    assert loop.changed and stepped.sessions["m"].rate_rps == 300.0
    assert loop.state.surge_floors == {"m": (300.0, 2.0)}      # while it is the latest report
    # The surge aged out, the latest reports go on at the step's rate: with floors the plan stayed
    # (the test above); without, the lagging mean is planned.
    lagging = at(108.0, 4.0, latest=280.0)
    assert loop.state.surge_floors == {} and lagging.sessions["m"].rate_rps == 108.0


def test_surge_floors_are_off_by_default_and_a_flag_turns_them_on():
    assert not SchedulerConfig().surge_floors and not PlannerSettings.from_config(SchedulerConfig()).surge_floors
    assert not PlannerSettings().surge_floors
    p = argparse.ArgumentParser()
    add_arguments(p, SchedulerConfig)
    on = from_args(SchedulerConfig, p.parse_args(["--surge-floors"]))
    assert on.surge_floors and PlannerSettings.from_config(on).surge_floors


def test_a_lower_surge_leaves_the_held_one_and_a_higher_one_replaces_it():
    floors = held_surges({}, {"m": 300.0}, {"m": 300.0}, {"m": 10.0}, 0.0)
    assert floors == {"m": (300.0, 0.0)}
    assert held_surges(floors, {"m": 200.0}, {"m": 200.0}, {"m": 10.0}, 3.0) == {"m": (300.0, 0.0)}
    assert held_surges(floors, {"m": 500.0}, {"m": 500.0}, {"m": 10.0}, 3.0) == {"m": (500.0, 3.0)}
    assert held_surges(floors, {}, {"m": 150.0}, {}, 9.0) == {"m": (300.0, 0.0)}    # no window: held by time
    assert held_surges(floors, {}, {"m": 150.0}, {}, 10.0) == {}
    assert held_surges(floors, {}, {}, {}, 1.0) == {}                                # no longer reported
    # The latest report within noise of the held rate (540 where 600): held; far below it: a burst, gone.
    assert held_surges(floors, {}, {"m": 150.0}, {"m": 10.0}, 4.0, {"m": (270.0, 2.0)}) == floors
    assert held_surges(floors, {}, {"m": 150.0}, {"m": 10.0}, 4.0, {"m": (100.0, 2.0)}) == {}
    # A bursty session's lull (300 where 600, Gamma arrivals of CV 4): within its own noise, held.
    lull = {"m": (150.0, 2.0)}
    assert held_surges(floors, {}, {"m": 150.0}, {"m": 10.0}, 4.0, lull) == {}
    assert held_surges(floors, {}, {"m": 150.0}, {"m": 10.0}, 4.0, lull, {"m": 16.0}) == floors


# ---- spare replicas on idle backends --------------------------------------------------------------


def _spare_loop(overbook: float = PlannerSettings.spare_overbook, **replan) -> Loop:
    return Loop(PlannerSettings(ReplanConfig(**replan), spare_replicas=True, spare_overbook=overbook))


def _spare_backends(plan) -> set[str]:
    return {b.node_id for p in plan.placements.values() for b in p.backends if b.spare}


def test_idle_backends_hold_spares_of_the_busiest_sessions_and_count_as_neither_needed_nor_costly():
    from globalsched.actuators.device_scaler import demands

    loop = _spare_loop()
    # Each of m0-m2 nearly fills a GPU; "light" shares one. Five backends: one or two idle.
    sessions = [SessionInput(f"m{i}", 100.0, 300.0 - 50.0 * i, {"gpu": PROFILE}) for i in range(3)]
    plain = Loop().plan(sessions, _slots("a", "b", "c", "d", "e"), 0.0)
    used = {b.node_id for p in plain.placements.values() for b in p.backends if b.sessions}
    plan = loop.plan(sessions, _slots("a", "b", "c", "d", "e"), 0.0)
    spares = _spare_backends(plan)
    assert spares and len(spares) == 5 - len(used)
    assert plan.devices_needed["gpu"] == plain.devices_needed["gpu"] == len(used)     # spares are not needed
    where = _where(plan)
    with_spare = sorted(m for m, nodes in where.items() if nodes & spares)
    assert with_spare and with_spare[0] == "m0"          # the busiest first
    for m in with_spare:
        shares = [share for _, share in plan.backends_of(m)]
        assert len(shares) == 2 and shares[0] == shares[1]     # the frontends split its arrivals
    [t4] = demands(plan, [_node(n) for n in "abcde"], {}).values()
    assert all(t4.move_cost[n] == 0.0 for n in spares)   # drained first, as an idle one
    assert all(t4.move_cost[n] > 0.0 for n in used)


def test_a_surge_its_routes_serve_spares_at_the_overbook_is_left_to_them_and_a_larger_one_is_planned():
    """A burst goes to the replica with the least work outstanding, spares included: a surge within the
    session's routes (a spare's throughput counted at 1/overbook, its room being overbooked) forces no
    plan, which would move the spares; beyond them, it is planned at once."""
    sessions = [SessionInput("m", 100.0, 60.0, {"gpu": PROFILE})]
    slots = _slots("a", "b", "c", "d")
    loop = _spare_loop(2.0, cooldown_s=5.0, epoch_s=30.0)
    plan = loop.plan(sessions, slots, 0.0)
    own = sum(s.throughput_rps for p in plan.placements.values() for b in p.backends if not b.spare
              for s in b.sessions if s.model == "m")
    spare = sum(s.throughput_rps for p in plan.placements.values() for b in p.backends if b.spare
                for s in b.sessions if s.model == "m")
    assert own > 0 and spare > 0
    routes = own + spare / 2.0
    assert 0.95 * routes > 1.1 * 60.0                     # a demand surge by the re-planner's band
    within = loop.plan(sessions, slots, 1.0, surges={"m": 0.95 * routes})
    assert not loop.changed and within.why == ()
    beyond = loop.plan(sessions, slots, 1.5, surges={"m": 1.05 * routes})
    assert loop.changed and beyond.why[0].startswith("demand surge: m at")
    # Without spares the same surge is beyond the routes: planned.
    plain = _loop(cooldown_s=5.0, epoch_s=30.0)
    plain.plan(sessions, slots, 0.0)
    plain.plan(sessions, slots, 1.0, surges={"m": 0.95 * routes})
    assert plain.changed


def test_a_surge_of_a_session_with_no_plan_or_no_route_is_unabsorbed():
    assert unabsorbed_surges({"m": 5.0}, None, 2.0) == {"m": 5.0}
    plan = Loop().plan([SessionInput("m", 100.0, 60.0, {"gpu": PROFILE})], _slots("a"), 0.0)
    assert unabsorbed_surges({"new": 1.0, "m": 1.0}, plan, 2.0) == {"new": 1.0}
    assert unabsorbed_surges({}, plan, 2.0) == {}


def test_a_lost_primary_leaves_its_spare_serving_and_a_spare_stays_put_across_re_plans():
    loop = _spare_loop(1.0, cooldown_s=5.0, epoch_s=30.0)      # a spare GPU holds one batch: one spare each
    sessions = [SessionInput(f"m{i}", 100.0, 300.0, {"gpu": PROFILE}) for i in range(2)]
    slots = _slots("a", "b", "c", "d")
    first = _where(loop.plan(sessions, slots, 0.0))
    assert all(len(nodes) == 2 for nodes in first.values())          # two busy, two spare
    again = _where(loop.plan(sessions, slots, 40.0, force=ReplanReason.EPOCH))
    assert again == first                                             # nothing moves, spares included
    primary = sorted(first["m0"])[0]
    spare = (first["m0"] - {primary}).pop()
    plan = loop.plan(sessions, [s for s in slots if s.node_id != primary], 41.0, force=ReplanReason.MEMBERSHIP)
    assert spare in _where(plan)["m0"]                                # the spare carries it on


def test_a_plan_that_needs_the_idle_backends_takes_them_from_the_spares():
    loop = _spare_loop(cooldown_s=0.0)
    sessions = [SessionInput(f"m{i}", 100.0, 300.0, {"gpu": PROFILE}) for i in range(2)]
    slots = _slots("a", "b", "c", "d")
    assert len(_spare_backends(loop.plan(sessions, slots, 0.0))) == 2
    more = sessions + [SessionInput(f"n{i}", 100.0, 300.0, {"gpu": PROFILE}) for i in range(2)]
    plan = loop.plan(more, slots, 1.0)
    assert plan.devices_needed["gpu"] == 4 and plan.placements["gpu"].overcommitted == 0
    assert not _spare_backends(plan) and all(len(nodes) == 1 for nodes in _where(plan).values())


def _primaries(rates: dict[str, float], duty_ms: float = 100.0) -> tuple[list[GpuPlan], list[SessionSpec]]:
    """Each session alone on a GPU of ``duty_ms``, carrying its rate."""
    gpus, specs = [], []
    for i, (name, rate) in enumerate(rates.items()):
        batch = round(rate * duty_ms / 1000)
        gpus.append(GpuPlan(i, duty_ms, (SessionAlloc(name, batch, batch * 1000.0 / duty_ms, rate),)))
        specs.append(SessionSpec(name, name, 300.0, rate, PROFILE))
    return gpus, specs


def test_spares_share_the_first_spare_gpu_with_room_not_only_the_last_one_filled():
    # l(b) = 2b + 10 ms on a 100 ms cycle: a (batch 30, 70 ms) fills spare 1 alone; b (40 ms) and c
    # (38 ms) share spare 2 (78 ms); d (28 ms) fits only beside a. With no third idle backend, a
    # next fit (the last spare, then a new one) leaves d without a spare.
    gpus, specs = _primaries({"a": 300.0, "b": 150.0, "c": 140.0, "d": 90.0})
    out, added, spares = add_spares(gpus, specs, GpuSpec("gpu", 16000.0), 2, PlannerConfig())
    holder = {name: gid for gid, name in added}
    assert set(holder) == {"a", "b", "c", "d"} and len(spares) == 2
    assert holder["d"] == holder["a"] != holder["b"] == holder["c"]
    assert validate_plan(Plan("spares", tuple(out), 0, 0.0), specs, GpuSpec("gpu", 16000.0)) == []


def test_a_spare_gpu_pools_its_room_over_its_spares_up_to_the_overbook():
    # l(b) = 2b + 10 ms on a 100 ms cycle: a (70 ms), b (40), c (38), d (28). One idle backend. Each
    # spare's batch in full at once: a and d (98 ms). Pooled at twice the cycle: all four (176 ms).
    from common.config import ConfigError

    gpus, specs = _primaries({"a": 300.0, "b": 150.0, "c": 140.0, "d": 90.0})
    gpu = GpuSpec("gpu", 16000.0)
    _, strict, _ = add_spares(gpus, specs, gpu, 1, PlannerConfig())
    assert sorted(name for _, name in strict) == ["a", "d"]
    out, pooled, spares = add_spares(gpus, specs, gpu, 1, PlannerConfig(), overbook=2.0)
    assert sorted(name for _, name in pooled) == ["a", "b", "c", "d"] and len(spares) == 1
    plan = Plan("spares", tuple(out), 0, 0.0)
    assert [g for g in out if g.id not in spares] == gpus                  # the busy GPUs as they were
    assert validate_plan(plan, specs, gpu, spare_gpus=spares, spare_overbook=2.0) == []
    [spare] = spares
    [tight] = validate_plan(plan, specs, gpu, spare_gpus=spares, spare_overbook=1.5)
    assert tight.gpu_id == spare and tight.message == (f"gpu {spare}: executions take 176 ms > duty cycle 100 ms x 1.5 "
                                                       f"(a spare GPU)")
    [busy] = validate_plan(plan, specs, gpu)                                # judged as a busy GPU, it overflows
    assert busy.gpu_id == spare and busy.kind.value == "duty-cycle"
    # The scheduler's setting: at least 1, finite; the flag reaches the planner.
    for bad in (0.5, float("nan"), float("inf")):
        with pytest.raises(ConfigError) as refused:
            SchedulerConfig(spare_overbook=bad).validate()
        assert str(refused.value) == f"--spare-overbook: expected a number at least 1, got {bad}"
    p = argparse.ArgumentParser()
    add_arguments(p, SchedulerConfig)
    assert PlannerSettings.from_config(from_args(SchedulerConfig, p.parse_args(["--spare-overbook", "1.5"]))
                                       ).spare_overbook == 1.5


def test_a_pooled_spare_gpu_holds_a_spare_of_each_session_beside_the_plans_own_gpus():
    # Two sessions alone on a GPU each, two idle backends: with spare GPUs of one batch, one spare
    # each; pooled at twice the cycle, both spare GPUs hold a spare of both (88 ms of 56). The plan's
    # own GPUs keep the backends they would take without spares; the spare GPUs take the rest.
    sessions = [SessionInput(f"m{i}", 100.0, 300.0, {"gpu": PROFILE}) for i in range(2)]
    slots = _slots("a", "b", "c", "d")
    plain = _where(Loop().plan(sessions, slots, 0.0))
    assert _where(_spare_loop(1.0).plan(sessions, slots, 0.0)) == {"m0": {"a", "c"}, "m1": {"b", "d"}}
    plan = _spare_loop(2.0).plan(sessions, slots, 0.0)
    assert _where(plan) == {"m0": plain["m0"] | {"c", "d"}, "m1": plain["m1"] | {"c", "d"}}
    assert _spare_backends(plan) == {"c", "d"}


def test_idle_backends_hold_a_spare_of_every_session_then_more_where_the_load_is():
    # On a 100 ms cycle: a (310 rps, 72 ms), b (100 rps, 30 ms; not beside a), c (10 rps, 12 ms).
    # Each gains one spare (c's beside a's), then the idle room goes to the most load per GPU: a
    # (155 per GPU) before b (50) and c (5), never twice on one GPU, until the room is full.
    gpus, specs = _primaries({"a": 310.0, "b": 100.0, "c": 10.0})
    load = {"a": 310.0, "b": 100.0}
    out, added, spares = add_spares(gpus, specs, GpuSpec("gpu", 16000.0), 3, PlannerConfig())
    # Three idle backends: a's, b's and a's second spare; b has no room left; c fills in beside each.
    assert sorted(name for _, name in added) == ["a", "a", "b", "c", "c", "c"] and len(spares) == 3
    out, added, spares = add_spares(gpus, specs, GpuSpec("gpu", 16000.0), 40, PlannerConfig())
    on = {n: {gid for gid, name in added if name == n} for n in ("a", "b", "c")}
    assert sum(1 for _, name in added if name == "a") == len(on["a"])        # never twice on one GPU
    assert len(spares) == 40 and on["a"] | on["b"] == set(spares)           # every idle backend taken
    # Filled where the load per GPU is highest: neither a nor b would have taken the other's last spare.
    gpus_of = {n: len(on[n]) + 1 for n in ("a", "b")}
    assert load["a"] / (gpus_of["a"] - 1) >= load["b"] / gpus_of["b"]
    assert load["b"] / (gpus_of["b"] - 1) >= load["a"] / gpus_of["a"]
    assert on["c"] == set(spares)                                         # the small one fits beside either
    assert validate_plan(Plan("spares", tuple(out), 0, 0.0), specs, GpuSpec("gpu", 16000.0)) == []


def test_a_session_on_many_gpus_of_its_own_gains_spares_where_the_room_is_idle():
    # "big" runs on 20 GPUs (150 rps each: 3,000 rps), five tail sessions on one each (10 rps). Ten
    # idle backends: big, the busiest per GPU by far, takes a spare on every one of them, and the
    # tails fill in beside. With a cap of 16 GPUs a session, big gained its first spare only, and the
    # tails took the room (issue 24's trace at 1,000 devices: m00, 12% of the load, on more than 16
    # GPUs of its own, failed most of the step's requests with every device registered).
    tails = {f"t{i}": 10.0 for i in range(5)}
    gpus, specs = _primaries(tails)
    for gid in range(5, 25):
        gpus.append(GpuPlan(gid, 100.0, (SessionAlloc("big", 15, 150.0, 150.0),)))
    specs.append(SessionSpec("big", "big", 300.0, 3000.0, PROFILE))
    out, added, spares = add_spares(gpus, specs, GpuSpec("gpu", 16000.0), 10, PlannerConfig())
    assert {gid for gid, name in added if name == "big"} == set(spares) and len(spares) == 10
    assert validate_plan(Plan("spares", tuple(out), 0, 0.0), specs, GpuSpec("gpu", 16000.0)) == []


def test_a_session_on_several_gpus_gains_its_spare_before_the_single_gpu_sessions_fill_the_room():
    # On a 100 ms cycle: "big" runs on two GPUs (150 rps each, batch 15: 40 ms), six tail sessions on
    # one each (10 rps, batch 1: 12 ms). One idle backend. Every session gains one spare, busiest
    # first: big's (40 ms), then the tails' beside it while they fit. Spares for the single-GPU
    # sessions first left big, the busiest, none: its bursts then overflowed its two GPUs (issue 24's
    # trace with every device registered: a CV-4 session of 82 rps on two GPUs, no spare, at the peak).
    tails = {f"t{i}": 10.0 for i in range(6)}
    gpus, specs = _primaries(tails)
    for gid in (6, 7):
        gpus.append(GpuPlan(gid, 100.0, (SessionAlloc("big", 15, 150.0, 150.0),)))
    specs.append(SessionSpec("big", "big", 300.0, 300.0, PROFILE))
    out, added, spares = add_spares(gpus, specs, GpuSpec("gpu", 16000.0), 1, PlannerConfig())
    with_spare = {name for _, name in added}
    assert "big" in with_spare and len(spares) == 1
    assert 3 <= len(with_spare & set(tails)) < len(tails)          # the tails take the room left
    assert validate_plan(Plan("spares", tuple(out), 0, 0.0), specs, GpuSpec("gpu", 16000.0)) == []


def test_filling_the_idle_room_judges_a_bounded_number_of_spare_gpus_per_spare(monkeypatch):
    # b1's second spare (74 ms) fits only beside m's spare, on a 200 ms cycle, the last of the spare
    # GPUs (the others run b2, b3 and x alone, 64-74 ms of 100): found within FILL_CHECKS judged
    # GPUs, not within 2.
    import globalsched.planning.replicas as replicas

    gpus, specs = _primaries({"b1": 320.0, "b2": 320.0, "b3": 320.0, "x": 270.0, "l": 10.0})
    gpus.append(GpuPlan(len(gpus), 200.0, (SessionAlloc("m", 28, 140.0, 140.0),)))
    specs.append(SessionSpec("m", "m", 300.0, 140.0, PROFILE))

    def b1_beside_m() -> bool:
        out, added, _ = add_spares(gpus, specs, GpuSpec("gpu", 16000.0), 5, PlannerConfig())
        assert validate_plan(Plan("spares", tuple(out), 0, 0.0), specs, GpuSpec("gpu", 16000.0)) == []
        m_spare = next(gid for gid, name in added if name == "m")
        return (m_spare, "b1") in added

    assert b1_beside_m()
    monkeypatch.setattr(replicas, "FILL_CHECKS", 2)
    assert not b1_beside_m()


def test_a_spare_gpu_is_judged_by_its_running_sums_as_the_full_rule_check_judges_it():
    # _SpareRoom.fits is a constant-time form of _with's full rule check: where it says yes or no,
    # the full check says the same, and it defers to the full check only within rounding of a
    # bound. Its sums grown by a replica are those of the grown GPU. Random GPUs, sessions, SLOs,
    # memory, margins and burst headroom.
    rng = np.random.default_rng(7)
    gpu = GpuSpec("gpu", 4000.0)
    verdicts = {True: 0, False: 0, None: 0}
    for _ in range(3000):
        planner = PlannerConfig(network_ms=float(rng.choice([0.0, 5.0])), burst_sigma=float(rng.choice([0.0, 2.0])))
        overbook = float(rng.choice([1.0, 1.5, 2.0]))
        duty_ms = float(rng.uniform(20.0, 200.0))
        specs = {}
        for i in range(int(rng.integers(1, 5))):
            profile = Profile.linear(float(rng.uniform(0.2, 4.0)), float(rng.uniform(1.0, 30.0)), 32,
                                     memory_base_mb=float(rng.uniform(0, 1500)), memory_per_item_mb=2.0)
            specs[f"s{i}"] = SessionSpec(f"s{i}", f"s{i}", float(rng.uniform(50.0, 500.0)),
                                         float(rng.uniform(1.0, 300.0)), profile)
        sessions = tuple(SessionAlloc(n, b := int(rng.integers(1, 9)), b * 1000.0 / duty_ms, float(rng.uniform(0.5, 1.0))
                                      * b * 1000.0 / duty_ms) for n in specs)
        g = GpuPlan(0, duty_ms, sessions)
        new = SessionSpec("new", "new", float(rng.uniform(50.0, 500.0)), 0.0,
                          Profile.linear(float(rng.uniform(0.2, 4.0)), float(rng.uniform(1.0, 30.0)), 32,
                                         memory_base_mb=float(rng.uniform(0, 1500)), memory_per_item_mb=2.0))
        rate = float(rng.uniform(1.0, 300.0))
        room = _SpareRoom.of(g, specs, {}, planner, {})
        verdict = room.fits(new, rate, gpu, planner, {}, overbook)
        grown = _with(g, new, rate, gpu, planner, {**specs, "new": new}, (), overbook)
        assert verdict is None or verdict == (grown is not None), (g, new, rate, planner)
        verdicts[verdict] += 1
        if grown is not None:
            assert room.plus(grown, new, {**specs, "new": new}, {}, planner, {}) == \
                _SpareRoom.of(grown, {**specs, "new": new}, {}, planner, {})
    assert verdicts[True] > 300 and verdicts[False] > 300 and verdicts[None] == 0


def test_a_member_of_a_prefix_the_spare_gpu_shares_is_left_to_the_full_rule_check():
    # Its executions merge with the prefix's batch, so the GPU's running sums cannot judge it.
    member = SessionSpec("m", "m", 300.0, 10.0, PROFILE, prefix_group="p")
    other = SessionSpec("o", "o", 300.0, 10.0, PROFILE, prefix_group="p")
    g = GpuPlan(0, 100.0, (SessionAlloc("o", 1, 10.0),), shared_prefixes=("p",))
    room = _SpareRoom.of(g, {"o": other}, {"p": PrefixGroup("p", PROFILE)}, PlannerConfig(), {})
    assert room.fits(member, 10.0, GpuSpec("gpu", 16000.0), PlannerConfig(), {}) is None
    assert room.fits(SessionSpec("x", "x", 300.0, 10.0, PROFILE), 10.0, GpuSpec("gpu", 16000.0), PlannerConfig(),
                     {}) is True


def _node(name: str):
    from common.pb import control
    from globalsched.state.membership import Node

    return Node(name, control.NODE_KIND_BACKEND, f"{name}:1", "gpu", "gpu", 16000.0)


def test_a_plan_folded_onto_fewer_backends_is_replaced_by_a_fresh_one_that_fits_them():
    # The first start: mlp is planned with a slow first profile, so the two sessions cannot share a
    # duty cycle and the plan needs two devices on the one backend there is. Its real profile then
    # lets them share one: the re-plan must not keep the folded second device as tolerated waste.
    loop = _loop(cooldown_s=5.0, epoch_s=30.0)
    slow = Profile.linear(20.0, 1.0, 32, device_type="gpu")
    fast = Profile.linear(2.0, 1.0, 32, device_type="gpu")
    resnet = Profile.linear(15.0, 1.0, 32, device_type="gpu")
    slots = _slots("a")
    first = loop.plan([SessionInput("resnet", 100.0, 1.0, {"gpu": resnet}),
                       SessionInput("mlp", 50.0, 1.0, {"gpu": slow})], slots, 0.0)
    assert first.devices_needed["gpu"] == 2 and first.placements["gpu"].overcommitted == 1
    again = loop.plan([SessionInput("resnet", 100.0, 1.0, {"gpu": resnet}),
                       SessionInput("mlp", 50.0, 1.0, {"gpu": fast})], slots, 1.0,
                      force=ReplanReason.SESSIONS_CHANGED)        # as the arrival of a profile asks
    assert again.reasons["gpu"] is not ReplanReason.NONE, again.reasons
    assert again.devices_needed["gpu"] == 1 and again.placements["gpu"].overcommitted == 0
    assert _where(again) == {"resnet": {"a"}, "mlp": {"a"}}
    assert not [n for n in again.notes if "folded" in n]


def test_a_plan_that_grows_past_the_backends_moves_nothing_to_save_a_device():
    # A step under --backends auto: the re-plan needs more devices than are registered (the scaler
    # starts them). A fresh plan would need fewer, still more than there are, by moving sessions between
    # busy backends; the minimal-movement re-plan is kept (issue 24's step trace lost points of SLO
    # attainment to those moves).
    profile = Profile.linear(5.0, 10.0, 32, memory_base_mb=100, memory_per_item_mb=1, device_type="gpu")

    def sessions(boost: float) -> list[SessionInput]:
        return [SessionInput(f"m{i}", 200.0, (boost if i < 3 else 1.0) * 20.0 * (1 + i % 3), {"gpu": profile})
                for i in range(9)]

    loop = _loop(cooldown_s=0.0)
    slots = _slots("a", "b", "c")
    first = loop.plan(sessions(1.0), slots, 0.0)
    assert first.devices_needed["gpu"] == 3
    before = _where(first)
    grown = loop.plan(sessions(3.0), slots, 1.0)
    assert grown.reasons["gpu"] is not ReplanReason.NONE
    assert grown.devices_needed["gpu"] > len(slots)                  # the cluster must grow
    after = _where(grown)
    assert all(after[m] == nodes for m, nodes in before.items()), (before, after)


def test_a_backends_routed_load_splits_its_sessions_planned_load_over_their_spares():
    # m is planned at 90 rps on a; its spare on c is planned for as much, and the frontends send each
    # half. n (30 rps) has no spare. The simulator's kill fault picks backends by this load.
    from globalsched.planning.cluster_values import ClusterPlan
    from globalsched.planning.placement import BackendAssignment, PlacedSession, Placement

    backends = (BackendAssignment("a", 100.0, (PlacedSession("m", 9, 90.0, 90.0),)),
                BackendAssignment("b", 100.0, (PlacedSession("n", 3, 30.0, 30.0),)),
                BackendAssignment("c", 100.0, (PlacedSession("m", 9, 90.0, 90.0),), spare=True))
    load = ClusterPlan({"gpu": Placement(backends, 0, 0)}, {}, {}).routed_load_rps()
    assert load == {"a": 45.0, "c": 45.0, "b": 30.0}


def test_every_plan_carries_its_types_bounds_before_rounding_at_the_rates_it_planned():
    # The device scaler tells from them how a plan grows with its rates (a step: scaling_policy.grown),
    # so they are the bounds of the rates planned.
    loop = _loop(cooldown_s=5.0, epoch_s=30.0)
    sessions = [SessionInput(f"m{i}", 100.0, 5.0 * (i + 1), {"gpu": PROFILE}) for i in range(6)]
    first = loop.plan(sessions, _slots("a", "b", "c"), 0.0)
    specs = [SessionSpec(p.name, p.model, p.slo_ms, p.rate_rps, PROFILE) for p in first.sessions.values()]
    tight, per_request = bounds_gpus(specs, GpuSpec("gpu", 16000.0), loop.settings.replan.planner)
    assert first.bound_gpus["gpu"] == pytest.approx((tight, per_request))
    assert math.ceil(tight - 1e-9) == first.lower_bounds["gpu"] and 0 < per_request < tight


def test_a_fixed_cluster_keeps_burst_room_on_its_devices_only_while_its_idle_ones_are_too_few_for_spares():
    fixed = PlannerSettings.from_config(SchedulerConfig())
    assert fixed.planner.burst_sigma == 0.0 and fixed.short_burst_sigma == FIXED_BURST_SIGMA
    elastic = PlannerSettings.from_config(SchedulerConfig(min_devices="1", max_devices="8"))
    assert elastic.planner.burst_sigma == 0.0 and elastic.short_burst_sigma is None
    chosen = PlannerSettings.from_config(SchedulerConfig(burst_sigma=2.0))
    assert chosen.planner.burst_sigma == 2.0 and chosen.short_burst_sigma is None
    # Eight sessions on 4 devices; 60% more is 2: six backends hold the spares, five do not.
    sessions = [SessionInput(f"m{i}", 60.0, 30.0, {"gpu": PROFILE}) for i in range(8)]
    specs = [SessionSpec(s.model, s.model, s.slo_ms, s.rate_rps, PROFILE) for s in sessions]

    def room_kept(loop: Loop) -> bool:
        ts = loop.state.types["gpu"]
        return not validate_plan(ts.plan, specs, GpuSpec("gpu", 16000.0), fixed.planner.margins_ms,
                                 burst_sigma=FIXED_BURST_SIGMA, spare_gpus=ts.spares, spare_overbook=2.0)

    loops = {}
    for n, short in ((5, True), (6, False)):
        loop = loops[n] = Loop(fixed)
        slots = _slots(*(f"b{k}" for k in range(n)))
        first = loop.plan(sessions, slots, 0.0)          # no plan in force yet: none
        assert first.devices_needed == {"gpu": 4} and not first.notes and not room_kept(loop)
        plan = loop.plan(sessions, slots, 1.0, force=ReplanReason.EPOCH)
        assert room_kept(loop) is short, n
        assert any("too few backends for the plan's devices and 60% more" in note for note in plan.notes) is short
    # A cluster sized to its plan keeps the room and says nothing: it has no idle backend to wonder about.
    loop = Loop(fixed)
    loop.plan(sessions, _slots(*(f"b{k}" for k in range(4))), 0.0)
    plan = loop.plan(sessions, _slots(*(f"b{k}" for k in range(4))), 1.0, force=ReplanReason.EPOCH)
    assert room_kept(loop) and not plan.notes
    # Two backends more beside the plan with room: the next plan drops it, the spares take the bursts.
    plan = loops[5].plan(sessions, _slots(*(f"b{k}" for k in range(7))), 2.0, force=ReplanReason.EPOCH)
    assert not room_kept(loops[5]) and loops[5].state.types["gpu"].spares and not plan.notes
    # A chosen Z holds whatever the backends.
    loop = Loop(chosen)
    loop.plan(sessions, _slots(*(f"b{k}" for k in range(20))), 0.0)
    assert not validate_plan(loop.state.types["gpu"].plan, specs, GpuSpec("gpu", 16000.0), chosen.planner.margins_ms,
                             burst_sigma=2.0, spare_gpus=loop.state.types["gpu"].spares, spare_overbook=2.0)


def test_a_plan_of_one_device_keeps_burst_room_unless_a_second_backend_holds_its_spare():
    fixed = PlannerSettings.from_config(SchedulerConfig())
    one = Plan("replan", (GpuPlan(0, 50.0, (SessionAlloc("m", 4, 80.0, 40.0),)),), 1, 0.0)
    assert type_burst_sigma(fixed, TypeState(plan=one), 1) == FIXED_BURST_SIGMA
    assert type_burst_sigma(fixed, TypeState(plan=one), 2) == 0.0
    assert type_burst_sigma(fixed, TypeState(), 1) == 0.0          # the first plan: nothing in force
    # A plan's spare GPUs are not its devices: 4 GPUs, one of them spares, need 3 + 2.
    four = Plan("replan", tuple(GpuPlan(i, 50.0, (SessionAlloc("m", 4, 80.0, 40.0),)) for i in range(4)), 4, 0.0)
    assert type_burst_sigma(fixed, TypeState(plan=four, spares=frozenset({3})), 5) == 0.0
    assert type_burst_sigma(fixed, TypeState(plan=four), 5) == FIXED_BURST_SIGMA
