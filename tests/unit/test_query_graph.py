"""One query graph for serving and planning: structure, invariants with precise errors, and the
served definition and its planning view agreeing on it."""

from __future__ import annotations

import pytest

from globalsched.planning.plan import QueryEdge, QuerySpec, QueryStage
from common.profile import Profile
from common.query_def import parse_query
from common.query_graph import QueryError, QueryGraph

P = Profile.linear(1.0, 2.0, 16)


def test_structure_of_a_diamond() -> None:
    g = QueryGraph("q", ("a", "b", "c", "d"), (("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")))
    assert g.roots() == ["a"]
    assert g.topological_order() == ["a", "b", "c", "d"]
    assert g.parents("d") == ("b", "c") and g.children("a") == ("b", "c")
    assert sorted(g.paths()) == [("a", "b", "d"), ("a", "c", "d")]
    assert not g.is_tree()
    assert g.session_name("b") == "q/b"


def test_a_forest_keeps_declaration_order_among_ties() -> None:
    g = QueryGraph("q", ("x", "a", "y"), (("a", "y"),))
    assert g.topological_order() == ["x", "a", "y"]
    assert g.roots() == ["x", "a"] and g.is_tree()
    assert g.paths() == [("x",), ("a", "y")]


@pytest.mark.parametrize("stages, edges, message", [
    ((), (), "needs at least one stage"),
    (("a", "a"), (), r"duplicate stage name\(s\) \['a'\]"),
    (("a",), (("a", "z"),), "edge a->z names unknown stage 'z'"),
    (("a", "b"), (("a", "b"), ("a", "b")), "duplicate edge a->b"),
    (("a", "b", "c"), (("a", "b"), ("b", "c"), ("c", "a")), "stages form a cycle: a -> b -> c -> a"),
    (("r", "a", "b"), (("r", "a"), ("a", "b"), ("b", "a")), "stages form a cycle: a -> b -> a"),
    (("a",), (("a", "a"),), "stages form a cycle: a -> a"),
])
def test_broken_graphs_are_refused_naming_the_problem(stages, edges, message) -> None:
    with pytest.raises(QueryError, match=message):
        QueryGraph("q", stages, edges)


def test_served_definition_and_planning_view_share_the_graph() -> None:
    served = parse_query("""{"name": "t", "slo_ms": 300,
        "inputs": [{"name": "image", "datatype": "FP32", "shape": [3, 8, 8]}],
        "stages": [{"name": "det", "model": "d", "inputs": {"input": "image"}},
                   {"name": "car", "model": "c", "inputs": {"input": "det.crops"}, "fanout": true},
                   {"name": "face", "model": "f", "inputs": {"input": "det.crops"},
                    "fanout": {"select": "det.scores", "min": 0.5}}],
        "outputs": {"cars": "car.logits"}}""")
    planned = QuerySpec(served.name, served.slo_ms, 10.0,
                        tuple(QueryStage(s.name, s.model, P) for s in served.stages),
                        tuple(QueryEdge(p, c, 2.0) for p, c in served.graph.edges))
    assert planned.graph == served.graph
    assert planned.stage_rates_rps() == {"det": 10.0, "car": 20.0, "face": 20.0}


def test_a_cycle_in_a_served_definition_is_named() -> None:
    served = parse_query("""{"name": "loop", "slo_ms": 300,
        "inputs": [{"name": "image", "datatype": "FP32", "shape": [4]}],
        "stages": [{"name": "a", "model": "m", "inputs": {"input": "b.out"}},
                   {"name": "b", "model": "m", "inputs": {"input": "a.out"}}],
        "outputs": {"o": "b.out"}}""")
    with pytest.raises(QueryError, match="stages form a cycle: a -> b -> a"):
        served.graph
