"""The scheduler's ``GetStatus`` reply: the current plan per device, for ``nexus status``.

Read-only: it looks at the service's plan, nodes, profiles and measured rates and changes nothing.
The messages are built in globalsched/convert.py.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from common.pb import control
from globalsched import convert

if TYPE_CHECKING:
    from globalsched.service import SchedulerService


def status_reply(service: SchedulerService) -> control.StatusReply:
    planner = service.planner
    plan = planner.plan
    now = time.monotonic()
    assigned = {}
    if plan is not None:
        for placement in plan.placements.values():
            for b in placement.backends:
                assigned[b.node_id] = b
    devices = []
    for node in service.membership.backends():
        b = assigned.get(node.node_id)
        sessions = []
        if b is not None:
            for s in b.sessions:
                model = planner.session_models.get(s.model, s.model)
                sessions.append(convert.device_session(s, model, planner.session_slos.get(s.model, 0.0),
                                                       service.admin.profiles(model).get(node.device_type)))
        devices.append(convert.device_status(node.node_id, node.address, node.device, node.device_type,
                                             node.memory_mb, b.duty_cycle_ms if b is not None else 0.0, sessions))
    routing = control.RoutingTable(epoch=planner.epoch) if plan is None else service.routing_table(plan)
    return convert.status_reply(len(service.membership.frontends()), routing, devices, plan,
                                max(now - planner.last_plan_time, 0.0))
