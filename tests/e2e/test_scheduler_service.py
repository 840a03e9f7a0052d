"""The scheduler service's own logic, in process: co-location slowdown, rate smoothing, bad config."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from common.config import SchedulerConfig
from common.pb import control
from common.profile import Profile
from common.sample_models import mlp_small, model_bytes
from globalsched.state.modeldb import ModelDatabase
from globalsched.planning.planner import PlannerState, plan_cluster, session_inputs
from globalsched.rpc.service import SchedulerService
from globalsched.state.rate_reports import RATE_SMOOTHING


def _service(tmp_path, **config) -> SchedulerService:
    db = ModelDatabase(tmp_path / "db")
    profile = Profile.linear(1.0, 4.0, 8, device_type="cpu")
    db.add_model("m", [model_bytes(mlp_small())], profile_json=profile.to_json(), slo_ms=50)
    return SchedulerService(SchedulerConfig(data_dir=tmp_path / "db", **config), db)


def test_colocation_report_inflates_planning_latency(tmp_path):
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"models": [{"name": "m", "slowdown": 1.5}]}))
    plain = _service(tmp_path / "a").admin.in_service.profiles("m")["cpu"]
    inflated = _service(tmp_path / "b", colocation_report=str(report)).admin.in_service.profiles("m")["cpu"]
    for b in range(1, plain.max_batch + 1):
        assert abs(inflated.latency_ms(b) - 1.5 * plain.latency_ms(b)) < 1e-9
    assert inflated.meta["colocation_slowdown"] == 1.5


def test_unreadable_colocation_report_stops_the_scheduler_with_a_message(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    done = subprocess.run([sys.executable, "-m", "nexus", "scheduler", "--listen", "127.0.0.1:0", "--data-dir",
                           str(tmp_path / "db"), "--colocation-report", str(bad)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "--colocation-report" in done.stderr


def test_bad_scheduler_flags_are_refused(tmp_path):
    for flags, message in ((["--listen", "nowhere"], "--listen: expected HOST:PORT"),
                           (["--epoch-s", "0"], "--epoch-s: must be positive"),
                           (["--latency-split", "random"], "--latency-split"),
                           (["--rate-headroom", "-0.1"], "--rate-headroom: must not be negative"),
                           (["--burst-sigma", "-1"], "--burst-sigma: must not be negative"),
                           (["--path-allowance-ms", "-1"], "--path-allowance-ms: must not be negative"),
                           (["--min-replicas", "0"], "--min-replicas: must be positive")):
        done = subprocess.run([sys.executable, "-m", "nexus", "scheduler", "--data-dir", str(tmp_path), *flags],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and message in done.stderr, (flags, done.stderr)


def _report(service, now, **rates_rps):
    """Frontend "fe" reports these rates, as its first report (no smoothing)."""
    service.workload.report(control.WorkloadReport(node_id="fe", rates=[
        control.SessionRate(model=m, rate_rps=r) for m, r in rates_rps.items()]), now)


def test_reported_rates_are_smoothed(tmp_path):
    service = _service(tmp_path)
    service.workload.rates["fe"] = {}

    def Report(rate):
        return control.WorkloadReport(node_id="fe", rates=[control.SessionRate(model="m", rate_rps=rate)])

    import asyncio

    service.nodes["fe"] = object()
    asyncio.run(service.ReportWorkload(Report(100.0), None))
    asyncio.run(service.ReportWorkload(Report(200.0), None))
    expected = RATE_SMOOTHING * 200.0 + (1 - RATE_SMOOTHING) * 100.0
    assert abs(service.workload.rates["fe"]["m"][0] - expected) < 1e-9


def test_sessions_are_planned_with_the_rate_headroom(tmp_path):
    import time

    service = _service(tmp_path, rate_headroom=0.5)
    service.db.set_session("m", 50)
    now = time.monotonic()
    _report(service, now, m=10.0)
    [session], planned, _ = session_inputs(service.read_view(now), service.control.settings)
    assert abs(session.rate_rps - 15.0) < 1e-9 and planned["m"].rate_rps == session.rate_rps
    service.workload.forget("fe")
    [idle], _, _ = session_inputs(service.read_view(now), service.control.settings)   # no report yet: the default rate
    assert abs(idle.rate_rps - 1.5 * service.config.default_rate_rps) < 1e-9


def test_the_latency_split_is_outdated_only_when_a_gamma_leaves_its_band():
    """Rates are the re-planner's to judge (tests/unit/test_plan_device_type.py); a query's fan-out forces a re-plan."""
    from globalsched.planning.replan_policy import gamma_drift

    planned = {("q", "a", "b"): 3.0}
    assert gamma_drift({("q", "a", "b"): 3.0}, planned) == ""
    assert gamma_drift({("q", "a", "b"): 3.3}, planned) == ""
    assert gamma_drift({("q", "a", "b"): 4.0}, planned) == "gamma of q: a->b is 4.00, planned 3.0"
    assert gamma_drift({("q", "a", "c"): 1.0}, planned) == "gamma of q: a->c is 1.00, planned None"


def test_path_allowance_and_burst_sigma_reach_the_planner(tmp_path):
    from globalsched.planning.cluster_values import SessionInput
    from globalsched.planning.placement import BackendSlot
    from globalsched.planning.planner import place_sessions

    service = _service(tmp_path, path_allowance_ms=12.0, burst_sigma=1.5)
    settings = service.control.settings
    assert settings.planner.margins_ms == 12.0 and settings.planner.burst_sigma == 1.5
    profile = Profile.linear(1.0, 20.0, 8, device_type="cpu")     # 2*l(1) = 42 ms
    sessions = [SessionInput("m", 50.0, 10.0, {"cpu": profile})]
    backends = [BackendSlot("b0", "cpu", 0.0)]
    plain, _ = place_sessions(sessions, backends, PlannerState(), 0.0)
    assert not plain.best_effort
    plan, _ = place_sessions(sessions, backends, PlannerState(), 0.0, settings=settings)
    assert plan.best_effort["m"] == ("SLO 50 ms less the 12 ms path allowance is below 2*l(1) = 42.0 ms on cpu; "
                                     "served best effort at batch 1")


@pytest.mark.parametrize("config, sigma, short", [
    # fixed (no maximum is taken as fixed): the spares pool the bursts while the idle devices are
    # enough for them, each device keeps room of its own where they are too few
    ({}, 0.0, 1.5),
    ({"min_devices": "t4=4", "max_devices": "t4=4"}, 0.0, 1.5),
    ({"min_devices": "t4=1", "max_devices": "t4=4"}, 0.0, None),    # elastic: the spares pool the bursts
    ({"min_devices": "2", "max_devices": "8"}, 0.0, None),
    ({"min_devices": "t4=1", "max_devices": "t4=4", "burst_sigma": 1.0}, 1.0, None),   # given: as given
    ({"burst_sigma": 0.0}, 0.0, None),
    ({"burst_sigma": 1.5}, 1.5, None),
    ({"spare_replicas": False}, 1.5, None),                         # fixed with no spares: always the room
])
def test_an_unset_burst_sigma_is_that_of_the_clusters_kind_and_reaches_the_planner(tmp_path, config, sigma, short):
    service = _service(tmp_path, **config)
    settings = service.control.settings
    assert settings.planner.burst_sigma == sigma and settings.short_burst_sigma == short
    assert settings.device_headroom == service.config.device_headroom


def test_plans_use_the_windowed_mean_rate_not_the_smoothed_one(tmp_path):
    import asyncio
    import time

    from globalsched.state.rate_reports import Workload

    service = _service(tmp_path)
    service.nodes["fe"] = object()

    def Report(requests):
        return control.WorkloadReport(node_id="fe", rates=[control.SessionRate(
            model="m", rate_rps=float(requests), requests=requests, window_ms=1000)])

    for requests in (20, 20, 20, 20, 34):   # a noisy last second (3 sigma: not a surge)
        asyncio.run(service.ReportWorkload(Report(requests), None))
    now = time.monotonic()
    smoothed = service.workload.current_rates(now)["m"]
    assert smoothed > 24                                              # the excursion of the last report
    assert abs(service.workload.planning_rates(now)["m"] - 114 / 5) < 1e-9     # what the plan is made for
    assert service.workload.rate_windows_s(now) == {"m": 5.0}                   # over 5 s of counts
    uncounted = Workload()                                           # a frontend that sends no counts:
    for rate in (20.0, 20.0, 20.0, 20.0, 34.0):
        uncounted.report(control.WorkloadReport(node_id="fe", rates=[control.SessionRate(model="m", rate_rps=rate)]), now)
    assert uncounted.planning_rates(now)["m"] == uncounted.current_rates(now)["m"] > 24     # the smoothed rate
    assert uncounted.rate_windows_s(now) == {"m": 0.0}                          # and no noise estimate


def test_routing_table_carries_the_planned_figures(tmp_path):
    """Frontends export these as gauges: batch and duty cycle per route, planned and measured rate per
    session, planned devices and the lower bound."""
    import time

    from globalsched.state.membership import Node

    service = _service(tmp_path)
    service.db.set_session("m", 50)
    now = time.monotonic()
    _report(service, now, m=12.0)
    service.nodes["be-1"] = Node("be-1", control.NODE_KIND_BACKEND, "127.0.0.1:1", "cpu", "cpu", 1000.0)
    plan, _ = plan_cluster(service.read_view(now), PlannerState())
    plan = dataclasses.replace(plan, catalog=service.admin.catalog(plan))      # as the control loop attaches it
    table = service.distribution.routing_table(plan, 7)
    assert table.epoch == 7
    assert table.planned_devices == plan.num_devices_planned == 1
    assert table.lower_bound == plan.lower_bound == 1
    [route] = table.routes
    assert route.measured_rate_rps == 12.0
    assert route.planned_rate_rps == 12.0
    [backend] = route.backends
    [placed] = plan.placements["cpu"].backends[0].sessions
    assert backend.node_id == "be-1" and backend.batch == placed.batch >= 1
    assert backend.duty_cycle_ms == plan.placements["cpu"].backends[0].duty_cycle_ms > 0



def test_model_files_are_downloaded_in_chunks_and_unknown_ones_refused(tmp_path, monkeypatch):
    """DownloadModel reads the file a chunk at a time in a thread; the chunks make up the file."""
    import asyncio

    import grpc
    import pytest

    from common import grpc_util
    from globalsched.refusal import Refused

    service = _service(tmp_path)
    sha256 = service.db.model("m").sha256
    monkeypatch.setattr(grpc_util, "UPLOAD_CHUNK_BYTES", 1000)     # several chunks from a small model

    async def download(sha256):
        return [c.data async for c in service.admin.download(sha256)]

    chunks = asyncio.run(download(sha256))
    assert len(chunks) > 1 and all(len(c) <= 1000 for c in chunks)
    assert b"".join(chunks) == service.db.read_blob(sha256)
    for bad in ("0" * 64, "not-a-sha", ""):
        with pytest.raises(Refused) as refused:
            asyncio.run(download(bad))
        assert refused.value.code == grpc.StatusCode.NOT_FOUND
        assert "no model file with sha256" in refused.value.message


def test_a_model_uploaded_with_an_expected_rate_and_a_batch_cap_is_planned_by_them(tmp_path):
    """Issue 17's cold start and issue 20's max_batch_size: planned for the expected rate until one is
    measured, never at a batch beyond the cap, and both are in the model's description."""
    import time

    from globalsched.state.membership import Node
    from globalsched.state.modeldb import ServingSettings

    service = _service(tmp_path)
    profile = Profile.linear(0.5, 2.0, 32, device_type="cpu")
    service.db.add_model("hot", [model_bytes(mlp_small())], profile_json=profile.to_json(), slo_ms=100,
                         serving=ServingSettings(expected_rate_rps=400.0, batch_cap=4))
    now = time.monotonic()
    service.nodes["be-1"] = Node("be-1", control.NODE_KIND_BACKEND, "127.0.0.1:1", "cpu", "cpu", 0.0)
    sessions, _, _ = session_inputs(service.read_view(now), service.control.settings)
    assert {s.model: s.rate_rps for s in sessions} == {"hot": 400.0, "m": service.config.default_rate_rps}
    [hot] = [s for s in sessions if s.model == "hot"]
    assert hot.profiles["cpu"].max_batch == 4
    plan, _ = plan_cluster(service.read_view(now), PlannerState())
    batches = [s.batch for p in plan.placements.values() for b in p.backends for s in b.sessions if s.model == "hot"]
    assert batches and max(batches) <= 4
    desc = service.admin.desc("hot")
    assert desc.expected_rate_rps == 400.0 and desc.batch_cap == 4 and desc.max_batch == 4
    _report(service, now, hot=0.0)                                 # routed, but no client yet: still expected
    sessions, _, _ = session_inputs(service.read_view(now), service.control.settings)
    assert {s.model: s.rate_rps for s in sessions}["hot"] == 400.0
    service.workload.forget("fe")
    _report(service, now, hot=50.0)                                # requests measured: that rate from now on
    _, state = plan_cluster(service.read_view(now), PlannerState())
    assert state.first_requests_s == {"hot": now}
    sessions, _, _ = session_inputs(service.read_view(now), service.control.settings, first_requests_s={"hot": now})
    assert {s.model: s.rate_rps for s in sessions}["hot"] == 400.0      # a first window: still at least expected
    sessions, _, _ = session_inputs(service.read_view(now), service.control.settings,
                                    first_requests_s={"hot": now - 11.0})
    assert {s.model: s.rate_rps for s in sessions}["hot"] == 50.0       # a whole window of requests: as measured


def test_bad_serving_settings_are_refused_at_upload(tmp_path):
    import pytest

    from globalsched.state.modeldb import ServingSettings, UploadError

    db = ModelDatabase(tmp_path / "db")
    for settings, message in ((ServingSettings(expected_rate_rps=-1.0), "expected_rate_rps must be a rate of at least 0"),
                              (ServingSettings(expected_rate_rps=float("nan")), "expected_rate_rps must be a rate"),
                              (ServingSettings(batch_cap=-2), "batch_cap must be at least 0, got -2")):
        with pytest.raises(UploadError, match=message):
            db.add_model("x", [model_bytes(mlp_small())], serving=settings)
        assert db.model("x") is None


def test_a_surge_beyond_noise_is_planned_for_at_once_and_noise_is_not():
    """Cold start (issue 17): a report far above the window's mean is planned for at once, with no
    cooldown; an ordinary Poisson excursion is not."""
    from globalsched.planning.cluster_values import PlannedSession
    from globalsched.planning.replan_policy import demand_surge
    from globalsched.state.rate_reports import Workload

    def report(workload, now, requests):
        workload.report(control.WorkloadReport(node_id="fe", rates=[control.SessionRate(
            model="m", rate_rps=float(requests), requests=requests, window_ms=1000)]), now)

    noisy, surged = Workload(), Workload()
    for t, n in enumerate([60, 55, 66, 58, 74]):                  # 74 is within 4 sigma of ~60
        report(noisy, float(t), n)
    for t, n in enumerate([60, 55, 66, 58, 300]):                 # a 5x step
        report(surged, float(t), n)
    assert noisy.surges(4.0) == {} and noisy.planning_rates(4.0)["m"] == sum([60, 55, 66, 58, 74]) / 5
    assert surged.surges(4.0) == {"m": 300.0} and surged.planning_rates(4.0)["m"] == 300.0
    assert surged.surge_windows_s(4.0) == {"m": 1.0} and noisy.surge_windows_s(4.0) == {}   # the surging report's
    assert surged.latest_reports(4.0) == {"m": (300.0, 1.0)}      # whether a held surge goes on (the planner's)
    assert surged.latest_reports(20.0) == {}                       # reports older than their TTL count no more
    plan = _plan_for({"m": PlannedSession("m", "m", 50.0, 60.0)})
    assert demand_surge(surged.surges(4.0), plan) == "demand surge: m at 300 rps, planned for 60"
    assert demand_surge({"m": 64.0}, plan) == ""          # within the band of the plan
    assert demand_surge(surged.surges(4.0), None) == ""
    # A frontend's first report is judged against nothing (a frontend that just started, or one that
    # reports early before its first period ended): its traffic is news.
    first, quiet = Workload(), Workload()
    report(first, 0.0, 60)
    report(quiet, 0.0, 3)
    assert first.surges(0.0) == {"m": 60.0} and quiet.surges(0.0) == {}


def _plan_for(sessions):
    from globalsched.planning.cluster_values import ClusterPlan

    return ClusterPlan({}, {}, {}, sessions=sessions)


def test_warming_parses_and_fingerprints_every_stored_profile_once(tmp_path):
    """What the scheduler does before it answers anything: the first plan's read of the profiles then
    finds them parsed and fingerprinted (at 2,400 models that read held the loop 2 s)."""
    cold, warmed = _service(tmp_path / "cold"), _service(tmp_path / "warm")
    warmed.warm()
    assert "digest" not in vars(cold.admin.in_service.tables()["m"]["cpu"])
    table = warmed.admin.in_service.tables()["m"]["cpu"]
    assert "digest" in vars(table)                      # computed, and kept on the parsed object
    assert warmed.read_view(1.0).models[0].profiles["cpu"] is table      # the plan reads that object


def test_warm_reads_leave_the_first_view_no_statement_to_run(tmp_path):
    """The leading scheduler reads its views' database rows in a worker thread before its first plan
    (at 2,400 models the first view's statements held the loop 0.35-0.66 s): that view then runs no
    statement on the event loop, and reads what a cold view reads."""
    from globalsched.state.read_view import warm_reads

    svc = _service(tmp_path)
    svc.admin.db.keep_reads = True
    statements: list[str] = []
    execute = svc.admin.db._db.execute

    def counted(sql, *args, **kwargs):
        statements.append(sql)
        return execute(sql, *args, **kwargs)

    svc.admin.db._db.execute = counted
    cold = svc.read_view(1.0)
    assert statements                     # nothing kept: the view reads the database
    svc.admin.db.forget_reads()
    warm_reads(svc.admin)
    statements.clear()
    warm = svc.read_view(1.0)
    assert statements == []
    assert warm.models == cold.models and warm.queries == cold.queries and [m.name for m in warm.models] == ["m"]


def test_the_profiles_samples_are_made_in_the_thread_that_writes_the_text(tmp_path, monkeypatch):
    """The scheduler's metrics endpoint collects on the loop and writes the text in a worker thread: the
    profile collector takes its reports on the loop and makes its 26,000 samples (at 2,400 models)
    only when the text is written; the text is what an eager build writes."""
    import threading

    from prometheus_client import generate_latest

    from globalsched.rpc import profile_metrics

    svc = _service(tmp_path)
    svc.warm()
    made_in: list[str] = []
    families = profile_metrics._families

    def counted(reports, invalid):
        if reports:
            made_in.append(threading.current_thread().name)
        return families(reports, invalid)

    monkeypatch.setattr(profile_metrics, "_families", counted)

    class Collected:
        def __init__(self, collector):
            self.families = list(collector.collect())       # on "the loop": this thread

        def collect(self):
            return iter(self.families)

    collected = Collected(profile_metrics.ProfileCollector(svc.admin))
    assert made_in == []
    texts = []
    writer = threading.Thread(target=lambda: texts.append(generate_latest(collected)), name="writer")
    writer.start()
    writer.join()
    assert made_in == ["writer"]
    eager = families(svc.admin.in_service.profile_reports(), svc.admin.in_service.invalid_samples)

    class Eager:
        def collect(self):
            return iter(eager)

    assert texts[0] == generate_latest(Eager())
    assert b'nexus_profile_latency_seconds{batch="1",device_type="cpu",model="m",source="table"}' in texts[0]


def test_a_new_set_of_device_types_recomputes_only_the_predictions(tmp_path, monkeypatch):
    """The first backend of a type changes the types present: the models' tables' choices are kept (the
    same objects, nothing chosen again); only predictions are made for a type with no table (none
    here: one model's profile predicts nothing)."""
    svc = _service(tmp_path)
    in_service = svc.admin.in_service
    present = [()]
    monkeypatch.setattr(in_service, "present_types", lambda: present[0])
    chosen: list[tuple] = []
    choose = in_service.book.choose

    def counted(model, t, table, predicted):
        chosen.append((model, t, table is not None))
        return choose(model, t, table, predicted)

    monkeypatch.setattr(in_service.book, "choose", counted)
    before = in_service.choices()
    assert list(before) == ["m"] and list(before["m"]) == ["cpu"] and chosen == [("m", "cpu", True)]
    present[0] = ("cpu",)
    again = in_service.choices()
    assert again["m"]["cpu"] is before["m"]["cpu"] and len(chosen) == 1        # nothing chosen again
    present[0] = ("cpu", "t4")
    with_t4 = in_service.choices()
    assert with_t4["m"]["cpu"] is before["m"]["cpu"] and len(chosen) == 1 and "t4" not in with_t4["m"]
    assert in_service.choices() is with_t4
