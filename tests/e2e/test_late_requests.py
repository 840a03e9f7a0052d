"""A model that serves its late requests against one that drops them, on real processes: an emulated
backend whose batches take 20x its table (every request is late), a scheduler that does not fold the
measurements in (the plan keeps the table), and a frontend. The dropping model answers
DEADLINE_EXCEEDED; the serving one answers every request late; its client's own deadline still
holds; the CLI sets and shows the setting; a garbage value is refused.
"""

from __future__ import annotations

import json
import time

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from common.pb import control, control_grpc
from common.profile import Profile
from common.sample_models import mlp_small, model_bytes
from harness.cluster import Cluster
from tests.components import wait_for
from tests.conftest import nexus_cli

pytestmark = pytest.mark.slow

SLO_MS = 50.0
TABLE = Profile.linear(1.0, 4.0, 16, memory_base_mb=50, device_type="t4")    # l(1) = 5 ms; served: 100 ms
FACTOR = 20.0


def _infer(client, model: str, timeout_s: float | None = None, timeout_param_us: int | None = None):
    """(status, seconds): "OK" or the error's status. ``timeout_s``: the gRPC deadline;
    ``timeout_param_us``: the request's ``timeout`` parameter."""
    inp = grpcclient.InferInput("input", [1, 64], "FP32")
    inp.set_data_from_numpy(np.ones((1, 64), np.float32))
    t0 = time.monotonic()
    try:
        client.infer(model, [inp], client_timeout=timeout_s, timeout=timeout_param_us)
        return "OK", time.monotonic() - t0
    except InferenceServerException as exc:
        return str(exc.status()), time.monotonic() - t0


def test_late_requests_are_served_or_dropped_as_the_model_says(tmp_path):
    with Cluster(tmp_path, backends=1, device="emulated:t4",
                 scheduler={"profile_update_s": 3600.0, "spare_replicas": False},
                 backend={"emulated_latency_factor": FACTOR}).start() as c:
        profile = tmp_path / "t4.json"
        profile.write_text(TABLE.to_json())
        model = tmp_path / "mlp.onnx"
        model.write_bytes(model_bytes(mlp_small()))
        for name, extra in (("drops", []), ("late", ["--late-requests", "serve"])):
            up = nexus_cli("models", "upload", str(model), "--name", name, "--profile", str(profile),
                           "--slo-ms", f"{SLO_MS:g}", "--scheduler", c.scheduler.address, *extra)
            assert up.returncode == 0, up.stderr
        client = grpcclient.InferenceServerClient(c.frontend.address)
        for name in ("drops", "late"):       # ready (an inference of "drops" cannot succeed)
            wait_for(lambda: client.is_model_ready(name), timeout_s=90, what=f"{name} ready")
        listed = nexus_cli("models", "list", "--json", "--scheduler", c.scheduler.address)
        assert {m["name"]: m["late_requests"] for m in json.loads(listed.stdout)} == {"drops": "drop", "late": "serve"}

        late = [_infer(client, "late") for _ in range(4)]
        assert [s for s, _ in late] == ["OK"] * 4, late
        assert all(t > SLO_MS / 1000 for _, t in late)          # every answer came after the SLO
        drops = [_infer(client, "drops") for _ in range(4)]
        assert [s for s, _ in drops] == ["StatusCode.DEADLINE_EXCEEDED"] * 4, drops
        # A 'timeout' parameter is the request's SLO: served late too; the other model drops it.
        assert _infer(client, "late", timeout_param_us=int(SLO_MS * 1000))[0] == "OK"
        assert _infer(client, "drops", timeout_param_us=int(SLO_MS * 1000))[0] == "StatusCode.DEADLINE_EXCEEDED"
        # The client's gRPC deadline holds for a model that serves late, as for any other.
        status, took = _infer(client, "late", timeout_s=0.06)
        assert status == "StatusCode.DEADLINE_EXCEEDED"
        assert _infer(client, "late")[0] == "OK"                # and the model serves on

        with grpc.insecure_channel(c.scheduler.address) as ch:
            header = control.UploadHeader(name="late", profile_json=TABLE.to_json(), slo_ms=SLO_MS, load=True,
                                          late_requests=7)
            with pytest.raises(grpc.RpcError) as err:
                control_grpc.SchedulerStub(ch).UploadModel(
                    iter([control.UploadChunk(header=header), control.UploadChunk(data=model.read_bytes())]),
                    timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "unknown late_requests 7" in err.value.details()


def test_the_cli_refuses_an_unknown_setting(tmp_path):
    model = tmp_path / "mlp.onnx"
    model.write_bytes(model_bytes(mlp_small()))
    out = nexus_cli("models", "upload", str(model), "--name", "m", "--late-requests", "maybe",
                    "--scheduler", "127.0.0.1:1")
    assert out.returncode == 2 and "--late-requests: invalid choice: 'maybe'" in out.stderr
