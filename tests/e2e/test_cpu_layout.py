"""``nexus serve --cpu-layout`` on real processes (nexus/cpu_layout.py, nexus/cpu_layout_switch.py):
auto, the default on a CPU, measures a served model in both layouts on the running backend,
switches to one backend per core make-before-break while a client sends requests, and every
request is answered; a fixed layout starts its backends as it says; a backend that is not on a CPU
refuses to measure with other threads; bad flags are refused before anything starts."""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from common.pb import control, control_grpc
from common.profile import Profile
from common.sample_models import mlp_small, model_bytes, resnet18_64
from harness.cluster import ServeCluster, Upload
from nexus.cpu_layout import PER_CORE_DEVICE_TYPE
from nexus.cpu_layout_switch import measure_on_backend
from nexus.scheduler_client import fetch_status
from tests.components import start_cluster, wait_for
from tests.conftest import nexus_cli

pytestmark = pytest.mark.slow

MODEL = "mlp"


def _model(tmp_path) -> Upload:
    path = tmp_path / "mlp.onnx"
    path.write_bytes(model_bytes(mlp_small()))
    return Upload(path, MODEL, slo_ms=100.0)


class _Client(threading.Thread):
    """Sends one request every ``period_s`` until stopped; counts every outcome by status."""

    def __init__(self, address: str, period_s: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.client = grpcclient.InferenceServerClient(address)
        self.period_s = period_s
        self.outcomes: dict[str, int] = {}
        self.halt = threading.Event()

    def run(self) -> None:
        inp = grpcclient.InferInput("input", [1, 64], "FP32")
        inp.set_data_from_numpy(np.ones((1, 64), np.float32))
        while not self.halt.is_set():
            try:
                self.client.infer(MODEL, [inp], client_timeout=10.0)
                status = "OK"
            except InferenceServerException as exc:
                status = f"{exc.status()}: {exc.message()}"
            self.outcomes[status] = self.outcomes.get(status, 0) + 1
            time.sleep(self.period_s)


def _device_types(cluster: ServeCluster) -> list[str]:
    return sorted(d.device_type for d in fetch_status(cluster.scheduler, 5.0, cluster.creds).devices)


def test_the_default_auto_switches_to_one_backend_per_core_without_failing_a_request(tmp_path):
    log = tmp_path / "serve.log"
    cluster = ServeCluster(tmp_path / "data", "--no-samples", log_path=log)        # --cpu-layout auto
    client = None
    try:
        # logged just after the ready line: waited for, not read at once
        first = f"cpu layout: machine (1 backend(s) on {len(os.sched_getaffinity(0))} core(s))"
        wait_for(lambda: first in cluster.logs(), 30, "the layout it starts with")
        # a backend says it is ready before its registration is through (backend/server.py): under a
        # loaded CI run the scheduler had no device yet when this line was logged
        wait_for(lambda: _device_types(cluster) != [], 30, "the backend's registration")
        assert _device_types(cluster) == ["cpu"]
        cluster.upload(_model(tmp_path))
        client = _Client(cluster.frontend)
        client.start()
        try:
            wait_for(lambda: "cpu layout: now per-core" in cluster.logs(), 150, "the switch to per-core")
        except AssertionError as exc:        # with what the switch logged: its measurements and verdicts
            said = "\n".join(line for line in cluster.logs().splitlines() if "cpu layout" in line)
            raise AssertionError(f"{exc}; serve said:\n{said}") from None
        wait_for(lambda: "backend-0 (pid" in cluster.logs().split("cpu layout: now per-core", 1)[1], 60,
                 "the machine backend's exit")
        time.sleep(3.0)                    # and the routing of the new layout alone
        client.halt.set()
        client.join(15)
        text = cluster.logs()
        assert f"cpu layout: measured {MODEL} (typical): machine l(1)=" in text and "; per-core l(1)=" in text
        assert "cpu layout: switch to per-core: machine: " in text
        assert "backend-0 (pid" in text and "stopped, exit status 0" in text
        assert _device_types(cluster) == [PER_CORE_DEVICE_TYPE, PER_CORE_DEVICE_TYPE]
        profiles = {(p.model, p.device_type) for p in fetch_status(cluster.scheduler, 5.0, cluster.creds).profiles}
        assert (MODEL, PER_CORE_DEVICE_TYPE) in profiles
        assert client.outcomes.get("OK", 0) > 100, client.outcomes
        assert set(client.outcomes) == {"OK"}, client.outcomes
    finally:
        if client is not None:
            client.halt.set()
        cluster.stop()
    assert "every process exited cleanly" in log.read_text()


def test_a_fixed_per_core_layout_starts_one_single_thread_backend_per_core(tmp_path):
    cluster = ServeCluster(tmp_path / "data", "--no-samples", "--cpu-layout", "per-core", log_path=tmp_path / "log")
    try:
        cluster.upload(_model(tmp_path))
        cores = len(os.sched_getaffinity(0))          # serve's own, inherited
        wait_for(lambda: len(_device_types(cluster)) == cores, 60, f"{cores} backends registered")
        assert _device_types(cluster) == [PER_CORE_DEVICE_TYPE] * cores
        fixed = f"cpu layout: per-core ({cores} backend(s) on {cores} core(s))\n"
        wait_for(lambda: fixed in cluster.logs(), 30, "the fixed layout's line, with no switching promised")
        assert "cpu layout: measured" not in cluster.logs()
    finally:
        cluster.stop()


def test_a_backend_not_on_a_cpu_refuses_to_measure_with_other_threads(tmp_path):
    with start_cluster(tmp_path, 1, "emulated:t4") as c:
        with grpc.insecure_channel(c.backends[0].address) as channel:
            reply = control_grpc.BackendStub(channel).ProfileModel(
                control.ProfileRequest(model=control.ModelDesc(name="m", sha256="0" * 64), batch_sizes=[1],
                                       threads=1), timeout=30)
    assert not reply.profile_json
    assert reply.error == ("threads=1: only a CPU backend measures with other intra-op threads than its own "
                           "(this one runs emulated:t4)")


def _thread_nices(pid: int) -> set[int]:
    """The nice value of every thread of process ``pid`` now."""
    found = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                found.add(int(f.read().rsplit(")", 1)[1].split()[16]))
        except (OSError, IndexError, ValueError):    # a thread that ended meanwhile
            pass
    return found


def test_a_background_measurement_runs_below_the_serving_threads_and_a_foreground_one_does_not(tmp_path):
    """The layout's measurements ask for the background (nexus/cpu_layout_switch.py); the scheduler's
    first profile of a model does not. Seen from outside: the nice values of the backend's threads
    while each measurement runs."""
    path = tmp_path / "resnet.onnx"
    path.write_bytes(model_bytes(resnet18_64()))
    with start_cluster(tmp_path / "cluster", 1, "cpu") as c:
        stored = nexus_cli("models", "upload", str(path), "--name", "r", "--no-load", "--scheduler",
                           c.scheduler.address)
        assert stored.returncode == 0, stored.stderr
        with grpc.insecure_channel(c.scheduler.address) as channel:
            [desc] = [m for m in control_grpc.SchedulerStub(channel).ListModels(
                control.ListModelsRequest(), timeout=10).models if m.name == "r"]
        backend = c.backends[0]
        base = _thread_nices(backend.pid)

        def measured_with(background: bool) -> set[int]:
            seen: set[int] = set()
            done = threading.Event()

            def sample():
                while not done.is_set():
                    seen.update(_thread_nices(backend.pid))
                    time.sleep(0.01)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            try:
                with grpc.insecure_channel(backend.address) as channel:
                    reply = control_grpc.BackendStub(channel).ProfileModel(
                        control.ProfileRequest(model=desc, batch_sizes=[1, 2, 4, 8], budget_s=5.0,
                                               background=background), timeout=120)
            finally:
                done.set()
                sampler.join(5)
            assert reply.profile_json and not reply.error, reply.error
            return seen

        assert measured_with(background=False) == base           # a foreground one: every thread as it was
        lowered = measured_with(background=True) - base
        assert lowered and all(n >= min(max(base) + 10, 19) for n in lowered), (base, lowered)


def test_the_layouts_measurement_asks_a_backend_for_the_background():
    """What nexus/cpu_layout_switch.py sends, seen by a gRPC server in its place."""
    asked: list[control.ProfileRequest] = []

    class Backend(control_grpc.BackendServicer):
        def ProfileModel(self, request, context):
            asked.append(request)
            return control.MeasuredProfile(profile_json=Profile.linear(0.5, 1.0, 32, device_type="cpu").to_json())

    server = grpc.server(concurrent.futures.ThreadPoolExecutor(2))
    control_grpc.add_BackendServicer_to_server(Backend(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        profile = measure_on_backend()(f"127.0.0.1:{port}", control.ModelDesc(name="m", sha256="0" * 64), 1)
    finally:
        server.stop(None)
    assert profile.max_batch == 32
    [request] = asked
    assert request.background and request.threads == 1 and list(request.batch_sizes) == [1, 2, 4, 8, 16, 32]


def test_bad_layout_flags_are_refused_before_anything_starts(tmp_path):
    run = subprocess.run([sys.executable, "-m", "nexus", "serve", "--cpu-layout", "auto", "--backends", "2",
                          "--data-dir", str(tmp_path / "data")], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "nexus serve: error: --cpu-layout sets the backends, their threads and device types; drop --backends" \
        in run.stderr
    assert not (tmp_path / "data").exists()
