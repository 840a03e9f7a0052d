"""The lower bound of DESIGN.md: hand-computed values, memory, margins, prefix groups."""

from __future__ import annotations

import math

import pytest

from common.plan import GpuSpec, PlanningError, PrefixGroup, SessionSpec
from common.profile import BatchLatency, Profile
from globalsched.algorithms import PlannerConfig, lower_bound, lower_bound_gpus, solve

RESNET = Profile.linear(1.3, 5.0, 64)


def test_hand_computed_bound() -> None:
    # best l(b)/b with 2 l(b) <= 100 is at b = 34: 49.2/34 ms per request
    s = SessionSpec("a", "m", 100.0, 2000.0, RESNET)
    assert lower_bound_gpus([s]) == pytest.approx(2000 * 49.2 / 34 / 1000)
    assert lower_bound([s]) == math.ceil(2000 * 49.2 / 34 / 1000) == 3
    two = [s, SessionSpec("b", "m", 400.0, 100.0, RESNET)]  # b = 64 fits: 88.2/64
    assert lower_bound_gpus(two) == pytest.approx(2.894117647 + 100 * 88.2 / 64 / 1000)


def test_exact_multiples_do_not_round_up() -> None:
    # 1.0 GPU exactly (up to float noise) must stay 1
    s = SessionSpec("a", "m", 100.0, 1000.0 / (49.2 / 34) * 3, RESNET)
    assert lower_bound([s]) == 3


def test_memory_and_margins_raise_the_bound() -> None:
    p = Profile.linear(1.0, 5.0, 64, 1000.0, 100.0)
    s = [SessionSpec("a", "m", 400.0, 3000.0, p)]
    assert lower_bound_gpus(s, GpuSpec("g", 5000)) == pytest.approx(3000 * 45 / 40 / 1000)
    assert lower_bound_gpus(s) == pytest.approx(3000 * 69 / 64 / 1000)
    tight = lower_bound_gpus(s, config=PlannerConfig(network_ms=300))  # budget 100: b <= 45
    assert tight == pytest.approx(3000 * 50 / 45 / 1000)


def test_non_monotone_memory_is_handled_soundly() -> None:
    rows = (BatchLatency(1, 10.0, 100.0), BatchLatency(2, 10.0, 900.0), BatchLatency(3, 10.0, 100.0))
    s = [SessionSpec("a", "m", 100.0, 300.0, Profile(rows))]
    assert lower_bound_gpus(s, GpuSpec("g", 500)) == pytest.approx(300 * 10 / 3 / 1000)


def test_prefix_groups_lower_the_bound_soundly() -> None:
    prefix = Profile.linear(1.0, 10.0, 64)
    model = Profile(tuple(BatchLatency(b, prefix.latency_ms(b) + 0.1 * b + 0.5) for b in range(1, 33)))
    sessions = [SessionSpec(f"s{i}", "m", 200.0, 300.0, model, "trunk") for i in range(4)]
    group = PrefixGroup("trunk", prefix)
    alone = lower_bound_gpus([SessionSpec(s.name, s.model, s.slo_ms, s.rate_rps, s.profile) for s in sessions])
    shared = lower_bound_gpus(sessions, prefix_groups=[group])
    # prefix best per item: its largest batch 64 (2*74 <= 200): 74/64; suffix best: (0.1*32 + 0.5)/32
    assert shared == pytest.approx(1200 * (74 / 64 + 3.7 / 32) / 1000)
    assert shared < alone
    plan = solve(sessions, GpuSpec("g", 1e9), prefix_groups=[group])
    assert plan.num_gpus >= math.ceil(shared - 1e-9) == plan.lower_bound


def test_infeasible_sessions_are_named() -> None:
    with pytest.raises(PlanningError, match="session 'x'"):
        lower_bound([SessionSpec("x", "m", 10.0, 1.0, RESNET)])
