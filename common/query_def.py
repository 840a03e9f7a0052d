"""Multi-model queries: the definition file, its parsing and its validation (pure functions).

A query is a DAG of stages, each running one model, served under one end-to-end SLO as a model
name of its own (like a Triton ensemble)::

    {
      "name": "traffic",
      "slo_ms": 400,
      "inputs": [{"name": "image", "datatype": "FP32", "shape": [3, 64, 64]}],
      "stages": [
        {"name": "detect", "model": "detector", "inputs": {"input": "image"}},
        {"name": "vehicle", "model": "vehicle_cls", "inputs": {"input": "detect.crops"},
         "fanout": {"select": "detect.scores", "min": 0.5}}
      ],
      "outputs": {"vehicle_logits": "vehicle.logits", "scores": "detect.scores"}
    }

A stage input comes from a query input (``"image"``) or a parent's output (``"stage.tensor"``).
Shapes omit the batch dimension. Without ``fanout`` a child receives the parent's tensor row for
row. With ``fanout`` the parent's tensor has shape [K, *child_input] per row and every one of the K
rows becomes a separate request to the child (``true``), or only those whose ``select`` score (a
[K] tensor of the same parent) is at least ``min``. The fan-out gamma (child requests per parent
request) is therefore data dependent: the frontend measures it and the scheduler re-splits the
latency budget with it. Outputs of a fan-out stage have one row per child request.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from common.query_graph import QueryError, QueryGraph
from common.tensors import KSERVE_TO_NUMPY, TensorSpec

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


@dataclass(frozen=True)
class Source:
    """Where a tensor comes from: a query input (stage None) or a stage's output."""

    stage: str | None
    tensor: str

    def __str__(self) -> str:
        return self.tensor if self.stage is None else f"{self.stage}.{self.tensor}"


@dataclass(frozen=True)
class FanOut:
    select: Source | None = None     # a [K] score tensor of the parent, or None: every row
    min_score: float = 0.0


@dataclass(frozen=True)
class StageDef:
    name: str
    model: str
    inputs: tuple[tuple[str, Source], ...]     # (model input name, source)
    fanout: FanOut | None = None

    def parents(self) -> tuple[str, ...]:
        out = []
        for _, src in self.inputs:
            if src.stage is not None and src.stage not in out:
                out.append(src.stage)
        if self.fanout and self.fanout.select and self.fanout.select.stage not in out:
            out.append(self.fanout.select.stage)
        return tuple(out)


@dataclass(frozen=True)
class QueryDef:
    """A served query: its tensors and wiring. Its structure is :attr:`graph`, whose edges come from
    the stages' sources; the graph is built when first asked for, so that :func:`validate_query`
    can name an unknown stage before the graph would."""

    name: str
    slo_ms: float
    inputs: tuple[TensorSpec, ...]
    stages: tuple[StageDef, ...]
    outputs: tuple[tuple[str, Source], ...]
    source_json: str = ""

    def stage(self, name: str) -> StageDef:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(name)

    @functools.cached_property
    def graph(self) -> QueryGraph:
        """QueryError when the stages repeat a name, read an unknown stage or form a cycle."""
        return QueryGraph(self.name, tuple(s.name for s in self.stages),
                          tuple((p, s.name) for s in self.stages for p in s.parents()))


# ---- parsing ------------------------------------------------------------------------------------


def _expect(cond: bool, message: str) -> None:
    if not cond:
        raise QueryError(message)


def _keys(obj: Any, where: str, required: Sequence[str], optional: Sequence[str] = ()) -> None:
    _expect(isinstance(obj, dict), f"{where}: must be an object")
    unknown = sorted(set(obj) - set(required) - set(optional))
    _expect(not unknown, f"{where}: unknown key(s) {unknown}")
    for k in required:
        _expect(k in obj, f"{where}: missing field '{k}'")


def _source(text: Any, where: str) -> Source:
    _expect(isinstance(text, str) and text, f"{where}: must be 'input' or 'stage.tensor'")
    stage, dot, tensor = text.partition(".")
    return Source(stage, tensor) if dot else Source(None, text)


def parse_query(text: str) -> QueryDef:
    """Parse a query file; QueryError names the first malformed field."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise QueryError(f"query: not valid JSON ({exc})") from None
    _keys(obj, "query", ("name", "slo_ms", "inputs", "stages", "outputs"))
    name = obj["name"]
    _expect(isinstance(name, str) and bool(_NAME.match(name)), f"query.name: invalid name {name!r}")
    where = f"query {name!r}"
    slo = obj["slo_ms"]
    _expect(isinstance(slo, (int, float)) and not isinstance(slo, bool) and slo > 0,
            f"{where}: slo_ms must be a positive number")
    _expect(isinstance(obj["inputs"], list) and obj["inputs"], f"{where}: inputs must be a non-empty list")
    inputs = []
    for i, spec in enumerate(obj["inputs"]):
        _keys(spec, f"{where}: inputs[{i}]", ("name", "datatype", "shape"))
        _expect(spec["datatype"] in KSERVE_TO_NUMPY, f"{where}: inputs[{i}].datatype {spec['datatype']!r} unsupported")
        _expect(isinstance(spec["shape"], list) and all(isinstance(d, int) and d > 0 for d in spec["shape"]),
                f"{where}: inputs[{i}].shape must list positive dimensions (without the batch dimension)")
        inputs.append(TensorSpec(spec["name"], spec["datatype"], tuple(spec["shape"])))
    _expect(isinstance(obj["stages"], list) and obj["stages"], f"{where}: stages must be a non-empty list")
    stages = []
    for i, st in enumerate(obj["stages"]):
        sw = f"{where}: stages[{i}]"
        _keys(st, sw, ("name", "model", "inputs"), ("fanout",))
        _expect(isinstance(st["name"], str) and bool(_NAME.match(st["name"])) and "." not in st["name"],
                f"{sw}.name: invalid stage name {st['name']!r}")
        _expect(isinstance(st["model"], str) and st["model"], f"{sw}.model: must be a model name")
        _expect(isinstance(st["inputs"], dict) and st["inputs"], f"{sw}.inputs: must map model inputs to sources")
        mapping = tuple((k, _source(v, f"{sw}.inputs.{k}")) for k, v in st["inputs"].items())
        fanout = None
        if "fanout" in st and st["fanout"] is not False:
            f = st["fanout"]
            if f is True:
                fanout = FanOut()
            else:
                _keys(f, f"{sw}.fanout", (), ("select", "min"))
                select = _source(f["select"], f"{sw}.fanout.select") if "select" in f else None
                _expect(select is None or select.stage is not None, f"{sw}.fanout.select: must be 'stage.tensor'")
                m = f.get("min", 0.0)
                _expect(isinstance(m, (int, float)) and not isinstance(m, bool), f"{sw}.fanout.min: must be a number")
                fanout = FanOut(select, float(m))
        stages.append(StageDef(st["name"], st["model"], mapping, fanout))
    _expect(isinstance(obj["outputs"], dict) and obj["outputs"], f"{where}: outputs must map names to 'stage.tensor'")
    outputs = tuple((k, _source(v, f"{where}: outputs.{k}")) for k, v in obj["outputs"].items())
    return QueryDef(name, float(slo), tuple(inputs), tuple(stages), outputs, text)


# ---- validation against the model database --------------------------------------------------------


@dataclass(frozen=True)
class ModelIO:
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    def output(self, name: str) -> TensorSpec | None:
        return next((t for t in self.outputs if t.name == name), None)


def validate_query(q: QueryDef, models: Mapping[str, ModelIO], min_latency_ms: Mapping[str, float]) -> None:
    """Check a parsed query against the models it uses; QueryError names the problem.

    ``min_latency_ms[model]`` is the model's smallest batch-1 latency on any profiled device; a
    model without one is skipped in the SLO check (it is checked again when planned).
    """
    where = f"query {q.name!r}"
    names = [s.name for s in q.stages]
    dup = {n for n in names if names.count(n) > 1}
    _expect(not dup, f"{where}: duplicate stage name(s) {sorted(dup)}")
    query_inputs = {t.name: t for t in q.inputs}
    _expect(not set(query_inputs) & set(names), f"{where}: a stage and a query input share a name")
    for s in q.stages:
        _expect(s.model in models, f"{where}: stage {s.name!r} uses unknown model {s.model!r}")
    for s in q.stages:
        for _, src in s.inputs:
            if src.stage is not None:
                _expect(src.stage in names, f"{where}: stage {s.name!r} reads {src} from unknown stage {src.stage!r}")
        if s.fanout and s.fanout.select:
            _expect(s.fanout.select.stage in names,
                    f"{where}: stage {s.name!r} selects on unknown stage {s.fanout.select.stage!r}")
    q.graph   # raises on a cycle, naming it

    def spec_of(src: Source, reader: str) -> TensorSpec:
        if src.stage is None:
            _expect(src.tensor in query_inputs, f"{where}: {reader} reads unknown query input {src.tensor!r}")
            return query_inputs[src.tensor]
        spec = models[q.stage(src.stage).model].output(src.tensor)
        _expect(spec is not None, f"{where}: {reader} reads {src}, but model {q.stage(src.stage).model!r} "
                                  f"has no output {src.tensor!r}")
        return spec

    for s in q.stages:
        io = models[s.model]
        mapped = {k for k, _ in s.inputs}
        expected = {t.name for t in io.inputs}
        _expect(mapped == expected, f"{where}: stage {s.name!r} must map exactly the inputs {sorted(expected)} "
                                    f"of model {s.model!r}, got {sorted(mapped)}")
        fanned_k = None
        for input_name, src in s.inputs:
            target = next(t for t in io.inputs if t.name == input_name)
            source = spec_of(src, f"stage {s.name!r} input {input_name!r}")
            _expect(source.datatype == target.datatype,
                    f"{where}: stage {s.name!r} input {input_name!r}: {src} is {source.datatype}, "
                    f"model {s.model!r} expects {target.datatype}")
            if s.fanout is not None and src.stage is not None:
                _expect(len(source.shape) == len(target.shape) + 1 and _dims_match(source.shape[1:], target.shape),
                        f"{where}: stage {s.name!r} input {input_name!r}: fan-out needs {src} of shape "
                        f"[K, {', '.join(map(str, target.shape))}], got {list(source.shape)}")
                fanned_k = source.shape[0]
            else:
                _expect(_dims_match(source.shape, target.shape),
                        f"{where}: stage {s.name!r} input {input_name!r}: {src} has shape {list(source.shape)}, "
                        f"model {s.model!r} expects {list(target.shape)}")
        if s.fanout is not None:
            _expect(fanned_k is not None, f"{where}: stage {s.name!r} fans out but reads no parent tensor")
            if s.fanout.select is not None:
                sel = spec_of(s.fanout.select, f"stage {s.name!r} fanout.select")
                _expect(len(sel.shape) == 1 and sel.shape[0] == fanned_k,
                        f"{where}: stage {s.name!r}: fanout.select {s.fanout.select} must have shape [{fanned_k}], "
                        f"got {list(sel.shape)}")
    for out_name, src in q.outputs:
        _expect(src.stage is not None and src.stage in names,
                f"{where}: output {out_name!r} must name 'stage.tensor', got {src}")
        spec_of(src, f"output {out_name!r}")
    for path in q.graph.paths():
        known = [min_latency_ms[q.stage(s).model] for s in path if q.stage(s).model in min_latency_ms]
        need = sum(known)
        _expect(need <= q.slo_ms, f"{where}: SLO {q.slo_ms:g} ms is below the sum of minimal latencies "
                                  f"{need:.1f} ms along the path {' -> '.join(path)}")


def _dims_match(got: Sequence[int], want: Sequence[int]) -> bool:
    return len(got) == len(want) and all(w < 0 or g < 0 or g == w for g, w in zip(got, want))


def stage_deadlines_ms(q: QueryDef, budgets_ms: Mapping[str, float]) -> dict[str, float]:
    """Finish time of each stage after the query starts: its budget plus its latest parent's."""
    finish: dict[str, float] = {}
    for name in q.graph.topological_order():
        s = q.stage(name)
        start = max((finish[p] for p in s.parents()), default=0.0)
        finish[name] = min(start + budgets_ms.get(name, 0.0), q.slo_ms)
    return finish


def latest_finish_ms(q: QueryDef, min_stage_ms: Mapping[str, float]) -> dict[str, float]:
    """The latest time after the query starts at which each stage may finish and still leave every
    stage after it its minimal time: the SLO less the heaviest path of ``min_stage_ms`` below it.

    A stage whose batch runs past its budget need not be dropped while this holds: the stages after
    it may be quicker than their budgets (slack passes down the DAG).
    """
    below: dict[str, float] = {}
    for name in reversed(q.graph.topological_order()):
        below[name] = max((min_stage_ms.get(c, 0.0) + below[c] for c in q.graph.children(name)), default=0.0)
    return {name: max(q.slo_ms - tail, 0.0) for name, tail in below.items()}


def even_budgets_ms(q: QueryDef) -> dict[str, float]:
    """SLO divided evenly along the longest path through each stage (before any split is known)."""
    longest = max(len(p) for p in q.graph.paths())
    return {s.name: q.slo_ms / longest for s in q.stages}
