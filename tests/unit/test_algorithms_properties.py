"""Property tests: on random workloads every solver's plan is valid and never below the lower bound."""

from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from globalsched.planning.plan import GpuSpec, Plan, PrefixGroup, SessionSpec, ViolationKind, gpu_exec_breakdown, validate_plan
from common.profile import BatchLatency, Profile
from globalsched.planning.algorithms import PlannerConfig, Solver, lower_bound, lower_bound_gpus, solve

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def profiles(draw: st.DrawFn, max_memory_mb: float) -> Profile:
    """GPU-like linear profiles or arbitrary monotone ones, memory growing with the batch."""
    n = draw(st.integers(1, 24))
    base_mb = draw(st.floats(0, max_memory_mb / 3))
    per_item_mb = draw(st.floats(0, 80))
    if draw(st.booleans()):
        alpha, beta = draw(st.floats(0.1, 4.0)), draw(st.floats(0.5, 12.0))
        lats = [alpha * b + beta for b in range(1, n + 1)]
    else:
        first = draw(st.floats(0.5, 15.0))
        steps = draw(st.lists(st.floats(0.0, 6.0), min_size=n - 1, max_size=n - 1))
        lats = [first]
        for s in steps:
            lats.append(lats[-1] + s)
    return Profile(tuple(BatchLatency(b, lats[b - 1], base_mb + per_item_mb * b) for b in range(1, n + 1)))


@st.composite
def workloads(draw: st.DrawFn, max_sessions: int = 8, max_rate: float = 1500.0,
              margins_ms: float = 0.0) -> tuple[list[SessionSpec], GpuSpec]:
    gpu = GpuSpec("gpu", draw(st.floats(4000, 16000)))
    sessions = []
    for i in range(draw(st.integers(1, max_sessions))):
        p = draw(profiles(gpu.memory_mb))
        slo_floor = 2 * p.latency_ms(1) + margins_ms
        slo = draw(st.floats(slo_floor, max(slo_floor, 400.0)))
        rate = draw(st.floats(0.5, max_rate))
        sessions.append(SessionSpec(f"s{i}", f"m{i}", slo, rate, p))
    return sessions, gpu


def _assert_sound(plan: Plan, sessions: list[SessionSpec], gpu: GpuSpec, margins_ms: float = 0.0,
                  groups: tuple[PrefixGroup, ...] = ()) -> None:
    assert validate_plan(plan, sessions, gpu, margins_ms, groups) == []
    assert plan.lower_bound == lower_bound(sessions, gpu, PlannerConfig(network_ms=margins_ms), groups)
    assert plan.num_gpus >= plan.lower_bound
    bound = lower_bound_gpus(sessions, gpu, PlannerConfig(network_ms=margins_ms), groups)
    assert plan.lower_bound >= bound - 1e-9
    # The proof's inequalities themselves: the shares of their GPUs the sessions use add up to the
    # bound of time shares, and the memory they hold on them to the memory term.
    specs, group_map = {s.name: s for s in sessions}, {g.name: g for g in groups}
    time_bound = lower_bound_gpus(sessions, gpu, PlannerConfig(network_ms=margins_ms), groups, memory_term=False)
    assert sum(gpu_exec_breakdown(g, specs, group_map)[0] / g.duty_cycle_ms for g in plan.gpus) >= time_bound - 1e-9
    if bound > time_bound:
        held = sum(specs[a.session].profile.memory_mb(a.batch) for g in plan.gpus for a in g.sessions)
        assert held / gpu.memory_mb >= bound - 1e-9
    assert plan.lower_bound_throughput_only is not None and plan.lower_bound_throughput_only <= plan.lower_bound


@SETTINGS
@given(workloads())
def test_squishy_plans_are_valid_and_above_the_bound(w: tuple[list[SessionSpec], GpuSpec]) -> None:
    sessions, gpu = w
    _assert_sound(solve(sessions, gpu, Solver.SQUISHY), sessions, gpu)


@SETTINGS
@given(workloads())
def test_baselines_are_valid_and_above_the_bound(w: tuple[list[SessionSpec], GpuSpec]) -> None:
    sessions, gpu = w
    for solver in (Solver.BATCH_OBLIVIOUS, Solver.ONE_PER_GPU):
        _assert_sound(solve(sessions, gpu, solver), sessions, gpu)


@SETTINGS
@given(workloads())
def test_published_nexus_breaks_only_memory_and_squishy_never_needs_more(
        w: tuple[list[SessionSpec], GpuSpec]) -> None:
    sessions, gpu = w
    nexus = solve(sessions, gpu, Solver.NEXUS)
    violations = validate_plan(nexus, sessions, gpu)
    assert {v.kind for v in violations} <= {ViolationKind.MEMORY}
    assert nexus.num_gpus >= nexus.lower_bound
    if not violations:  # memory did not bind: ours must be at least as good
        assert solve(sessions, gpu, Solver.SQUISHY).num_gpus <= nexus.num_gpus


@SETTINGS
@given(st.floats(0.0, 20.0).flatmap(lambda m: st.tuples(st.just(m), workloads(margins_ms=m))))
def test_margins_are_respected(arg: tuple[float, tuple[list[SessionSpec], GpuSpec]]) -> None:
    margins, (sessions, gpu) = arg
    config = PlannerConfig(network_ms=margins / 2, preprocess_ms=margins / 4, postprocess_ms=margins / 4)
    plan = solve(sessions, gpu, Solver.SQUISHY, config)
    assert validate_plan(plan, sessions, gpu, margins) == []
    assert plan.num_gpus >= lower_bound(sessions, gpu, config)


@st.composite
def grouped_workloads(draw: st.DrawFn) -> tuple[list[SessionSpec], GpuSpec, tuple[PrefixGroup, ...]]:
    """Sessions whose models share one prefix: each model = prefix + its own suffix."""
    gpu = GpuSpec("gpu", draw(st.floats(3000, 16000)))
    n = draw(st.integers(8, 24))
    p_alpha, p_beta = draw(st.floats(0.1, 2.0)), draw(st.floats(0.5, 8.0))
    p_mem = draw(st.floats(0, gpu.memory_mb / 3))
    prefix = Profile.linear(p_alpha, p_beta, 4 * n, p_mem, draw(st.floats(0, 20)))
    sessions = []
    for i in range(draw(st.integers(1, 5))):
        s_alpha, s_beta = draw(st.floats(0.0, 2.0)), draw(st.floats(0.0, 5.0))
        s_mem = draw(st.floats(0, gpu.memory_mb / 4))
        rows = tuple(BatchLatency(b, prefix.latency_ms(b) + s_alpha * b + s_beta,
                                  prefix.memory_mb(b) + s_mem) for b in range(1, n + 1))
        p = Profile(rows)
        slo = draw(st.floats(2 * p.latency_ms(1), max(2 * p.latency_ms(1), 300.0)))
        sessions.append(SessionSpec(f"g{i}", f"m{i}", slo, draw(st.floats(0.5, 800)), p, "trunk"))
    if draw(st.booleans()):
        sessions.append(SessionSpec("solo", "solo", 100.0, draw(st.floats(1, 300)), Profile.linear(1.0, 3.0, 16)))
    return sessions, gpu, (PrefixGroup("trunk", prefix),)


@SETTINGS
@given(grouped_workloads())
def test_prefix_aware_plans_are_valid(w: tuple[list[SessionSpec], GpuSpec, tuple[PrefixGroup, ...]]) -> None:
    sessions, gpu, groups = w
    plan = solve(sessions, gpu, Solver.SQUISHY, prefix_groups=groups)
    _assert_sound(plan, sessions, gpu, 0.0, groups)
    # The bound with sharing is never above the bound without it.
    alone = [SessionSpec(s.name, s.model, s.slo_ms, s.rate_rps, s.profile) for s in sessions]
    assert plan.lower_bound <= lower_bound(alone, gpu)
    for solver in (Solver.BATCH_OBLIVIOUS, Solver.ONE_PER_GPU):  # prefix-unaware: no shared prefixes
        other = solve(sessions, gpu, solver, prefix_groups=groups)
        assert all(not g.shared_prefixes for g in other.gpus)
        assert validate_plan(other, sessions, gpu, 0.0, groups) == []


@SETTINGS
@given(workloads())
def test_plan_json_round_trips(w: tuple[list[SessionSpec], GpuSpec]) -> None:
    sessions, gpu = w
    plan = solve(sessions, gpu)
    back = Plan.from_json_obj(plan.to_json_obj())
    assert back.gpus == plan.gpus
    assert (back.solver, back.lower_bound, back.optimal) == (plan.solver, plan.lower_bound, plan.optimal)
    assert math.isclose(back.solve_ms, plan.solve_ms, abs_tol=1e-3)
    assert validate_plan(back, sessions, gpu) == []
