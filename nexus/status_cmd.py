"""``nexus status [--json] [--plot FILE.png]``: what the scheduler is doing now.

Every device with its duty cycle and occupancy (the share of the duty cycle its sessions' batches
take), the sessions on it with batch, planned and measured rate and SLO, the queries with their
latency split, and the plan's device count against the lower bound. The data comes from the
scheduler's read-only ``GetStatus`` RPC and is turned into the dataclasses below at the edge.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field

import grpc

from common import grpc_util
from common.pb import control, control_grpc
from common.query_def import QueryDef, QueryError, parse_query
from common.security import Credentials
from nexus.client_flags import ClientFlagError, add_client_security, client_credentials
from nexus.models_cmd import DEFAULT_SCHEDULER, CommandError, _rpc_message


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


@dataclass(frozen=True)
class DeviceStatus:
    node_id: str
    device: str
    device_type: str
    memory_mb: float
    duty_cycle_ms: float
    sessions: tuple[SessionStatus, ...]

    @property
    def occupancy(self) -> float:
        return sum(s.share for s in self.sessions)

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
    lower_bound_throughput_only: int = 0     # the bound of earlier releases, for comparison

    @property
    def devices_in_use(self) -> int:
        return sum(1 for d in self.devices if d.sessions)

    def to_json_obj(self) -> dict:
        obj = asdict(self)
        for d, dev in zip(obj["devices"], self.devices):
            d["occupancy"] = round(dev.occupancy, 4)
            d["memory_used_mb"] = round(dev.memory_used_mb, 2)
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
                slo_ms=s.slo_ms, memory_mb=s.memory_mb))
        devices.append(DeviceStatus(d.node_id, d.device, d.device_type, d.memory_mb, d.duty_cycle_ms,
                                    tuple(sorted(sessions, key=lambda x: -x.latency_ms))))
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
    return ClusterStatus(routing.epoch, reply.solver, reply.plan_age_s, routing.planned_devices, routing.lower_bound,
                         reply.frontends, tuple(devices), tuple(queries), unplaced, dict(reply.best_effort),
                         tuple(reply.notes), routing.lower_bound_throughput_only)


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


def fetch_status(scheduler: str, timeout_s: float = 30.0,
                 creds: Credentials = grpc_util.NO_CREDENTIALS) -> ClusterStatus:
    with grpc_util.channel(scheduler, creds) as channel:
        try:
            reply = control_grpc.SchedulerStub(channel).GetStatus(control.StatusRequest(), timeout=timeout_s)
        except grpc.RpcError as exc:
            raise CommandError(_rpc_message(exc, scheduler)) from None
    return from_reply(reply)


def _table(rows: list[list[str]], indent: str = "") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
            for r in rows]


def render_text(st: ClusterStatus) -> str:
    lines = [f"epoch {st.epoch} · solver {st.solver or '-'} · plan {st.plan_age_s:.1f} s old · "
             f"{st.frontends} frontend(s)",
             f"devices: {st.devices_in_use} in use of {len(st.devices)} registered · plan needs "
             f"{st.planned_devices} · lower bound {st.lower_bound} "
             f"(throughput alone: {st.lower_bound_throughput_only})", ""]
    for d in st.devices:
        memory = f"{d.memory_used_mb:,.0f} of {d.memory_mb:,.0f} MB" if d.memory_mb else f"{d.memory_used_mb:,.0f} MB"
        if not d.sessions:
            lines.append(f"{d.node_id}  {d.device}  idle  ({memory})")
            lines.append("")
            continue
        lines.append(f"{d.node_id}  {d.device}  duty cycle {d.duty_cycle_ms:.1f} ms  occupancy {d.occupancy:.0%}  "
                     f"memory {memory}")
        rows = [["session", "batch", "l(b) ms", "share", "here rps", "planned rps", "measured rps", "SLO ms"]]
        for s in d.sessions:
            rows.append([s.session, str(s.batch), f"{s.latency_ms:.2f}", f"{s.share:.0%}", f"{s.device_rate_rps:.1f}",
                         f"{s.planned_rate_rps:.1f}", f"{s.measured_rate_rps:.1f}", f"{s.slo_ms:.0f}"])
        lines += _table(rows, "  ")
        lines.append("")
    if st.queries:
        rows = [["query", "SLO ms", "split", "stage budgets ms", "fan-out", "planned qps", "devices"]]
        for q in st.queries:
            rows.append([q.name, f"{q.slo_ms:g}", q.split or "-",
                         ", ".join(f"{k} {v:.0f}" for k, v in q.budgets_ms.items()) or "-",
                         ", ".join(f"{k} {v:.2f}" for k, v in q.gamma.items()) or "-",
                         f"{q.planned_rate_rps:.1f}", str(q.devices)])
        lines += _table(rows)
        lines += [f"  {q.name}: {q.reason}" for q in st.queries if q.reason]
        lines.append("")
    for name, why in st.unplaced.items():
        lines.append(f"not placed: {name}: {why}")
    for name, why in st.best_effort.items():
        lines.append(f"best effort: {name}: {why}")
    for note in st.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines).rstrip() + "\n"


def _run(args) -> int:
    try:
        st = fetch_status(args.scheduler, creds=client_credentials(args))
    except (CommandError, ClientFlagError) as exc:
        print(f"nexus status: error: {exc}", file=sys.stderr)
        return 2
    if args.plot:
        from nexus.status_plot import write_status_plot

        try:
            write_status_plot(st, args.plot)
        except (OSError, ValueError) as exc:
            print(f"nexus status: error: cannot write {args.plot}: {exc}", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps(st.to_json_obj(), indent=2))
    else:
        sys.stdout.write(render_text(st))
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("status", help="show the scheduler's plan: devices, sessions, queries, lower bound",
                       description="Show what the scheduler is doing now: every device with its duty cycle and "
                                   "occupancy, the sessions on it, the queries' latency split and the lower bound.")
    p.add_argument("--scheduler", default=DEFAULT_SCHEDULER, help=f"scheduler address (default {DEFAULT_SCHEDULER})")
    p.add_argument("--json", action="store_true", help="print the status as JSON")
    add_client_security(p)
    p.add_argument("--plot", metavar="FILE.png", default="",
                   help="also draw the devices as bars filled by their sessions' shares of the duty cycle")
    p.set_defaults(func=_run)
