"""`nexus status` shows the profiles in service, from a GetStatus reply (no cluster): per model and
device type the table, the measured profile and the prediction, which one plans, samples, a raise
held back and a prediction's error; in the text and in --json."""

from __future__ import annotations

import json

from common.pb import control
from nexus.status_cmd import render_text
from nexus.status_model import from_reply


def _reply() -> control.StatusReply:
    reply = control.StatusReply(solver="squishy")
    emu = reply.profiles.add(model="emu", device_type="t4", in_use="measured", samples=240, contended_samples=12,
                             drift=0.5, held_back="latency raise limited to 10% until 3 updates agree (1 so far)")
    emu.table.CopyFrom(control.ProfileCurve(batch=[1, 16], latency_ms=[28.0, 148.0], max_batch=16))
    emu.measured.CopyFrom(control.ProfileCurve(batch=[1, 16], latency_ms=[14.0, 74.0], max_batch=16))
    c = reply.profiles.add(model="c", device_type="v100", in_use="measured", predicted_from="t4",
                           prediction_error_mean=0.25, prediction_error_max=0.31, prediction_error_batch=1,
                           prediction_bias=0.25, prediction_replaced_by="serving measurements")
    c.predicted.CopyFrom(control.ProfileCurve(batch=[1, 16], latency_ms=[14.0, 74.0], max_batch=16))
    c.measured.CopyFrom(control.ProfileCurve(batch=[1, 16], latency_ms=[11.2, 59.2], max_batch=16))
    reply.profiles.add(model="pin", device_type="cpu", in_use="table", pinned=True).table.CopyFrom(
        control.ProfileCurve(batch=[1], latency_ms=[3.0], max_batch=1))
    return reply


def test_the_text_shows_each_profile_and_marks_the_one_that_plans():
    text = render_text(from_reply(_reply()))
    [emu] = [line for line in text.splitlines() if line.split()[:2] == ["emu", "t4"]]
    assert "1:28 16:148" in emu and "1:14 16:74 *" in emu and "240" in emu and "50%" in emu
    [pin] = [line for line in text.splitlines() if line.split()[:2] == ["pin", "cpu"]]
    assert "table (pinned)" in pin and "1:3 *" in pin
    assert "emu on t4: latency raise limited to 10%" in text
    assert ("c on v100: the prediction (from t4) was replaced by serving measurements: off by 25% on average, "
            "31% at batch 1 (pessimistic)") in text


def test_the_json_carries_the_profiles():
    obj = json.loads(json.dumps(from_reply(_reply()).to_json_obj()))
    by_key = {(p["model"], p["device_type"]): p for p in obj["profiles"]}
    assert by_key[("emu", "t4")]["measured"] == [[1, 14.0], [16, 74.0]]
    assert by_key[("c", "v100")]["prediction_error"]["replaced_by"] == "serving measurements"
    assert by_key[("pin", "cpu")]["pinned"] is True and by_key[("pin", "cpu")]["measured"] == []


def test_a_status_without_profiles_has_no_profiles_section():
    assert "profiles:" not in render_text(from_reply(control.StatusReply()))
