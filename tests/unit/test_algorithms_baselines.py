"""Baselines: batch-oblivious packing, one model per GPU, squishy as published."""

from __future__ import annotations

import math

from globalsched.planning.plan import GpuSpec, SessionSpec, validate_plan
from common.profile import Profile
from globalsched.planning.algorithms import Solver, solve

BIG = GpuSpec("big", 1e9)
RESNET = Profile.linear(1.3, 5.0, 64)
SESSIONS = [SessionSpec("a", "m", 100.0, 2000.0, RESNET), SessionSpec("b", "m", 200.0, 150.0, RESNET),
            SessionSpec("c", "m", 60.0, 40.0, RESNET)]


def test_batch_oblivious_runs_everything_at_batch_one() -> None:
    plan = solve(SESSIONS, BIG, Solver.BATCH_OBLIVIOUS)
    assert {a.batch for g in plan.gpus for a in g.sessions} == {1}
    assert validate_plan(plan, SESSIONS, BIG) == []
    # at batch 1 a GPU serves 1000/6.3 = 158.7 req/s: session a alone needs 13 of them
    assert plan.num_gpus >= math.ceil(2000 / (1000 / 6.3))
    assert plan.num_gpus > solve(SESSIONS, BIG).num_gpus


def test_one_per_gpu_gives_each_session_its_own_gpus_at_the_largest_batch() -> None:
    plan = solve(SESSIONS, BIG, Solver.ONE_PER_GPU)
    assert all(len(g.sessions) == 1 for g in plan.gpus)
    # a: b=34 (691 req/s) x3; b: 2 l(b) <= 200 -> b=64 (725.6 req/s) x1; c: b=19 (1.3*19+5=29.7) x1
    assert sorted((g.sessions[0].session, g.sessions[0].batch) for g in plan.gpus) == [
        ("a", 34), ("a", 34), ("a", 34), ("b", 64), ("c", 19)]
    assert validate_plan(plan, SESSIONS, BIG) == []


def test_published_squishy_is_valid_without_memory_pressure() -> None:
    plan = solve(SESSIONS, BIG, Solver.NEXUS)
    assert plan.solver == "nexus" and validate_plan(plan, SESSIONS, BIG) == []
    assert solve(SESSIONS, BIG).num_gpus <= plan.num_gpus
