"""The scheduler's bookkeeping of profiles in service (globalsched/state/profile_book.py, and its use in
globalsched/state/model_admin.py) on a fake clock: when a measurement plans, when it re-plans and why, no
ratchet under overload, pins, resets, predictions and their errors, and a restart."""

from __future__ import annotations

import logging
import random

import pytest

from common.config import SchedulerConfig
from common.measured_profile import LatencySample
from common.pb import control
from common.profile import Profile
from common.sample_models import mlp_small, model_bytes
from globalsched.state.membership import Node
from globalsched.state.model_admin import ModelAdmin
from globalsched.state.modeldb import ModelDatabase
from globalsched.state.profile_book import MEASURED, PREDICTED, TABLE, ProfileBook
from globalsched.planning.replan_trigger import ReplanTrigger

TABLE_T4 = Profile.linear(4.0, 20.0, 8, device_type="t4")     # what was uploaded: l(b) = 4b + 20 ms
KEY = ("m", "t4")


def samples(scale: float, n: int = 30, batches=(1, 2, 4), contended: bool = False, seed: int = 0):
    """Serving samples of a device whose batches take ``scale`` times the table's latency."""
    rng = random.Random(seed)
    return [LatencySample(b, TABLE_T4.latency_ms(b) * scale * rng.uniform(0.99, 1.01), contended)
            for _ in range(n) for b in batches]


def book(**kw) -> ProfileBook:
    return ProfileBook(update_interval_s=10.0, **kw)


def fed(scale: float, n: int = 30, **kw) -> tuple[ProfileBook, str]:
    """A book that got one update of ``n`` rounds of samples at ``scale`` times the table; and its re-plan reason."""
    pb = book(**kw)
    pb.record("m", "t4", samples(scale, n=n), emulated=True, now_s=0.0)
    return pb, pb.update(KEY, TABLE_T4, None, 10.0)


def test_a_faster_device_is_measured_then_planned_with_and_the_replan_says_why():
    pb = book()
    pb.record("m", "t4", samples(0.5), emulated=True, now_s=0.0)
    assert pb.due(5.0) == []                               # the update interval has not passed
    assert pb.choose("m", "t4", TABLE_T4, None).source == TABLE
    assert pb.due(10.0) == [KEY]
    why = pb.update(KEY, TABLE_T4, None, 10.0)
    assert why.startswith("profile of m on t4 drifted 5") and why.endswith("% from its table: re-plan")
    choice = pb.choose("m", "t4", TABLE_T4, None)
    assert choice.source == MEASURED
    assert choice.profile.latency_ms(8) == pytest.approx(TABLE_T4.latency_ms(8) * 0.5, rel=0.05)
    # the same device again: no drift from the profile in use, no re-plan
    pb.record("m", "t4", samples(0.5, seed=1), emulated=True, now_s=11.0)
    assert pb.update(KEY, TABLE_T4, None, 20.0) == ""
    assert pb.entries[KEY].pending == []


def test_too_few_samples_keep_the_table():
    pb, why = fed(0.5, n=5)
    assert why == ""
    assert pb.choose("m", "t4", TABLE_T4, None).source == TABLE


def test_contended_samples_never_lower_planned_capacity():
    pb, _ = fed(1.0)
    planned = pb.choose("m", "t4", TABLE_T4, None).profile
    for i in range(5):       # an overloaded minute: every batch 3x slower, every one flagged
        pb.record("m", "t4", samples(3.0, contended=True, seed=i), emulated=True, now_s=10.0 * (i + 1))
        assert pb.update(KEY, TABLE_T4, None, 10.0 * (i + 2)) == ""
    assert pb.choose("m", "t4", TABLE_T4, None).profile is planned
    assert pb.entries[KEY].state.contended_samples() == 5 * 90


def test_an_unflagged_slowdown_moves_the_plan_10_percent_per_update_until_three_agree():
    pb, _ = fed(1.0)
    base = pb.choose("m", "t4", TABLE_T4, None).profile.latency_ms(4)
    seen = []
    for i in range(3):
        pb.record("m", "t4", samples(2.0, n=300, seed=10 + i), emulated=True, now_s=20.0 + 10 * i)
        pb.update(KEY, TABLE_T4, None, 20.0 + 10 * i)
        seen.append(pb.choose("m", "t4", TABLE_T4, None).profile.latency_ms(4) / base)
    assert seen[0] == pytest.approx(1.10, rel=0.01) and seen[1] == pytest.approx(1.21, rel=0.01)
    assert seen[2] == pytest.approx(2.0, rel=0.05)         # the third agreeing update applies it


def test_a_pinned_table_always_plans_and_never_replans():
    pinned = Profile.from_rows(TABLE_T4.rows, "t4", {"pinned": True})
    pb = book()
    pb.record("m", "t4", samples(0.5), emulated=True, now_s=0.0)
    assert pb.update(KEY, pinned, None, 10.0) == ""
    choice = pb.choose("m", "t4", pinned, None)
    assert (choice.source, choice.pinned) == (TABLE, True)
    assert pb.entries[KEY].state.applied is not None       # measured, and shown, all the same


def test_measured_profiles_off_keeps_the_tables():
    pb, why = fed(0.5, enabled=False)
    assert why == ""
    assert pb.choose("m", "t4", TABLE_T4, None).source == TABLE


def test_a_new_table_resets_the_measurement():
    pb, _ = fed(0.5)
    new = TABLE_T4.scaled(0.8)
    choice = pb.choose("m", "t4", new, None)
    assert choice.source == TABLE and choice.profile is new   # the upload plans at once
    pb.record("m", "t4", samples(0.5, n=3), emulated=True, now_s=11.0)
    assert pb.update(KEY, new, None, 20.0) == ""
    assert pb.entries[KEY].state.applied is None and pb.entries[KEY].state.figures() == {}


def test_emulated_types_are_measured_without_a_second_margin():
    pb = book()
    pb.record("m", "t4", samples(1.0), emulated=True, now_s=0.0)
    pb.record("m", "cpu", samples(1.0), emulated=False, now_s=0.0)
    cpu_table = Profile.from_rows(TABLE_T4.rows, "cpu")
    assert pb.update(KEY, TABLE_T4, None, 10.0) == ""       # the device follows its table: no drift
    assert pb.update(("m", "cpu"), cpu_table, None, 10.0).startswith("profile of m on cpu drifted 1")
    # a CPU's samples get Nexus's margin: 15% above its table, a raise applied 10% at a time
    assert pb.entries[("m", "cpu")].state.applied.latency_ms(2) == pytest.approx(TABLE_T4.latency_ms(2) * 1.10)
    assert pb.entries[("m", "cpu")].last.held_back


def test_a_prediction_plans_until_serving_measures_it_and_its_error_is_recorded(caplog):
    predicted = Profile.from_rows(TABLE_T4.rows, "t4", {"predicted": True, "predicted_from": "v100"})
    pb = book()
    assert pb.choose("m", "t4", None, predicted).source == PREDICTED
    pb.note_prediction(KEY, predicted)
    pb.record("m", "t4", samples(0.8), emulated=True, now_s=0.0)
    with caplog.at_level(logging.WARNING, "nexus.scheduler"):
        why = pb.update(KEY, None, predicted, 10.0)
    assert "from its prediction: re-plan" in why
    assert pb.choose("m", "t4", None, predicted).source == MEASURED
    replaced = pb.replaced[KEY]
    assert replaced.by == "serving measurements" and replaced.error.bias > 0      # pessimistic
    assert replaced.error.mean_rel == pytest.approx(0.25, abs=0.03)               # 1 / 0.8 - 1
    assert "prediction of m on t4 (from v100) replaced by serving measurements: off by 2" in caplog.text


def test_a_table_arriving_replaces_a_prediction_and_reports_its_error():
    predicted = Profile.from_rows(TABLE_T4.scaled(2.0).rows, "t4", {"predicted": True})
    pb = book()
    pb.note_prediction(KEY, predicted)
    pb.table_arrived(KEY, TABLE_T4, "a profiling run")
    assert pb.replaced[KEY].by == "a profiling run" and pb.replaced[KEY].error.mean_rel == pytest.approx(1.0)
    assert KEY not in pb.predictions
    pb.table_arrived(("x", "t4"), TABLE_T4, "an upload")      # no prediction there: nothing to report
    assert ("x", "t4") not in pb.replaced


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="update_interval_s must be positive"):
        ProfileBook(update_interval_s=0)


def test_the_pending_samples_are_bounded():
    pb = book()
    pb.record("m", "t4", [LatencySample(1, 1.0)] * 5000, emulated=True, now_s=0.0, lost=7)
    entry = pb.entries[KEY]
    assert len(entry.pending) == 4096 and entry.lost == 7 + 5000 - 4096


# ---- through the model administration: heartbeats, a real database, restarts --------------------------------


def _admin(tmp_path, nodes, **config):
    db = ModelDatabase(tmp_path / "db")
    trigger = ReplanTrigger()
    requests: list[str] = []
    trigger.request = lambda why, membership=False: requests.append(why)
    admin = ModelAdmin(SchedulerConfig(data_dir=tmp_path / "db", **config), db, nodes, trigger)
    return admin, db, requests


def _upload(db, name: str, *profiles: Profile) -> None:
    db.add_model(name, [model_bytes(mlp_small())], profile_json=profiles[0].to_json() if profiles else "")
    for p in profiles[1:]:
        db.add_profile(name, p)


def _report(model: str, scale: float, seed: int = 0, **kw) -> control.BatchSamples:
    out = control.BatchSamples(model=model)
    for s in samples(scale, seed=seed, **kw):
        out.samples.add(batch=s.batch, latency_ms=s.latency_ms, contended=s.contended)
    return out


def backend(node_id: str, device: str) -> Node:
    return Node(node_id, control.NODE_KIND_BACKEND, "127.0.0.1:1", device, device.split(":")[-1])


def test_heartbeat_samples_correct_the_table_and_ask_for_a_replan(tmp_path):
    node = backend("be-1", "emulated:t4")
    admin, db, requests = _admin(tmp_path, {"be-1": node}, profile_update_s=1.0)
    _upload(db, "m", TABLE_T4)
    admin.in_service.serving_samples(node, [_report("m", 0.5), _report("unknown-model", 0.5)], now_s=0.0)
    assert requests == []
    admin.in_service.serving_samples(node, [_report("m", 0.5, seed=1)], now_s=1.0)
    assert len(requests) == 1 and requests[0].startswith("profile of m on t4 drifted")
    assert admin.in_service.profile_choices("m")["t4"].source == MEASURED
    assert admin.in_service.profiles("m")["t4"].latency_ms(8) == pytest.approx(26.0, rel=0.05)
    assert admin.in_service.emulated_profile("m", "t4").latency_ms(8) == TABLE_T4.latency_ms(8)   # emulation: the table
    db.close()


def test_samples_that_are_no_measurement_are_counted_and_ignored(tmp_path, caplog):
    node = backend("be-1", "emulated:t4")
    admin, db, requests = _admin(tmp_path, {"be-1": node}, profile_update_s=1.0)
    _upload(db, "m", TABLE_T4)
    bad = control.BatchSamples(model="m")
    bad.samples.add(batch=0, latency_ms=5.0)
    bad.samples.add(batch=2, latency_ms=float("nan"))
    bad.samples.add(batch=2, latency_ms=-1.0)
    bad.samples.add(batch=2, latency_ms=20.0)
    with caplog.at_level(logging.WARNING, "nexus.scheduler"):
        admin.in_service.serving_samples(node, [bad], now_s=0.0)
    assert admin.in_service.invalid_samples == 3 and "be-1 reported 3 latency samples that are no measurement" in caplog.text
    assert [s.latency_ms for s in admin.in_service.book.entries[("m", "t4")].pending] == [20.0]
    db.close()


def test_an_uploaded_profile_resets_the_measurement_and_a_restart_keeps_it(tmp_path):
    node = backend("be-1", "emulated:t4")
    admin, db, _ = _admin(tmp_path, {"be-1": node}, profile_update_s=1.0)
    _upload(db, "m", TABLE_T4)
    admin.in_service.serving_samples(node, [_report("m", 0.5)], now_s=0.0)
    admin.in_service.serving_samples(node, [_report("m", 0.5, seed=1)], now_s=1.0)
    measured = admin.in_service.profiles("m")["t4"]
    db.close()
    # a restarted scheduler plans with the measurement it trusted
    admin, db, _ = _admin(tmp_path, {"be-1": node}, profile_update_s=1.0)
    assert admin.in_service.profile_choices("m")["t4"].source == MEASURED
    assert admin.in_service.profiles("m")["t4"].latency_ms(8) == pytest.approx(measured.latency_ms(8))
    # uploading a table replaces what plans and starts the measurement afresh, across restarts too
    new = TABLE_T4.scaled(0.9)
    db.add_profile("m", new)
    assert admin.in_service.profile_choices("m")["t4"].source == TABLE
    admin.in_service.serving_samples(node, [_report("m", 0.5, n=3)], now_s=2.0)
    admin.in_service.serving_samples(node, [], now_s=3.0)
    admin.in_service.serving_samples(node, [_report("m", 0.5, n=3, seed=2)], now_s=4.0)
    assert db.measured_profiles() == []
    db.close()
    admin, db, _ = _admin(tmp_path, {"be-1": node})
    assert admin.in_service.profile_choices("m")["t4"].source == TABLE
    db.close()


def test_a_model_without_a_table_on_a_present_type_plans_with_a_prediction(tmp_path):
    node = backend("be-1", "emulated:v100")
    admin, db, _ = _admin(tmp_path, {"be-1": node}, profile_update_s=1.0)
    for name, scale in (("a", 1.0), ("b", 2.0)):          # measured on both: v100 takes 0.4x of t4
        _upload(db, name, TABLE_T4.scaled(scale), Profile.from_rows(TABLE_T4.scaled(0.4 * scale).rows, "v100"))
    _upload(db, "c", TABLE_T4)
    choice = admin.in_service.profile_choices("c")["v100"]
    assert choice.source == PREDICTED and choice.profile.meta["predicted_from"] == "t4"
    assert choice.profile.latency_ms(4) == pytest.approx(0.4 * TABLE_T4.latency_ms(4))
    admin.profiling.unmeasurable[("c", "v100")] = "an emulated device cannot measure it"
    assert "v100" not in admin.unloadable_on("c")           # the prediction lets it be planned there
    [state] = [d for d in admin.desc("c").device_types if d.device_type == "v100"]
    assert state.state == control.PREDICTED and state.reason.startswith("predicted from t4")
    assert admin.in_service.emulated_profile("c", "v100").latency_ms(4) == pytest.approx(choice.profile.latency_ms(4))
    # serving measures it on the device: the measurement replaces the prediction and its error is kept
    admin.in_service.serving_samples(node, [_report("c", 0.4 * 0.8)], now_s=0.0)
    admin.in_service.serving_samples(node, [_report("c", 0.4 * 0.8, seed=1)], now_s=1.0)
    assert admin.in_service.profile_choices("c")["v100"].source == MEASURED
    assert admin.in_service.book.replaced[("c", "v100")].error.mean_rel == pytest.approx(0.25, abs=0.03)
    db.close()


def test_measured_profiles_off_keeps_planning_on_tables_and_asks_for_no_replan(tmp_path):
    node = backend("be-1", "emulated:t4")
    admin, db, requests = _admin(tmp_path, {"be-1": node}, profile_update_s=1.0, measured_profiles=False)
    _upload(db, "m", TABLE_T4)
    admin.in_service.serving_samples(node, [_report("m", 0.5)], now_s=0.0)
    admin.in_service.serving_samples(node, [_report("m", 0.5, seed=1)], now_s=1.0)
    assert requests == [] and admin.in_service.profile_choices("m")["t4"].source == TABLE
    [r] = admin.in_service.profile_reports()
    assert r.measured is not None and r.samples >= 60          # measured and shown all the same
    db.close()


def test_settings_that_make_no_sense_are_refused():
    from common.config import BackendConfig, ConfigError
    from common.profile import ProfileError

    with pytest.raises(ConfigError, match="--profile-update-s"):
        SchedulerConfig(profile_update_s=0).validate()
    with pytest.raises(ConfigError, match="--emulated-latency-factor"):
        BackendConfig(emulated_latency_factor=-1.0).validate()
    with pytest.raises(ProfileError, match="positive number"):
        TABLE_T4.scaled(0.0)


def test_a_tables_digest_names_its_exact_text_and_is_kept_while_its_text_is():
    """The measurement's basis (a table's digest) is computed once per table object, and the scheduler's
    tables keep their objects across a change of another model's (a fleet's uploads re-read them all)."""
    import hashlib

    assert TABLE_T4.digest == hashlib.sha256(TABLE_T4.to_json().encode()).hexdigest()
    assert Profile.from_rows(TABLE_T4.rows, "t4", {"pinned": True}).digest != TABLE_T4.digest   # meta counts
    assert Profile.from_json(TABLE_T4.to_json()).digest == TABLE_T4.digest


def test_the_tables_in_service_keep_unchanged_objects_and_see_every_change(tmp_path):
    admin, db, _ = _admin(tmp_path, {})
    _upload(db, "a", TABLE_T4)
    first = admin.in_service.tables()
    _upload(db, "b", TABLE_T4.scaled(2.0))                    # another model: a's table is the same object
    second = admin.in_service.tables()
    assert second["a"]["t4"] is first["a"]["t4"]
    assert second["b"]["t4"] == TABLE_T4.scaled(2.0)
    db.add_profile("a", TABLE_T4.scaled(3.0))                 # a's own table changed: read again
    assert admin.in_service.tables()["a"]["t4"] == TABLE_T4.scaled(3.0)
    assert [d.name for d in admin.descs().values()] == ["a", "b"]


def test_the_device_types_present_follow_every_change_of_the_node_table(tmp_path):
    """Worked out once per change of the scheduler's node table (not once per model), and never stale."""
    from globalsched.state.membership import NodeTable

    nodes = NodeTable()
    admin, _, _ = _admin(tmp_path, nodes)
    assert admin.in_service.present_types() == ()
    nodes["be-1"] = backend("be-1", "emulated:t4")
    assert admin.in_service.present_types() == ("t4",)
    nodes["be-1"] = backend("be-1", "emulated:v100")          # registered again, on another device
    assert admin.in_service.present_types() == ("v100",)
    nodes["be-2"] = backend("be-2", "emulated:t4")
    nodes.pop("be-1")
    assert admin.in_service.present_types() == ("t4",)
    del nodes["be-2"]
    assert admin.in_service.present_types() == ()
