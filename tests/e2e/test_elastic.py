"""An elastic cluster on real processes and emulated GPUs (issue 17 items 5 and 7).

`nexus serve --backends auto` grows under load within --max-backends (and says that the plan folds
sessions when the maximum binds), then shrinks back to its minimum once the load falls, one drain at
a time, without failing a request of the load that keeps going during the shrink. A frontend whose
report period is a minute reports a surge of demand at once, and a model uploaded with an expected
rate is planned for it before any request. Outcomes and counts only: no wall-clock assertion
(timings are benchmarks/elastic.py's).
"""

from __future__ import annotations

import re
import time

import pytest

from common.pb import control, control_grpc
from common.profile import Profile
from common.sample_models import mlp_small, model_bytes
from harness.background_load import BackgroundLoad
from harness.cluster import Cluster, Upload, cmdline, descendants
from nexus.scheduler_client import fetch_status, upload_model
from tests.components import wait_for
from tests.conftest import start_serve

pytestmark = pytest.mark.slow

DEVICE = "emulated:t4"
SLO_MS = 300.0
# l(b) = 20 b + 10 ms: one device serves about 40 requests/s within the SLO, so a few tens of
# requests per second need several devices while the processes stay light on this machine.
PROFILE = Profile.linear(20.0, 10.0, 16, device_type="t4")


def _upload(workdir, name: str = "slow") -> Upload:
    model, profile = workdir / f"{name}.onnx", workdir / f"{name}.profile.json"
    model.write_bytes(model_bytes(mlp_small()))
    profile.write_text(PROFILE.to_json())
    return Upload(model, name, str(profile), SLO_MS)


def _backend_pids(serve_pid: int) -> list[int]:
    return [p for p in descendants(serve_pid) if " backend " in f" {cmdline(p)} "]


def test_auto_grows_under_load_within_its_maximum_and_shrinks_back_without_failing_a_request(tmp_path):
    log = tmp_path / "serve.log"
    with log.open("w") as err:
        cluster = start_serve(tmp_path / "data", "--no-samples", "--device", DEVICE, "--backends", "auto",
                                "--max-backends", "2", "--scale-down-cooldown-s", "1", "--epoch-s", "3",
                                "--frontend-report-interval-s", "0.5", stderr=err)
    try:
        model = _upload(tmp_path)
        cluster.upload(model)
        status = lambda: fetch_status(cluster.scheduler, creds=cluster.creds)  # noqa: E731
        assert len(_backend_pids(cluster.pid)) == 1
        # About 3 devices' worth of load: it grows to the maximum of 2 and says the plan folds.
        heavy = BackgroundLoad(cluster.frontend, model.name, 110.0, slo_ms=SLO_MS, timeout_s=5.0, seed=1).start()
        most = 0
        try:
            def capped():
                nonlocal most
                most = max(most, len(_backend_pids(cluster.pid)))
                d = status().decision("t4")
                return d if d is not None and d.registered == 2 and "capped at --max-devices 2" in d.reason else None

            decision = wait_for(capped, 120, "two backends registered and the maximum binding")
            for _ in range(10):                       # it stays at the maximum while the load lasts
                most = max(most, len(_backend_pids(cluster.pid)))
                time.sleep(0.2)
        finally:
            heavy.stop()
        assert most == 2 and decision.desired == 2 and decision.needed == 2
        assert "folded onto busy backends" in decision.reason, decision.reason
        text = log.read_text()
        assert re.search(r"adding backend-1 \(pid \d+\): ", text), text
        assert "backend-2" not in text
        # The load falls to a trickle one backend serves: back to the minimum, one drain, no failure.
        trickle = BackgroundLoad(cluster.frontend, model.name, 8.0, slo_ms=SLO_MS, timeout_s=5.0, seed=2).start()
        try:
            wait_for(lambda: (d := status().decision("t4")) is not None and d.desired == 1 and d.registered == 1,
                     120, "back to one registered backend")
            wait_for(lambda: len(_backend_pids(cluster.pid)) == 1, 60, "the drained backend's process gone")
            time.sleep(1.0)
        finally:
            result = trickle.stop()
        counts = trickle.counts()
        assert counts["sent"] > 0 and counts["failed_total"] == 0 and counts["no_response"] == 0, counts
        assert result.ok == counts["sent"]
        text = log.read_text()
        removed = re.findall(r"removing (backend-\d) \((be-[0-9a-f-]+) at [^)]+\): (.*); draining it", text)
        assert len(removed) == 1 and removed[0][2], text
        assert re.search(rf"{removed[0][0]} \(pid \d+\) stopped, exit status 0", text), text
        assert f"{removed[0][0]} restarted" not in text          # stopped on purpose: never restarted
    finally:
        assert cluster.stop() == 0
    assert "every process exited cleanly" in log.read_text()


def _route(scheduler: str, name: str) -> control.ModelRoute | None:
    import grpc

    with grpc.insecure_channel(scheduler) as channel:
        reply = control_grpc.SchedulerStub(channel).GetStatus(control.StatusRequest(), timeout=10)
    return next((r for r in reply.routing.routes if r.model.name == name), None)


def test_a_surge_is_reported_at_once_and_an_expected_rate_is_planned_for_from_the_start(tmp_path):
    # Reports every minute: within this test only an early report can tell the scheduler anything.
    with Cluster(tmp_path, backends=2, device=DEVICE, frontend={"report_interval_s": 60.0}) as cluster:
        model = _upload(tmp_path)
        cluster.start([model])
        route = _route(cluster.scheduler.address, model.name)
        assert route.measured_rate_rps == 0.0 and route.planned_rate_rps < 5
        load = BackgroundLoad(cluster.frontend.address, model.name, 60.0, slo_ms=SLO_MS, timeout_s=5.0, seed=3).start()
        try:
            # reported before the frontend's first periodic report, and planned for
            route = wait_for(lambda: (r := _route(cluster.scheduler.address, model.name)).measured_rate_rps > 0
                             and r.planned_rate_rps > 20 and r, 30, "the surge reported early and planned for")
        finally:
            load.stop()
        assert len(route.backends) == 2, route           # 60 requests/s at l(b) = 20 b + 10 need both devices
        # A model uploaded expecting 150 requests/s is planned for them before it gets one.
        hot = _upload(tmp_path, "hot")
        upload_model(cluster.scheduler.address, hot.path, hot.name, profile_path=hot.profile_path, slo_ms=SLO_MS,
                     expected_rate_rps=150.0)
        route = wait_for(lambda: (r := _route(cluster.scheduler.address, hot.name)) is not None and r.backends and r,
                         60, "the hot model placed")
        assert route.planned_rate_rps >= 150.0 and route.measured_rate_rps == 0.0
        assert len(route.backends) == 2          # more than one device serves 150 requests/s at l(b) = 20 b + 10
