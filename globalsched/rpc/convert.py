"""Protobuf <-> internal types at the scheduler's edge: every message the scheduler sends is built here.

The parts of the scheduler decide *what* to send (globalsched/actuators/distribution.py, globalsched/rpc/status.py,
globalsched/state/model_admin.py); these functions only say how it looks on the wire.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from common.pb import control
from common.profile import Profile
from common.tensors import TensorSpec
from common.warmup_spec import to_pb as warmup_to_pb
from globalsched.state.modeldb import ModelRecord, ServingSettings

if TYPE_CHECKING:
    from globalsched.planning.cluster_values import ClusterPlan, QueryPlan
    from globalsched.state.profile_book import ProfileReport
    from globalsched.planning.placement import BackendAssignment, PlacedSession
    from globalsched.planning.scaling_policy import ScalingDecision


def tensor_desc(spec: TensorSpec) -> control.TensorDesc:
    return control.TensorDesc(name=spec.name, datatype=spec.datatype, shape=list(spec.shape))


def model_desc(record: ModelRecord, profiles: dict[str, Profile], loaded: bool, min_replicas: int = 0,
               serving: ServingSettings = ServingSettings()) -> control.ModelDesc:
    return control.ModelDesc(
        name=record.name, sha256=record.sha256, runtime=record.runtime,
        inputs=[tensor_desc(t) for t in record.inputs], outputs=[tensor_desc(t) for t in record.outputs],
        size_bytes=record.size_bytes, default_slo_ms=record.default_slo_ms,
        max_batch=max((p.max_batch for p in profiles.values()), default=0),
        profiled_device_types=sorted(profiles), prefix_group=record.prefix_group, loaded=loaded,
        created_unix_ms=record.created_ms, min_replicas=min_replicas,
        expected_rate_rps=serving.expected_rate_rps, batch_cap=serving.batch_cap, warmup=warmup_to_pb(record.warmup),
        version=record.version, late_requests=serving.late_requests.to_pb())


# ---- model tables (to backends) ------------------------------------------------------------------


def session_entry(desc: control.ModelDesc, placed: PlacedSession, slo_ms: float, profile: Profile | None,
                  emulated: Profile | None = None) -> control.SessionEntry:
    """One session of a backend's table; ``placed.model`` is the session's name (a query stage's
    differs from the model it runs). ``profile``: what the plan uses; ``emulated``: what an emulated
    device executes, when it differs."""
    emulated_json = emulated.to_json() if emulated is not None else ""
    profile_json = profile.to_json() if profile is not None else ""
    return control.SessionEntry(model=desc, slo_ms=slo_ms, batch=placed.batch, profile_json=profile_json,
                                rate_rps=placed.throughput_rps,
                                session=placed.model if placed.model != desc.name else "",
                                emulated_profile_json=emulated_json if emulated_json != profile_json else "")


def model_table(epoch: int, assignment: BackendAssignment, entries: Iterable[control.SessionEntry]
                ) -> control.ModelTable:
    return control.ModelTable(epoch=epoch, duty_cycle_ms=assignment.duty_cycle_ms, sessions=list(entries))


# ---- routing tables (to frontends) ---------------------------------------------------------------


def backend_route(node_id: str, address: str, share_rps: float, batch: int, duty_cycle_ms: float
                  ) -> control.BackendRoute:
    return control.BackendRoute(node_id=node_id, address=address, weight=share_rps, batch=batch,
                                duty_cycle_ms=duty_cycle_ms)


def model_route(desc: control.ModelDesc, slo_ms: float, session: str, backends: Iterable[control.BackendRoute] = (),
                reason: str = "", planned_rate_rps: float = 0.0, measured_rate_rps: float = 0.0,
                cold: bool = False) -> control.ModelRoute:
    """A session's route: its backends, or why it has none (the reason frontends answer with). The
    model's warm-up samples stay out: only backends run them."""
    if desc.warmup:
        bare = control.ModelDesc()
        bare.CopyFrom(desc)
        bare.ClearField("warmup")
        desc = bare
    return control.ModelRoute(model=desc, slo_ms=slo_ms, backends=list(backends), reason=reason,
                              session=session if session != desc.name else "",
                              planned_rate_rps=planned_rate_rps, measured_rate_rps=measured_rate_rps, cold=cold)


def query_info(name: str, text: str, plan: QueryPlan | None, planned_rate_rps: float, devices: int
               ) -> control.QueryInfo:
    info = control.QueryInfo(name=name, json=text)
    if plan is not None:
        info.budgets_ms.update(plan.budgets_ms)
        info.gamma.update(plan.gammas)
        info.split_method = plan.method
        info.reason = plan.reason
        info.planned_rate_rps = planned_rate_rps
        info.latest_finish_ms.update(plan.latest_finish_ms)
        info.devices = devices
    return info


def routing_table(epoch: int, plan: ClusterPlan, routes: Iterable[control.ModelRoute],
                  stored: Iterable[control.ModelDesc], queries: Iterable[control.QueryInfo]) -> control.RoutingTable:
    return control.RoutingTable(epoch=epoch, routes=list(routes), stored=list(stored), queries=list(queries),
                                planned_devices=plan.num_devices_planned, lower_bound=plan.lower_bound,
                                lower_bound_throughput_only=plan.lower_bound_throughput_only)


# ---- status (to `nexus status`) ------------------------------------------------------------------


def device_session(placed: PlacedSession, model: str, slo_ms: float, profile: Profile | None
                   ) -> control.DeviceSession:
    """A session on a device, with the latency and memory its profile gives at its batch (0 without one)."""
    batch = min(placed.batch, profile.max_batch) if profile is not None else 0
    return control.DeviceSession(session=placed.model, model=model, batch=placed.batch,
                                 planned_rate_rps=placed.throughput_rps, slo_ms=slo_ms,
                                 latency_ms=profile.latency_ms(batch) if batch else 0.0,
                                 memory_mb=profile.memory_mb(batch) if batch else 0.0)


def device_status(node_id: str, address: str, device: str, device_type: str, memory_mb: float,
                  duty_cycle_ms: float = 0.0, sessions: Iterable[control.DeviceSession] = (),
                  exec_ms: float = 0.0) -> control.DeviceStatus:
    return control.DeviceStatus(node_id=node_id, address=address, device=device, device_type=device_type,
                                memory_mb=memory_mb, duty_cycle_ms=duty_cycle_ms, sessions=list(sessions),
                                exec_ms=exec_ms)


def scaling_decision(decision: ScalingDecision, plan: ClusterPlan | None) -> control.ScalingDecision:
    return control.ScalingDecision(device_type=decision.device_type, desired=decision.desired,
                                   registered=decision.registered, needed=decision.needed,
                                   plan_devices=plan.devices_needed.get(decision.device_type, 0) if plan else 0,
                                   reason=decision.reason, drain_node_id=decision.drain,
                                   drain_node_ids=decision.drains)


def profile_curve(profile: Profile) -> control.ProfileCurve:
    """l(b) at batches 1, 2, 4, ... and the largest."""
    batches, b = [], 1
    while b < profile.max_batch:
        batches.append(b)
        b *= 2
    batches.append(profile.max_batch)
    return control.ProfileCurve(batch=batches, latency_ms=[profile.latency_ms(b) for b in batches],
                                max_batch=profile.max_batch)


def profile_status(r: ProfileReport) -> control.ModelProfileStatus:
    out = control.ModelProfileStatus(
        model=r.model, device_type=r.device_type, in_use=r.in_use, pinned=r.pinned, samples=r.samples,
        contended_samples=r.contended_samples, samples_by_batch=dict(r.samples_by_batch), drift=r.drift,
        held_back=r.held_back)
    for field_name, profile in (("table", r.table), ("measured", r.measured), ("predicted", r.predicted)):
        if profile is not None:
            getattr(out, field_name).CopyFrom(profile_curve(profile))
    if r.predicted is not None:
        out.predicted_from = str(r.predicted.meta.get("predicted_from", ""))
    if r.replaced is not None:
        e = r.replaced.error
        out.prediction_error_mean, out.prediction_error_max = e.mean_rel, e.max_rel
        out.prediction_error_batch, out.prediction_bias = e.worst_batch, e.bias
        out.prediction_replaced_by = r.replaced.by
        out.predicted_from = out.predicted_from or str(r.replaced.predicted.meta.get("predicted_from", ""))
    return out


def status_reply(frontends: int, routing: control.RoutingTable, devices: Iterable[control.DeviceStatus],
                 plan: ClusterPlan | None = None, plan_age_s: float = 0.0,
                 scaling: Iterable[ScalingDecision] = (), profiles: Iterable[ProfileReport] = ()
                 ) -> control.StatusReply:
    reply = control.StatusReply(frontends=frontends, routing=routing, devices=list(devices),
                                scaling=[scaling_decision(d, plan) for d in scaling],
                                profiles=[profile_status(r) for r in profiles])
    if plan is not None:
        reply.solver = plan.solver
        reply.notes.extend(plan.notes)
        reply.plan_age_s = plan_age_s
        reply.best_effort.update(plan.best_effort)
    return reply
