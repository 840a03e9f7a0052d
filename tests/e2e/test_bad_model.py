"""A model file that passes upload validation but that ONNX Runtime cannot load.

The model ends UNAVAILABLE with the runtime's reason after a bounded number of attempts (spread
over the backends), and the other models keep serving. Both ways in are covered: a model without
a profile fails while being profiled, one uploaded with a profile fails while loading.
"""

from __future__ import annotations

import json
import time

import grpc
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from common import grpc_util
from common.pb import kserve, kserve_grpc
from common.profile import Profile
from common.sample_models import mlp_small, model_bytes
from globalsched.state.load_failures import MAX_LOAD_ATTEMPTS, LoadFailures
from tests.components import wait_for
from tests.conftest import nexus_cli, start_serve


def softmax_out_of_range(axis: int) -> bytes:
    """Valid ONNX (the checker accepts it) whose Softmax axis is out of range: ONNX Runtime refuses it."""
    graph = helper.make_graph([helper.make_node("Softmax", ["input"], ["probs"], axis=axis)], "bad",
                              [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 8])],
                              [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["batch", 8])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model.SerializeToString()


def test_load_failures_allow_a_bounded_number_of_attempts_per_model_and_device_type():
    failures = LoadFailures(max_attempts=3)
    assert failures.record("my_model", "cpu", "be-1", "bad axis")
    assert failures.record("my_model", "cpu", "be-2", "bad axis")
    assert not failures.exhausted("my_model", "cpu") and failures.reason("my_model") == ""
    assert not failures.record("my_model", "cpu", "be-1", "bad axis")
    assert not failures.record("my_model", "cpu", "be-3", "bad axis")      # spent: not counted again
    assert failures.exhausted("my_model", "cpu") and failures.tried("my_model", "cpu") == {"be-1", "be-2"}
    assert failures.reason("my_model") == "cannot load on cpu (3 attempts on 2 backends): bad axis"
    assert failures.reason_on("my_model", "cpu") == failures.reason("my_model")
    assert failures.reason_on("my_model", "t4") == ""
    assert failures.exhausted_types("my_model") == {"cpu"}
    # Keyed by the model, not the file: a model with the same bytes has its own attempts.
    assert failures.exhausted_types("same_bytes") == frozenset() and not failures.exhausted("same_bytes", "cpu")
    failures.forget("my_model")                             # a new upload or an explicit load starts afresh
    assert not failures.exhausted("my_model", "cpu") and failures.reason("my_model") == ""


@pytest.mark.slow
def test_a_model_onnxruntime_cannot_load_is_unavailable_with_the_reason_and_others_keep_serving(tmp_path):
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        cluster = start_serve(tmp_path / "data", "--no-samples", "--backends", "2", "--threads", "1", stderr=log)
    try:
        profile = tmp_path / "profile.json"
        profile.write_text(Profile.linear(0.2, 1.0, 32, memory_base_mb=5, device_type="cpu").to_json())
        files = {"mlp": model_bytes(mlp_small()), "bad_profiled": softmax_out_of_range(7),
                 "bad_loaded": softmax_out_of_range(9)}
        for name, data in files.items():
            path = tmp_path / f"{name}.onnx"
            path.write_bytes(data)
            extra = [] if name == "bad_profiled" else ["--profile", str(profile)]
            up = nexus_cli("models", "upload", str(path), "--name", name, "--slo-ms", "1000", *extra,
                           "--scheduler", cluster.scheduler)
            # The checker accepts all three; the upload waits until each can serve, or says why not.
            if name == "mlp":
                assert up.returncode == 0 and "mlp version 1 is ready" in up.stdout, up
            else:
                assert up.returncode == 1, up
                assert f"{name} version 1 cannot be served: cpu:" in up.stderr and "axis" in up.stderr, up.stderr
                assert f"({MAX_LOAD_ATTEMPTS} attempts on" in up.stderr, up.stderr
        # A query with a stage on the model that cannot load: it must not keep the scheduler retrying.
        query = tmp_path / "bad_query.json"
        query.write_text(json.dumps({
            "name": "bad_query", "slo_ms": 1000, "inputs": [{"name": "x", "datatype": "FP32", "shape": [8]}],
            "stages": [{"name": "s", "model": "bad_loaded", "inputs": {"input": "x"}}],
            "outputs": {"probs": "s.probs"}}))
        registered = nexus_cli("queries", "register", str(query), "--scheduler", cluster.scheduler)
        assert registered.returncode == 0, registered.stderr

        with grpc_util.channel(cluster.frontend) as channel:
            stub = kserve_grpc.GRPCInferenceServiceStub(channel)
            deadline = time.monotonic() + 180
            index = {}
            while time.monotonic() < deadline:
                index = {m.name: m for m in stub.RepositoryIndex(kserve.RepositoryIndexRequest(), timeout=10).models}
                if (index.get("mlp") and index["mlp"].state == "READY"
                        and all("attempts on" in getattr(index.get(n), "reason", "") for n in files if n != "mlp")):
                    break
                time.sleep(0.3)
            for name in ("bad_profiled", "bad_loaded"):
                entry = index[name]
                assert entry.state == "UNAVAILABLE", entry
                assert f"({MAX_LOAD_ATTEMPTS} attempts on" in entry.reason and "axis" in entry.reason, entry.reason
                assert not stub.ModelReady(kserve.ModelReadyRequest(name=name), timeout=10).ready
            # Profiling tried a backend not tried before while there was one.
            assert "attempts on 2 backends" in index["bad_profiled"].reason, index["bad_profiled"].reason

            bad = kserve.ModelInferRequest(model_name="bad_profiled")
            bad.inputs.add(name="input", datatype="FP32", shape=[1, 8])
            bad.raw_input_contents.append(np.ones((1, 8), np.float32).tobytes())
            with pytest.raises(grpc.RpcError) as err:
                stub.ModelInfer(bad, timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "axis" in err.value.details()

            good = kserve.ModelInferRequest(model_name="mlp")
            good.inputs.add(name="input", datatype="FP32", shape=[2, 64])
            good.raw_input_contents.append(np.ones((2, 64), np.float32).tobytes())
            assert stub.ModelInfer(good, timeout=30).outputs[0].shape == [2, 10]
            assert not stub.ModelReady(kserve.ModelReadyRequest(name="bad_query"), timeout=10).ready
        logs = log_path.read_text()
        assert logs.count("profiling bad_profiled on") == MAX_LOAD_ATTEMPTS   # bounded: no retry loop
        # The model and the query stage share the model's attempts; one push may try both at once.
        assert MAX_LOAD_ATTEMPTS <= logs.count("cannot load bad_loaded") + logs.count("cannot load bad_query/s") \
            <= 2 * MAX_LOAD_ATTEMPTS
        assert "Traceback" not in logs
        # Triton's repository load answers once the model is ready, or with why it cannot be, which
        # it knows once the fresh attempts an explicit load grants are spent (not at a timeout).
        with grpc_util.channel(cluster.frontend, cluster.creds) as channel:
            stub = kserve_grpc.GRPCInferenceServiceStub(channel)
            stub.RepositoryModelLoad(kserve.RepositoryModelLoadRequest(model_name="mlp"), timeout=60)
            with pytest.raises(grpc.RpcError) as err:
                stub.RepositoryModelLoad(kserve.RepositoryModelLoadRequest(model_name="bad_loaded"), timeout=60)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
            assert "'bad_loaded' cannot be served: cpu:" in err.value.details() and "axis" in err.value.details()
    finally:
        cluster.stop()


@pytest.mark.slow
def test_a_model_no_device_type_can_profile_is_reported_and_one_with_the_same_bytes_and_a_profile_serves(tmp_path):
    """Issue 20, items 2 and 3: on emulated t4 backends, a model without a t4 profile cannot be
    profiled there (an emulated GPU executes a given profile). It is reported as needing one, with
    that advice, without spending load attempts; a model with the same bytes and its own t4 profile
    is placed and serves."""
    from common.pb import control, control_grpc
    from tests.components import infer_request, start_cluster as start_components, wait_ready

    cluster = start_components(tmp_path / "db", 2, "emulated:t4")
    try:
        path = tmp_path / "softmax.onnx"
        path.write_bytes(softmax_out_of_range(1))          # axis 1 is in range: a model, not a sample one
        profile = tmp_path / "t4.json"
        profile.write_text(Profile.linear(0.1, 1.0, 32, memory_base_mb=5, device_type="t4").to_json())
        # The upload says at once that the model cannot be served, and what to do; with a profile it serves.
        up = nexus_cli("models", "upload", str(path), "--name", "my_model", "--slo-ms", "200",
                       "--scheduler", cluster.scheduler.address)
        assert up.returncode == 1 and "my_model version 1 cannot be served: t4:" in up.stderr, up
        assert "--profile for device type 't4'" in up.stderr
        up = nexus_cli("models", "upload", str(path), "--name", "slow_model", "--slo-ms", "200", "--profile",
                       str(profile), "--scheduler", cluster.scheduler.address)
        assert up.returncode == 0 and "slow_model version 1 is ready" in up.stdout, up
        wait_ready(cluster.frontend.address, "slow_model")
        with grpc.insecure_channel(cluster.scheduler.address) as channel:
            admin = control_grpc.SchedulerStub(channel)
            deadline = time.monotonic() + 60
            states = {}
            while time.monotonic() < deadline:
                models = {m.name: m for m in admin.ListModels(control.ListModelsRequest(), timeout=10).models}
                states = {n: {d.device_type: d for d in m.device_types} for n, m in models.items()}
                if states["my_model"]["t4"].state == control.NEEDS_PROFILE:
                    break
                time.sleep(0.2)
        mine = states["my_model"]["t4"]
        assert mine.state == control.NEEDS_PROFILE, mine
        assert "cannot measure one" in mine.reason and "--profile for device type 't4'" in mine.reason
        assert states["slow_model"]["t4"].state == control.PROFILED
        with grpc.insecure_channel(cluster.frontend.address) as channel:
            stub = kserve_grpc.GRPCInferenceServiceStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.ModelInfer(infer_request("my_model", features=8), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "--profile for device type 't4'" in refused.value.details()
            assert stub.ModelInfer(infer_request("slow_model", features=8), timeout=10).outputs[0].shape == [1, 8]
    finally:
        cluster.stop()


@pytest.mark.slow
def test_nexus_serve_reports_a_model_no_device_type_can_serve_and_counts_only_the_servable_ones(tmp_path):
    """Issue 20 item 2: on emulated t4s, a repository model without a t4 profile can never be served.
    `nexus serve` says so instead of waiting its whole --ready-timeout-s for it, leaves it out of the
    models it serves, and `nexus models list` shows why per device type."""
    repo = tmp_path / "repo"
    (repo / "my_model" / "1").mkdir(parents=True)
    (repo / "my_model" / "1" / "model.onnx").write_bytes(softmax_out_of_range(1))
    (repo / "my_model" / "config.pbtxt").write_text('max_batch_size: 8\n')
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        cluster = start_serve(tmp_path / "data", "--device", "emulated:t4", "--model-repository", str(repo),
                                "--ready-timeout-s", "600", stderr=log)
    try:
        logs = log_path.read_text()
        [line] = [ln for ln in logs.splitlines() if "my_model cannot be served" in ln]
        assert "t4: an emulated device (emulated:t4) executes a given profile and cannot measure one" in line
        assert "not ready after" not in logs
        def listed(*flags: str) -> str:
            done = nexus_cli("models", "list", *flags, "--scheduler", cluster.scheduler)
            assert done.returncode == 0, done.stderr
            return done.stdout

        # (a loaded machine can drop a backend for a moment: the state is per registered device type)
        row = wait_for(lambda: next((r for r in listed().splitlines()
                                     if r.startswith("my_model ") and "t4: needs a profile" in r), None),
                       what="my_model listed as needing a t4 profile")
        assert "t4: needs a profile" in row
        mine = wait_for(lambda: next((m for m in json.loads(listed("--json"))
                                      if m["name"] == "my_model" and m["device_types"]), None),
                        what="my_model's device types in the JSON listing")
        [t4] = mine["device_types"]
        assert (t4["device_type"], t4["state"], t4["backends"]) == ("t4", "needs a profile", 1)
        assert "--profile for device type 't4'" in t4["reason"]
        with grpc_util.channel(cluster.frontend) as channel:       # the sample models serve
            stub = kserve_grpc.GRPCInferenceServiceStub(channel)
            assert stub.ModelReady(kserve.ModelReadyRequest(name="resnet18_64"), timeout=10).ready
    finally:
        cluster.stop()
