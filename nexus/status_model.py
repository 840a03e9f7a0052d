"""What ``nexus status`` shows, as values: the plan's devices with their sessions, the queries with
their latency split, the plan's device count against the lower bound, the scaling policy's decision
per device type (how many devices it wants, and why), and per (model, device type) the profiles in
service (table, measured, predicted) and which one the plan uses.

:func:`from_reply` builds it from the scheduler's ``GetStatus`` reply; ``nexus status`` prints it as
text or JSON (:mod:`nexus.status_cmd`) and draws it (:mod:`nexus.status_plot`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from common.pb import control
from common.query_def import QueryDef, QueryError, parse_query


@dataclass(frozen=True)
class SessionStatus:
    session: str
    model: str
    batch: int
    latency_ms: float            # l(batch) on this device
    share: float                 # latency_ms / the device's duty cycle
    device_rate_rps: float       # throughput planned on this device
    planned_rate_rps: float      # the session's planned rate (all devices)
    measured_rate_rps: float     # the session's measured rate (all frontends)
    slo_ms: float
    memory_mb: float
    batch_cap: int = 0           # the model's largest batch (config.pbtxt max_batch_size; 0: none)


@dataclass(frozen=True)
class DeviceStatus:
    node_id: str
    device: str
    device_type: str
    memory_mb: float
    duty_cycle_ms: float
    sessions: tuple[SessionStatus, ...]
    exec_ms: float = 0.0         # planned execution per duty cycle, a shared prefix counted once
    address: str = ""            # where the backend serves (what `nexus serve` knows its children by)

    @property
    def occupancy(self) -> float:
        """The share of the duty cycle the device executes: a prefix its sessions share runs once per
        cycle, so this is not the sum of their shares."""
        return self.exec_ms / self.duty_cycle_ms if self.duty_cycle_ms > 0 else 0.0

    @property
    def memory_used_mb(self) -> float:
        return sum(s.memory_mb for s in self.sessions)


@dataclass(frozen=True)
class QueryStatus:
    name: str
    slo_ms: float
    split: str
    budgets_ms: dict[str, float]
    gamma: dict[str, float]
    planned_rate_rps: float
    devices: int
    reason: str
    stage_models: dict[str, str] = field(default_factory=dict)       # stage -> model
    paths: tuple[tuple[str, ...], ...] = ()                          # root-to-leaf stage paths


@dataclass(frozen=True)
class ScalingStatus:
    """The scaling policy's decision for one device type (globalsched/planning/scaling_policy.py)."""

    device_type: str
    desired: int                 # devices to have (nexus_desired_devices)
    registered: int              # backends registered now
    needed: int                  # the raw need now: the plan's devices, demand and headroom, within the bounds
    plan_devices: int            # devices the plan in force uses
    reason: str
    drain_node_ids: tuple[str, ...] = ()   # when desired < registered: the backends to drain, cheapest first

    @property
    def drain_node_id(self) -> str:
        """The backend to drain first ('' when none)."""
        return self.drain_node_ids[0] if self.drain_node_ids else ""


@dataclass(frozen=True)
class ProfileStatus:
    """One model's profiles on one device type (globalsched/state/profile_book.py): l(b) at a few batches
    each ((batch, ms) pairs; empty where there is none), which one plans, the serving samples held."""

    model: str
    device_type: str
    in_use: str                  # "table" | "measured" | "predicted"
    pinned: bool
    table: tuple[tuple[int, float], ...]
    measured: tuple[tuple[int, float], ...]
    predicted: tuple[tuple[int, float], ...]
    predicted_from: str
    samples: int
    contended_samples: int
    drift: float
    held_back: str
    prediction_error: dict[str, float | int | str] = field(default_factory=dict)   # once a measurement replaced it


@dataclass(frozen=True)
class ClusterStatus:
    epoch: int
    solver: str
    plan_age_s: float
    planned_devices: int
    lower_bound: int
    frontends: int
    devices: tuple[DeviceStatus, ...]
    queries: tuple[QueryStatus, ...]
    unplaced: dict[str, str] = field(default_factory=dict)      # session -> why
    best_effort: dict[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    scaling: tuple[ScalingStatus, ...] = ()
    profiles: tuple[ProfileStatus, ...] = ()
    lower_bound_throughput_only: int = 0     # the bound of earlier releases, for comparison
    leader: str = ""                         # the leading scheduler's address (it answered)

    def decision(self, device_type: str) -> ScalingStatus | None:
        return next((d for d in self.scaling if d.device_type == device_type), None)

    @property
    def devices_in_use(self) -> int:
        return sum(1 for d in self.devices if d.sessions)

    def to_json_obj(self) -> dict:
        obj = asdict(self)
        for d, dev in zip(obj["devices"], self.devices):
            d["occupancy"] = round(dev.occupancy, 4)
            d["memory_used_mb"] = round(dev.memory_used_mb, 2)
        for s, scaling in zip(obj["scaling"], self.scaling):
            s["drain_node_id"] = scaling.drain_node_id      # the first, as before the list was added
        obj["devices_in_use"] = self.devices_in_use
        return obj


def from_reply(reply: control.StatusReply) -> ClusterStatus:
    """Convert the scheduler's reply to :class:`ClusterStatus`."""
    routing = reply.routing
    routes = {r.session or r.model.name: r for r in routing.routes}
    devices = []
    for d in reply.devices:
        sessions = []
        for s in d.sessions:
            route = routes.get(s.session)
            sessions.append(SessionStatus(
                session=s.session, model=s.model, batch=s.batch, latency_ms=s.latency_ms,
                share=s.latency_ms / d.duty_cycle_ms if d.duty_cycle_ms > 0 else 0.0,
                device_rate_rps=s.planned_rate_rps,
                planned_rate_rps=route.planned_rate_rps if route else s.planned_rate_rps,
                measured_rate_rps=route.measured_rate_rps if route else 0.0,
                slo_ms=s.slo_ms, memory_mb=s.memory_mb, batch_cap=route.model.batch_cap if route else 0))
        devices.append(DeviceStatus(d.node_id, d.device, d.device_type, d.memory_mb, d.duty_cycle_ms,
                                    tuple(sorted(sessions, key=lambda x: -x.latency_ms)), d.exec_ms, d.address))
    devices.sort(key=lambda d: (-d.occupancy, d.node_id))
    queries = []
    for q in routing.queries:
        try:
            definition = parse_query(q.json)
        except QueryError:     # the scheduler keeps only queries that parsed; show the figures anyway
            definition = None
        slo = definition.slo_ms if definition else 0.0
        stage_models = {st.name: st.model for st in definition.stages} if definition else {}
        queries.append(QueryStatus(q.name, slo, q.split_method, dict(q.budgets_ms), dict(q.gamma),
                                   q.planned_rate_rps, q.devices, q.reason, stage_models,
                                   _paths(definition) if definition else ()))
    unplaced = {name: r.reason for name, r in routes.items() if not r.backends}
    scaling = tuple(ScalingStatus(s.device_type, s.desired, s.registered, s.needed, s.plan_devices, s.reason,
                                  tuple(s.drain_node_ids) or ((s.drain_node_id,) if s.drain_node_id else ()))
                    for s in reply.scaling)       # a scheduler of before drain_node_ids names only the first
    return ClusterStatus(routing.epoch, reply.solver, reply.plan_age_s, routing.planned_devices, routing.lower_bound,
                         reply.frontends, tuple(devices), tuple(queries), unplaced, dict(reply.best_effort),
                         tuple(reply.notes), scaling, tuple(_profile(p) for p in reply.profiles),
                         routing.lower_bound_throughput_only, reply.leader)


def _curve(message: control.ModelProfileStatus, name: str) -> tuple[tuple[int, float], ...]:
    if not message.HasField(name):
        return ()
    curve = getattr(message, name)
    return tuple(zip(curve.batch, curve.latency_ms))


def _profile(p: control.ModelProfileStatus) -> ProfileStatus:
    error: dict[str, float | int | str] = {}
    if p.prediction_replaced_by:
        error = {"mean": p.prediction_error_mean, "max": p.prediction_error_max, "batch": p.prediction_error_batch,
                 "bias": p.prediction_bias, "replaced_by": p.prediction_replaced_by}
    return ProfileStatus(p.model, p.device_type, p.in_use, p.pinned, _curve(p, "table"), _curve(p, "measured"),
                         _curve(p, "predicted"), p.predicted_from, p.samples, p.contended_samples, p.drift,
                         p.held_back, error)


def _paths(q: QueryDef) -> tuple[tuple[str, ...], ...]:
    """Every root-to-leaf path of stages in a query's DAG, in definition order."""
    children: dict[str, list[str]] = {st.name: [] for st in q.stages}
    for st in q.stages:
        for parent in st.parents():
            children[parent].append(st.name)
    out = []

    def walk(path: tuple[str, ...]) -> None:
        kids = children[path[-1]]
        if not kids:
            out.append(path)
        for k in kids:
            walk(path + (k,))

    for st in q.stages:
        if not st.parents():
            walk((st.name,))
    return tuple(out)
