"""Pooled burst headroom (globalsched/planning/headroom.py): the statistic, the plans that keep it, and Poisson
arrivals simulated against planned devices overflowing no more often than the target."""

from __future__ import annotations

import math
import random

import pytest

from globalsched.planning.headroom import (BurstSums, BurstTerm, burst_excess_ms, lone_session_load_items, marginal_ms_per_item,
                             overflow_probability_target, own_burst_load_items, poisson_quantile_items, poisson_tail,
                             simulated_overflow_share)
from globalsched.planning.plan import GpuPlan, GpuSpec, Plan, SessionAlloc, SessionSpec, ViolationKind, validate_plan
from common.profile import Profile
from globalsched.planning.algorithms import PlannerConfig, ReplanState, Solver, replan, solve
from globalsched.planning.algorithms.baselines import per_session_headroom

BIG = GpuSpec("big", 1e9)
Z = 1.5
CYCLES = 20000


def tolerance(p: float, n: int = CYCLES) -> float:
    return 3.5 * math.sqrt(p * (1 - p) / n)


def long_tail(n: int, total_rps: float, seed: int) -> list[SessionSpec]:
    """Zipf rates, GPU-like profiles l(b) = 3-8 ms + 1-3 ms per item, SLOs of 50-200 ms (issue 18)."""
    rng = random.Random(seed)
    weights = [1 / (i + 1) for i in range(n)]
    scale = total_rps / sum(weights)
    return [SessionSpec(f"m{i}", f"m{i}", rng.uniform(50, 200), w * scale,
                        Profile.linear(rng.uniform(1, 3), rng.uniform(3, 8), 32)) for i, w in enumerate(weights)]


def test_target_probability_and_the_lone_session_rule() -> None:
    assert overflow_probability_target(1.5) == pytest.approx(0.0668072, abs=1e-6)
    assert overflow_probability_target(0.0) == pytest.approx(0.5)
    assert lone_session_load_items(7, 0.0) == 7
    p = overflow_probability_target(Z)
    for b in (1, 4, 32):
        n = lone_session_load_items(b, Z)  # exact: P(Poisson(n) > b) = p
        assert poisson_tail(n, b) == pytest.approx(p, rel=1e-6) and poisson_quantile_items(n, Z) == b
        assert poisson_quantile_items(n * 1.01, Z) == b + 1
        # alone at duty l(b) with that load the device needs no time beyond its batch; a bit more, one item
        assert burst_excess_ms([BurstTerm(b, n * 1000 / 40.0, 2.0)], 40.0, Z) == 0.0
        assert burst_excess_ms([BurstTerm(b, n * 1010 / 40.0, 2.0)], 40.0, Z) == pytest.approx(2.0)
        # the per-allocation form the CP-SAT model keeps is the statistic's single term, never laxer
        own = own_burst_load_items(b, Z)
        assert own + Z * math.sqrt(own) + (Z * Z - 1) / 6 + 0.5 == pytest.approx(b) and own < n
    assert lone_session_load_items(1, 1.5) == pytest.approx(0.419, abs=1e-3)  # 0.25 by n + z*sqrt(n) <= 1
    assert own_burst_load_items(1, 3.0) == 0.0  # too small a batch for any load at z = 3


def test_marginal_cost_is_the_steepest_secant() -> None:
    linear = Profile.linear(2.0, 5.0, 8)
    assert [marginal_ms_per_item(linear.latency_ms, b, 8) for b in (1, 4, 8)] == pytest.approx([2.0, 2.0, 2.0])
    lats = [10.0, 11.0, 15.0, 16.0]
    lat = lambda b: lats[b - 1]  # noqa: E731
    assert marginal_ms_per_item(lat, 1, 4) == pytest.approx(2.5)    # (15 - 10) / 2 beats 1 and 2
    assert marginal_ms_per_item(lat, 4, 4) == pytest.approx(2.0)    # at the top: mean slope
    assert marginal_ms_per_item(lat, 1, 1) == pytest.approx(10.0)   # no larger batch: another batch


def test_pooling_needs_less_than_the_sum_of_own_bursts() -> None:
    terms = [BurstTerm(1, 18.0, 2.0) for _ in range(20)]  # 20 sessions, 0.9 arrivals per 50 ms cycle
    pooled = burst_excess_ms(terms, 50.0, Z)
    own = sum(burst_excess_ms([t], 50.0, Z) for t in terms)
    assert 0 < pooled < own / 2
    assert burst_excess_ms(terms, 50.0, 0.0) == 0.0
    sums = BurstSums()
    for t in terms:
        sums.add(t)
    assert sums.excess_ms(50.0, Z) == pooled


def test_devices_provisioned_with_the_statistic_overflow_at_most_the_target() -> None:
    """Random devices of 1-30 sessions whose loads are scaled up until executions + H just fill the
    duty cycle; simulated Poisson cycles overflow at most as often as the target (within 3.5 sigma)."""
    rng = random.Random(7)
    p = overflow_probability_target(Z)
    worst, tried = 0.0, 0
    for trial in range(40):
        k = rng.choice([1, 1, 2, 3, 5, 10, 30])
        profiles = [Profile.linear(rng.uniform(0.3, 4.0), rng.uniform(0.5, 4.0), 64) for _ in range(k)]
        duty = rng.uniform(40, 150)
        weights = [math.exp(rng.uniform(0, math.log(100))) for _ in range(k)]

        def device(scale: float) -> tuple[list[float], float]:
            loads = [w * scale for w in weights]
            batches = [max(1, math.ceil(r * duty / 1000 - 1e-9)) for r in loads]
            if max(batches) > 64:
                return loads, math.inf
            terms = [BurstTerm(b, r, marginal_ms_per_item(pr.latency_ms, b, pr.max_batch))
                     for b, r, pr in zip(batches, loads, profiles)]
            return loads, sum(pr.latency_ms(b) for pr, b in zip(profiles, batches)) + burst_excess_ms(terms, duty, Z)

        if device(1e-9)[1] > duty:
            continue  # the fixed costs alone fill the cycle
        lo, hi = 1e-9, 1e4
        for _ in range(60):
            mid = math.sqrt(lo * hi)
            lo, hi = (mid, hi) if device(mid)[1] <= duty else (lo, mid)
        loads, need = device(lo)
        assert need <= duty
        share = simulated_overflow_share([pr.latency_ms for pr in profiles], [pr.max_batch for pr in profiles],
                                         loads, duty, CYCLES, seed=trial)
        assert share <= p + tolerance(p), (trial, k, share)
        worst, tried = max(worst, share), tried + 1
    assert tried >= 25 and worst > p / 4  # enough devices, and the statistic is not wildly conservative


def test_pooled_plans_keep_the_rule_and_overflow_at_most_the_target() -> None:
    sessions = long_tail(100, 1500.0, seed=1)
    config = PlannerConfig(burst_sigma=Z)
    plan = solve(sessions, BIG, Solver.SQUISHY, config)
    assert validate_plan(plan, sessions, BIG, burst_sigma=Z) == []
    assert all(a.load_rps is not None and a.load_rps <= a.throughput + 1e-9 for g in plan.gpus for a in g.sessions)
    loads = plan.load_by_session()
    assert all(loads[s.name] >= s.rate_rps * (1 - 1e-9) for s in sessions)
    assert plan.lower_bound <= plan.num_gpus
    specs = {s.name: s for s in sessions}
    p = overflow_probability_target(Z)
    for i, g in enumerate(plan.gpus):
        share = simulated_overflow_share([specs[a.session].profile.latency_ms for a in g.sessions],
                                         [specs[a.session].profile.max_batch for a in g.sessions],
                                         [a.load_rps for a in g.sessions], g.duty_cycle_ms, CYCLES, seed=100 + i)
        assert share <= p + tolerance(p), (g.id, share)
    # The per-session rule of earlier releases needs more devices for the same tail.
    per_session = solve(per_session_headroom(sessions, BIG, PlannerConfig(), Z), BIG)
    assert per_session.num_gpus > plan.num_gpus
    # Without headroom the same plan is tighter still, and carries no loads.
    plain = solve(sessions, BIG)
    assert plain.num_gpus <= plan.num_gpus and all(a.load_rps is None for g in plain.gpus for a in g.sessions)


def test_every_solver_and_the_replanner_keep_the_rule() -> None:
    sessions = long_tail(8, 120.0, seed=3)
    config = PlannerConfig(burst_sigma=Z, cpsat_time_limit_s=2.0)
    for solver in (Solver.SQUISHY, Solver.CPSAT, Solver.CPSAT_LNS, Solver.BATCH_OBLIVIOUS, Solver.ONE_PER_GPU):
        plan = solve(sessions, BIG, solver, config)
        assert validate_plan(plan, sessions, BIG, burst_sigma=Z) == [], solver
    from globalsched.planning.algorithms import ReplanConfig

    rc = ReplanConfig(planner=config)
    plan, state = replan(None, sessions, BIG, 0.0, ReplanState(), rc)
    assert validate_plan(plan, sessions, BIG, burst_sigma=Z) == []
    for factor in (1.3, 0.6, 2.0):
        changed = [s.with_rate(s.rate_rps * factor) for s in sessions]
        plan, state = replan(plan, changed, BIG, state.last_replan_s + 31.0, state, rc)
        assert validate_plan(plan, changed, BIG, burst_sigma=Z) == [], factor


def test_validation_names_a_device_without_room_for_bursts() -> None:
    s = SessionSpec("a", "m", 100.0, 500.0, Profile.linear(1.0, 5.0, 32))
    # l(20) = 25 ms: no idle time, and 19.5 arrivals per cycle on average for a batch of 20
    full = GpuPlan(0, 25.0, (SessionAlloc("a", 20, 800.0, 780.0),))
    violations = validate_plan(Plan("x", (full,), 1, 0.0), [s], BIG, burst_sigma=Z)
    assert [v.kind for v in violations] == [ViolationKind.DUTY_CYCLE]
    assert "burst headroom" in violations[0].message
    tight = SessionSpec("a", "m", 52.0, 500.0, Profile.linear(1.0, 5.0, 32))  # 25 + 25 + H > 52
    assert ViolationKind.SLO in {v.kind for v in validate_plan(Plan("x", (full,), 1, 0.0), [tight], BIG,
                                                                burst_sigma=Z)}
    assert validate_plan(Plan("x", (full,), 1, 0.0), [s], BIG) == []  # without headroom it is valid
    over = GpuPlan(0, 25.0, (SessionAlloc("a", 20, 800.0, 900.0),))
    assert ViolationKind.LOAD in {v.kind for v in validate_plan(Plan("x", (over,), 1, 0.0), [s], BIG)}
    under = GpuPlan(0, 25.0, (SessionAlloc("a", 20, 800.0, 400.0),))
    msgs = [v.message for v in validate_plan(Plan("x", (under,), 1, 0.0), [s], BIG)]
    assert msgs == ["session 'a': load 400 req/s < rate 500"]


def test_loads_round_trip_through_json() -> None:
    plan = solve(long_tail(10, 50.0, seed=2), BIG, Solver.SQUISHY, PlannerConfig(burst_sigma=Z))
    obj = plan.to_json_obj()
    assert all("load_rps" in a for g in obj["gpus"] for a in g["sessions"])
    assert Plan.from_json_obj(obj).gpus == plan.gpus


def test_a_residual_whose_duty_cycle_sits_on_the_rules_edge_gets_a_gpu_of_its_own() -> None:
    """At 1,000 devices in the simulator a residual of 31.8 requests/s (l(b) = 19.33b + 2.65 ms, SLO
    budget 395 ms) fit only by the exact lone quantile, at a duty cycle whose d + l + H was the SLO
    plus the validator's slack: the packer's own check, summed in another order, refused it an empty
    GPU and the planner failed. The duty cycle now keeps the rules with no slack."""
    spec = SessionSpec("m331", "m331", 400.0, 65.0, Profile.linear(19.33, 2.65, 32))
    config = PlannerConfig(network_ms=5.0, burst_sigma=Z)
    plan = solve([spec], BIG, Solver.SQUISHY, config)
    assert not validate_plan(plan, [spec], BIG, burst_sigma=Z, margins_ms=5.0)
    assert sum(a.planned_load_rps for g in plan.gpus for a in g.sessions) >= 65.0 - 1e-6
