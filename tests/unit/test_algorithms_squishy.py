"""Squishy bin packing: the arithmetic of docs/planning.md, memory and prefix awareness, errors, speed."""

from __future__ import annotations

import math
import random

import pytest

from globalsched.planning.plan import GpuSpec, PlanningError, PrefixGroup, SessionSpec, ViolationKind, validate_plan
from common.profile import BatchLatency, Profile
from globalsched.planning.algorithms import PlannerConfig, Solver, lower_bound, lower_bound_gpus, solve
from globalsched.planning.algorithms.batch_sizing import (batch_for, prepare, residual_config, residual_config_published,
                                             saturated)
from globalsched.planning.algorithms.squishy import saturated_split

BIG = GpuSpec("big", 1e9)
RESNET = Profile.linear(1.3, 5.0, 64)  # ResNet-50-class: l(b) = 1.3 b + 5 ms


def session(name: str, slo: float, rate: float, profile: Profile = RESNET, group: str | None = None) -> SessionSpec:
    return SessionSpec(name, "m-" + name, slo, rate, profile, group)


def test_saturated_gpus_and_residual_follow_design() -> None:
    sm = prepare(session("a", 100.0, 2000.0), BIG, PlannerConfig())
    # largest b with 2*(1.3 b + 5) <= 100 is 34: l = 49.2 ms, 691.06 req/s per GPU
    assert saturated(sm) == (34, pytest.approx(34000 / 49.2), pytest.approx(34000 / 49.2))
    n, sat, residual = saturated_split(sm)
    assert (n, sat.batch) == (2, 34) and residual == pytest.approx(2000 - 2 * 34000 / 49.2)
    b, d = residual_config(sm, residual)
    assert (b, d) == (32, pytest.approx(32000 / residual))  # d + l(32) = 98.4 <= 100; b = 33 misses
    assert residual_config_published(sm, residual) == (b, d)
    plan = solve([session("a", 100.0, 2000.0)], BIG)
    full = [g for g in plan.gpus if g.duty_cycle_ms == pytest.approx(49.2)]
    assert len(full) == 2 and all(g.sessions[0].batch == 34 for g in full)
    assert plan.num_gpus == 3 and validate_plan(plan, [session("a", 100.0, 2000.0)], BIG) == []


def test_low_rates_keep_batch_one_with_the_duty_cycle_capped_by_the_slo() -> None:
    sm = prepare(session("a", 100.0, 5.0), BIG, PlannerConfig())
    assert residual_config(sm, 5.0) == (1, pytest.approx(93.7))  # 1000/5 = 200 ms would miss the SLO
    assert residual_config_published(sm, 5.0) == (1, pytest.approx(93.7))


def test_batch_for_covers_the_rate_and_respects_max_batch() -> None:
    sm = prepare(session("a", 100.0, 5.0, Profile.linear(1.0, 1.0, 8)), BIG, PlannerConfig())
    assert batch_for(sm, 100.0, 30.0) == 3
    assert batch_for(sm, 100.0, 40.0) == 4  # exactly 4*1000/40 = 100
    assert batch_for(sm, 1000.0, 30.0) is None  # would need 30 > 8
    assert batch_for(sm, 0.5, 30.0) == 1


def test_merged_gpu_shares_the_smaller_duty_cycle() -> None:
    sessions = [session("a", 200.0, 100.0), session("b", 100.0, 100.0)]
    plan = solve(sessions, BIG)
    assert plan.num_gpus == 1
    (gpu,) = plan.gpus
    assert {a.session for a in gpu.sessions} == {"a", "b"}
    for a in gpu.sessions:
        assert a.batch == math.ceil(gpu.duty_cycle_ms * 100.0 / 1000.0 - 1e-9)
    assert validate_plan(plan, sessions, BIG) == []


def test_squishy_checks_memory_that_published_nexus_ignores() -> None:
    heavy = Profile.linear(1.0, 5.0, 16, 6000.0, 10.0)
    sessions = [session("a", 200.0, 10.0, heavy), session("b", 200.0, 10.0, heavy)]
    gpu = GpuSpec("1080ti", 11000)
    nexus = solve(sessions, gpu, Solver.NEXUS)
    assert nexus.num_gpus == 1
    assert [v.kind for v in validate_plan(nexus, sessions, gpu)] == [ViolationKind.MEMORY]
    ours = solve(sessions, gpu)
    assert ours.num_gpus == 2 and validate_plan(ours, sessions, gpu) == []


def test_memory_limits_the_batch() -> None:
    p = Profile.linear(1.0, 5.0, 64, 1000.0, 100.0)  # m(b) = 1000 + 100 b: b <= 40 on 5000 MB
    sessions = [session("a", 400.0, 3000.0, p)]
    gpu = GpuSpec("g", 5000)
    plan = solve(sessions, gpu)
    assert max(a.batch for g in plan.gpus for a in g.sessions) <= 40
    assert validate_plan(plan, sessions, gpu) == []
    assert plan.num_gpus >= lower_bound(sessions, gpu)
    assert lower_bound_gpus(sessions, gpu) > lower_bound_gpus(sessions, BIG)


def test_consolidation_with_retimed_duty_cycles_beats_published_nexus() -> None:
    # Found by search against the exact solver: Nexus's merge rule leaves s2 alone; re-timing the
    # shared GPU's duty cycle fits all three on one GPU (the lower bound).
    sessions = [session("s0", 175.0, 234.0, Profile.linear(1.3, 3.7, 32)),
                session("s1", 93.0, 255.0, Profile.linear(1.5, 4.4, 32)),
                session("s2", 194.0, 16.0, Profile.linear(1.2, 9.7, 32))]
    assert solve(sessions, BIG, Solver.NEXUS).num_gpus == 2
    plan = solve(sessions, BIG)
    assert plan.num_gpus == 1 and plan.optimal is True
    assert validate_plan(plan, sessions, BIG) == []


def test_infeasible_slo_names_the_session() -> None:
    with pytest.raises(PlanningError, match=r"session 'tight': SLO 12 ms is below 2\*l\(1\) = 12.6 ms"):
        solve([session("ok", 100.0, 10.0), session("tight", 12.0, 10.0)], BIG)
    with pytest.raises(PlanningError, match=r"session 'ok': SLO 100 ms less margins 90 ms is below"):
        solve([session("ok", 100.0, 10.0)], BIG, config=PlannerConfig(network_ms=50, preprocess_ms=40))


def test_batch_one_beyond_memory_names_the_session() -> None:
    with pytest.raises(PlanningError, match=r"session 'fat': needs 12000 MB at batch 1, more than the GPU's 11000 MB"):
        solve([session("fat", 100.0, 10.0, Profile.linear(1.0, 1.0, 4, 11990.0, 10.0))], GpuSpec("g", 11000))


def test_duplicate_sessions_and_unknown_solver_are_errors() -> None:
    with pytest.raises(PlanningError, match="session 'a': listed twice"):
        solve([session("a", 100.0, 1.0), session("a", 100.0, 2.0)], BIG)
    with pytest.raises(ValueError, match="unknown solver 'magic'"):
        solve([session("a", 100.0, 1.0)], BIG, "magic")


def test_empty_workload_needs_no_gpu() -> None:
    plan = solve([], BIG)
    assert plan.num_gpus == 0 and plan.lower_bound == 0 and plan.optimal is True


# ---- prefix sharing -----------------------------------------------------------------------------------


def _grouped(n: int, rate: float, alpha: float = 0.8, beta: float = 4.0) -> tuple[list[SessionSpec], PrefixGroup]:
    prefix = Profile.linear(alpha, beta, 128, 4000.0, 20.0)  # a big shared trunk: 4 GB of weights
    model = Profile(tuple(BatchLatency(b, prefix.latency_ms(b) + 0.2 * b + 1.0, prefix.memory_mb(b) + 300.0)
                          for b in range(1, 17)))
    return [session(f"head{i}", 200.0, rate, model, "trunk") for i in range(n)], PrefixGroup("trunk", prefix)


def test_prefix_sharing_counts_the_trunk_memory_once() -> None:
    sessions, group = _grouped(4, 20.0)
    gpu = GpuSpec("1080ti", 11000)
    alone = [SessionSpec(s.name, s.model, s.slo_ms, s.rate_rps, s.profile) for s in sessions]
    unshared = solve(alone, gpu)
    assert unshared.num_gpus == 2  # two 4.3 GB models per 11 GB GPU
    shared = solve(sessions, gpu, prefix_groups=[group])
    assert shared.num_gpus == 1
    (g,) = shared.gpus
    assert g.shared_prefixes == ("trunk",) and len(g.sessions) == 4
    assert validate_plan(shared, sessions, gpu, prefix_groups=[group]) == []
    assert [v.kind for v in validate_plan(shared.replace(gpus=(g.__class__(g.id, g.duty_cycle_ms, g.sessions),)),
                                          sessions, gpu, prefix_groups=[group])] == [ViolationKind.MEMORY]


def test_prefix_sharing_batches_the_trunk_across_sessions() -> None:
    sessions, group = _grouped(6, 150.0, alpha=0.3, beta=15.0)  # the trunk's fixed cost dominates
    shared = solve(sessions, BIG, prefix_groups=[group])
    alone = solve([SessionSpec(s.name, s.model, s.slo_ms, s.rate_rps, s.profile) for s in sessions], BIG)
    assert (shared.num_gpus, alone.num_gpus) == (1, 2)
    (g,) = shared.gpus
    assert sum(a.batch for a in g.sessions) > 16  # the trunk runs one batch larger than any model's
    assert validate_plan(shared, sessions, BIG, prefix_groups=[group]) == []
    assert shared.lower_bound <= shared.num_gpus


def test_prefix_group_errors() -> None:
    sessions, group = _grouped(2, 10.0)
    with pytest.raises(PlanningError, match="unknown prefix group 'trunk'"):
        solve(sessions, BIG)
    too_costly = PrefixGroup("trunk", Profile.linear(5.0, 40.0, 64))
    with pytest.raises(PlanningError, match="costs more than the whole model at batch 1"):
        solve(sessions, BIG, prefix_groups=[too_costly])
    too_short = PrefixGroup("trunk", Profile.linear(0.1, 0.1, 4))
    with pytest.raises(PlanningError, match="profile stops at batch 4"):
        solve(sessions, BIG, prefix_groups=[too_short])


# ---- scale ------------------------------------------------------------------------------------------------


def _random_sessions(n: int, seed: int) -> list[SessionSpec]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        alpha, beta = rng.uniform(0.2, 3.0), rng.uniform(1.0, 10.0)
        slo = rng.uniform(max(50.0, 2 * (alpha + beta)), 400.0)
        rate = math.exp(rng.uniform(math.log(5), math.log(2000)))
        out.append(session(f"s{i}", slo, rate, Profile.linear(alpha, beta, 64, rng.uniform(100, 1500),
                                                             rng.uniform(5, 40))))
    return out


@pytest.mark.slow
def test_a_thousand_sessions_plan_validly_and_close_to_the_bound() -> None:
    sessions = _random_sessions(1000, 1)
    gpu = GpuSpec("v100", 16000)
    plan = solve(sessions, gpu)     # its CPU time is benchmarks/timing_checks.py's figure (--only planner)
    assert validate_plan(plan, sessions, gpu) == []
    assert plan.num_gpus <= 1.10 * plan.lower_bound
    assert plan.num_gpus <= solve(sessions, gpu, Solver.NEXUS).num_gpus
