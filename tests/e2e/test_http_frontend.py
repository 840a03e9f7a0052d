"""KServe v2 HTTP/REST on the frontend: tritonclient.http and plain HTTP against `nexus serve`.

Outputs are compared with ONNX Runtime run directly on the same model files; every error path is
sent as a real HTTP request and the server must keep serving afterwards.
"""

from __future__ import annotations

import contextlib
import gzip
import http.client
import json
import shutil
import ssl
import socket
import subprocess
import sys
import urllib.error
import urllib.request
import zlib

import grpc
import numpy as np
import pytest
import tritonclient.http as httpclient
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.utils import InferenceServerException

from common.config import ConfigError, FrontendConfig
from common.pb import kserve, kserve_grpc
from common.sample_models import SAMPLE_MODELS
from frontend.requests import RequestError
from frontend.rest_codec import decode_infer_request
from tests.components import wait_for
from tests.conftest import NexusProcess

pytestmark = pytest.mark.slow

TIMEOUT_US = 20_000_000      # KServe 'timeout' parameter: generous, CI machines are slow and shared
SMALL = "mlp_small"


@pytest.fixture(scope="module")
def client(cluster):
    c = httpclient.InferenceServerClient(cluster.http, network_timeout=120)
    yield c
    c.close()


def _send(address: str, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    """One plain HTTP request; returns (status, headers, body bytes)."""
    request = urllib.request.Request(f"http://{address}{path}", data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read()


def _error(address: str, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    status, _, data = _send(address, method, path, body, headers)
    doc = json.loads(data)
    assert set(doc) == {"error"}, doc
    return status, doc["error"]


def _small_input(direct, batch: int = 2, seed: int = 0):
    spec = direct[SMALL].get_inputs()[0]
    data = np.random.default_rng(seed).standard_normal([batch, *spec.shape[1:]]).astype(np.float32)
    return spec.name, data


def test_health_and_server_metadata(client, cluster):
    assert client.is_server_live() and client.is_server_ready()
    meta = client.get_server_metadata()
    assert meta["name"] == "nexus"
    assert {"binary_tensor_data", "statistics", "model_repository"} <= set(meta["extensions"])
    assert _send(cluster.http, "GET", "/v2/health/live")[0] == 200
    assert client.is_model_ready(SMALL) and not client.is_model_ready("no_such_model")


@pytest.mark.parametrize("model", list(SAMPLE_MODELS))
def test_metadata_config_and_infer_binary_and_json_match_onnxruntime(client, direct, model):
    session = direct[model]
    meta = client.get_model_metadata(model)
    assert meta == client.get_model_metadata(model, model_version="1")
    assert meta["name"] == model and meta["versions"] == ["1"]
    assert [i["name"] for i in meta["inputs"]] == [i.name for i in session.get_inputs()]
    assert [o["name"] for o in meta["outputs"]] == [o.name for o in session.get_outputs()]
    for tensor in meta["inputs"] + meta["outputs"]:
        assert tensor["shape"][0] == -1 and tensor["datatype"] == "FP32"
    config = client.get_model_config(model)
    assert config["name"] == model and config["max_batch_size"] > 0
    assert [i["name"] for i in config["input"]] == [i["name"] for i in meta["inputs"]]
    assert config["input"][0]["dims"] == meta["inputs"][0]["shape"][1:]
    assert config["input"][0]["data_type"] == "TYPE_FP32"

    inp = meta["inputs"][0]
    data = np.random.default_rng(3).standard_normal([3, *inp["shape"][1:]]).astype(np.float32)
    expected = session.run(None, {inp["name"]: data})
    for binary in (True, False):
        tensor = httpclient.InferInput(inp["name"], list(data.shape), "FP32")
        tensor.set_data_from_numpy(data, binary_data=binary)
        outputs = [httpclient.InferRequestedOutput(o["name"], binary_data=binary) for o in meta["outputs"]]
        result = client.infer(model, [tensor], outputs=outputs, request_id=f"r{binary}", timeout=TIMEOUT_US)
        response = result.get_response()
        assert response["model_name"] == model and response["id"] == f"r{binary}"
        for out, exp in zip(meta["outputs"], expected):
            got = result.as_numpy(out["name"])
            assert got.shape == exp.shape
            np.testing.assert_allclose(got, exp, rtol=1e-5, atol=1e-6)
            assert ("data" in result.get_output(out["name"])) == (not binary)


def test_infer_without_requested_outputs_returns_all_in_binary(client, direct):
    name, data = _small_input(direct, 4, seed=11)
    tensor = httpclient.InferInput(name, list(data.shape), "FP32")
    tensor.set_data_from_numpy(data)
    result = client.infer(SMALL, [tensor], timeout=TIMEOUT_US)      # sends binary_data_output: true
    for out, exp in zip(direct[SMALL].get_outputs(), direct[SMALL].run(None, {name: data})):
        np.testing.assert_allclose(result.as_numpy(out.name), exp, rtol=1e-5, atol=1e-6)
        assert result.get_output(out.name)["parameters"]["binary_data_size"] == exp.nbytes


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_request_and_response(cluster, client, direct, algorithm):
    name, data = _small_input(direct, 2, seed=21)
    tensor = httpclient.InferInput(name, list(data.shape), "FP32")
    tensor.set_data_from_numpy(data)
    result = client.infer(SMALL, [tensor], timeout=TIMEOUT_US, request_compression_algorithm=algorithm,
                          response_compression_algorithm=algorithm)
    out = direct[SMALL].get_outputs()[0].name
    expected = direct[SMALL].run(None, {name: data})[0]
    np.testing.assert_allclose(result.as_numpy(out), expected, rtol=1e-5, atol=1e-6)

    body = json.dumps({"parameters": {"timeout": TIMEOUT_US}, "inputs": [
        {"name": name, "shape": list(data.shape), "datatype": "FP32", "data": data.ravel().tolist()}]}).encode()
    status, headers, raw = _send(cluster.http, "POST", f"/v2/models/{SMALL}/infer", body,
                                 {"Accept-Encoding": algorithm})
    assert status == 200 and headers["Content-Encoding"] == algorithm
    doc = json.loads(gzip.decompress(raw) if algorithm == "gzip" else zlib.decompress(raw))
    np.testing.assert_allclose(np.reshape(doc["outputs"][0]["data"], expected.shape), expected, rtol=1e-5, atol=1e-6)


def test_plain_json_request_nested_data(cluster, direct):
    """What curl sends: nested JSON data in, JSON data out."""
    name, data = _small_input(direct, 2, seed=5)
    body = {"id": "curl-1", "parameters": {"timeout": TIMEOUT_US},
            "inputs": [{"name": name, "shape": list(data.shape), "datatype": "FP32", "data": data.tolist()}]}
    status, headers, raw = _send(cluster.http, "POST", f"/v2/models/{SMALL}/versions/1/infer",
                                 json.dumps(body).encode(), {"Content-Type": "application/json"})
    assert status == 200, raw
    assert HEADER not in headers and headers["Content-Type"].startswith("application/json")
    doc = json.loads(raw)
    assert doc["id"] == "curl-1" and doc["model_name"] == SMALL and doc["model_version"] == "1"
    expected = direct[SMALL].run(None, {name: data})
    for out, exp in zip(doc["outputs"], expected):
        assert out["shape"] == list(exp.shape) and out["datatype"] == "FP32"
        np.testing.assert_allclose(np.array(out["data"], np.float32).reshape(exp.shape), exp, rtol=1e-5, atol=1e-6)


HEADER = "Inference-Header-Content-Length"


def _binary_body(name: str, shape: list, datatype: str, payload: bytes, declared: int | None = None):
    header = json.dumps({"inputs": [{"name": name, "shape": shape, "datatype": datatype,
                                     "parameters": {"binary_data_size": len(payload) if declared is None
                                                    else declared}}]}).encode()
    return header + payload, {HEADER: str(len(header))}


def _bad_requests(name: str, data: np.ndarray):
    shape = list(data.shape)
    good_json = {"inputs": [{"name": name, "shape": shape, "datatype": "FP32", "data": data.ravel().tolist()}]}

    def js(doc):
        return json.dumps(doc).encode(), {}

    def with_input(**changes):
        doc = json.loads(json.dumps(good_json))
        doc["inputs"][0].update(changes)
        return js(doc)

    raw = data.tobytes()
    return {
        "wrong shape": (*with_input(shape=[shape[0], shape[1] + 1],
                                    data=np.zeros(shape[0] * (shape[1] + 1)).tolist()), 400, "shape"),
        "wrong datatype": (*_binary_body(name, shape, "FP64", data.astype(np.float64).tobytes()), 400, "datatype"),
        "unknown input": (*with_input(name="nope"), 400, "'nope'"),
        "bad json": (b'{"inputs": [', {}, 400, "malformed JSON"),
        "not an object": (b"[1, 2]", {}, 400, "JSON object"),
        "no inputs": (*js({"outputs": []}), 400, "'inputs'"),
        "too few values": (*with_input(data=[1.0, 2.0]), 400, "needs"),
        "strings as data": (*with_input(data=["a"] * data.size), 400, "numbers"),
        "ragged data": (*with_input(data=[[1.0], [1.0, 2.0]]), 400, "regular"),
        "no data": (*js({"inputs": [{"name": name, "shape": shape, "datatype": "FP32"}]}), 400, "neither"),
        "binary size past end": (*_binary_body(name, shape, "FP32", raw, declared=len(raw) + 4), 400,
                                 "past the end"),
        "binary bytes left over": (*_binary_body(name, shape, "FP32", raw + b"\0" * 8, declared=len(raw)), 400,
                                   "beyond"),
        "binary size wrong for shape": (*_binary_body(name, shape, "FP32", raw[:-4]), 400, "bytes"),
        "negative binary size": (*_binary_body(name, shape, "FP32", b"", declared=-1), 400, "non-negative"),
        "header length not a number": (_binary_body(name, shape, "FP32", raw)[0], {HEADER: "ten"}, 400, HEADER),
        "header length past body": (_binary_body(name, shape, "FP32", raw)[0], {HEADER: "999999999"}, 400,
                                    "outside the body"),
        "binary without header": (_binary_body(name, shape, "FP32", b"")[0], {}, 400, HEADER),
        "classification asked": (*js({**good_json, "outputs": [{"name": "x", "parameters": {"classification": 3}}]}),
                                 400, "classification"),
        "unknown output": (*js({**good_json, "outputs": [{"name": "nope"}]}), 400, "'nope'"),
        "shape of strings": (*with_input(shape=["2"]), 400, "list of integers"),
        "dimension past 64 bits": (*with_input(shape=[2**70, 1]), 400, "64 bits"),
        "nested too deeply": (b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", {}, 400, "nested too deeply"),
        "input without a name": (*js({"inputs": [{"shape": shape, "datatype": "FP32", "data": [1.0]}]}), 400,
                                 "'name'"),
        "input not an object": (*js({"inputs": [5]}), 400, "inputs[0]"),
        "datatype unknown to JSON": (*with_input(datatype="BYTES"), 400, "BYTES"),
        "fractions for integers": (*with_input(datatype="INT32", data=[1.5] * data.size), 400, "integers"),
        "integer out of range": (*with_input(datatype="INT8", data=[300] * data.size), 400, "out of range"),
        "booleans for floats": (*with_input(data=[True] * data.size), 400, "numbers"),
        "both data and binary": (*with_input(parameters={"binary_data_size": 4}), 400, "both"),
        "shared memory input with data": (*with_input(parameters={"shared_memory_region": "r"}), 400,
                                          "has both a shared_memory_region and data"),
        "shared memory input without a size": (*js({"inputs": [{"name": name, "shape": shape, "datatype": "FP32",
                                                                "parameters": {"shared_memory_region": "r"}}]}),
                                               400, "'shared_memory_byte_size' is required"),
        "shared memory input unregistered": (*js({"inputs": [{"name": name, "shape": shape, "datatype": "FP32",
                                                              "parameters": {"shared_memory_region": "r",
                                                                             "shared_memory_byte_size": len(raw)}}]}),
                                             400, "no shared memory region 'r' is registered"),
        "id not a string": (*js({**good_json, "id": 7}), 400, "'id'"),
        "parameters not an object": (*js({**good_json, "parameters": [1]}), 400, "JSON object"),
        "parameter of a list": (*js({**good_json, "parameters": {"p": [1]}}), 400, "expected a boolean"),
        "parameter past 64 bits": (*js({**good_json, "parameters": {"p": 2**70}}), 400, "64 bits"),
        "binary_data_output not boolean": (*js({**good_json, "parameters": {"binary_data_output": 1}}), 400,
                                           "binary_data_output"),
        "outputs not a list": (*js({**good_json, "outputs": {"name": "x"}}), 400, "'outputs'"),
        "output without a name": (*js({**good_json, "outputs": [{}]}), 400, "'name'"),
        "output binary_data not boolean": (*js({**good_json, "outputs": [{"name": "x", "parameters": {
            "binary_data": "yes"}}]}), 400, "binary_data"),
        "shared memory output without a size": (*js({**good_json, "outputs": [{"name": "logits", "parameters": {
            "shared_memory_region": "r"}}]}), 400, "'shared_memory_byte_size' is required"),
        "shared memory region not a string": (*js({**good_json, "outputs": [{"name": "logits", "parameters": {
            "shared_memory_region": 3, "shared_memory_byte_size": 40}}]}), 400, "must be a region's name"),
    }


def test_bad_requests_get_400_with_error_json_and_server_keeps_serving(cluster, client, direct):
    name, data = _small_input(direct, 2)
    for case, (body, headers, want_status, fragment) in _bad_requests(name, data).items():
        status, message = _error(cluster.http, "POST", f"/v2/models/{SMALL}/infer", body, headers)
        assert (status, fragment in message) == (want_status, True), (case, status, message)

    # The same refusals reach tritonclient.http as exceptions carrying the HTTP status.
    wrong = httpclient.InferInput(name, list(data.shape), "FP64")
    wrong.set_data_from_numpy(data.astype(np.float64))
    with pytest.raises(InferenceServerException) as e:
        client.infer(SMALL, [wrong])
    assert e.value.status() == "400" and "datatype" in e.value.message()

    good = httpclient.InferInput(name, list(data.shape), "FP32")
    good.set_data_from_numpy(data)
    result = client.infer(SMALL, [good], timeout=TIMEOUT_US)
    np.testing.assert_allclose(result.as_numpy(direct[SMALL].get_outputs()[0].name),
                               direct[SMALL].run(None, {name: data})[0], rtol=1e-5, atol=1e-6)
    assert client.is_server_ready()


def test_not_found_paths_and_methods(cluster, client, direct):
    name, data = _small_input(direct, 1)
    body = json.dumps({"inputs": [{"name": name, "shape": list(data.shape), "datatype": "FP32",
                                   "data": data.ravel().tolist()}]}).encode()
    assert _error(cluster.http, "POST", "/v2/models/no_such_model/infer", body)[0] == 404
    status, message = _error(cluster.http, "POST", f"/v2/models/{SMALL}/versions/7/infer", body)
    assert status == 404 and "version" in message
    for path in ("/v2/models/no_such_model", "/v2/models/no_such_model/config", "/v2/models/no_such_model/stats"):
        status, message = _error(cluster.http, "GET", path)
        assert status == 404 and "no_such_model" in message
    status, message = _error(cluster.http, "GET", "/v2/no/such/path")
    assert status == 404 and "/v2/no/such/path" in message
    status, message = _error(cluster.http, "GET", f"/v2/models/{SMALL}/infer")
    assert status == 405 and "GET" in message
    assert _error(cluster.http, "PUT", "/v2/repository/index")[0] == 405

    with pytest.raises(InferenceServerException) as e:
        client.get_model_metadata("no_such_model")
    assert e.value.status() == "404"
    assert client.is_server_ready()


def test_request_past_its_deadline_gets_504(client, direct):
    name, data = _small_input(direct, 1)
    tensor = httpclient.InferInput(name, list(data.shape), "FP32")
    tensor.set_data_from_numpy(data)
    with pytest.raises(InferenceServerException) as e:
        client.infer(SMALL, [tensor], timeout=1)     # a deadline of 1 us has passed before dispatch
    assert e.value.status() == "504" and "deadline" in e.value.message()
    out = direct[SMALL].get_outputs()[0].name
    got = client.infer(SMALL, [tensor], timeout=TIMEOUT_US).as_numpy(out)
    np.testing.assert_allclose(got, direct[SMALL].run([out], {name: data})[0], rtol=1e-5, atol=1e-6)


def test_repository_index_and_statistics(cluster, client, direct):
    index = {m["name"]: m for m in client.get_model_repository_index()}
    for model in SAMPLE_MODELS:
        assert index[model]["state"] == "READY" and index[model]["version"] == "1"
    status, _, raw = _send(cluster.http, "POST", "/v2/repository/index", b'{"ready": true}')
    assert status == 200 and {m["name"] for m in json.loads(raw)} >= set(SAMPLE_MODELS)
    assert _error(cluster.http, "POST", "/v2/repository/index", b'{"ready": 1}')[0] == 400

    before = client.get_inference_statistics(SMALL)["model_stats"][0]
    name, data = _small_input(direct, 3, seed=9)
    tensor = httpclient.InferInput(name, list(data.shape), "FP32")
    tensor.set_data_from_numpy(data)
    client.infer(SMALL, [tensor], timeout=TIMEOUT_US)
    stats = client.get_inference_statistics(SMALL, model_version="1")["model_stats"]
    assert [s["name"] for s in stats] == [SMALL]
    after = stats[0]
    assert after["inference_count"] - before["inference_count"] == 3
    success = after["inference_stats"]["success"]
    assert success["count"] - before["inference_stats"]["success"]["count"] == 1 and success["ns"] > 0
    everything = {s["name"] for s in client.get_inference_statistics()["model_stats"]}
    assert set(SAMPLE_MODELS) <= everything


def test_repository_load_and_unload(cluster, client):
    admin = {"authorization": f"Bearer {cluster.token}"}     # repository calls are admin calls
    client.load_model(SMALL, headers=admin)                  # already loaded: answered once it is ready
    assert client.is_model_ready(SMALL)
    for verb in ("load", "unload"):
        status, message = _error(cluster.http, "POST", f"/v2/repository/models/no_such_model/{verb}", headers=admin)
        assert status == 404 and "no_such_model" in message, (verb, message)
    status, message = _error(cluster.http, "POST", f"/v2/repository/models/{SMALL}/load",
                             b'{"parameters": {"config": "{}"}}', admin)
    assert status == 400 and "config" in message
    status, message = _error(cluster.http, "POST", f"/v2/repository/models/{SMALL}/load",
                             b'{"parameters": {"file:1/model.onnx": "AAAA"}}', admin)
    assert status == 400 and "nexus models upload" in message


@pytest.mark.parametrize("headers, expected", [(None, "missing cluster token"),
                                                ({"authorization": "Bearer wrong"}, "wrong cluster token")])
def test_repository_calls_over_http_need_the_cluster_token(cluster, client, headers, expected):
    assert cluster.token
    for verb in ("load", "unload"):
        status, message = _error(cluster.http, "POST", f"/v2/repository/models/{SMALL}/{verb}", headers=headers)
        assert status == 401 and expected in message, (verb, message)
    assert client.is_model_ready(SMALL)            # the refused unload did nothing


def test_restricted_repository_header_applies_to_http_too():
    with _frontend_alone("--restricted-repository-header", "admin-key=s3cret") as address:
        for headers in (None, {"triton-grpc-protocol-admin-key": "nope"}):
            status, message = _error(address, "POST", "/v2/repository/models/m/unload", headers=headers)
            assert status == 503 and "restricted" in message and "triton-grpc-protocol-admin-key" in message
        # the right header passes the guard; with no scheduler behind this frontend the call itself fails
        status, message = _error(address, "POST", "/v2/repository/models/m/unload",
                                 headers={"triton-grpc-protocol-admin-key": "s3cret"})
        assert "restricted" not in message, (status, message)


@contextlib.contextmanager
def _frontend_alone(*flags: str):
    """`nexus frontend` with no scheduler to reach (so no routing table); yields its HTTP address."""
    with socket.socket() as s:              # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "nexus", "frontend", "--scheduler", f"127.0.0.1:{dead}",
                             "--listen", "127.0.0.1:0", "--log-level", "ERROR", *flags],
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("NEXUS-READY frontend"), line
        yield dict(w.split("=", 1) for w in line.split()[3:])["http"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def lone_frontend():
    """A frontend without a routing table and with a 16 KiB body limit."""
    with _frontend_alone("--http-max-body-mb", str(16 / 1024)) as address:
        yield address


def test_body_over_the_limit_gets_413(lone_frontend):
    big = json.dumps({"inputs": [{"name": "x", "shape": [1, 5000], "datatype": "FP32",
                                  "data": [0.5] * 5000}]}).encode()
    assert len(big) > 16 * 1024
    status, message = _error(lone_frontend, "POST", "/v2/models/m/infer", big)
    assert status == 413 and "limit" in message
    # Without a Content-Length (chunked), the limit holds while the body streams in.
    conn = http.client.HTTPConnection(lone_frontend, timeout=60)
    try:
        conn.request("POST", "/v2/models/m/infer", body=iter([big[i:i + 4096] for i in range(0, len(big), 4096)]),
                     encode_chunked=True)
        response = conn.getresponse()
        assert response.status == 413 and "limit" in json.loads(response.read())["error"]
    finally:
        conn.close()
    assert _send(lone_frontend, "GET", "/v2/health/live")[0] == 200


def test_frontend_without_routing_table(lone_frontend):
    assert _send(lone_frontend, "GET", "/v2/health/live")[0] == 200
    assert _send(lone_frontend, "GET", "/v2/health/ready")[0] == 400     # no routing table yet
    status, message = _error(lone_frontend, "POST", "/v2/models/m/infer",
                             b'{"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}]}')
    assert status == 404 and "'m'" in message
    status, message = _error(lone_frontend, "POST", "/v2/repository/models/m/load")
    assert status == 503                                               # the scheduler is unreachable
    assert _send(lone_frontend, "GET", "/v2")[0] == 200


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_https_when_the_frontend_has_a_certificate(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    with _frontend_alone("--tls-cert", str(cert), "--tls-key", str(key)) as address:
        context = ssl.create_default_context(cafile=str(cert))
        with urllib.request.urlopen(f"https://{address}/v2", context=context, timeout=60) as response:
            assert json.loads(response.read())["name"] == "nexus"
        with pytest.raises((OSError, http.client.HTTPException)):
            urllib.request.urlopen(f"http://{address}/v2/health/live", timeout=60).read()


def test_http_address_in_use_is_a_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        proc = subprocess.run([sys.executable, "-m", "nexus", "frontend", "--scheduler", "127.0.0.1:1", "--listen",
                               "127.0.0.1:0", "--http-listen", address, "--log-level", "ERROR"],
                              capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and f"could not bind HTTP {address}" in proc.stderr


def test_a_grpc_client_or_bad_bytes_on_the_http_port_make_one_log_line_each(tmp_path):
    with socket.socket() as s:              # a port nothing listens on: no scheduler needed here
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    frontend = NexusProcess(tmp_path / "frontend.log", "frontend", "--scheduler", f"127.0.0.1:{dead}",
                            "--listen", "127.0.0.1:0")
    try:
        address = frontend.info["http"]
        with grpc.insecure_channel(address) as channel:          # HTTP/2 where HTTP/1.1 is served
            with pytest.raises(grpc.RpcError):
                kserve_grpc.GRPCInferenceServiceStub(channel).ServerLive(kserve.ServerLiveRequest(), timeout=10)
        host, port = address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=30) as raw:   # a header line without a colon
            raw.sendall(b"GET /v2 HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n")
            assert raw.recv(64).split(b" ")[1] == b"400"
        assert _send(address, "GET", "/v2/health/live")[0] == 200            # and it keeps serving
        logs = wait_for(lambda: (text := frontend.logs()).count("HTTP/REST port:") >= 2 and text, 30,
                        "a log line for each")
    finally:
        frontend.stop()
    lines = [line for line in logs.splitlines() if "HTTP/REST port:" in line]
    assert any("spoke HTTP/2 (a gRPC client?" in line for line in lines), logs
    assert any("sent no valid HTTP/1 request" in line for line in lines), logs
    assert "Traceback" not in logs and "aiohttp" not in logs, logs


_json_values = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
                            lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                         max_size=4),
                            max_leaves=12)
_tensor = st.fixed_dictionaries({}, optional={"name": _json_values | st.just("input"),
                                              "datatype": _json_values | st.sampled_from(["FP32", "INT8", "BOOL"]),
                                              "shape": _json_values | st.lists(st.integers(-2, 2**64), max_size=3),
                                              "data": _json_values, "parameters": _json_values | st.fixed_dictionaries(
                                                  {"binary_data_size": st.integers(-1, 64)})})


@settings(max_examples=150, deadline=None)
@given(doc=st.fixed_dictionaries({}, optional={"id": _json_values, "parameters": _json_values,
                                               "inputs": _json_values | st.lists(_tensor, max_size=3),
                                               "outputs": _json_values}),
       binary=st.binary(max_size=64), header=st.none() | st.integers(-5, 400).map(str) | st.text(max_size=4))
def test_decoding_any_request_either_succeeds_or_names_the_problem(doc, binary, header):
    """Whatever a client sends, the HTTP edge answers a RequestError (400), never an unexpected exception."""
    body = json.dumps(doc).encode() + binary
    try:
        request, _ = decode_infer_request("m", "", body, header)
    except RequestError as exc:
        assert exc.code == grpc.StatusCode.INVALID_ARGUMENT and str(exc)
    else:
        assert len(request.raw_input_contents) == len(request.inputs) >= 1


@pytest.mark.parametrize("changes, flag", [({"http_listen": "8000"}, "--http-listen"),
                                           ({"http_max_body_mb": 0}, "--http-max-body-mb")])
def test_bad_http_flags_are_refused_naming_the_flag(changes, flag):
    with pytest.raises(ConfigError, match=flag):
        FrontendConfig(**changes).validate()


def test_http_address_follows_an_ephemeral_grpc_port_unless_given():
    assert FrontendConfig().resolved_http_listen == "127.0.0.1:8000"
    assert FrontendConfig(listen="127.0.0.1:0").resolved_http_listen == "127.0.0.1:0"
    assert FrontendConfig(listen="127.0.0.1:0", http_listen="0.0.0.0:9000").resolved_http_listen == "0.0.0.0:9000"
    assert FrontendConfig(http_listen="").resolved_http_listen == ""
