"""CP-SAT: the exact optimum on small instances (never above squishy), LNS on larger ones."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from globalsched.planning.plan import GpuSpec, PrefixGroup, SessionSpec, validate_plan
from common.profile import BatchLatency, Profile
from globalsched.planning.algorithms import PlannerConfig, Solver, lower_bound, solve

BIG = GpuSpec("big", 1e9)
FAST = PlannerConfig(cpsat_time_limit_s=3.0)


def lin(name: str, slo: float, rate: float, alpha: float, beta: float, max_batch: int = 32) -> SessionSpec:
    return SessionSpec(name, "m-" + name, slo, rate, Profile.linear(alpha, beta, max_batch))


# Found by search: squishy needs 3 GPUs, two suffice (and CP-SAT proves it).
BEATS_SQUISHY = [lin("s0", 127, 12, 3.0, 2.0), lin("s1", 107, 92, 2.7, 7.0), lin("s2", 38, 308, 1.0, 1.7),
                 lin("s3", 135, 357, 2.8, 2.4)]


def test_exact_solver_finds_and_proves_a_better_plan() -> None:
    assert solve(BEATS_SQUISHY, BIG).num_gpus == 3
    plan = solve(BEATS_SQUISHY, BIG, Solver.CPSAT, FAST)
    assert plan.num_gpus == 2 and plan.optimal is True
    assert plan.notes and plan.notes[0].startswith("cp-sat optimal")
    assert validate_plan(plan, BEATS_SQUISHY, BIG) == []
    for g in plan.gpus:  # duty cycle = execution time, throughput from it
        assert g.duty_cycle_ms == pytest.approx(sum(BEATS_SQUISHY[int(a.session[1])].profile.latency_ms(a.batch)
                                                    for a in g.sessions))


def test_squishy_at_the_bound_is_reported_optimal_without_search() -> None:
    sessions = [lin("a", 200, 50, 1.0, 5.0)]
    plan = solve(sessions, BIG, Solver.CPSAT)
    assert plan.num_gpus == plan.lower_bound == 1 and plan.optimal is True
    assert plan.notes == ("squishy's plan meets the lower bound",)


def test_exact_model_respects_memory_and_margins() -> None:
    heavy = Profile.linear(1.0, 5.0, 16, 6000.0, 10.0)
    sessions = [SessionSpec(n, n, 200.0, 10.0, heavy) for n in ("a", "b", "c")]
    gpu = GpuSpec("1080ti", 11000)
    plan = solve(sessions, gpu, Solver.CPSAT, PlannerConfig(cpsat_time_limit_s=3.0, network_ms=30.0))
    assert plan.num_gpus == 3 and validate_plan(plan, sessions, gpu, margins_ms=30.0) == []


def test_exact_model_shares_prefixes() -> None:
    prefix = Profile.linear(0.3, 15.0, 128, 4000.0, 20.0)
    model = Profile(tuple(BatchLatency(b, prefix.latency_ms(b) + 0.2 * b + 1.0, prefix.memory_mb(b) + 300.0)
                          for b in range(1, 17)))
    sessions = [SessionSpec(f"h{i}", "m", 200.0, 150.0, model, "trunk") for i in range(3)]
    groups = [PrefixGroup("trunk", prefix)]
    gpu = GpuSpec("1080ti", 11000)
    plan = solve(sessions, gpu, Solver.CPSAT, FAST, prefix_groups=groups)
    assert plan.num_gpus == 1 and plan.gpus[0].shared_prefixes == ("trunk",)
    assert validate_plan(plan, sessions, gpu, prefix_groups=groups) == []


# Squishy needs 6 GPUs, the bound says 5; proving either way takes CP-SAT far longer than 0.05 s.
HARD = [lin("s0", 111.2, 52.7, 0.38, 2.9, 64), lin("s1", 209.6, 6.7, 0.41, 1.16, 64),
        lin("s2", 395.6, 1581.9, 0.98, 6.36, 64), lin("s3", 123.8, 1537.5, 1.3, 6.85, 64),
        lin("s4", 93.4, 5.2, 0.93, 5.59, 64), lin("s5", 59.1, 269.9, 2.33, 7.0, 64)]


def test_a_time_limit_too_short_to_prove_is_reported() -> None:
    squishy = solve(HARD, BIG)
    assert (squishy.num_gpus, squishy.lower_bound) == (6, 5)
    plan = solve(HARD, BIG, Solver.CPSAT, PlannerConfig(cpsat_time_limit_s=0.05))
    assert plan.optimal is False
    assert plan.notes[0].startswith("cp-sat ") and "kept squishy's plan" in plan.notes[0]
    assert plan.num_gpus <= squishy.num_gpus and validate_plan(plan, HARD, BIG) == []


def test_lns_improves_or_keeps_squishy_on_larger_instances() -> None:
    rng = random.Random(5)
    sessions = [lin(f"s{i}", rng.uniform(40, 400), math.exp(rng.uniform(math.log(5), math.log(600))),
                    rng.uniform(0.3, 3), rng.uniform(1, 10)) for i in range(30)]
    plan = solve(sessions, BIG, Solver.CPSAT_LNS, PlannerConfig(cpsat_time_limit_s=2.0, cpsat_workers=1))
    assert validate_plan(plan, sessions, BIG) == []
    assert lower_bound(sessions, BIG) <= plan.num_gpus <= solve(sessions, BIG).num_gpus
    assert plan.notes[0].startswith("cp-sat lns saved")
    # cpsat on an instance beyond "small" goes to the LNS too
    auto = solve(sessions, BIG, Solver.CPSAT, PlannerConfig(cpsat_time_limit_s=1.0, cpsat_workers=1))
    assert auto.notes[0].startswith("cp-sat lns") and auto.num_gpus <= solve(sessions, BIG).num_gpus


@st.composite
def small_workloads(draw: st.DrawFn) -> list[SessionSpec]:
    out = []
    for i in range(draw(st.integers(2, 4))):
        alpha, beta = draw(st.floats(0.3, 3.0)), draw(st.floats(1.0, 10.0))
        slo = draw(st.floats(max(30.0, 2 * (alpha + beta)), 300.0))
        out.append(lin(f"s{i}", slo, draw(st.floats(5.0, 600.0)), alpha, beta, draw(st.integers(1, 32))))
    return out


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_workloads())
def test_cpsat_solvers_are_valid_never_above_squishy_nor_below_the_bound(sessions: list[SessionSpec]) -> None:
    squishy = solve(sessions, BIG)
    for solver, limit in ((Solver.CPSAT, 2.0), (Solver.CPSAT_LNS, 0.5)):
        plan = solve(sessions, BIG, solver, PlannerConfig(cpsat_time_limit_s=limit))
        assert validate_plan(plan, sessions, BIG) == []
        assert plan.lower_bound <= plan.num_gpus <= squishy.num_gpus
