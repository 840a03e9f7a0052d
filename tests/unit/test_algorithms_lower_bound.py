"""The lower bounds of docs/planning.md: hand-computed values, memory, margins, prefix groups; the tight
bound never above the CP-SAT optimum."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from globalsched.planning.plan import GpuSpec, PlanningError, PrefixGroup, SessionSpec, gpu_exec_breakdown, validate_plan
from common.profile import BatchLatency, Profile
from globalsched.planning.algorithms import (PlannerConfig, lower_bound, lower_bound_gpus, lower_bound_throughput_only,
                                   lower_bound_throughput_only_gpus, solve)
from globalsched.planning.algorithms.config import Solver

RESNET = Profile.linear(1.3, 5.0, 64)


def test_hand_computed_throughput_only_bound() -> None:
    # best l(b)/b with 2 l(b) <= 100 is at b = 34: 49.2/34 ms per request
    s = SessionSpec("a", "m", 100.0, 2000.0, RESNET)
    assert lower_bound_throughput_only_gpus([s]) == pytest.approx(2000 * 49.2 / 34 / 1000)
    assert lower_bound_throughput_only([s]) == math.ceil(2000 * 49.2 / 34 / 1000) == 3
    two = [s, SessionSpec("b", "m", 400.0, 100.0, RESNET)]  # b = 64 fits: 88.2/64
    assert lower_bound_throughput_only_gpus(two) == pytest.approx(2.894117647 + 100 * 88.2 / 64 / 1000)


def test_hand_computed_fixed_cost_floor() -> None:
    # A high rate: the throughput term wins at the best batch, as before.
    s = SessionSpec("a", "m", 100.0, 2000.0, RESNET)
    assert lower_bound_gpus([s]) == pytest.approx(2000 * 49.2 / 34 / 1000)
    # 100 req/s at 400 ms: b = 35 balances 0.1 * 50.5/35 against 50.5/(400 - 50.5); b = 64 would
    # cost 88.2/311.8 per cycle. The throughput-only bound says 100 * 88.2/64.
    slow = SessionSpec("b", "m", 400.0, 100.0, RESNET)
    expected = min(max(0.1 * RESNET.latency_ms(b) / b, RESNET.latency_ms(b) / (400 - RESNET.latency_ms(b)))
                   for b in range(1, 65))
    assert expected == pytest.approx(max(0.1 * 50.5 / 35, 50.5 / 349.5))
    assert lower_bound_gpus([slow]) == pytest.approx(expected, rel=1e-6)
    assert lower_bound_throughput_only_gpus([slow]) == pytest.approx(100 * 88.2 / 64 / 1000)
    # A long tail: 100 sessions of 1 req/s, 50 ms SLO, l(b) = 5 + b. Each pays l(1)/(50 - 6) = 6/44
    # of a GPU at least: 14 GPUs, where throughput alone says 1.
    tail = [SessionSpec(f"t{i}", "m", 50.0, 1.0, Profile.linear(1.0, 5.0, 8)) for i in range(100)]
    assert lower_bound_gpus(tail) == pytest.approx(100 * 6 / 44, rel=1e-6)
    assert (lower_bound(tail), lower_bound_throughput_only(tail)) == (14, 1)
    plan = solve(tail, GpuSpec("g", 1e9))
    assert (plan.lower_bound, plan.lower_bound_throughput_only) == (14, 1) and plan.num_gpus >= 14


def test_exact_multiples_do_not_round_up() -> None:
    # 1.0 GPU exactly (up to float noise) must stay 1
    s = SessionSpec("a", "m", 100.0, 1000.0 / (49.2 / 34) * 3, RESNET)
    assert lower_bound([s]) == 3


def test_memory_and_margins_raise_the_bound() -> None:
    p = Profile.linear(1.0, 5.0, 64, 1000.0, 100.0)
    s = [SessionSpec("a", "m", 400.0, 3000.0, p)]
    assert lower_bound_gpus(s, GpuSpec("g", 5000)) == pytest.approx(3000 * 45 / 40 / 1000)
    assert lower_bound_gpus(s) == pytest.approx(3000 * 69 / 64 / 1000)
    tight = lower_bound_throughput_only_gpus(s, config=PlannerConfig(network_ms=300))  # budget 100: b <= 45
    assert tight == pytest.approx(3000 * 50 / 45 / 1000)


def test_non_monotone_memory_is_handled_soundly() -> None:
    rows = (BatchLatency(1, 10.0, 100.0), BatchLatency(2, 10.0, 900.0), BatchLatency(3, 10.0, 100.0))
    s = [SessionSpec("a", "m", 100.0, 300.0, Profile(rows))]
    assert lower_bound_gpus(s, GpuSpec("g", 500)) == pytest.approx(300 * 10 / 3 / 1000)
    assert lower_bound_gpus(s, GpuSpec("g", 500)) == lower_bound_throughput_only_gpus(s, GpuSpec("g", 500))


def test_prefix_groups_lower_the_bound_soundly() -> None:
    prefix = Profile.linear(1.0, 10.0, 64)
    model = Profile(tuple(BatchLatency(b, prefix.latency_ms(b) + 0.1 * b + 0.5) for b in range(1, 33)))
    sessions = [SessionSpec(f"s{i}", "m", 200.0, 300.0, model, "trunk") for i in range(4)]
    group = PrefixGroup("trunk", prefix)
    alone = lower_bound_throughput_only_gpus([SessionSpec(s.name, s.model, s.slo_ms, s.rate_rps, s.profile)
                                              for s in sessions])
    shared = lower_bound_throughput_only_gpus(sessions, prefix_groups=[group])
    # prefix best per item: its largest batch 64 (2*74 <= 200): 74/64; suffix best: (0.1*32 + 0.5)/32
    assert shared == pytest.approx(1200 * (74 / 64 + 3.7 / 32) / 1000)
    assert shared < alone
    plan = solve(sessions, GpuSpec("g", 1e9), prefix_groups=[group])
    assert plan.num_gpus >= math.ceil(shared - 1e-9) == plan.lower_bound_throughput_only
    # The tight bound takes the larger of that and the members' own fixed-cost floors.
    floor = min(max(0.3 * model.latency_ms(b) / b, model.latency_ms(b) / (200 - model.latency_ms(b)))
                for b in range(1, 33) if 2 * model.latency_ms(b) <= 200)
    assert lower_bound_gpus(sessions, prefix_groups=[group]) == pytest.approx(max(shared, floor), rel=1e-6)


def test_tail_of_tiny_group_members_is_floored() -> None:
    prefix = Profile.linear(1.0, 10.0, 64)
    model = Profile(tuple(BatchLatency(b, prefix.latency_ms(b) + 0.1 * b + 0.5) for b in range(1, 33)))
    sessions = [SessionSpec(f"s{i}", "m", 60.0, 0.5, model, "trunk") for i in range(4)]
    l1 = model.latency_ms(1)
    assert lower_bound_gpus(sessions, prefix_groups=[PrefixGroup("trunk", prefix)]) == pytest.approx(
        l1 / (60 - l1), rel=1e-6)


def test_infeasible_sessions_are_named() -> None:
    with pytest.raises(PlanningError, match="session 'x'"):
        lower_bound([SessionSpec("x", "m", 10.0, 1.0, RESNET)])


@st.composite
def tails(draw: st.DrawFn) -> list[SessionSpec]:
    """2-5 sessions, mostly slow ones whose fixed cost per cycle dominates, on an unbounded GPU."""
    out = []
    for i in range(draw(st.integers(2, 5))):
        alpha, beta = draw(st.floats(0.3, 3.0)), draw(st.floats(1.0, 10.0))
        slo = draw(st.floats(2 * (alpha + beta) + 1.0, 250.0))
        rate = math.exp(draw(st.floats(math.log(0.5), math.log(400.0))))
        out.append(SessionSpec(f"s{i}", f"m{i}", slo, rate, Profile.linear(alpha, beta, draw(st.integers(1, 16)))))
    return out


@pytest.mark.slow
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tails())
def test_tight_bound_never_exceeds_the_cpsat_optimum(sessions: list[SessionSpec]) -> None:
    gpu = GpuSpec("g", 1e9)
    plan = solve(sessions, gpu, Solver.CPSAT, PlannerConfig(cpsat_time_limit_s=2.0))
    assert validate_plan(plan, sessions, gpu) == []
    assert lower_bound_throughput_only(sessions, gpu) <= plan.lower_bound <= plan.num_gpus
    # Sharper than the integer check: the GPU shares every plan uses add up to the fractional bound.
    specs = {s.name: s for s in sessions}
    used = sum(gpu_exec_breakdown(g, specs, {})[0] / g.duty_cycle_ms for g in plan.gpus)
    assert used >= lower_bound_gpus(sessions, gpu) - 1e-9


def test_a_fleet_whose_memory_sets_the_device_count_is_bounded_by_its_memory() -> None:
    # 30 idle sessions of 600 MB on 4,000 MB GPUs: time needs a fraction of one GPU, memory 4.5 of them
    profile = Profile.linear(0.5, 1.5, 8, memory_base_mb=600.0)
    sessions = [SessionSpec(f"s{i}", f"m{i}", 100.0, 0.1, profile) for i in range(30)]
    gpu = GpuSpec("gpu", 4000.0)
    assert lower_bound_gpus(sessions, gpu, memory_term=False) < 1.0
    assert lower_bound_gpus(sessions, gpu) == pytest.approx(30 * profile.memory_mb(1) / 4000.0)
    assert lower_bound(sessions, gpu) == math.ceil(30 * profile.memory_mb(1) / 4000.0) == 5
    plan = solve(sessions, gpu, Solver.SQUISHY)
    assert validate_plan(plan, sessions, gpu) == [] and plan.num_gpus >= plan.lower_bound == 5
    # without a GPU to hold them (no memory given), time alone bounds it
    assert lower_bound(sessions) == 1
