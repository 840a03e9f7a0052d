"""Profiles in service, end to end on real processes (a scheduler, a frontend and emulated backends):

- a table 2x pessimistic: the emulated devices run at half its latencies (``--emulated-latency-factor
  0.5``); serving measures them, the scheduler re-plans on the measured profile with the reason in its
  log, and the plan serves the load on fewer devices; an overloaded period that follows is flagged
  contended and lowers no planned capacity;
- a model with a table on t4 only is planned on a v100 with a profile predicted from the models
  measured on both; serving then measures it, the measurement replaces the prediction, and the
  prediction's error is reported (log, GetStatus, metrics).
"""

from __future__ import annotations

import subprocess
import time

import grpc
import pytest
from harness.prometheus import scrape

from common.pb import control, control_grpc
from common.profile import Profile
from common.sample_models import mlp_small, model_bytes
from harness.cluster import Cluster
from harness.background_load import BackgroundLoad
from nexus.launcher import nexus_command
from tests.components import wait_for, wait_ready

pytestmark = pytest.mark.slow

SLO_MS = 400.0
TABLE = Profile.linear(8.0, 20.0, 16, memory_base_mb=100, memory_per_item_mb=1, device_type="t4")  # l(16) = 148 ms


def cluster(tmp_path, device: str, backends: int, factor: float) -> Cluster:
    """A scheduler (logging at INFO, folding samples every second), a frontend and ``backends`` emulated
    backends whose batches take ``factor`` times their table's latency; no spare replicas (the tests count
    the devices a plan gives a model)."""
    return Cluster(tmp_path, backends=backends, device=device,
                   scheduler={"profile_update_s": 1.0, "spare_replicas": False},
                   backend={"emulated_latency_factor": factor}, frontend={"report_interval_s": 0.5},
                   env=lambda kind: {"NEXUS_LOG": "INFO"} if kind == "scheduler" else {}).start()


def upload(stub, name: str, profile: Profile, *, load: bool = True, rate_rps: float = 0.0, sample: bool = True) -> None:
    model = mlp_small()
    if not sample:
        model.producer_name = "not-a-sample"      # an emulated GPU has no datasheet for it: it cannot measure it
    header = control.UploadHeader(name=name, profile_json=profile.to_json(), slo_ms=SLO_MS, load=load,
                                  expected_rate_rps=rate_rps)
    stub.UploadModel(iter([control.UploadChunk(header=header), control.UploadChunk(data=model_bytes(model))]),
                     timeout=60)


def status(stub) -> control.StatusReply:
    return stub.GetStatus(control.StatusRequest(), timeout=10)


def profile_of(reply: control.StatusReply, model: str, device_type: str) -> control.ModelProfileStatus | None:
    return next((p for p in reply.profiles if p.model == model and p.device_type == device_type), None)


def placement(reply: control.StatusReply, model: str) -> list[float]:
    """The planned throughput of ``model`` on each device that runs it."""
    return [s.planned_rate_rps for d in reply.devices for s in d.sessions if s.session == model]


def device_types(stub, model: str) -> list[control.DeviceTypeStatus]:
    return [d for m in stub.ListModels(control.ListModelsRequest(), timeout=10).models if m.name == model
            for d in m.device_types]


def l_at(curve: control.ProfileCurve, batch: int) -> float:
    return dict(zip(curve.batch, curve.latency_ms))[batch]




def test_a_pessimistic_table_is_measured_and_replaced_and_overload_does_not_ratchet(tmp_path):
    with cluster(tmp_path, "emulated:t4", 2, 0.5) as c, grpc.insecure_channel(c.scheduler.address) as channel:
        stub = control_grpc.SchedulerStub(channel)
        upload(stub, "emu", TABLE, rate_rps=120.0)
        # The table's plan: 120 rps needs two devices at 16 / 148 ms = 108 rps each.
        before = wait_for(lambda: len(placement(r := status(stub), "emu")) == 2 and r, 60, "the table's plan")
        assert profile_of(before, "emu", "t4").in_use == "table"
        assert max(placement(before, "emu")) < 110
        wait_ready(c.frontend.address, "emu")

        load = BackgroundLoad(c.frontend.address, "emu", 120.0, slo_ms=SLO_MS).start()
        try:
            after = wait_for(lambda: profile_of(r := status(stub), "emu", "t4").in_use == "measured"
                             and len(placement(r, "emu")) == 1 and r, 90, "a plan on the measured profile")
        finally:
            report = load.stop()
        measured = profile_of(after, "emu", "t4")
        # the devices run at half the table's latency, and the plan now gives one device the whole load
        assert l_at(measured.measured, 16) == pytest.approx(0.5 * TABLE.latency_ms(16), rel=0.15)
        assert l_at(measured.table, 16) == pytest.approx(TABLE.latency_ms(16))
        print(f"planned throughput per device: table {placement(before, 'emu')}, measured {placement(after, 'emu')}")
        # one device carries the whole rate the plan serves (what the frontend measured: below the offered
        # 120 rps when the client lags on a busy machine)
        [route] = [r for r in after.routing.routes if r.model.name == "emu"]
        assert placement(after, "emu")[0] >= 0.99 * route.planned_rate_rps > 0
        assert measured.samples >= 40 and measured.drift >= 0.15
        assert report.ok > 0, report        # SLO attainment is the machine's here (load averages of 20 were seen)

        # An overloaded period: far beyond both devices' capacity. Its batches are flagged contended
        # and the profile the plan uses does not move (no ratchet).
        in_use_l16 = l_at(measured.measured, 16)
        overload = BackgroundLoad(c.frontend.address, "emu", 500.0, slo_ms=SLO_MS, timeout_s=2.0).start()
        try:
            time.sleep(4.0)
        finally:
            overload.stop()
        later = wait_for(lambda: (p := profile_of(status(stub), "emu", "t4")).contended_samples > 0 and p, 30,
                         "contended samples reported")
        assert later.in_use == "measured"
        assert l_at(later.measured, 16) <= in_use_l16 * 1.02

        in_use = {dict(lab)["source"] for lab in scrape(c.scheduler.info["metrics"]).matching(
            "nexus_profile_in_use", model="emu")}
        assert in_use == {"measured"}
        log = c.scheduler.logs()
    assert "profile of emu on t4 drifted" in log and "% from its table: re-plan" in log, log[-3000:]


def test_a_predicted_profile_plans_until_serving_measures_it_and_its_error_is_reported(tmp_path):
    with cluster(tmp_path, "emulated:v100", 1, 0.8) as c, grpc.insecure_channel(c.scheduler.address) as channel:
        stub = control_grpc.SchedulerStub(channel)
        # Two models measured on both types (a v100 takes half a t4's time), stored only;
        # a third with a t4 table only, served.
        for name, t4 in (("a", Profile.linear(4.0, 20.0, 16, device_type="t4")),
                         ("b", Profile.linear(2.0, 10.0, 16, device_type="t4"))):
            upload(stub, name, t4, load=False)
            stub.AddProfile(control.ProfileUpload(model=name, profile_json=Profile.from_rows(
                t4.scaled(0.5).rows, "v100").to_json()), timeout=10)
        upload(stub, "c", TABLE, sample=False)
        planned = wait_for(lambda: placement(r := status(stub), "c") and r, 60, "c planned on the v100")
        predicted = profile_of(planned, "c", "v100")
        assert predicted.in_use == "predicted" and predicted.predicted_from == "t4"
        assert not predicted.HasField("table")
        assert l_at(predicted.predicted, 16) == pytest.approx(0.5 * TABLE.latency_ms(16))
        # the v100 cannot measure a model it has no datasheet for: the prediction keeps planning it
        state = wait_for(lambda: next((d for d in device_types(stub, "c") if d.device_type == "v100"
                                       and d.state == control.PREDICTED), None), 30, "the profiling run refused")
        assert state.reason.startswith("predicted from t4; an emulated device (emulated:v100)")

        wait_ready(c.frontend.address, "c")
        load = BackgroundLoad(c.frontend.address, "c", 60.0, slo_ms=SLO_MS).start()
        try:
            after = wait_for(lambda: (p := profile_of(status(stub), "c", "v100")).in_use == "measured" and p,
                             90, "the measurement replacing the prediction")
        finally:
            load.stop()
        print(f"prediction of c on v100: l(16) {l_at(after.predicted, 16):.1f} ms, measured {l_at(after.measured, 16):.1f} "
              f"ms, error mean {after.prediction_error_mean:.3f} max {after.prediction_error_max:.3f}")
        # the device runs at 0.8x the prediction: the prediction was 25% pessimistic
        assert after.prediction_replaced_by == "serving measurements"
        assert after.prediction_error_mean == pytest.approx(0.25, abs=0.06) and after.prediction_bias > 0
        assert l_at(after.measured, 16) == pytest.approx(0.8 * l_at(after.predicted, 16), rel=0.15)
        state = next(d for d in device_types(stub, "c") if d.device_type == "v100")
        assert (state.state, state.reason) == (control.PROFILED, "measured while serving (no table)")
        errors = {dict(lab)["stat"]: v for lab, v in scrape(c.scheduler.info["metrics"]).matching(
            "nexus_profile_prediction_error_ratio", model="c").items()}
        assert errors["mean"] == pytest.approx(after.prediction_error_mean)
        shown = subprocess.run([*nexus_command(), "status", "--scheduler", c.scheduler.address], capture_output=True,
                               text=True, timeout=60)
        assert shown.returncode == 0, shown.stderr
        assert "c on v100: the prediction (from t4) was replaced by serving measurements: off by" in shown.stdout
        log = c.scheduler.logs()
    assert "prediction of c on v100 (from t4) replaced by serving measurements: off by" in log, log[-3000:]
