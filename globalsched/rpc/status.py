"""The scheduler's ``GetStatus`` reply: the plan in force per device, for ``nexus status``.

Read-only: it looks at the plan, the registered nodes, the profiles (per model and device type: the
table, the measured profile, the prediction and which one plans, globalsched/state/profile_book.py) and
the routing table the plan gives, and changes nothing. The messages are built in globalsched/rpc/convert.py.
A reply with the scaling decisions and the devices' identities only (:func:`scaling_reply`) is what
``nexus serve --backends auto`` reads ten times a second.
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


def scaling_reply(plan: ClusterPlan | None, backends: Iterable[Node],
                  scaling: Iterable[ScalingDecision]) -> control.StatusReply:
    """``GetStatus(scaling_only)``: the scaling decisions and each registered device's identity (node
    id, address, device, type, memory), none of its sessions, no routes or profiles. Read ten times a
    second under an idle ``nexus serve --backends auto`` (three models, one backend; 2026-12-06, AMD
    EPYC), the full reply kept the scheduler 2.9-3.1% of a core busy (it builds the routing table for
    every read), this one 1.6-1.7%."""
    devices = [convert.device_status(n.node_id, n.address, n.device, n.device_type, n.memory_mb) for n in backends]
    return control.StatusReply(devices=devices, scaling=[convert.scaling_decision(d, plan) for d in scaling])
