"""The scheduler's ``GetStatus`` reply: the plan in force per device, for ``nexus status``.

Read-only: it looks at the plan, the registered nodes, the profiles (per model and device type: the
table, the measured profile, the prediction and which one plans, globalsched/state/profile_book.py) and
the routing table the plan gives, and changes nothing. The messages are built in globalsched/rpc/convert.py.
"""

from __future__ import annotations

from typing import Iterable

from common.pb import control
from globalsched.rpc import convert
from globalsched.planning.cluster_values import ClusterPlan
from globalsched.state.membership import Node
from globalsched.state.model_admin import ModelAdmin
from globalsched.planning.scaling_policy import ScalingDecision


def status_reply(plan: ClusterPlan | None, routing: control.RoutingTable, backends: Iterable[Node], frontends: int,
                 admin: ModelAdmin, plan_age_s: float, scaling: Iterable[ScalingDecision] = ()) -> control.StatusReply:
    assigned = {}
    if plan is not None:
        for placement in plan.placements.values():
            for b in placement.backends:
                assigned[b.node_id] = b
    devices = []
    for node in backends:
        b = assigned.get(node.node_id)
        sessions = []
        if b is not None:
            for s in b.sessions:
                planned = plan.sessions.get(s.model)
                model = plan.model_of(s.model)
                sessions.append(convert.device_session(s, model, planned.slo_ms if planned else 0.0,
                                                       admin.in_service.profiles(model).get(node.device_type)))
        devices.append(convert.device_status(node.node_id, node.address, node.device, node.device_type,
                                             node.memory_mb, b.duty_cycle_ms if b is not None else 0.0, sessions,
                                             b.exec_ms if b is not None else 0.0))
    return convert.status_reply(frontends, routing, devices, plan, plan_age_s, scaling, admin.in_service.profile_reports())
