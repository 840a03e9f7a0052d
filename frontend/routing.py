"""The frontend's routing table: internal types built from the scheduler's pushed RoutingTable.

Versions (common/version_policy.py): every version of a model the scheduler knows is an entry of its own,
keyed like every entry by its session (the version key, ``name:version``; version 1's is the bare
name), and indexed by model name and version in :attr:`RoutingTable.versions`.
:meth:`RoutingTable.resolve` says which entry a request naming a model (and maybe a version) means.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import AbstractSet, Callable, Sequence

from common.late_requests import LateRequests
from common.pb import control
from common.query_def import QueryDef, QueryError, even_budgets_ms, parse_query
from common.tensors import TensorSpec
from common.version_policy import DEFAULT_POLICY, VersionPolicy, VersionError, from_pb as policy_from_pb, version_key


def item_counts(inputs: tuple[TensorSpec, ...]) -> tuple[int | None, ...]:
    """Values in one batch row of each input (None where a dimension is variable): computed once per
    routing table entry, not per request."""
    return tuple(None if any(d < 0 for d in s.shape) else math.prod(s.shape) for s in inputs)


@dataclass(frozen=True)
class Route:
    node_id: str
    address: str
    weight: float
    batch: int = 0                   # planned batch of the session on this backend
    duty_cycle_ms: float = 0.0       # the backend's planned duty cycle


@dataclass(frozen=True)
class ModelEntry:
    """One version of a model (or a query's stage session) as the frontend serves it."""

    name: str                        # the model's name (a query stage's: its session "<query>/<stage>")
    runtime: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    slo_ms: float
    max_batch: int
    served: bool                     # a session exists for it (loaded), even if no backend yet
    backends: tuple[Route, ...]
    reason: str = ""                 # why it has no backend
    planned_rate_rps: float = 0.0    # the rate the plan serves
    measured_rate_rps: float = 0.0   # the rate frontends reported, summed
    version: int = 1
    session: str = ""                # what backends, statistics and demand reports call it ("": ``name``)
    version_policy: VersionPolicy = DEFAULT_POLICY    # the model's
    cold: bool = False               # resident on no device: a request pages it in (frontend/frontend_state.py)
    serve_late: bool = False         # its late requests are served, not dropped (common/late_requests.py)

    def __post_init__(self) -> None:
        if not self.session:
            object.__setattr__(self, "session", self.name)

    @property
    def ready(self) -> bool:
        return bool(self.backends)

    @property
    def servable(self) -> bool:
        """A request is served: it has a backend, or it is cold and a request pages it in. Triton's
        model readiness and repository index say READY for both (a cold one with its reason), so that
        a client waiting for READY before its first request is not kept from the request that pages
        the model in."""
        return self.ready or self.cold

    @cached_property
    def input_item_counts(self) -> tuple[int | None, ...]:
        return item_counts(self.inputs)

    @property
    def platform(self) -> str:
        return {"onnxruntime": "onnxruntime_onnx", "torch": "pytorch_libtorch"}.get(self.runtime, self.runtime)


DEFAULT_MAX_BATCH = 64


def _query_entry(info: control.QueryInfo, models: dict[str, ModelEntry]) -> QueryEntry | None:
    try:
        q = parse_query(info.json)
    except QueryError:
        return None
    stage_models = {}
    reason = info.reason
    for s in q.stages:
        entry = models.get(q.graph.session_name(s.name))
        if entry is None:
            reason = reason or f"stage {s.name!r} is not placed yet"
            entry = ModelEntry(q.graph.session_name(s.name), "", (), (), 0.0, DEFAULT_MAX_BATCH, True, (), "not placed")
        stage_models[s.name] = entry
    outputs = []
    for out_name, src in q.outputs:
        spec = next((t for t in stage_models[src.stage].outputs if t.name == src.tensor), None)
        outputs.append(TensorSpec(out_name, spec.datatype if spec else "FP32", spec.shape if spec else ()))
    budgets = dict(info.budgets_ms) or even_budgets_ms(q)
    return QueryEntry(q, budgets, q.inputs, tuple(outputs), stage_models, reason,
                      latest_finish_ms=dict(info.latest_finish_ms))


def _entry(desc: control.ModelDesc, slo_ms: float, served: bool, routes=(), reason: str = "",
           planned_rate_rps: float = 0.0, measured_rate_rps: float = 0.0, session: str = "",
           cold: bool = False) -> ModelEntry:
    """The entry of ``desc``'s version, or of the query stage ``session`` that runs it."""
    spec = lambda t: TensorSpec(t.name, t.datatype, tuple(t.shape))  # noqa: E731
    version = desc.version or 1
    key = version_key(desc.name, version)
    stage = bool(session) and session != key
    return ModelEntry(session if stage else desc.name, desc.runtime, tuple(spec(t) for t in desc.inputs),
                      tuple(spec(t) for t in desc.outputs), slo_ms or desc.default_slo_ms,
                      min((b for b in (desc.max_batch, desc.batch_cap) if b), default=DEFAULT_MAX_BATCH), served,
                      tuple(Route(r.node_id, r.address, r.weight, r.batch, r.duty_cycle_ms) for r in routes), reason,
                      planned_rate_rps, measured_rate_rps, 1 if stage else version, session or key,
                      _policy(desc), cold, LateRequests.from_pb(desc.late_requests) is LateRequests.SERVE)


def _policy(desc: control.ModelDesc) -> VersionPolicy:
    try:
        return policy_from_pb(desc.version_policy) if desc.HasField("version_policy") else DEFAULT_POLICY
    except VersionError:        # the scheduler checked it; a table from elsewhere gets the default
        return DEFAULT_POLICY


@dataclass(frozen=True)
class QueryEntry:
    """A multi-model query served under its own name; its stages are sessions in the table."""

    definition: QueryDef
    budgets_ms: dict[str, float]           # per stage, from the scheduler's latency split
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    stage_models: dict[str, ModelEntry]    # stage -> its session's entry (backends, specs)
    reason: str = ""
    runtime: str = "ensemble"
    platform: str = "ensemble"
    max_batch: int = DEFAULT_MAX_BATCH
    served: bool = True
    backends: tuple[Route, ...] = ()
    latest_finish_ms: dict[str, float] = field(default_factory=dict)   # per stage; see common.query_def
    version: int = 1                       # a query has one version

    @property
    def name(self) -> str:
        return self.definition.name

    @property
    def session(self) -> str:
        """What its demand and statistics are counted under: its name."""
        return self.definition.name

    @cached_property
    def input_item_counts(self) -> tuple[int | None, ...]:
        return item_counts(self.inputs)

    @property
    def slo_ms(self) -> float:
        return self.definition.slo_ms

    @property
    def ready(self) -> bool:
        return not self.reason and all(m.ready for m in self.stage_models.values())

    @property
    def servable(self) -> bool:
        """Every stage is served, or cold and paged in by a request (:attr:`ModelEntry.servable`)."""
        return not self.reason and all(m.servable for m in self.stage_models.values())


@dataclass(frozen=True)
class RoutingTable:
    epoch: int
    models: dict[str, ModelEntry]          # by session: a version key, or "<query>/<stage>"
    queries: dict[str, QueryEntry] = field(default_factory=dict)
    planned_devices: int = 0               # devices the plan uses
    lower_bound: int = 0                   # devices no plan can do with fewer
    lower_bound_throughput_only: int = 0   # the throughput-only bound of earlier releases
    versions: dict[str, dict[int, ModelEntry]] = field(default_factory=dict)   # model -> version -> entry

    @staticmethod
    def empty() -> "RoutingTable":
        return RoutingTable(0, {})

    @staticmethod
    def from_proto(table: control.RoutingTable) -> "RoutingTable":
        models = {}
        versions: dict[str, dict[int, ModelEntry]] = {}
        for r in table.routes:
            entry = _entry(r.model, r.slo_ms, True, r.backends, r.reason, r.planned_rate_rps, r.measured_rate_rps,
                           r.session, r.cold)
            models[entry.session] = entry
            if entry.name == r.model.name:          # a model's version, not a query's stage ("<query>/<stage>")
                versions.setdefault(entry.name, {})[entry.version] = entry
        for d in table.stored:
            entry = _entry(d, 0.0, False, (), "not loaded")
            if entry.session not in models:
                models[entry.session] = entry
                versions.setdefault(entry.name, {})[entry.version] = entry
        queries = {}
        for info in table.queries:
            q = _query_entry(info, models)
            if q is not None:
                queries[q.name] = q
        return RoutingTable(table.epoch, models, queries, table.planned_devices, table.lower_bound,
                            table.lower_bound_throughput_only,
                            {name: dict(sorted(vs.items())) for name, vs in versions.items()})

    def addresses(self) -> set[str]:
        return {r.address for m in self.models.values() for r in m.backends}

    def newest(self, name: str) -> ModelEntry | None:
        """What a request for model ``name`` without a version means: its newest version that has
        backends (ready), else its newest served one (whose reason says why it is not ready), else its
        newest stored one; None for an unknown model."""
        versions = self.versions.get(name)
        if not versions:
            return None
        entries = list(versions.values())[::-1]
        return next((e for e in entries if e.ready), None) or next((e for e in entries if e.served), entries[0])

    def served_versions(self, name: str) -> list[ModelEntry]:
        """The versions of ``name`` being served (loaded), oldest first."""
        return [e for e in self.versions.get(name, {}).values() if e.served]


def choose_route(routes: Sequence[Route], outstanding: Callable[[str], int], down: Callable[[str], bool],
                 exclude: AbstractSet[str], tiebreak: Callable[[], float]) -> Route | None:
    """The frontend's choice of backend for one request: the least outstanding work per unit of planned
    share (``outstanding(address)``: requests sent there and not yet answered), among the routes not
    ``down`` (a broken connection) nor in ``exclude`` (tried already for this request); ties go to the
    smaller ``tiebreak()``. None when no route is left. Pure: the frontend and ``nexus simulate`` call it."""
    if len(routes) == 1 and not exclude:       # the common case: nothing to choose
        only = routes[0]
        return None if down(only.address) else only
    choices = [r for r in routes if r.address not in exclude and not down(r.address)]
    if not choices:
        return None
    return min(choices, key=lambda r: ((outstanding(r.address) + 1) / max(r.weight, 1e-6), tiebreak()))
