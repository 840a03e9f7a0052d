"""grpc.health.v1 on every component, at the moments docs/deployment.md documents: not ready before a
table, ready after; a frontend that loses the scheduler stays ready and keeps serving its last
table; on SIGTERM readiness turns NOT_SERVING first, requests in flight still finish, and the
process exits cleanly. Liveness stays SERVING throughout."""

from __future__ import annotations

import os
import threading
import time

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.config import BackendConfig, FrontendConfig, SchedulerConfig
from common.pb import control, control_grpc, kserve, kserve_grpc
from common.profile import Profile
from common.sample_models import mlp_small, model_bytes
from nexus.launcher import launch
from nexus.scheduler_client import upload_model
from harness.ports import free_port
from tests.components import wait_for

pytestmark = pytest.mark.slow

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
KSERVE = "inference.GRPCInferenceService"
DEVICE = "t4"


def check(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                         timeout=10).status


def server_ready(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        return kserve_grpc.GRPCInferenceServiceStub(channel).ServerReady(kserve.ServerReadyRequest(), timeout=10).ready


def queued(backend: str) -> int:
    """Requests waiting in the backend's queues (not those running)."""
    with grpc.insecure_channel(backend) as channel:
        stats = control_grpc.BackendStub(channel).Stats(control.BackendStatsRequest(), timeout=10)
    return sum(s.queue_length for s in stats.sessions)


def _input() -> grpcclient.InferInput:
    x = grpcclient.InferInput("input", [1, 64], "FP32")
    x.set_data_from_numpy(np.ones((1, 64), np.float32))
    return x


def infer(frontend: str, model: str = "mlp") -> np.ndarray:
    return grpcclient.InferenceServerClient(frontend).infer(model, [_input()], client_timeout=30).as_numpy("logits")


def upload(tmp_path, scheduler: str, latency_ms: float, max_batch: int = 16) -> None:
    path = tmp_path / "mlp.onnx"
    path.write_bytes(model_bytes(mlp_small()))
    profile = tmp_path / "profile.json"
    profile.write_text(Profile.linear(0.1, latency_ms, max_batch, device_type=DEVICE).to_json())
    upload_model(scheduler, path, "mlp", profile_path=str(profile), slo_ms=max(20 * latency_ms, 1000))


def _env() -> dict:
    return dict(os.environ, NEXUS_LOG="WARNING")


def test_readiness_before_and_after_a_table_and_without_the_scheduler(tmp_path):
    scheduler_address = f"127.0.0.1:{free_port()}"
    backend = launch(BackendConfig(scheduler=scheduler_address, listen="127.0.0.1:0", device=f"emulated:{DEVICE}"),
                     env=_env())
    frontend = launch(FrontendConfig(scheduler=scheduler_address, listen="127.0.0.1:0"), env=_env())
    scheduler = None
    try:
        b, f = backend.wait_ready(60), frontend.wait_ready(60)
        # No scheduler yet: no table, so not ready; live all the same.
        assert check(b) == NOT_SERVING and check(b, "liveness") == SERVING
        assert check(f) == NOT_SERVING and check(f, KSERVE) == NOT_SERVING and check(f, "liveness") == SERVING
        assert not server_ready(f)
        # An inference call before any table waits for one (never past its deadline), then gets NOT_FOUND.
        with pytest.raises(InferenceServerException, match="unknown model"):
            grpcclient.InferenceServerClient(f).infer("mlp", [_input()], client_timeout=30)
        scheduler = launch(SchedulerConfig(listen=scheduler_address, data_dir=tmp_path / "db"), env=_env())
        scheduler.wait_ready(60)
        assert check(scheduler_address) == SERVING and check(scheduler_address, "liveness") == SERVING
        upload(tmp_path, scheduler_address, latency_ms=2.0)
        wait_for(lambda: check(b) == SERVING, 120, what="backend ready once its model table is loaded")
        wait_for(lambda: check(f) == SERVING, 120, what="frontend ready with a table whose backends answer")
        assert check(f, KSERVE) == SERVING and server_ready(f)
        wait_for(lambda: infer_ok(f), 120, what="mlp served")
        # The scheduler dies: the frontend keeps its last table, stays ready and keeps serving.
        scheduler.proc.kill()
        scheduler.proc.wait(timeout=30)
        for _ in range(3):                      # across several of the frontend's readiness checks
            assert check(f) == SERVING and server_ready(f) and check(f, "liveness") == SERVING
            assert infer(f).shape == (1, 10)
            time.sleep(1.0)
        assert check(b) == SERVING
        # Its backend goes away too: nothing can serve the table's model, so not ready (still live).
        backend.proc.kill()
        backend.proc.wait(timeout=30)
        wait_for(lambda: check(f) == NOT_SERVING, 120, what="frontend not ready without a reachable backend")
        assert not server_ready(f) and check(f, "liveness") == SERVING
        # Without a scheduler to leave, SIGTERM still drains and exits cleanly.
        assert frontend.stop(timeout_s=60) == 0
    finally:
        for c in (frontend, backend, scheduler):
            if c is not None:
                c.stop()


def infer_ok(frontend: str) -> bool:
    try:
        return infer(frontend).shape == (1, 10)
    except Exception:
        return False


class Watch:
    """Every status a health Watch stream reports, collected on a thread."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.statuses: list[int] = []
        self._call = health_pb2_grpc.HealthStub(self.channel).Watch(health_pb2.HealthCheckRequest(service=""))
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            for reply in self._call:
                self.statuses.append(reply.status)
        except grpc.RpcError:
            pass

    def close(self) -> None:
        self._call.cancel()
        self.channel.close()


def test_sigterm_turns_not_serving_first_and_finishes_requests_in_flight(tmp_path):
    scheduler = launch(SchedulerConfig(listen="127.0.0.1:0", data_dir=tmp_path / "db"), env=_env())
    backend = frontend = None
    try:
        s = scheduler.wait_ready(60)
        # each request takes a second on the device, one at a time
        upload(tmp_path, s, latency_ms=1000.0, max_batch=1)
        backend = launch(BackendConfig(scheduler=s, listen="127.0.0.1:0", device=f"emulated:{DEVICE}"), env=_env())
        frontend = launch(FrontendConfig(scheduler=s, listen="127.0.0.1:0", drain_grace_s=30), env=_env())
        b, f = backend.wait_ready(60), frontend.wait_ready(60)
        wait_for(lambda: check(f) == SERVING, 120, what="frontend ready")
        wait_for(lambda: infer_ok(f), 120, what="mlp served")

        watch = Watch(f)
        wait_for(lambda: watch.statuses == [SERVING], 120, what="watch sees SERVING")
        results: list = []
        senders = [threading.Thread(target=lambda: results.append(infer(f))) for _ in range(2)]
        for sender in senders:
            sender.start()
        # one request runs on the device and one waits behind it: both are in flight at the signal
        wait_for(lambda: queued(b) == 1, 120, what="a request queued at the backend")
        frontend.signal(15)
        wait_for(lambda: NOT_SERVING in watch.statuses, 120, what="frontend NOT_SERVING after SIGTERM")
        for sender in senders:
            sender.join(timeout=60)
        assert [r.shape for r in results] == [(1, 10), (1, 10)]     # the requests in flight were answered
        assert frontend.proc.wait(timeout=60) == 0
        watch.close()

        watch = Watch(b)
        wait_for(lambda: watch.statuses == [SERVING], 120, what="backend watch sees SERVING")
        backend.signal(15)
        wait_for(lambda: NOT_SERVING in watch.statuses, 120, what="backend NOT_SERVING after SIGTERM")
        assert backend.proc.wait(timeout=60) == 0
        watch.close()
    finally:
        for c in (frontend, backend, scheduler):
            if c is not None:
                c.stop()


def test_a_draining_frontend_serves_the_calls_that_still_come_then_refuses_them(tmp_path):
    """A client pinned to a frontend (no health-based balancing) keeps sending through its SIGTERM:
    the calls that come after NOT_SERVING are served while they keep coming, then refused with
    UNAVAILABLE once the frontend stops; none is lost."""
    scheduler = launch(SchedulerConfig(listen="127.0.0.1:0", data_dir=tmp_path / "db"), env=_env())
    backend = frontend = None
    try:
        s = scheduler.wait_ready(60)
        upload(tmp_path, s, latency_ms=2.0)
        backend = launch(BackendConfig(scheduler=s, listen="127.0.0.1:0", device=f"emulated:{DEVICE}"), env=_env())
        frontend = launch(FrontendConfig(scheduler=s, listen="127.0.0.1:0", drain_grace_s=30), env=_env())
        backend.wait_ready(60)
        f = frontend.wait_ready(60)
        wait_for(lambda: infer_ok(f), 120, what="mlp served")
        watch = Watch(f)
        wait_for(lambda: watch.statuses == [SERVING], 120, what="watch sees SERVING")
        client = grpcclient.InferenceServerClient(f)
        frontend.signal(15)
        wait_for(lambda: NOT_SERVING in watch.statuses, 120, what="frontend NOT_SERVING after SIGTERM")
        served_after, statuses = 0, []
        while frontend.proc.poll() is None and len(statuses) < 10_000:
            try:
                client.infer("mlp", [_input()], client_timeout=30)
                served_after += 1
            except InferenceServerException as exc:
                statuses.append(exc.status())
                time.sleep(0.01)
        assert frontend.proc.wait(timeout=60) == 0
        # Calls came without a pause of 0.2 s for as long as the frontend served on (2 s at most).
        assert served_after >= 3, (served_after, statuses)
        # Then refused. The one call that crosses the stop's instant may be cancelled by gRPC's own stop
        # (it cancels calls that reach it then): this client has one call in flight at a time.
        assert statuses and set(statuses) <= {"StatusCode.UNAVAILABLE", "StatusCode.CANCELLED"}, statuses
        assert statuses.count("StatusCode.CANCELLED") <= 1, statuses
        client.close()
        watch.close()
    finally:
        for c in (frontend, backend, scheduler):
            if c is not None:
                c.stop()
