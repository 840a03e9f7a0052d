"""The scheduler's ``GetStatus`` reply: the current plan per device, for ``nexus status``.

Read-only: it looks at the service's plan, nodes, profiles and measured rates and changes nothing.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from common.pb import control

if TYPE_CHECKING:
    from globalsched.service import SchedulerService


def status_reply(service: SchedulerService) -> control.StatusReply:
    planner = service.planner
    plan = planner.plan
    now = time.monotonic()
    reply = control.StatusReply(frontends=sum(1 for n in service.nodes.values()
                                              if n.kind == control.NODE_KIND_FRONTEND))
    if plan is None:
        reply.routing.CopyFrom(control.RoutingTable(epoch=planner.epoch))
    else:
        reply.routing.CopyFrom(service.routing_table(plan))
        reply.solver = plan.solver
        reply.notes.extend(plan.notes)
        reply.plan_age_s = max(now - planner.last_plan_time, 0.0)
        reply.best_effort.update(plan.best_effort)
    assigned = {}
    if plan is not None:
        for placement in plan.placements.values():
            for b in placement.backends:
                assigned[b.node_id] = b
    for node in service.nodes.values():
        if node.kind != control.NODE_KIND_BACKEND:
            continue
        device = control.DeviceStatus(node_id=node.node_id, address=node.address, device=node.device,
                                      device_type=node.device_type, memory_mb=node.memory_mb)
        b = assigned.get(node.node_id)
        if b is not None:
            device.duty_cycle_ms = b.duty_cycle_ms
            for s in b.sessions:
                model = planner.session_models.get(s.model, s.model)
                profile = service.admin.profiles(model).get(node.device_type)
                batch = min(s.batch, profile.max_batch) if profile is not None else 0
                device.sessions.append(control.DeviceSession(
                    session=s.model, model=model, batch=s.batch, planned_rate_rps=s.throughput_rps,
                    slo_ms=planner.session_slos.get(s.model, 0.0),
                    latency_ms=profile.latency_ms(batch) if batch else 0.0,
                    memory_mb=profile.memory_mb(batch) if batch else 0.0))
        reply.devices.append(device)
    return reply
