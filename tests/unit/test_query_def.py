"""Query definitions: parsing, validation and budgets as pure functions."""

import copy
import json

import pytest

from globalsched.planning.plan import PlanningError
from common.profile import Profile
from common.query_def import (ModelIO, QueryError, even_budgets_ms, latest_finish_ms, parse_query,
                              stage_deadlines_ms, validate_query)
from common.sample_queries import SAMPLE_QUERIES
from common.tensors import TensorSpec
from globalsched.planning.query_sessions import plan_query_sessions

IMG = TensorSpec("input", "FP32", (3, 64, 64))
MODELS = {
    "detector": ModelIO((IMG,), (TensorSpec("scores", "FP32", (6,)), TensorSpec("crops", "FP32", (6, 3, 64, 64)))),
    "vehicle_cls": ModelIO((IMG,), (TensorSpec("logits", "FP32", (10,)),)),
    "face_cls": ModelIO((IMG,), (TensorSpec("logits", "FP32", (100,)),)),
}
LAT = {"detector": 5.0, "vehicle_cls": 3.0, "face_cls": 3.0}


def _q(change=None):
    q = copy.deepcopy(SAMPLE_QUERIES["traffic"])
    if change:
        change(q)
    return json.dumps(q)


def test_sample_queries_validate():
    for definition in SAMPLE_QUERIES.values():
        q = parse_query(json.dumps(definition))
        validate_query(q, MODELS, LAT)
    q = parse_query(_q())
    assert q.graph.topological_order()[0] == "detect"
    assert sorted(q.graph.paths()) == [("detect", "face"), ("detect", "vehicle")]
    assert set(q.graph.edges) == {("detect", "vehicle"), ("detect", "face")}


@pytest.mark.parametrize("change, message", [
    (lambda q: q.pop("slo_ms"), "missing field 'slo_ms'"),
    (lambda q: q.update(slo_ms=-1), "slo_ms must be a positive number"),
    (lambda q: q.update(name="bad name"), "invalid name"),
    (lambda q: q["inputs"][0].update(datatype="NOPE"), "unsupported"),
    (lambda q: q["inputs"][0].update(shape=[3, 0, 64]), "positive dimensions"),
    (lambda q: q.update(stages=[]), "stages must be a non-empty list"),
    (lambda q: q["stages"][1].update(fanout={"select": "scores"}), "must be 'stage.tensor'"),
    (lambda q: q["stages"][1].update(fanout={"min": "high"}), "fanout.min: must be a number"),
    (lambda q: q["stages"][1].update(extra=1), "unknown key"),
    (lambda q: q.update(outputs={}), "outputs must map"),
])
def test_malformed_fields_are_named(change, message):
    with pytest.raises(QueryError, match=message):
        parse_query(_q(change))


@pytest.mark.parametrize("change, message", [
    (lambda q: q["stages"][0].update(inputs={"input": "vehicle.logits"}), "cycle"),
    (lambda q: q["stages"][2].update(model="ghost"), "unknown model 'ghost'"),
    (lambda q: q["stages"][2].update(inputs={"input": "ghost.crops"}), "unknown stage 'ghost'"),
    (lambda q: q["stages"][2].update(inputs={"input": "detect.nope"}), "no output 'nope'"),
    (lambda q: q["stages"][2].update(inputs={"wrong": "detect.crops"}), "must map exactly the inputs"),
    (lambda q: q["stages"][2].pop("fanout"), "has shape \\[6, 3, 64, 64\\]"),
    (lambda q: q["stages"][2].update(inputs={"input": "detect.scores"}), "fan-out needs"),
    (lambda q: q["stages"][2].update(fanout={"select": "detect.crops", "min": 0.5}), "must have shape \\[6\\]"),
    (lambda q: q["inputs"][0].update(datatype="FP16"), "is FP16"),
    (lambda q: q["stages"][0].update(inputs={"input": "photo"}), "unknown query input 'photo'"),
    (lambda q: q["outputs"].update(x="image"), "must name 'stage.tensor'"),
    (lambda q: q.update(slo_ms=7.0), "below the sum of minimal latencies 8.0 ms along the path detect -> "),
])
def test_invalid_definitions_name_the_problem(change, message):
    q = parse_query(_q(change))
    with pytest.raises(QueryError, match=message):
        validate_query(q, MODELS, LAT)


def test_duplicate_stage_names_refused():
    q = parse_query(_q(lambda q: q["stages"][2].update(name="vehicle")))
    with pytest.raises(QueryError, match="duplicate stage"):
        validate_query(q, MODELS, LAT)


def test_stage_deadlines_accumulate_along_paths():
    q = parse_query(_q())
    finish = stage_deadlines_ms(q, {"detect": 100, "vehicle": 250, "face": 300})
    assert finish == {"detect": 100, "vehicle": 350, "face": 400}
    assert even_budgets_ms(q) == {"detect": 200, "vehicle": 200, "face": 200}


def test_latest_finish_leaves_every_later_stage_its_minimal_time():
    q = parse_query(_q())
    latest = latest_finish_ms(q, {"detect": 50, "vehicle": 30, "face": 70})
    assert latest == {"detect": 330, "vehicle": 400, "face": 400}   # the heavier branch (face) decides
    assert latest_finish_ms(q, {}) == {"detect": 400, "vehicle": 400, "face": 400}


def _profiles(alpha, beta):
    return {"gpu": Profile.linear(alpha, beta, 64)}


def test_plan_query_sessions_dp_respects_slo_and_uses_measured_gamma():
    q = parse_query(_q())
    profiles = {"detector": _profiles(2.0, 10.0), "vehicle_cls": _profiles(1.0, 5.0), "face_cls": _profiles(1.0, 5.0)}
    gammas = {("traffic", "detect", "vehicle"): 3.0, ("traffic", "detect", "face"): 2.0}
    sessions, plans = plan_query_sessions({"traffic": q}, {"traffic": 100.0}, gammas, profiles, ["gpu"], "dp")
    plan = plans["traffic"]
    assert plan.budgets_ms["detect"] + plan.budgets_ms["vehicle"] <= 400 + 1e-9
    assert plan.budgets_ms["detect"] + plan.budgets_ms["face"] <= 400 + 1e-9
    rates = {s.model: s.rate_rps for s in sessions}
    assert rates == {"traffic/detect": 100.0, "traffic/vehicle": 300.0, "traffic/face": 200.0}
    assert plan.gammas == {"detect->vehicle": 3.0, "detect->face": 2.0}
    even_sessions, even = plan_query_sessions({"traffic": q}, {"traffic": 100.0}, gammas, profiles, ["gpu"], "even")
    assert even.get("traffic").method == "even"


def test_plan_query_sessions_takes_the_path_allowance_from_every_stage():
    from globalsched.planning.algorithms import PlannerConfig

    q = parse_query(_q())
    profiles = {"detector": _profiles(2.0, 10.0), "vehicle_cls": _profiles(1.0, 5.0), "face_cls": _profiles(1.0, 5.0)}
    gammas = {("traffic", "detect", "vehicle"): 3.0, ("traffic", "detect", "face"): 3.0}
    config = PlannerConfig(network_ms=20.0)
    sessions, plans = plan_query_sessions({"traffic": q}, {"traffic": 100.0}, gammas, profiles, ["gpu"], "dp",
                                          config=config)
    plan = plans["traffic"]
    for s in q.stages:   # each budget covers the allowance plus at least 2*l(1)
        assert plan.budgets_ms[s.name] - 20.0 >= 2 * profiles[s.model]["gpu"].latency_ms(1) - 1e-6
    # latest finish of detect: the SLO less the heavier child's 2*l(1) + allowance (both children: 2*6 + 20)
    assert abs(plan.latest_finish_ms["detect"] - (400 - 32)) < 1e-9
    assert plan.latest_finish_ms["vehicle"] == plan.latest_finish_ms["face"] == 400
    # an allowance that leaves no room for 2*l(1) on a path makes the query best effort, with the reason
    _, tight = plan_query_sessions({"traffic": q}, {"traffic": 100.0}, gammas, profiles, ["gpu"], "dp",
                                   config=PlannerConfig(network_ms=190.0))
    assert "best effort" in tight["traffic"].reason and "margins" in tight["traffic"].reason


def test_plan_query_sessions_without_profiles_or_feasible_split_gives_reasons():
    q = parse_query(_q())
    sessions, plans = plan_query_sessions({"traffic": q}, {}, {}, {}, ["gpu"])
    assert sessions == [] and "no profile" in plans["traffic"].reason
    slow = {m: _profiles(50.0, 150.0) for m in ("detector", "vehicle_cls", "face_cls")}
    sessions, plans = plan_query_sessions({"traffic": q}, {}, {}, slow, ["gpu"])
    assert len(sessions) == 3 and "best effort" in plans["traffic"].reason
    with pytest.raises(ValueError, match="unknown latency split"):
        plan_query_sessions({"traffic": q}, {}, {}, slow, ["gpu"], "random")
    assert issubclass(PlanningError, ValueError)
