"""Workload files: the example of docs/planning.md parses; every malformation is named by its field."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from nexus.plan_files import WorkloadError, load_workload, parse_workload, workload_to_json_obj

EXAMPLE: dict[str, Any] = {
    "gpu": {"name": "gtx1080ti", "memory_mb": 11000},
    "sessions": [
        {"name": "face", "model": "vgg_face", "slo_ms": 200, "rate": 350.0,
         "profile": [{"batch": 1, "latency_ms": 6.3, "memory_mb": 950},
                     {"batch": 2, "latency_ms": 9.1, "memory_mb": 1000}]}
    ],
}

ROWS = [{"batch": 1, "latency_ms": 4.0, "memory_mb": 500}, {"batch": 2, "latency_ms": 6.0, "memory_mb": 600}]
PREFIX_ROWS = [{"batch": b, "latency_ms": 1.0 + b, "memory_mb": 300} for b in range(1, 5)]
FULL: dict[str, Any] = {
    "gpu": {"name": "v100", "memory_mb": 16000},
    "prefix_groups": [{"name": "trunk", "profile": PREFIX_ROWS[:2]}],
    "sessions": [{"name": "a", "model": "ma", "slo_ms": 100, "rate": 10, "profile": ROWS, "prefix_group": "trunk"}],
    "queries": [{"name": "q", "slo_ms": 300, "rate": 5,
                 "stages": [{"name": "det", "model": "ssd", "profile": ROWS},
                            {"name": "rec", "model": "rn", "profile": ROWS}],
                 "edges": [{"parent": "det", "child": "rec", "gamma": 2.5}]}],
}


def test_design_example_parses() -> None:
    w = parse_workload(EXAMPLE)
    assert w.gpu.name == "gtx1080ti" and w.gpu.memory_mb == 11000
    (s,) = w.sessions
    assert (s.name, s.model, s.slo_ms, s.rate_rps, s.profile.max_batch) == ("face", "vgg_face", 200, 350.0, 2)
    assert s.profile.latency_ms(2) == 9.1 and s.profile.memory_mb(1) == 950
    assert w.queries == () and w.prefix_groups == ()


def test_extensions_parse_and_round_trip() -> None:
    w = parse_workload(FULL)
    assert w.sessions[0].prefix_group == "trunk"
    (q,) = w.queries
    assert q.stage_rates_rps() == {"det": 5.0, "rec": 12.5}
    assert parse_workload(workload_to_json_obj(w)) == w


def test_load_workload_reads_files(tmp_path: Path) -> None:
    path = tmp_path / "w.json"
    path.write_text(json.dumps(EXAMPLE))
    assert load_workload(path).sessions[0].name == "face"
    path.write_text("{not json")
    with pytest.raises(WorkloadError, match="not valid JSON"):
        load_workload(path)
    with pytest.raises(WorkloadError, match="cannot read"):
        load_workload(tmp_path / "missing.json")


def mutate(base: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """Set (or, with value DELETE, remove) the field at a dotted path with [i] indices."""
    obj = copy.deepcopy(base)
    keys: list[Any] = []
    for part in path.split("."):
        while "[" in part:
            name, rest = part.split("[", 1)
            if name:
                keys.append(name)
            idx, part = rest.split("]", 1)
            keys.append(int(idx))
        if part:
            keys.append(part)
    target = obj
    for k in keys[:-1]:
        target = target[k]
    if value is DELETE:
        del target[keys[-1]]
    else:
        target[keys[-1]] = value
    return obj


DELETE = object()


@pytest.mark.parametrize("base, path, value, message", [
    (EXAMPLE, "extra", 1, r"workload: unknown key\(s\) \['extra'\]"),
    (EXAMPLE, "gpu", DELETE, "workload: missing field 'gpu'"),
    (EXAMPLE, "sessions", DELETE, "workload: missing field 'sessions'"),
    (EXAMPLE, "sessions", {}, "sessions: must be a list"),
    (EXAMPLE, "sessions", [], "sessions: must list at least one session"),
    (EXAMPLE, "gpu.memory_mb", 0, r"gpu\.memory_mb: must be positive"),
    (EXAMPLE, "gpu.memory_mb", "big", r"gpu\.memory_mb: must be a number"),
    (EXAMPLE, "gpu.name", "", r"gpu\.name: must be a non-empty string"),
    (EXAMPLE, "gpu.vendor", "x", r"gpu: unknown key\(s\) \['vendor'\]"),
    (EXAMPLE, "sessions[0]", 3, r"sessions\[0\]: must be an object"),
    (EXAMPLE, "sessions[0].slo_ms", 0, r"sessions\[0\]\.slo_ms: must be positive"),
    (EXAMPLE, "sessions[0].slo_ms", -5, r"sessions\[0\]\.slo_ms: must be positive"),
    (EXAMPLE, "sessions[0].slo_ms", True, r"sessions\[0\]\.slo_ms: must be a number"),
    (EXAMPLE, "sessions[0].rate", 0.0, r"sessions\[0\]\.rate: must be positive"),
    (EXAMPLE, "sessions[0].rate", float("nan"), r"sessions\[0\]\.rate: must be a number"),
    (EXAMPLE, "sessions[0].rate", DELETE, r"sessions\[0\]: missing field 'rate'"),
    (EXAMPLE, "sessions[0].name", DELETE, r"sessions\[0\]: missing field 'name'"),
    (EXAMPLE, "sessions[0].model", 7, r"sessions\[0\]\.model: must be a non-empty string"),
    (EXAMPLE, "sessions[0].rate_rps", 1, r"sessions\[0\]: unknown key\(s\) \['rate_rps'\]"),
    (EXAMPLE, "sessions[0].profile[1].latency_ms", 5.0,
     r"sessions\[0\]\.profile\[1\]\.latency_ms: latency decreases with batch size"),
    (EXAMPLE, "sessions[0].profile[1].batch", 3, r"sessions\[0\]\.profile\[1\]\.batch: expected 2"),
    (EXAMPLE, "sessions[0].profile[0].latency_ms", DELETE, r"sessions\[0\]\.profile\[0\]: missing field 'latency_ms'"),
    (EXAMPLE, "sessions[0].profile", [], r"sessions\[0\]\.profile: must list at least batch size 1"),
    (EXAMPLE, "sessions[0].prefix_group", "nope", r"sessions\[0\]\.prefix_group: unknown prefix group 'nope'"),
    (FULL, "sessions[0].name", "q/det", r"queries\[0\]\.stages\[0\]\.name: session name 'q/det' already used"),
    (FULL, "prefix_groups[0].profile", PREFIX_ROWS[:1],
     r"sessions\[0\]\.prefix_group: prefix group 'trunk' profile stops at batch 1"),
    (FULL, "prefix_groups[0].profile", [{"batch": 1, "latency_ms": 9.0, "memory_mb": 1}, {"batch": 2, "latency_ms": 9.0}],
     r"sessions\[0\]\.prefix_group: prefix group 'trunk' costs more than the whole model at batch 1"),
    (FULL, "prefix_groups[0].name", DELETE, r"prefix_groups\[0\]: missing field 'name'"),
    (FULL, "queries[0].rate", -1, r"queries\[0\]\.rate: must be positive"),
    (FULL, "queries[0].stages", [], r"queries\[0\]\.stages: must list at least one stage"),
    (FULL, "queries[0].stages[1].name", "det", r"queries\[0\]\.stages\[1\]\.name: duplicate stage name 'det'"),
    (FULL, "queries[0].stages[1].name", "a/b", r"queries\[0\]\.stages\[1\]\.name: must not contain '/'"),
    (FULL, "queries[0].edges[0].child", "zzz", r"queries\[0\]\.edges\[0\]\.child: unknown stage 'zzz'"),
    (FULL, "queries[0].edges[0].gamma", 0, r"queries\[0\]\.edges\[0\]\.gamma: must be positive"),
    (FULL, "queries[0].edges[0].child", "det", r"queries\[0\]\.edges\[0\]: an edge from a stage to itself"),
    (FULL, "queries[0].edges[1]", {"parent": "rec", "child": "det", "gamma": 1},
     r"queries\[0\]\.edges: query 'q': stages form a cycle: det -> rec -> det"),
    (FULL, "queries[0].edges[1]", {"parent": "det", "child": "rec", "gamma": 1},
     r"queries\[0\]\.edges\[1\]: duplicate edge det->rec"),
    (FULL, "queries[0].stages[0].depth", 1, r"queries\[0\]\.stages\[0\]: unknown key\(s\) \['depth'\]"),
])
def test_malformed_workloads_name_the_field(base: dict[str, Any], path: str, value: Any, message: str) -> None:
    obj = mutate(base, path, value) if not path.endswith("edges[1]") else _append_edge(base, value)
    with pytest.raises(WorkloadError, match=message):
        parse_workload(obj)


def _append_edge(base: dict[str, Any], edge: dict[str, Any]) -> dict[str, Any]:
    obj = copy.deepcopy(base)
    obj["queries"][0]["edges"].append(edge)
    return obj


def test_duplicate_names_are_errors() -> None:
    obj = copy.deepcopy(EXAMPLE)
    obj["sessions"].append(copy.deepcopy(obj["sessions"][0]))
    with pytest.raises(WorkloadError, match=r"sessions\[1\]\.name: duplicate session name 'face'"):
        parse_workload(obj)
    obj = copy.deepcopy(FULL)
    obj["queries"].append(copy.deepcopy(obj["queries"][0]))
    with pytest.raises(WorkloadError, match=r"queries\[1\]\.name: duplicate query name 'q'"):
        parse_workload(obj)
    obj = copy.deepcopy(FULL)
    obj["prefix_groups"].append(copy.deepcopy(obj["prefix_groups"][0]))
    with pytest.raises(WorkloadError, match=r"prefix_groups\[1\]\.name: duplicate prefix group 'trunk'"):
        parse_workload(obj)


def test_top_level_must_be_an_object() -> None:
    with pytest.raises(WorkloadError, match="workload: must be an object"):
        parse_workload([1, 2])


def test_queries_alone_are_enough() -> None:
    obj = copy.deepcopy(FULL)
    obj["sessions"] = []
    assert len(parse_workload(obj).queries) == 1
