"""What `nexus status` shows, from a GetStatus reply (no cluster): the scaling decision per device
type, occupancy from what a device executes per duty cycle (a shared prefix counted once), and each
session's batch cap; as text and as JSON."""

from __future__ import annotations

import json

from common.pb import control
from nexus.status_cmd import render_text
from nexus.status_model import from_reply


def _reply() -> control.StatusReply:
    reply = control.StatusReply(solver="squishy", frontends=1)
    reply.routing.epoch, reply.routing.planned_devices, reply.routing.lower_bound = 7, 3, 2
    for name, cap in (("cls_a", 16), ("cls_b", 0)):
        route = reply.routing.routes.add(slo_ms=100.0, planned_rate_rps=50.0, measured_rate_rps=40.0)
        route.model.name, route.model.batch_cap = name, cap
    # two classifiers sharing a backbone: 30 + 30 ms of sessions, the shared 20 ms run once
    dev = reply.devices.add(node_id="be-1", address="127.0.0.1:9001", device="emulated:t4", device_type="t4",
                            duty_cycle_ms=80.0, exec_ms=40.0)
    for name in ("cls_a", "cls_b"):
        dev.sessions.add(session=name, model=name, batch=4, latency_ms=30.0, planned_rate_rps=50.0, slo_ms=100.0)
    reply.devices.add(node_id="be-2", address="127.0.0.1:9002", device="emulated:t4", device_type="t4")
    reply.scaling.add(device_type="t4", desired=3, registered=2, needed=3, plan_devices=3, drain_node_id="",
                      reason="the plan uses 3; 1 plan devices folded onto busy backends: add 1")
    return reply


def test_status_shows_the_scaling_decision_occupancy_and_batch_cap():
    st = from_reply(_reply())
    busy = next(d for d in st.devices if d.node_id == "be-1")
    assert busy.occupancy == 0.5 and sum(s.share for s in busy.sessions) == 0.75    # the prefix counted once
    assert busy.address == "127.0.0.1:9001"
    assert {s.session: s.batch_cap for s in busy.sessions} == {"cls_a": 16, "cls_b": 0}
    assert st.decision("t4").desired == 3 and st.decision("cuda") is None
    text = render_text(st)
    assert ("scaling t4: 3 desired · 2 registered · plan uses 3: the plan uses 3; 1 plan devices folded onto busy "
            "backends: add 1") in text
    assert "occupancy 50%" in text
    rows = {line.split()[0]: line.split()[1:3] for line in text.splitlines() if line.strip().startswith("cls_")}
    assert rows == {"cls_a": ["4", "16"], "cls_b": ["4", "-"]}
    obj = json.loads(json.dumps(st.to_json_obj()))
    assert obj["scaling"] == [{"device_type": "t4", "desired": 3, "registered": 2, "needed": 3, "plan_devices": 3,
                               "reason": "the plan uses 3; 1 plan devices folded onto busy backends: add 1",
                               "drain_node_ids": [], "drain_node_id": ""}]
    assert next(d for d in obj["devices"] if d["node_id"] == "be-1")["occupancy"] == 0.5


def test_a_drain_is_named():
    reply = _reply()
    reply.scaling[0].desired, reply.scaling[0].drain_node_id = 1, "be-2"
    reply.scaling[0].reason = "the plan uses 1; surplus for 60 s: remove one (be-2: idle)"
    assert "scaling t4: 1 desired · 2 registered · plan uses 3 · drain be-2: the plan uses 1" in \
        render_text(from_reply(reply))          # a scheduler of before the list names only the first
    reply.scaling[0].drain_node_ids.extend(["be-2", "be-1"])
    reply.scaling[0].desired = 0
    st = from_reply(reply)
    assert st.decision("t4").drain_node_ids == ("be-2", "be-1")
    assert "· drain be-2 and 1 more:" in render_text(st)
    assert json.loads(json.dumps(st.to_json_obj()))["scaling"][0]["drain_node_ids"] == ["be-2", "be-1"]
