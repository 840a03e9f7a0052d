"""Model versions through the KServe API, as a Triton user manages them: a repository whose config.pbtxt
serves two versions (two MLPs with different weights), reached by version over gRPC and HTTP with
tritonclient; metadata, readiness, configs, statistics, the repository index and the metrics per
version; unknown versions refused naming them; a policy change that unloads a version."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from common.sample_models import mlp_small, model_bytes
from harness.prometheus import scrape
from tests.components import start_cluster, wait_for
from tests.conftest import nexus_cli

pytestmark = pytest.mark.slow

MODEL = "vmlp"
VERSIONS = {1: mlp_small(), 2: mlp_small(hidden=32)}       # same inputs and outputs, other weights
CONFIG = 'version_policy: {{ {policy} }}\nparameters {{ key: "slo_ms" value {{ string_value: "500" }} }}\n'
X = np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32)
TIMEOUT_US = 20_000_000      # KServe 'timeout' parameter: generous, CI machines are slow and shared


def _repository(root: pathlib.Path, policy: str, name: str = MODEL) -> pathlib.Path:
    for version, model in VERSIONS.items():
        (root / name / str(version)).mkdir(parents=True, exist_ok=True)
        (root / name / str(version) / "model.onnx").write_bytes(model_bytes(model))
    (root / name / "config.pbtxt").write_text(CONFIG.format(policy=policy))
    return root


@pytest.fixture(scope="module")
def expected():
    """Each version's output for X, from ONNX Runtime directly."""
    out = {}
    for version, model in VERSIONS.items():
        session = ort.InferenceSession(model_bytes(model), providers=["CPUExecutionProvider"])
        out[version] = session.run(None, {"input": X})[0]
    assert not np.allclose(out[1], out[2])
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A cluster serving versions 1 and 2 of MODEL (version_policy all), imported from a repository."""
    work = tmp_path_factory.mktemp("versions")
    cluster = start_cluster(work / "cluster", 1, "cpu")
    try:
        repo = _repository(work / "repo", "all { }")
        done = nexus_cli("models", "import", str(repo), "--scheduler", cluster.scheduler.address)
        assert done.returncode == 0, done.stderr
        assert "vmlp: version 1, onnxruntime, SLO 500 ms: uploaded" in done.stdout
        assert "vmlp: version 2, onnxruntime, SLO 500 ms: uploaded" in done.stdout
        with grpcclient.InferenceServerClient(cluster.frontend.address) as client:
            wait_for(lambda: client.is_model_ready(MODEL, "1") and client.is_model_ready(MODEL, "2"), 180,
                     "both versions ready")
        cluster.repo = repo
        yield cluster
    finally:
        cluster.stop()


def _grpc_infer(client, version: str = ""):
    x = grpcclient.InferInput("input", list(X.shape), "FP32")
    x.set_data_from_numpy(X)
    return client.infer(MODEL, [x], model_version=version, timeout=TIMEOUT_US, client_timeout=60)


def _http_infer(client, version: str = ""):
    x = httpclient.InferInput("input", list(X.shape), "FP32")
    x.set_data_from_numpy(X)
    return client.infer(MODEL, [x], model_version=version, timeout=TIMEOUT_US)




def test_each_version_is_reached_by_its_number_and_no_version_means_the_newest(served, expected):
    with grpcclient.InferenceServerClient(served.frontend.address) as client:
        newest = _grpc_infer(client)
        assert newest.get_response().model_version == "2"
        np.testing.assert_allclose(newest.as_numpy("logits"), expected[2], rtol=1e-4, atol=1e-5)
        for version in (1, 2):
            answer = _grpc_infer(client, str(version))
            assert answer.get_response().model_version == str(version)
            np.testing.assert_allclose(answer.as_numpy("logits"), expected[version], rtol=1e-4, atol=1e-5)
        for bad in ("7", "x"):
            with pytest.raises(InferenceServerException) as info:
                _grpc_infer(client, bad)
            assert info.value.status() == "StatusCode.NOT_FOUND"
            assert f"model 'vmlp' has no version '{bad}' (its versions: 1, 2)" in info.value.message()
        meta = client.get_model_metadata(MODEL, as_json=True)
        assert meta["versions"] == ["1", "2"]
        assert client.is_model_ready(MODEL, "1") and not client.is_model_ready(MODEL, "3")
        config = client.get_model_config(MODEL, "1", as_json=True)["config"]
        assert config["name"] == MODEL and "all" in config["version_policy"]
        with pytest.raises(InferenceServerException, match="has no version '3'"):
            client.get_model_config(MODEL, "3")
    with httpclient.InferenceServerClient(served.frontend.info["http"]) as client:
        for version in ("", "1", "2"):
            answer = _http_infer(client, version)
            assert answer.get_response()["model_version"] == (version or "2")
            np.testing.assert_allclose(answer.as_numpy("logits"), expected[int(version or 2)], rtol=1e-4, atol=1e-5)
        with pytest.raises(InferenceServerException) as info:
            _http_infer(client, "9")
        assert info.value.status() == "404" and "has no version '9'" in info.value.message()
        assert client.get_model_metadata(MODEL, "1")["versions"] == ["1", "2"]
        assert client.is_model_ready(MODEL, "2") and not client.is_model_ready(MODEL, "9")


def test_statistics_metrics_and_the_index_are_per_version(served):
    with grpcclient.InferenceServerClient(served.frontend.address) as client:
        before = {s["version"]: int(s["inference_stats"]["success"].get("count", 0))
                  for s in client.get_inference_statistics(MODEL, as_json=True)["model_stats"]}
        assert set(before) == {"1", "2"}
        for _ in range(3):
            _grpc_infer(client, "1")
        _grpc_infer(client)
        after = {s["version"]: int(s["inference_stats"]["success"].get("count", 0))
                 for s in client.get_inference_statistics(MODEL, as_json=True)["model_stats"]}
        assert (after["1"] - before["1"], after["2"] - before["2"]) == (3, 1)
        one = client.get_inference_statistics(MODEL, "1", as_json=True)["model_stats"]
        assert [(s["name"], s["version"]) for s in one] == [(MODEL, "1")]
        everything = client.get_inference_statistics(as_json=True)["model_stats"]
        assert {(MODEL, "1"), (MODEL, "2")} <= {(s["name"], s["version"]) for s in everything}
        with pytest.raises(InferenceServerException, match="has no version '5'"):
            client.get_inference_statistics(MODEL, "5")
        index = {(m["name"], m["version"]): m for m in client.get_model_repository_index(as_json=True)["models"]}
        assert index[(MODEL, "1")]["state"] == index[(MODEL, "2")]["state"] == "READY"
    metrics = scrape(served.frontend.info["metrics"], timeout_s=30)
    for version, n in after.items():
        assert metrics.value("nv_inference_request_success", model=MODEL, version=version) == n


def test_a_policy_that_drops_a_version_unloads_it(served, expected, tmp_path):
    name = "vdrop"          # a model of its own: the other tests' model keeps both versions
    repo = _repository(tmp_path, "all { }", name)
    assert nexus_cli("models", "import", str(repo), "--scheduler", served.scheduler.address).returncode == 0
    with grpcclient.InferenceServerClient(served.frontend.address) as client:
        wait_for(lambda: client.is_model_ready(name, "1") and client.is_model_ready(name, "2"), 180, "both ready")
        _repository(repo, "latest { num_versions: 1 }", name)
        done = nexus_cli("models", "import", str(repo), "--scheduler", served.scheduler.address)
        assert done.returncode == 0, done.stderr
        assert f"{name}: version 2, onnxruntime, SLO 500 ms: uploaded" in done.stdout and "version 1" not in done.stdout
        wait_for(lambda: not client.is_model_ready(name, "1"), 60, "version 1 unloaded")
        assert client.get_model_metadata(name, as_json=True)["versions"] == ["2"]
        x = grpcclient.InferInput("input", list(X.shape), "FP32")
        x.set_data_from_numpy(X)
        with pytest.raises(InferenceServerException) as info:
            client.infer(name, [x], model_version="1", timeout=TIMEOUT_US, client_timeout=60)
        assert info.value.status() == "StatusCode.UNAVAILABLE" and "not loaded" in info.value.message()
        np.testing.assert_allclose(client.infer(name, [x], timeout=TIMEOUT_US).as_numpy("logits"), expected[2],
                                   rtol=1e-4, atol=1e-5)
        index = {(m["name"], m["version"]): m for m in client.get_model_repository_index(as_json=True)["models"]}
        assert index[(name, "1")]["state"] == "UNAVAILABLE" and index[(name, "2")]["state"] == "READY"
    wait_for(lambda: not served.serving(name), 30, "version 1 gone from the backends")
    assert served.serving(f"{name}:2")
    listed = json.loads(nexus_cli("models", "list", "--json", "--scheduler", served.scheduler.address).stdout)
    mine = {m["version"]: m for m in listed if m["name"] == name}
    assert (mine[1]["loaded"], mine[2]["loaded"]) == (False, True)
    assert mine[2]["version_policy"] == "latest { num_versions: 1 }"


def test_upload_refuses_a_version_that_is_no_positive_integer(served):
    for bad in ("0", "-3", "two"):
        done = nexus_cli("models", "upload", str(served.repo / MODEL / "1" / "model.onnx"), "--name", MODEL,
                         "--version", bad, "--scheduler", served.scheduler.address)
        assert done.returncode == 2 and f"--version: must be a positive integer, got '{bad}'" in done.stderr
