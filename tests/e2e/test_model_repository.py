"""Triton model repositories: config.pbtxt parsed with protobuf's text format, completed from and checked
against the model file, served by `nexus serve --model-repository` and `nexus models import`."""

from __future__ import annotations

import json
import pathlib
import time

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient

from nexus.model_repository import RepositoryError, read_model, read_model_versions, read_repository
from common.late_requests import LateRequests
from common.sample_models import detector_64, mlp_small, model_bytes
from tests.conftest import nexus_cli, start_serve

FULL_CONFIG = """
name: "mlp"
platform: "onnxruntime_onnx"
max_batch_size: 16
input [
  {
    name: "input"
    data_type: TYPE_FP32
    dims: [ 64 ]
  }
]
output [
  {
    name: "logits"
    data_type: TYPE_FP32
    dims: [ 10 ]
  }
]
instance_group [ { count: 2 kind: KIND_GPU gpus: [ 0 ] } ]
dynamic_batching { preferred_batch_size: [ 4, 8 ] max_queue_delay_microseconds: 100 }
parameters { key: "slo_ms" value { string_value: "40" } }
parameters { key: "expected_rate_rps" value { string_value: "20" } }
parameters { key: "late_requests" value { string_value: "serve" } }
"""


def _model(root: pathlib.Path, name: str, model, config: str | None, version: int = 1) -> pathlib.Path:
    d = root / name
    (d / str(version)).mkdir(parents=True, exist_ok=True)
    (d / str(version) / "model.onnx").write_bytes(model_bytes(model))
    if config is not None:
        (d / "config.pbtxt").write_text(config)
    return d


def _error(model_dir: pathlib.Path) -> str:
    with pytest.raises(RepositoryError) as info:
        read_model(model_dir)
    return str(info.value)


def test_full_config_is_used_and_unsupported_settings_are_named(tmp_path):
    m = read_model(_model(tmp_path, "mlp", mlp_small(), FULL_CONFIG))
    assert (m.name, m.version, m.runtime, m.slo_ms, m.max_batch_size) == ("mlp", 1, "onnxruntime", 40.0, 16)
    assert m.expected_rate_rps == 20.0 and m.late_requests is LateRequests.SERVE
    assert [(t.name, t.datatype, t.shape) for t in m.inputs] == [("input", "FP32", (64,))]
    assert [(t.name, t.datatype, t.shape) for t in m.outputs] == [("logits", "FP32", (10,))]
    text = "\n".join(m.warnings)
    assert "instance_group (KIND_GPU count 2 gpus [0]) is ignored" in text
    assert "dynamic_batching preferred_batch_size, max_queue_delay_microseconds ignored" in text


@pytest.mark.parametrize("config", [None, "", 'platform: "onnxruntime_onnx"', 'backend: "onnxruntime"\nmax_batch_size: 8'])
def test_minimal_or_missing_config_is_completed_from_the_model(tmp_path, config):
    m = read_model(_model(tmp_path, "det", detector_64(), config))
    assert m.runtime == "onnxruntime" and m.slo_ms == 0.0 and m.warnings == ()
    assert [(t.name, t.datatype, t.shape) for t in m.inputs] == [("input", "FP32", (3, 64, 64))]
    assert [(t.name, t.shape) for t in m.outputs] == [("scores", (6,)), ("crops", (6, 3, 64, 64))]


def test_full_shapes_with_max_batch_size_zero(tmp_path):
    config = 'input [ { name: "input" data_type: TYPE_FP32 dims: [ -1, 64 ] } ]'
    m = read_model(_model(tmp_path, "mlp", mlp_small(), config))
    assert m.inputs[0].shape == (64,)
    config = 'input [ { name: "input" data_type: TYPE_FP32 dims: [ 64 ] } ]'
    assert "input[0].dims [64] with max_batch_size 0" in _error(_model(tmp_path, "mlp2", mlp_small(), config))


@pytest.mark.parametrize("replace, field", [
    (("TYPE_FP32\n    dims: [ 64 ]", "TYPE_FP16\n    dims: [ 64 ]"), "input[0].data_type TYPE_FP16 ('input') contradicts "
                                                                    "the model's TYPE_FP32"),
    (("dims: [ 64 ]", "dims: [ 32 ]"), "input[0].dims [32] ('input') contradict the model's [64]"),
    (("dims: [ 10 ]", "dims: [ 10, 2 ]"), "output[0].dims [10, 2] ('logits') contradict the model's [10]"),
    (('name: "input"', 'name: "x"'), "input[0].name 'x': the model has no input of that name (its inputs: input)"),
    (('name: "mlp"', 'name: "other"'), "name 'other' contradicts the folder's name 'mlp'"),
    (('string_value: "40"', 'string_value: "fast"'), "parameters.slo_ms must be a positive number"),
    (('string_value: "20"', 'string_value: "-5"'), "parameters.expected_rate_rps must be a number of requests per "
                                                     "second, at least 0, got '-5'"),
    (('string_value: "20"', 'string_value: "lots"'), "parameters.expected_rate_rps must be a number"),
    (('string_value: "serve"', 'string_value: "later"'), "parameters.late_requests must be drop or serve, got 'later'"),
    (('platform: "onnxruntime_onnx"', 'platform: "tensorrt_plan"'), "platform 'tensorrt_plan' is not supported"),
    (('platform: "onnxruntime_onnx"', 'platform: "ensemble"'), "ensembles are not supported"),
    (("dims: [ 64 ]", "dims: [ 64 ]\n    reshape: { shape: [ 8, 8 ] }"), "input[0].reshape ('input') is not supported"),
])
def test_a_config_that_contradicts_the_model_is_refused_naming_the_field(tmp_path, replace, field):
    d = _model(tmp_path, "mlp", mlp_small(), FULL_CONFIG.replace(*replace))
    message = _error(d)
    assert message.startswith(str(d / "config.pbtxt") + ": ")
    assert field in message


def test_max_batch_size_on_a_model_without_a_batch_dimension_is_refused(tmp_path):
    model = mlp_small()
    for value in [*model.graph.input, *model.graph.output]:
        value.type.tensor_type.shape.dim[0].ClearField("dim_param")
        value.type.tensor_type.shape.dim[0].dim_value = 1
    message = _error(_model(tmp_path, "fixed", model, "max_batch_size: 8"))
    assert "max_batch_size 8 contradicts the model: 'input' has a fixed first dimension of 1" in message


@pytest.mark.parametrize("config, where, what", [
    ('name: "mlp"\nmax_batch_size: 8\ninput [ { name: "input" data_type: TYPE_FP32 dims: [ 64 ] }\n', "4:1",
     'at the end of the file: Expected ","'),    # the list is not closed: the error is at the end of the text
    ('name: "mlp"\nmax_batch_size: "eight"\n', "2:17", "max_batch_size"),
    ('name: "mlp"\n\nsequence_batching { }\n', "3:1", "unsupported setting 'sequence_batching': stateful sequence "
                                                      "batching is not supported"),
    ('name: "mlp"\nfoo_bar: 3\n', "2:1", "unsupported setting 'foo_bar'"),
])
def test_parse_errors_name_the_file_and_line(tmp_path, config, where, what):
    d = _model(tmp_path, "mlp", mlp_small(), config)
    message = _error(d)
    assert message.startswith(f"{d / 'config.pbtxt'}:{where}: "), message
    assert what in message


def test_versions_follow_the_version_policy(tmp_path):
    d = _model(tmp_path, "mlp", mlp_small(), None, version=1)
    _model(tmp_path, "mlp", mlp_small(hidden=32), None, version=3)
    _model(tmp_path, "mlp", mlp_small(hidden=16), None, version=2)

    def versions():
        return [(m.version, m.version_policy.describe()) for m in read_model_versions(d)]

    assert versions() == [(3, "latest { num_versions: 1 }")] and read_model(d).version == 3     # Triton's default
    (d / "config.pbtxt").write_text("version_policy: { latest: { num_versions: 2 } }")
    assert versions() == [(2, "latest { num_versions: 2 }"), (3, "latest { num_versions: 2 }")]
    (d / "config.pbtxt").write_text("version_policy: { specific: { versions: [ 1, 3 ] } }")
    assert [v for v, _ in versions()] == [1, 3]
    (d / "config.pbtxt").write_text("version_policy: { all: { } }")
    assert [v for v, _ in versions()] == [1, 2, 3] and not read_model(d).warnings
    assert [(m.name, m.version) for m in read_repository(tmp_path)] == [("mlp", 1), ("mlp", 2), ("mlp", 3)]
    (d / "config.pbtxt").write_text("version_policy: { specific: { versions: [ 4 ] } }")
    assert "version_policy.specific.versions: no folder for version(s) 4" in _error(d)
    (d / "config.pbtxt").write_text("version_policy: { latest: { } }")
    assert "version_policy latest: num_versions must be at least 1, got 0" in _error(d)
    (d / "config.pbtxt").write_text("")
    (d / "0").mkdir()
    assert "version 0: versions are positive integers" in _error(d)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no version folder" in _error(empty)


def test_torchscript_model_takes_its_io_from_the_config(tmp_path):
    torch = pytest.importorskip("torch")
    d = tmp_path / "scaled" / "1"
    d.mkdir(parents=True)
    torch.jit.script(torch.nn.Linear(4, 2)).save(str(d / "model.pt"))
    assert "a TorchScript model carries no input/output description: input must be listed" in _error(tmp_path / "scaled")
    config = ('platform: "pytorch_libtorch"\nmax_batch_size: 8\n'
              'input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
              'output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 2 ] } ]')
    (tmp_path / "scaled" / "config.pbtxt").write_text(config)
    m = read_model(tmp_path / "scaled")
    assert (m.runtime, m.path.name, m.inputs[0].name, m.outputs[0].shape) == ("torch", "model.pt", "INPUT__0", (2,))
    assert json.loads(m.io_json)["inputs"] == [{"name": "INPUT__0", "datatype": "FP32", "shape": [4]}]


def test_torchscript_without_io_is_refused(tmp_path):
    d = tmp_path / "t" / "1"
    d.mkdir(parents=True)
    import zipfile

    with zipfile.ZipFile(d / "model.pt", "w") as z:
        z.writestr("t/data.pkl", b"")
    assert "input must be listed in config.pbtxt" in _error(tmp_path / "t")


def test_a_folder_name_that_is_no_model_name_is_refused(tmp_path):
    assert "invalid model name 'my model'" in _error(_model(tmp_path, "my model", mlp_small(), None))


def test_an_empty_repository_is_refused(tmp_path):
    with pytest.raises(RepositoryError, match="no model folders"):
        read_repository(tmp_path)
    with pytest.raises(RepositoryError, match="not a directory"):
        read_repository(tmp_path / "missing")


def test_cli_refuses_a_bad_repository_before_starting_anything(tmp_path):
    repo = tmp_path / "repo"
    _model(repo, "mlp", mlp_small(), FULL_CONFIG.replace("dims: [ 64 ]", "dims: [ 32 ]"))
    r = nexus_cli("models", "import", str(repo), "--scheduler", "127.0.0.1:1")
    assert r.returncode == 2 and "input[0].dims [32]" in r.stderr and "config.pbtxt" in r.stderr
    r = nexus_cli("serve", "--model-repository", str(repo), "--data-dir", str(tmp_path / "data"))
    assert r.returncode == 2 and "input[0].dims [32]" in r.stderr
    assert not (tmp_path / "data").exists()
    good = tmp_path / "good"
    _model(good, "mlp", mlp_small(), FULL_CONFIG)
    r = nexus_cli("models", "import", str(good), "--dry-run")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)[0]["slo_ms"] == 40.0 and "instance_group" in r.stderr


# ---- served -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def repository_cluster(tmp_path_factory):
    repo = tmp_path_factory.mktemp("triton_repo")
    _model(repo, "mlp", mlp_small(), FULL_CONFIG)                 # full config
    _model(repo, "det", detector_64(), 'backend: "onnxruntime"')   # minimal config
    c = start_serve(tmp_path_factory.mktemp("repo_cluster"), "--no-samples", "--model-repository", str(repo))
    c.repo = repo
    yield c
    c.stop()


def _compare_with_onnxruntime(client, name: str, model, shape):
    x = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
    inp = grpcclient.InferInput("input", list(shape), "FP32")
    inp.set_data_from_numpy(x)
    result = client.infer(name, [inp], client_timeout=60)
    session = ort.InferenceSession(model_bytes(model), providers=["CPUExecutionProvider"])
    expected = session.run(None, {"input": x})
    for out, want in zip(session.get_outputs(), expected):
        np.testing.assert_allclose(result.as_numpy(out.name), want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_repository_models_are_served_with_onnxruntime_outputs(repository_cluster, tmp_path):
    client = grpcclient.InferenceServerClient(repository_cluster.frontend)
    try:
        _compare_with_onnxruntime(client, "mlp", mlp_small(), (3, 64))
        _compare_with_onnxruntime(client, "det", detector_64(), (2, 3, 64, 64))
        served = client.get_model_config("mlp").config
    finally:
        client.close()
    assert served.parameters["slo_ms"].string_value == "40"
    assert served.parameters["late_requests"].string_value == "serve"
    # The config the server reports, written out as text, is a repository config this server accepts.
    from google.protobuf import text_format

    again = _model(tmp_path, "mlp", mlp_small(), text_format.MessageToString(served))
    m = read_model(again)
    assert (m.slo_ms, [t.shape for t in m.inputs], [t.shape for t in m.outputs]) == (40.0, [(64,)], [(10,)])
    assert m.late_requests is LateRequests.SERVE
    listed = {m["name"]: m for m in json.loads(nexus_cli("models", "list", "--scheduler", repository_cluster.scheduler,
                                                         "--json").stdout)}
    assert listed["mlp"]["slo_ms"] == 40.0 and listed["mlp"]["loaded"] and listed["det"]["loaded"]
    # config.pbtxt's expected rate and batch cap reach the model database (planned by them: test_elastic.py,
    # test_scheduler_service.py); the cap shows beside the batch in `nexus status`
    assert (listed["mlp"]["expected_rate_rps"], listed["mlp"]["batch_cap"], listed["mlp"]["late_requests"]) \
        == (20.0, 16, "serve")
    assert (listed["det"]["expected_rate_rps"], listed["det"]["batch_cap"], listed["det"]["late_requests"]) \
        == (0.0, 0, "drop")
    status = json.loads(nexus_cli("status", "--scheduler", repository_cluster.scheduler, "--json").stdout)
    [mlp] = [s for d in status["devices"] for s in d["sessions"] if s["session"] == "mlp"]
    assert mlp["batch_cap"] == 16 and 1 <= mlp["batch"] <= 16
    text = nexus_cli("status", "--scheduler", repository_cluster.scheduler).stdout
    assert any(line.split()[:3] == ["mlp", str(mlp["batch"]), "16"] for line in text.splitlines()), text


@pytest.mark.slow
def test_models_import_serves_a_repository_on_a_running_cluster(repository_cluster, tmp_path):
    model = mlp_small(in_features=32, hidden=16, num_classes=4)
    _model(tmp_path, "mlp32", model, None)                       # no config at all
    r = nexus_cli("models", "import", str(tmp_path), "--scheduler", repository_cluster.scheduler)
    assert r.returncode == 0, r.stderr
    assert "mlp32: version 1, onnxruntime, default SLO: uploaded" in r.stdout
    again = nexus_cli("models", "import", str(repository_cluster.repo), "--scheduler", repository_cluster.scheduler)
    assert again.returncode == 0 and "mlp: version 1, onnxruntime, SLO 40 ms: unchanged" in again.stdout
    client = grpcclient.InferenceServerClient(repository_cluster.frontend)
    try:
        deadline = time.monotonic() + 120
        while not client.is_model_ready("mlp32") and time.monotonic() < deadline:
            time.sleep(0.3)
        _compare_with_onnxruntime(client, "mlp32", model, (2, 32))
        _compare_with_onnxruntime(client, "mlp", mlp_small(), (1, 64))     # the others still serve
    finally:
        client.close()
