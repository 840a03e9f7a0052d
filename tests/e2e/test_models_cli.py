"""Model uploads through the `nexus models` CLI: served when valid, refused cleanly when not, durable."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient

from common.sample_models import backbone_variant, mlp_small, model_bytes
from nexus.launcher import Child
from tests.conftest import nexus_cli

pytestmark = pytest.mark.slow


class Scheduler:
    """A lone `nexus scheduler` process on a free port."""

    def __init__(self, data_dir, *extra: str) -> None:
        self.child = Child("scheduler", ["scheduler", "--listen", "127.0.0.1:0", "--data-dir", str(data_dir), *extra],
                           dict(os.environ, NEXUS_LOG="WARNING"))
        self.proc = self.child.proc
        self.address = self.child.wait_ready(60)

    def stop(self) -> None:
        assert self.child.stop(timeout_s=30) == 0


def _list(address: str) -> list[dict]:
    result = nexus_cli("models", "list", "--scheduler", address, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture()
def small_limit_scheduler(tmp_path):
    s = Scheduler(tmp_path / "db", "--max-upload-mb", "1")
    yield s
    s.stop()


def test_bad_uploads_are_refused_with_a_clear_message_and_register_nothing(small_limit_scheduler, tmp_path):
    address = small_limit_scheduler.address
    corrupt = tmp_path / "corrupt.onnx"
    corrupt.write_bytes(model_bytes(mlp_small())[:-57])
    not_onnx = tmp_path / "notes.onnx"
    not_onnx.write_text("this is not a model\n" * 20)
    oversized = tmp_path / "big.onnx"
    oversized.write_bytes(model_bytes(backbone_variant(3)))   # ~5 MB > the 1 MB limit
    for path, expected in ((corrupt, "ONNX"), (not_onnx, "ONNX"), (oversized, "upload limit")):
        result = nexus_cli("models", "upload", str(path), "--name", path.stem, "--scheduler", address)
        assert result.returncode == 2, (path, result.stdout, result.stderr)
        assert result.stderr.startswith("nexus models upload: error:"), result.stderr
        assert expected in result.stderr, result.stderr
        assert path.stem in result.stderr or "limit" in result.stderr
    missing = nexus_cli("models", "upload", str(tmp_path / "absent.onnx"), "--name", "x", "--scheduler", address)
    assert missing.returncode == 2 and "no such file" in missing.stderr
    bad_name = tmp_path / "ok.onnx"
    bad_name.write_bytes(model_bytes(mlp_small()))
    result = nexus_cli("models", "upload", str(bad_name), "--name", "bad name!", "--scheduler", address)
    assert result.returncode == 2 and "invalid model name" in result.stderr
    result = nexus_cli("models", "upload", str(bad_name), "--name", "m", "--expected-rate-rps", "-5",
                       "--scheduler", address)
    assert result.returncode == 2 and "expected_rate_rps must be a rate of at least 0" in result.stderr
    assert _list(address) == []
    blobs = list((tmp_path / "db" / "blobs").rglob("*"))
    assert not [b for b in blobs if b.is_file()], blobs
    assert not list((tmp_path / "db" / "tmp").iterdir())


def test_scheduler_restarted_on_the_same_data_dir_knows_every_model(tmp_path):
    first = Scheduler(tmp_path / "db")
    model = tmp_path / "m.onnx"
    model.write_bytes(model_bytes(mlp_small()))
    for name, rate in (("alpha", "200"), ("beta", "0")):
        result = nexus_cli("models", "upload", str(model), "--name", name, "--slo-ms", "40",
                           "--expected-rate-rps", rate, "--scheduler", first.address)
        assert result.returncode == 0, result.stderr
        # no backend to serve it: the upload does not wait for one, and says so
        assert "is not served yet: no backend is registered" in result.stderr, result.stderr
    before = {m["name"]: m for m in _list(first.address)}
    first.stop()
    second = Scheduler(tmp_path / "db")
    try:
        after = {m["name"]: m for m in _list(second.address)}
    finally:
        second.stop()
    assert set(after) == {"alpha", "beta"}
    for name in after:
        assert after[name]["sha256"] == before[name]["sha256"]
        assert after[name]["slo_ms"] == 40
        assert after[name]["loaded"]
    assert (after["alpha"]["expected_rate_rps"], after["beta"]["expected_rate_rps"]) == (200.0, 0.0)


def test_unreachable_scheduler_is_a_clear_error(tmp_path):
    model = tmp_path / "m.onnx"
    model.write_bytes(model_bytes(mlp_small()))
    result = nexus_cli("models", "upload", str(model), "--name", "m", "--scheduler", "127.0.0.1:1")
    assert result.returncode == 2 and "cannot reach the scheduler" in result.stderr


def test_uploaded_model_is_served(cluster, tmp_path):
    variant = backbone_variant(4)
    path = tmp_path / "variant4.onnx"
    path.write_bytes(model_bytes(variant))
    result = nexus_cli("models", "upload", str(path), "--name", "variant4", "--slo-ms", "200",
                       "--scheduler", cluster.scheduler)
    assert result.returncode == 0, result.stderr
    # The upload returned once the model was servable, with the time it took and the way there.
    ready = re.search(r"variant4 version 1 is ready: ([0-9.]+) s after its upload \(.*: (.*)\)", result.stdout)
    assert ready, result.stdout
    stages = dict(part.split() for part in ready.group(2).split(", "))
    assert list(stages) == ["stored", "profiled", "planned", "loaded", "routed"], stages
    times = [float(t) for t in stages.values()]
    assert times == sorted(times) and times[-1] == pytest.approx(float(ready.group(1)), abs=0.011)
    [listed] = [m for m in _list(cluster.scheduler) if m["name"] == "variant4"]
    assert listed["state"] == "ready" and listed["ready_after_s"] == pytest.approx(float(ready.group(1)), abs=0.011)
    client = grpcclient.InferenceServerClient(cluster.frontend)
    try:
        assert client.is_model_ready("variant4")        # at once: no polling after the upload
        data = np.random.default_rng(3).standard_normal((2, 3, 64, 64)).astype(np.float32)
        tensor = grpcclient.InferInput("input", list(data.shape), "FP32")
        tensor.set_data_from_numpy(data)
        got = client.infer("variant4", [tensor]).as_numpy("logits")
    finally:
        client.close()
    expected = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"input": data})[0]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_a_pinned_profile_is_uploaded_pinned_and_errors_are_clear(small_limit_scheduler, tmp_path):
    import grpc

    from common.pb import control, control_grpc
    from common.profile import Profile

    address = small_limit_scheduler.address
    model = tmp_path / "m.onnx"
    model.write_bytes(model_bytes(mlp_small()))
    profile = tmp_path / "t4.json"
    profile.write_text(Profile.linear(1.0, 2.0, 8, device_type="t4").to_json())
    alone = nexus_cli("models", "upload", str(model), "--name", "m", "--pin-profile", "--scheduler", address)
    assert alone.returncode == 2 and "--pin-profile needs --profile" in alone.stderr
    broken = tmp_path / "broken.json"
    broken.write_text('{"device_type": "t4", "profile": [{"batch": 2, "latency_ms": 1}]}')
    bad = nexus_cli("models", "upload", str(model), "--name", "m", "--profile", str(broken), "--pin-profile",
                    "--scheduler", address)
    assert bad.returncode == 2 and "invalid profile" in bad.stderr and "expected 1" in bad.stderr
    ok = nexus_cli("models", "upload", str(model), "--name", "m", "--profile", str(profile), "--pin-profile",
                   "--scheduler", address)
    assert ok.returncode == 0, ok.stderr
    with grpc.insecure_channel(address) as channel:
        status = control_grpc.SchedulerStub(channel).GetStatus(control.StatusRequest(), timeout=10)
    [p] = [p for p in status.profiles if p.model == "m"]
    assert (p.device_type, p.in_use, p.pinned) == ("t4", "table", True)
    assert list(p.table.batch) == [1, 2, 4, 8] and p.table.latency_ms[-1] == pytest.approx(10.0)
    assert not p.HasField("measured") and p.samples == 0


def test_no_wait_returns_at_once_and_wait_errors_are_precise(small_limit_scheduler, tmp_path):
    import grpc

    from common.pb import control, control_grpc

    address = small_limit_scheduler.address
    model = tmp_path / "m.onnx"
    model.write_bytes(model_bytes(mlp_small()))
    quick = nexus_cli("models", "upload", str(model), "--name", "m", "--no-wait", "--scheduler", address)
    assert quick.returncode == 0 and "is ready" not in quick.stdout and not quick.stderr, quick
    stored = nexus_cli("models", "upload", str(model), "--name", "s", "--no-load", "--scheduler", address)
    assert stored.returncode == 0, stored.stderr
    states = {m["name"]: (m["state"], m["state_reason"]) for m in _list(address)}
    assert states == {"m": ("loading", "no backend is registered"), "s": ("stored", "stored, not loaded")}
    bad_timeout = nexus_cli("models", "upload", str(model), "--name", "m", "--wait-timeout-s", "-1",
                            "--scheduler", address)
    assert bad_timeout.returncode == 2 and "0 or more" in bad_timeout.stderr
    with grpc.insecure_channel(address) as channel:
        stub = control_grpc.SchedulerStub(channel)
        for request, code, words in (
                (control.WaitReadyRequest(name="absent"), grpc.StatusCode.NOT_FOUND, "no model 'absent'"),
                (control.WaitReadyRequest(name="m", version=7), grpc.StatusCode.NOT_FOUND,
                 "no version 7 of model 'm'"),
                (control.WaitReadyRequest(name="m", timeout_s=-1), grpc.StatusCode.INVALID_ARGUMENT, "negative")):
            with pytest.raises(grpc.RpcError) as err:
                stub.WaitModelReady(request, timeout=10)
            assert err.value.code() == code and words in err.value.details(), err.value
        # a stored model waits for nothing: it answers at once with its state
        desc = stub.WaitModelReady(control.WaitReadyRequest(name="s", timeout_s=60), timeout=10)
        assert desc.serving_state == control.STORED
