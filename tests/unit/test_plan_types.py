"""Plan value types: validation catches every rule of docs/planning.md, JSON follows the contract."""

from __future__ import annotations

import json

import pytest

from globalsched.planning.plan import (GpuPlan, GpuSpec, LatencySplit, Plan, PrefixGroup, QueryEdge, QuerySpec, QueryStage,
                         SessionAlloc, SessionSpec, SplitMethod, ViolationKind, gpu_exec_breakdown, validate_plan)
from common.profile import Profile

GPU = GpuSpec("gtx1080ti", 11000)
# l(b) = b + 5 ms, m(b) = 1000 + 100 b MB
FACE = SessionSpec("face", "vgg_face", 100.0, 100.0, Profile.linear(1.0, 5.0, 16, 1000.0, 100.0))
CAR = SessionSpec("car", "googlenet", 60.0, 50.0, Profile.linear(1.0, 5.0, 16, 1000.0, 100.0))


def alloc(name: str, batch: int, duty: float) -> SessionAlloc:
    return SessionAlloc(name, batch, batch * 1000.0 / duty)


def plan_of(*gpus: GpuPlan) -> Plan:
    return Plan("test", tuple(gpus), 1, 0.1)


def kinds(plan: Plan, sessions=(FACE, CAR), gpu=GPU, **kw) -> set[ViolationKind]:
    return {v.kind for v in validate_plan(plan, list(sessions), gpu, **kw)}


def test_a_valid_shared_gpu_has_no_violations() -> None:
    # duty 40: face b=4 (9 ms) + car b=2 (7 ms) = 16 <= 40; 40 + 9 <= 100; 40 + 7 <= 60
    plan = plan_of(GpuPlan(0, 40.0, (alloc("face", 4, 40.0), alloc("car", 2, 40.0))))
    assert validate_plan(plan, [FACE, CAR], GPU) == []


@pytest.mark.parametrize("gpu_plan, kind", [
    (GpuPlan(0, 40.0, (alloc("face", 4, 40.0), alloc("bike", 1, 40.0))), ViolationKind.UNKNOWN_SESSION),
    (GpuPlan(0, 40.0, (alloc("face", 4, 40.0), alloc("face", 1, 40.0))), ViolationKind.DUPLICATE_SESSION),
    (GpuPlan(0, 40.0, ()), ViolationKind.EMPTY_GPU),
    (GpuPlan(0, 0.0, (SessionAlloc("face", 4, 1.0),)), ViolationKind.BAD_DUTY_CYCLE),
    (GpuPlan(0, 40.0, (alloc("face", 17, 40.0),)), ViolationKind.BAD_BATCH),
    (GpuPlan(0, 40.0, (SessionAlloc("face", 4, 120.0),)), ViolationKind.THROUGHPUT),
    (GpuPlan(0, 10.0, (alloc("face", 4, 10.0), alloc("car", 1, 10.0))), ViolationKind.DUTY_CYCLE),
    (GpuPlan(0, 55.0, (alloc("face", 6, 55.0), alloc("car", 1, 55.0))), ViolationKind.SLO),
    (GpuPlan(0, 40.0, (alloc("face", 3, 40.0), alloc("car", 1, 40.0))), ViolationKind.UNDER_SERVED),
])
def test_each_rule_is_reported(gpu_plan: GpuPlan, kind: ViolationKind) -> None:
    assert kind in kinds(plan_of(gpu_plan))


def test_memory_and_duplicate_ids_are_reported() -> None:
    small = GpuSpec("small", 2000)
    plan = plan_of(GpuPlan(0, 40.0, (alloc("face", 4, 40.0), alloc("car", 2, 40.0))),
                   GpuPlan(0, 40.0, (alloc("car", 2, 40.0),)))
    found = kinds(plan, gpu=small)
    assert ViolationKind.MEMORY in found and ViolationKind.DUPLICATE_GPU_ID in found


def test_margins_tighten_the_slo() -> None:
    plan = plan_of(GpuPlan(0, 40.0, (alloc("face", 4, 40.0), alloc("car", 2, 40.0))))
    assert kinds(plan) == set()
    violations = validate_plan(plan, [FACE, CAR], GPU, margins_ms=20.0)
    assert [(v.kind, v.session) for v in violations] == [(ViolationKind.SLO, "car")]
    assert "car" in violations[0].message


def test_violation_messages_name_the_gpu_and_session() -> None:
    plan = plan_of(GpuPlan(3, 40.0, (alloc("face", 3, 40.0),)))
    messages = [v.message for v in validate_plan(plan, [FACE], GPU)]
    assert messages == ["session 'face': throughput 75 req/s < rate 100"]
    plan = plan_of(GpuPlan(3, 10.0, (alloc("face", 6, 10.0),)))
    assert any(m.startswith("gpu 3:") for m in (v.message for v in validate_plan(plan, [FACE], GPU)))


# ---- prefix sharing ---------------------------------------------------------------------------------

PREFIX = PrefixGroup("trunk", Profile.linear(0.5, 4.0, 32, 3000.0, 50.0))
# member = prefix + suffix (0.5 ms/item + 1 ms, 500 MB)
A = SessionSpec("a", "ma", 100.0, 100.0, Profile.linear(1.0, 5.0, 16, 3500.0, 50.0), "trunk")
B = SessionSpec("b", "mb", 100.0, 100.0, Profile.linear(1.0, 5.0, 16, 3500.0, 50.0), "trunk")


def test_shared_prefix_runs_once_on_the_combined_batch() -> None:
    gpu = GpuPlan(0, 40.0, (alloc("a", 4, 40.0), alloc("b", 4, 40.0)), ("trunk",))
    exec_ms, memory, seen = gpu_exec_breakdown(gpu, {"a": A, "b": B}, {"trunk": PREFIX})
    # prefix l_p(8) = 8 ms, suffixes 2 * (0.5*4 + 1) = 6 ms
    assert exec_ms == pytest.approx(14.0)
    assert seen == {"a": pytest.approx(14.0), "b": pytest.approx(14.0)}
    # prefix m_p(8) = 3400, suffixes 2 * 500
    assert memory == pytest.approx(4400.0)
    unshared = GpuPlan(0, 40.0, gpu.sessions)
    exec2, memory2, _ = gpu_exec_breakdown(unshared, {"a": A, "b": B}, {"trunk": PREFIX})
    assert exec2 == pytest.approx(18.0) and memory2 == pytest.approx(7400.0)


def test_shared_prefix_validation() -> None:
    gpu = GpuSpec("g", 5000)
    shared = plan_of(GpuPlan(0, 40.0, (alloc("a", 4, 40.0), alloc("b", 4, 40.0)), ("trunk",)))
    assert validate_plan(shared, [A, B], gpu, prefix_groups=[PREFIX]) == []
    unshared = plan_of(GpuPlan(0, 40.0, (alloc("a", 4, 40.0), alloc("b", 4, 40.0))))
    assert {v.kind for v in validate_plan(unshared, [A, B], gpu, prefix_groups=[PREFIX])} == {ViolationKind.MEMORY}
    assert {v.kind for v in validate_plan(shared, [A, B], gpu)} == {ViolationKind.PREFIX}
    tiny = PrefixGroup("trunk", Profile.linear(0.5, 4.0, 6, 3000.0, 50.0))
    assert ViolationKind.PREFIX in {v.kind for v in validate_plan(shared, [A, B], gpu, prefix_groups=[tiny])}


# ---- JSON -------------------------------------------------------------------------------------------


def test_plan_json_matches_the_contract() -> None:
    plan = Plan("squishy", (GpuPlan(0, 80.0, (SessionAlloc("face", 16, 200.0),)),), 3, 1.7)
    obj = plan.to_json_obj()
    assert obj == {"solver": "squishy", "num_gpus": 1, "lower_bound": 3, "solve_ms": 1.7,
                   "gpus": [{"id": 0, "duty_cycle_ms": 80.0,
                             "sessions": [{"session": "face", "batch": 16, "throughput": 200.0}]}]}
    assert list(obj) == ["solver", "num_gpus", "lower_bound", "solve_ms", "gpus"]
    json.dumps(obj)
    extra = Plan("cpsat", plan.gpus, 1, 2.0, True, 3, ("note",)).to_json_obj()
    assert (extra["optimal"], extra["moved"], extra["notes"]) == (True, 3, ["note"])


def test_plan_from_json_names_missing_fields() -> None:
    with pytest.raises(ValueError, match=r"gpus\[0\]\.sessions\[0\]: missing field 'batch'"):
        Plan.from_json_obj({"solver": "x", "lower_bound": 0, "solve_ms": 0,
                            "gpus": [{"id": 0, "duty_cycle_ms": 1.0, "sessions": [{"session": "a"}]}]})
    with pytest.raises(ValueError, match="num_gpus"):
        Plan.from_json_obj({"solver": "x", "lower_bound": 0, "solve_ms": 0, "num_gpus": 2, "gpus": []})
    with pytest.raises(ValueError, match="plan: missing field 'gpus'"):
        Plan.from_json_obj({"solver": "x"})


def test_plan_helpers() -> None:
    plan = plan_of(GpuPlan(0, 40.0, (alloc("face", 4, 40.0),)), GpuPlan(5, 40.0, (alloc("face", 1, 40.0),)))
    assert plan.num_gpus == 2
    assert plan.throughput_by_session() == {"face": pytest.approx(125.0)}
    assert plan.gpus_of("face") == frozenset({0, 5})
    assert plan.replace(moved=2).moved == 2


# ---- queries ----------------------------------------------------------------------------------------

P = Profile.linear(1.0, 4.0, 8)


def test_query_rates_paths_and_sessions() -> None:
    q = QuerySpec("q", 300.0, 10.0, (QueryStage("a", "ma", P), QueryStage("b", "mb", P), QueryStage("c", "mc", P),
                                     QueryStage("d", "md", P)),
                  (QueryEdge("a", "b", 2.0), QueryEdge("a", "c", 0.5), QueryEdge("b", "d", 1.0),
                   QueryEdge("c", "d", 4.0)))
    assert q.stage_rates_rps() == {"a": 10.0, "b": 20.0, "c": 5.0, "d": 40.0}
    assert sorted(q.graph.paths()) == [("a", "b", "d"), ("a", "c", "d")]
    assert not q.graph.is_tree() and q.graph.roots() == ["a"]
    split = LatencySplit("q", SplitMethod.EVEN, (("a", 100.0), ("b", 100.0), ("c", 100.0), ("d", 100.0)), 0.0)
    sessions = split.sessions(q)
    assert [(s.name, s.slo_ms, s.rate_rps) for s in sessions] == [
        ("q/a", 100.0, 10.0), ("q/b", 100.0, 20.0), ("q/c", 100.0, 5.0), ("q/d", 100.0, 40.0)]
    assert split.to_json_obj()["budgets_ms"] == {"a": 100.0, "b": 100.0, "c": 100.0, "d": 100.0}


@pytest.mark.parametrize("stages, edges, slo, rate, message", [
    ((), (), 100.0, 1.0, "at least one stage"),
    (("a",), (), 0.0, 1.0, "slo_ms must be positive"),
    (("a",), (), 100.0, -1.0, "rate must be positive"),
    (("a", "a"), (), 100.0, 1.0, "duplicate stage"),
    (("a",), (("a", "z", 1.0),), 100.0, 1.0, "unknown stage 'z'"),
    (("a", "b"), (("a", "b", 0.0),), 100.0, 1.0, "gamma must be positive"),
    (("a", "b"), (("a", "b", 1.0), ("a", "b", 2.0)), 100.0, 1.0, "duplicate edge"),
    (("a", "b"), (("a", "b", 1.0), ("b", "a", 1.0)), 100.0, 1.0, "cycle"),
])
def test_query_validation(stages, edges, slo, rate, message) -> None:
    with pytest.raises(ValueError, match=message):
        QuerySpec("q", slo, rate, tuple(QueryStage(s, s, P) for s in stages),
                  tuple(QueryEdge(a, b, g) for a, b, g in edges))
