"""Workload files for ``nexus plan`` (docs/planning.md, "The workload file"): parsing with field-naming errors.

The contract::

    {"gpu": {"name": str, "memory_mb": number > 0},
     "sessions": [{"name": str, "model": str, "slo_ms": number > 0, "rate": number > 0,
                   "profile": [{"batch": 1, "latency_ms": ..., "memory_mb": ...}, ...],
                   "prefix_group": str (optional)}],
     "queries": [...] (optional), "prefix_groups": [...] (optional)}

Extensions (optional keys, this project): ``prefix_groups`` lists ``{"name", "profile"}`` of shared
model prefixes that sessions name in ``prefix_group``; ``queries`` lists multi-model queries
``{"name", "slo_ms", "rate", "stages": [{"name", "model", "profile", "prefix_group"?}],
"edges": [{"parent", "child", "gamma"}]}`` whose stages become sessions ``<query>/<stage>`` once the
latency split gives them budgets. Unknown keys, missing fields, non-positive rates or SLOs and
profiles whose latency decreases with batch size raise :class:`WorkloadError` whose message starts
with the JSON path of the offending field, e.g. ``sessions[2].slo_ms: must be positive``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from globalsched.planning.plan import GpuSpec, PrefixGroup, QueryEdge, QuerySpec, QueryStage, SessionSpec
from common.profile import Profile, ProfileError
from common.query_graph import session_name


class WorkloadError(ValueError):
    """A malformed workload; the message begins with the path of the field at fault."""


@dataclass(frozen=True)
class Workload:
    gpu: GpuSpec
    sessions: tuple[SessionSpec, ...]
    queries: tuple[QuerySpec, ...] = ()
    prefix_groups: tuple[PrefixGroup, ...] = ()


_TOP_KEYS = {"gpu", "sessions", "queries", "prefix_groups"}
_GPU_KEYS = {"name", "memory_mb"}
_SESSION_KEYS = {"name", "model", "slo_ms", "rate", "profile", "prefix_group"}
_GROUP_KEYS = {"name", "profile"}
_QUERY_KEYS = {"name", "slo_ms", "rate", "stages", "edges"}
_STAGE_KEYS = {"name", "model", "profile", "prefix_group"}
_EDGE_KEYS = {"parent", "child", "gamma"}


def _object(value: Any, where: str, allowed: set[str], required: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise WorkloadError(f"{where}: must be an object")
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise WorkloadError(f"{where}: unknown key(s) {unknown}")
    for key in required:
        if key not in value:
            raise WorkloadError(f"{where}: missing field '{key}'")
    return value


def _name(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise WorkloadError(f"{where}: must be a non-empty string")
    return value


def _positive(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise WorkloadError(f"{where}: must be a number, got {value!r}")
    if value <= 0:
        raise WorkloadError(f"{where}: must be positive, got {value!r}")
    return float(value)


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise WorkloadError(f"{where}: must be a list")
    return value


def _profile(value: Any, where: str) -> Profile:
    try:
        return Profile.from_json_obj(value, where)
    except ProfileError as exc:
        raise WorkloadError(str(exc)) from None


def _check_prefix_fits(profile: Profile, group: PrefixGroup, where: str) -> None:
    prefix = group.profile
    if prefix.max_batch < profile.max_batch:
        raise WorkloadError(f"{where}: prefix group {group.name!r} profile stops at batch {prefix.max_batch}, "
                            f"below this model's {profile.max_batch}")
    for b in range(1, profile.max_batch + 1):
        if prefix.latency_ms(b) > profile.latency_ms(b) + 1e-9 or prefix.memory_mb(b) > profile.memory_mb(b) + 1e-9:
            raise WorkloadError(f"{where}: prefix group {group.name!r} costs more than the whole model at batch {b}")


def parse_workload(obj: Any) -> Workload:
    """Validate a decoded workload JSON object and build the value types."""
    top = _object(obj, "workload", _TOP_KEYS, ("gpu", "sessions"))
    g = _object(top["gpu"], "gpu", _GPU_KEYS, ("name", "memory_mb"))
    gpu = GpuSpec(_name(g["name"], "gpu.name"), _positive(g["memory_mb"], "gpu.memory_mb"))

    groups: dict[str, PrefixGroup] = {}
    for i, raw in enumerate(_list(top.get("prefix_groups", []), "prefix_groups")):
        where = f"prefix_groups[{i}]"
        o = _object(raw, where, _GROUP_KEYS, ("name", "profile"))
        name = _name(o["name"], f"{where}.name")
        if name in groups:
            raise WorkloadError(f"{where}.name: duplicate prefix group {name!r}")
        groups[name] = PrefixGroup(name, _profile(o["profile"], f"{where}.profile"))

    def group_of(o: dict[str, Any], where: str, profile: Profile) -> str | None:
        if "prefix_group" not in o or o["prefix_group"] is None:
            return None
        gname = _name(o["prefix_group"], f"{where}.prefix_group")
        if gname not in groups:
            raise WorkloadError(f"{where}.prefix_group: unknown prefix group {gname!r}")
        _check_prefix_fits(profile, groups[gname], f"{where}.prefix_group")
        return gname

    sessions: list[SessionSpec] = []
    names: set[str] = set()
    for i, raw in enumerate(_list(top["sessions"], "sessions")):
        where = f"sessions[{i}]"
        o = _object(raw, where, _SESSION_KEYS, ("name", "model", "slo_ms", "rate", "profile"))
        name = _name(o["name"], f"{where}.name")
        if name in names:
            raise WorkloadError(f"{where}.name: duplicate session name {name!r}")
        names.add(name)
        model = _name(o["model"], f"{where}.model")
        slo = _positive(o["slo_ms"], f"{where}.slo_ms")
        rate = _positive(o["rate"], f"{where}.rate")
        profile = _profile(o["profile"], f"{where}.profile")
        sessions.append(SessionSpec(name, model, slo, rate, profile, group_of(o, where, profile)))

    queries: list[QuerySpec] = []
    qnames: set[str] = set()
    for i, raw in enumerate(_list(top.get("queries", []), "queries")):
        where = f"queries[{i}]"
        o = _object(raw, where, _QUERY_KEYS, ("name", "slo_ms", "rate", "stages"))
        qname = _name(o["name"], f"{where}.name")
        if qname in qnames:
            raise WorkloadError(f"{where}.name: duplicate query name {qname!r}")
        qnames.add(qname)
        slo = _positive(o["slo_ms"], f"{where}.slo_ms")
        rate = _positive(o["rate"], f"{where}.rate")
        stages: list[QueryStage] = []
        stage_names: set[str] = set()
        raw_stages = _list(o["stages"], f"{where}.stages")
        if not raw_stages:
            raise WorkloadError(f"{where}.stages: must list at least one stage")
        for j, rs in enumerate(raw_stages):
            sw = f"{where}.stages[{j}]"
            so = _object(rs, sw, _STAGE_KEYS, ("name", "model", "profile"))
            sname = _name(so["name"], f"{sw}.name")
            if "/" in sname:
                raise WorkloadError(f"{sw}.name: must not contain '/'")
            if sname in stage_names:
                raise WorkloadError(f"{sw}.name: duplicate stage name {sname!r}")
            stage_names.add(sname)
            session = session_name(qname, sname)
            if session in names:
                raise WorkloadError(f"{sw}.name: session name {session!r} already used")
            names.add(session)
            profile = _profile(so["profile"], f"{sw}.profile")
            stages.append(QueryStage(sname, _name(so["model"], f"{sw}.model"), profile, group_of(so, sw, profile)))
        edges: list[QueryEdge] = []
        for j, re_ in enumerate(_list(o.get("edges", []), f"{where}.edges")):
            ew = f"{where}.edges[{j}]"
            eo = _object(re_, ew, _EDGE_KEYS, ("parent", "child", "gamma"))
            for key in ("parent", "child"):
                if _name(eo[key], f"{ew}.{key}") not in stage_names:
                    raise WorkloadError(f"{ew}.{key}: unknown stage {eo[key]!r}")
            if eo["parent"] == eo["child"]:
                raise WorkloadError(f"{ew}: an edge from a stage to itself")
            if any(e.parent == eo["parent"] and e.child == eo["child"] for e in edges):
                raise WorkloadError(f"{ew}: duplicate edge {eo['parent']}->{eo['child']}")
            edges.append(QueryEdge(eo["parent"], eo["child"], _positive(eo["gamma"], f"{ew}.gamma")))
        try:
            queries.append(QuerySpec(qname, slo, rate, tuple(stages), tuple(edges)))
        except ValueError as exc:  # cycles: the only check left to the dataclass
            raise WorkloadError(f"{where}.edges: {exc}") from None

    if not sessions and not queries:
        raise WorkloadError("sessions: must list at least one session (or give queries)")
    return Workload(gpu, tuple(sessions), tuple(queries), tuple(groups.values()))


def load_workload(path: str | Path) -> Workload:
    """Read and parse a workload file; I/O and JSON errors become WorkloadError too."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise WorkloadError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"{path}: not valid JSON ({exc})") from None
    return parse_workload(obj)


def workload_to_json_obj(w: Workload) -> dict[str, Any]:
    """The file form of a workload (round-trips through :func:`parse_workload`)."""
    def rows(p: Profile) -> list[dict[str, Any]]:
        return [{"batch": r.batch, "latency_ms": r.latency_ms, "memory_mb": r.memory_mb} for r in p.rows]

    out: dict[str, Any] = {"gpu": {"name": w.gpu.name, "memory_mb": w.gpu.memory_mb}, "sessions": []}
    for s in w.sessions:
        o: dict[str, Any] = {"name": s.name, "model": s.model, "slo_ms": s.slo_ms, "rate": s.rate_rps,
                             "profile": rows(s.profile)}
        if s.prefix_group:
            o["prefix_group"] = s.prefix_group
        out["sessions"].append(o)
    if w.prefix_groups:
        out["prefix_groups"] = [{"name": g.name, "profile": rows(g.profile)} for g in w.prefix_groups]
    if w.queries:
        out["queries"] = [{
            "name": q.name, "slo_ms": q.slo_ms, "rate": q.rate_rps,
            "stages": [dict({"name": st.name, "model": st.model, "profile": rows(st.profile)},
                            **({"prefix_group": st.prefix_group} if st.prefix_group else {}))
                       for st in q.stages],
            "edges": [{"parent": e.parent, "child": e.child, "gamma": e.gamma} for e in q.edges]}
            for q in w.queries]
    return out
