"""Latency split: the DP equals brute force on small trees; DAG splits are sound; never worse than even."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from globalsched.planning.plan import GpuSpec, PlanningError, QueryEdge, QuerySpec, QueryStage, SplitMethod, validate_plan
from common.profile import Profile
from globalsched.planning.algorithms import PlannerConfig, even_split, proportional_split, solve, split_latency
from globalsched.planning.algorithms.latency_split import stage_cost_gpus

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
STEPS = 12


@st.composite
def queries(draw: st.DrawFn, dag: bool = False, max_stages: int = 4) -> QuerySpec:
    n = draw(st.integers(1, max_stages))
    stages = []
    for i in range(n):
        p = Profile.linear(draw(st.floats(0.2, 3.0)), draw(st.floats(1.0, 10.0)), draw(st.integers(1, 64)))
        stages.append(QueryStage(f"m{i}", f"model{i}", p))
    edges = []
    for i in range(1, n):
        parents = {draw(st.integers(0, i - 1))}
        if dag and i >= 2 and draw(st.booleans()):
            parents.add(draw(st.integers(0, i - 1)))
        edges += [QueryEdge(f"m{p}", f"m{i}", draw(st.floats(0.5, 3.0))) for p in sorted(parents)]
    need = sum(2 * s.profile.latency_ms(1) for s in stages)
    slo = draw(st.floats(need, 4 * need))
    return QuerySpec("q", slo, draw(st.floats(1.0, 800.0)), tuple(stages), tuple(edges))


def brute_force(q: QuerySpec, steps: int) -> float:
    """Minimum total cost over all grid budgets whose every path fits the SLO."""
    step = q.slo_ms / steps
    names = [s.name for s in q.stages]
    rates = q.stage_rates_rps()
    costs = {u: [stage_cost_gpus(q, u, k * step, PlannerConfig(), None, rates[u]) for k in range(steps + 1)]
             for u in names}
    paths = q.graph.paths()
    best = math.inf
    for ks in itertools.product(range(1, steps + 1), repeat=len(names)):
        k = dict(zip(names, ks))
        if all(sum(k[u] for u in p) <= steps for p in paths):
            best = min(best, sum(costs[u][k[u]] for u in names))
    return best


@SETTINGS
@given(queries())
def test_dp_equals_brute_force_on_small_trees(q: QuerySpec) -> None:
    split = split_latency(q, steps=STEPS, slack=False)
    expected = brute_force(q, STEPS)
    if math.isinf(expected):  # the grid is too coarse for this SLO; the DP falls back to minimum budgets
        assert math.isfinite(split.est_gpus)
    else:
        assert split.method is SplitMethod.TREE_DP
        assert split.est_gpus == pytest.approx(expected, rel=1e-9, abs=1e-12)
    _assert_paths_fit(q, split)


@SETTINGS
@given(queries(dag=True))
def test_dag_splits_are_sound_and_never_beat_the_optimum(q: QuerySpec) -> None:
    grid = split_latency(q, steps=STEPS, slack=False)
    _assert_paths_fit(q, grid)
    expected = brute_force(q, STEPS)
    if math.isfinite(expected):
        assert grid.est_gpus >= expected - 1e-9
    final = split_latency(q)
    _assert_paths_fit(q, final)
    assert final.est_gpus <= even_split(q).est_gpus + 1e-12
    assert final.est_gpus <= proportional_split(q).est_gpus + 1e-12


@SETTINGS
@given(queries(max_stages=5))
def test_reference_splits_are_sound_and_the_dp_never_loses_to_them(q: QuerySpec) -> None:
    for ref in (even_split(q), proportional_split(q)):
        _assert_paths_fit(q, ref)
    split = split_latency(q)
    _assert_paths_fit(q, split)
    assert split.est_gpus <= even_split(q).est_gpus + 1e-12


def _assert_paths_fit(q: QuerySpec, split) -> None:
    budgets = dict(split.budgets_ms)
    assert set(budgets) == {s.name for s in q.stages}
    for path in q.graph.paths():
        assert sum(budgets[u] for u in path) <= q.slo_ms + 1e-6
    for s in q.stages:
        assert budgets[s.name] >= 2 * s.profile.latency_ms(1) - 1e-6 or math.isinf(split.est_gpus)


P = Profile.linear


def traffic() -> QuerySpec:
    return QuerySpec("traffic", 300.0, 100.0,
                     (QueryStage("ssd", "ssd", P(3.0, 10.0, 64)), QueryStage("car", "car", P(1.0, 4.0, 64)),
                      QueryStage("face", "face", P(1.3, 5.0, 64))),
                     (QueryEdge("ssd", "car", 3.0), QueryEdge("ssd", "face", 1.5)))


def test_split_sessions_plan_validly() -> None:
    q = traffic()
    split = split_latency(q)
    assert split.method is SplitMethod.TREE_DP
    assert split.est_gpus < even_split(q).est_gpus
    sessions = list(split.sessions(q))
    gpu = GpuSpec("v100", 16000)
    plan = solve(sessions, gpu)
    assert validate_plan(plan, sessions, gpu) == []
    assert {s.name for s in sessions} == {"traffic/ssd", "traffic/car", "traffic/face"}


def test_slack_is_spread_not_left_on_one_stage() -> None:
    q = traffic()
    budgets = dict(split_latency(q).budgets_ms)
    assert budgets["ssd"] + budgets["car"] == pytest.approx(300.0)
    assert budgets["ssd"] + budgets["face"] == pytest.approx(300.0)
    assert min(budgets.values()) > 60.0  # nobody is starved to its 2*l(1) minimum


def test_dag_method_is_reported() -> None:
    p = P(1.0, 5.0, 32)
    q = QuerySpec("d", 400.0, 50.0, tuple(QueryStage(n, n, p) for n in "abcd"),
                  (QueryEdge("a", "b", 2.0), QueryEdge("a", "c", 1.0), QueryEdge("b", "d", 1.0),
                   QueryEdge("c", "d", 1.0)))
    split = split_latency(q)
    assert split.method in (SplitMethod.DAG_DP, SplitMethod.EVEN, SplitMethod.PROPORTIONAL)
    assert split_latency(q, slack=False).method is SplitMethod.DAG_DP
    _assert_paths_fit(q, split)


def test_margins_count_against_every_stage() -> None:
    q = traffic()
    config = PlannerConfig(network_ms=20.0)
    split = split_latency(q, config)
    for s in q.stages:
        assert split.budget_ms(s.name) >= 2 * s.profile.latency_ms(1) + 20.0


def test_infeasible_query_names_query_and_path() -> None:
    q = QuerySpec("tight", 30.0, 10.0, (QueryStage("a", "a", P(1.0, 5.0, 8)), QueryStage("b", "b", P(1.0, 9.0, 8))),
                  (QueryEdge("a", "b", 1.0),))
    with pytest.raises(PlanningError, match=r"query 'tight': path a->b needs at least 32 ms"):
        split_latency(q)
