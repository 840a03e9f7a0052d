"""Triton's system shared-memory extension on the frontend, with tritonclient 2.73 as a client on the
frontend's host: the flow of Triton's simple_grpc_shm_client (and its HTTP twin) unmodified, outputs
compared with ONNX Runtime run directly; every bad input refused with a precise error while the
frontend keeps serving."""

from __future__ import annotations

import asyncio
import os
import pathlib
import time
import uuid

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException, triton_to_np_dtype

from common.pb import kserve
from common.profile import Profile
from common.sample_models import model_bytes
from common.security import ProtocolAccess, parse_restricted_header
from frontend.frontend_state import FrontendState
from frontend.kserve_api import Call, KServeApi
from frontend.requests import RequestError
from tests.conftest import nexus_cli

pytestmark = pytest.mark.slow

MODEL = "mlp_small"          # input "input" [-1, 64] FP32, output "logits" [-1, 10] FP32
TIMEOUT_US = 20_000_000


def _key(what: str) -> str:
    return f"/nexus-test-{what}-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def regions():
    """Shared-memory objects the test creates; destroyed (unlinked) at the end whatever happens."""
    made = []

    def create(name: str, byte_size: int):
        handle = shm.create_shared_memory_region(name, _key(name), byte_size)
        made.append(handle)
        return handle

    yield create
    for handle in made:
        try:
            shm.destroy_shared_memory_region(handle)
        except Exception:       # already destroyed by the test
            pass


def _expected(direct, x: np.ndarray) -> np.ndarray:
    return direct[MODEL].run(None, {"input": x})[0]


def _simple_model():
    """Triton's example model ``simple``: INPUT0 and INPUT1, INT32 [-1, 16]; OUTPUT0 is their sum,
    OUTPUT1 their difference."""
    from onnx import TensorProto, helper

    def tensor(name):
        return helper.make_tensor_value_info(name, TensorProto.INT32, ["batch", 16])
    graph = helper.make_graph([helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
                               helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"])],
                              "simple", [tensor("INPUT0"), tensor("INPUT1")], [tensor("OUTPUT0"), tensor("OUTPUT1")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.fixture(scope="module")
def simple(cluster, tmp_path_factory):
    """Triton's ``simple`` model, served by the shared cluster (its name: what the examples ask for)."""
    work = tmp_path_factory.mktemp("simple")
    (work / "simple.onnx").write_bytes(model_bytes(_simple_model()))
    (work / "profile.json").write_text(Profile.linear(0.1, 0.1, 8, memory_base_mb=1, device_type="cpu").to_json())
    up = nexus_cli("models", "upload", str(work / "simple.onnx"), "--name", "simple", "--profile",
                   str(work / "profile.json"), "--slo-ms", "2000", "--scheduler", cluster.scheduler)
    assert up.returncode == 0, up.stderr
    client = grpcclient.InferenceServerClient(cluster.frontend)
    deadline = time.monotonic() + 120
    while not client.is_model_ready("simple"):
        assert time.monotonic() < deadline, "model 'simple' not ready after 120 s"
        time.sleep(0.3)
    client.close()
    return "simple"


def _simple_shm_client(client_module, url: str) -> None:
    """Triton's simple_grpc_shm_client.py / simple_http_shm_client.py (tritonclient's examples), their
    calls unchanged; ``client_module`` is tritonclient.grpc or tritonclient.http."""
    from tritonclient import utils

    triton_client = client_module.InferenceServerClient(url=url, verbose=False)
    # To make sure no shared memory regions are registered with the server.
    triton_client.unregister_system_shared_memory()
    triton_client.unregister_cuda_shared_memory()

    model_name = "simple"
    input0_data = np.arange(start=0, stop=16, dtype=np.int32)
    input1_data = np.ones(shape=16, dtype=np.int32)
    input_byte_size = input0_data.size * input0_data.itemsize
    output_byte_size = input_byte_size
    output_key, input_key = _key("output_simple"), _key("input_simple")

    # Create Output0 and Output1 in shared memory and register it.
    shm_op_handle = shm.create_shared_memory_region("output_data", output_key, output_byte_size * 2)
    triton_client.register_system_shared_memory("output_data", output_key, output_byte_size * 2)
    # Create Input0 and Input1 in shared memory, store the inputs there and register it.
    shm_ip_handle = shm.create_shared_memory_region("input_data", input_key, input_byte_size * 2)
    try:
        shm.set_shared_memory_region(shm_ip_handle, [input0_data])
        shm.set_shared_memory_region(shm_ip_handle, [input1_data], offset=input_byte_size)
        triton_client.register_system_shared_memory("input_data", input_key, input_byte_size * 2)

        inputs = [client_module.InferInput("INPUT0", [1, 16], "INT32"),
                  client_module.InferInput("INPUT1", [1, 16], "INT32")]
        inputs[0].set_shared_memory("input_data", input_byte_size)
        inputs[1].set_shared_memory("input_data", input_byte_size, offset=input_byte_size)
        outputs = [client_module.InferRequestedOutput("OUTPUT0"), client_module.InferRequestedOutput("OUTPUT1")]
        outputs[0].set_shared_memory("output_data", output_byte_size)
        outputs[1].set_shared_memory("output_data", output_byte_size, offset=output_byte_size)

        results = triton_client.infer(model_name=model_name, inputs=inputs, outputs=outputs)

        # Read the results from the shared memory.
        output0 = results.get_output("OUTPUT0")
        output1 = results.get_output("OUTPUT1")
        assert output0 is not None and output1 is not None
        if client_module is grpcclient:
            dtype0, shape0 = output0.datatype, output0.shape
            dtype1, shape1 = output1.datatype, output1.shape
        else:
            dtype0, shape0 = output0["datatype"], output0["shape"]
            dtype1, shape1 = output1["datatype"], output1["shape"]
        output0_data = shm.get_contents_as_numpy(shm_op_handle, utils.triton_to_np_dtype(dtype0), shape0)
        output1_data = shm.get_contents_as_numpy(shm_op_handle, utils.triton_to_np_dtype(dtype1), shape1,
                                                 offset=output_byte_size)
        for i in range(16):
            assert input0_data[i] + input1_data[i] == output0_data[0][i], "shm infer error: incorrect sum"
            assert input0_data[i] - input1_data[i] == output1_data[0][i], "shm infer error: incorrect difference"

        status = triton_client.get_system_shared_memory_status()
        names = sorted(status.regions) if client_module is grpcclient else sorted(r["name"] for r in status)
        assert names == ["input_data", "output_data"]
        triton_client.unregister_system_shared_memory()
        assert len(shm.mapped_shared_memory_regions()) >= 2
    finally:
        shm.destroy_shared_memory_region(shm_ip_handle)
        shm.destroy_shared_memory_region(shm_op_handle)
        triton_client.close()


def test_tritons_simple_grpc_shm_client_works_unmodified(cluster, simple):
    _simple_shm_client(grpcclient, cluster.frontend)


def test_tritons_simple_http_shm_client_works_unmodified(cluster, simple):
    _simple_shm_client(httpclient, cluster.http)


def test_cuda_shared_memory_is_refused_and_empty_as_on_a_server_without_it(cluster):
    """What a Triton without CUDA regions answers: none registered, unregistering is no error, and a
    registration is refused saying what is offered instead; over gRPC and HTTP."""
    g = grpcclient.InferenceServerClient(cluster.frontend)
    h = httpclient.InferenceServerClient(cluster.http)
    try:
        assert not g.get_cuda_shared_memory_status().regions and h.get_cuda_shared_memory_status() == []
        g.unregister_cuda_shared_memory("never")
        h.unregister_cuda_shared_memory()
        for client, status in ((g, "StatusCode.UNIMPLEMENTED"), (h, "501")):
            with pytest.raises(InferenceServerException) as info:
                client.register_cuda_shared_memory("gpu_in", b"aGFuZGxl", 0, 64)    # base64 of a handle
            assert str(info.value.status()) == status, info.value
            assert "does not offer CUDA shared memory; register system shared memory" in info.value.message()
        with pytest.raises(InferenceServerException) as info:
            g.get_cuda_shared_memory_status("gpu_in")
        assert info.value.status() == "StatusCode.NOT_FOUND" and "no CUDA shared memory region 'gpu_in'" in \
            info.value.message()
        assert "cuda_shared_memory" not in h.get_server_metadata()["extensions"]
    finally:
        g.close()
        h.close()


def test_the_simple_grpc_shm_client_flow(cluster, direct, regions):
    """Triton's simple_grpc_shm_client, step for step: inputs read from a region at an offset, outputs
    written to another region at an offset."""
    client = grpcclient.InferenceServerClient(cluster.frontend)
    try:
        client.unregister_system_shared_memory()
        x = np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32)
        input_size, output_size = x.nbytes, 4 * 10 * 4
        ip = regions("input_data", 128 + input_size)          # the input 128 bytes in
        op = regions("output_data", 64 + output_size)         # the output 64 bytes in
        client.register_system_shared_memory("output_data", op._shm_key, 64 + output_size)
        shm.set_shared_memory_region(ip, [x], offset=128)
        client.register_system_shared_memory("input_data", ip._shm_key, 128 + input_size)
        status = client.get_system_shared_memory_status(as_json=True)["regions"]
        assert {n: (r["key"], int(r["byte_size"])) for n, r in status.items()} == {
            "input_data": (ip._shm_key, 128 + input_size), "output_data": (op._shm_key, 64 + output_size)}
        inputs = [grpcclient.InferInput("input", list(x.shape), "FP32")]
        inputs[0].set_shared_memory("input_data", input_size, offset=128)
        outputs = [grpcclient.InferRequestedOutput("logits")]
        outputs[0].set_shared_memory("output_data", output_size, offset=64)
        results = client.infer(MODEL, inputs, outputs=outputs, timeout=TIMEOUT_US)
        output = results.get_output("logits")
        assert output is not None and list(output.shape) == [4, 10]
        assert results.get_response().raw_output_contents == [b""]         # the bytes went to the region
        got = shm.get_contents_as_numpy(op, triton_to_np_dtype(output.datatype), output.shape, offset=64)
        np.testing.assert_allclose(got, _expected(direct, x), rtol=1e-4, atol=1e-5)
        # An input in shared memory beside an output returned in the response, and the reverse.
        mixed = [grpcclient.InferRequestedOutput("logits")]
        np.testing.assert_allclose(client.infer(MODEL, inputs, outputs=mixed, timeout=TIMEOUT_US).as_numpy("logits"),
                                   _expected(direct, x), rtol=1e-4, atol=1e-5)
        plain = [grpcclient.InferInput("input", list(x.shape), "FP32")]
        plain[0].set_data_from_numpy(x * 2)
        client.infer(MODEL, plain, outputs=outputs, timeout=TIMEOUT_US)
        got = shm.get_contents_as_numpy(op, np.float32, [4, 10], offset=64)
        np.testing.assert_allclose(got, _expected(direct, x * 2), rtol=1e-4, atol=1e-5)
        client.unregister_system_shared_memory("input_data")
        assert list(client.get_system_shared_memory_status(as_json=True)["regions"]) == ["output_data"]
        client.unregister_system_shared_memory()
        assert not client.get_system_shared_memory_status(as_json=True).get("regions")
    finally:
        client.close()


def test_the_http_shm_client_flow(cluster, direct, regions):
    client = httpclient.InferenceServerClient(cluster.http, network_timeout=120)
    try:
        assert "system_shared_memory" in client.get_server_metadata()["extensions"]
        x = np.random.default_rng(4).standard_normal((2, 64)).astype(np.float32)
        ip, op = regions("http_input", x.nbytes), regions("http_output", 2 * 10 * 4)
        shm.set_shared_memory_region(ip, [x])
        client.register_system_shared_memory("http_input", ip._shm_key, x.nbytes)
        client.register_system_shared_memory("http_output", op._shm_key, 80)
        status = {r["name"]: r for r in client.get_system_shared_memory_status()}
        assert status["http_input"]["key"] == ip._shm_key and int(status["http_output"]["byte_size"]) == 80
        assert [r["name"] for r in client.get_system_shared_memory_status("http_input")] == ["http_input"]
        inputs = [httpclient.InferInput("input", list(x.shape), "FP32")]
        inputs[0].set_shared_memory("http_input", x.nbytes)
        outputs = [httpclient.InferRequestedOutput("logits", binary_data=True)]
        outputs[0].set_shared_memory("http_output", 80)
        results = client.infer(MODEL, inputs, outputs=outputs, timeout=TIMEOUT_US)
        output = results.get_output("logits")
        assert output["parameters"]["shared_memory_region"] == "http_output" and output["shape"] == [2, 10]
        got = shm.get_contents_as_numpy(op, triton_to_np_dtype(output["datatype"]), output["shape"])
        np.testing.assert_allclose(got, _expected(direct, x), rtol=1e-4, atol=1e-5)
        client.unregister_system_shared_memory("http_input")
        client.unregister_system_shared_memory("never-registered")         # no error, as Triton
        assert [r["name"] for r in client.get_system_shared_memory_status()] == ["http_output"]
        client.unregister_system_shared_memory()
        assert client.get_system_shared_memory_status() == []
    finally:
        client.close()


def _infer_error(client, inputs, outputs=None) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as info:
        client.infer(MODEL, inputs, outputs=outputs, timeout=TIMEOUT_US)
    return info.value.status(), info.value.message()


def test_bad_registrations_and_bad_references_get_precise_errors(cluster, direct, regions):
    client = grpcclient.InferenceServerClient(cluster.frontend)
    name = f"bad-{uuid.uuid4().hex[:8]}"
    try:
        region = regions(name, 256)
        key = region._shm_key
        for args, status, message in (
                ((name, "/nexus-test-no-such-object", 256), "NOT_FOUND",
                 "no shared-memory object with key '/nexus-test-no-such-object' on the frontend's host"),
                ((name, "/a/b", 256), "INVALID_ARGUMENT", "shared memory key '/a/b' is not a POSIX shared-memory name"),
                ((name, "/", 256), "INVALID_ARGUMENT", "shared memory key '/' is not a POSIX"),
                ((name, key, 0), "INVALID_ARGUMENT", "byte_size must be positive, got 0"),
                ((name, key, 200, 100), "INVALID_ARGUMENT",
                 f"offset 100 + byte_size 200 runs past the end of object '{key}' (256 bytes)"),
                (("", key, 256), "INVALID_ARGUMENT", "a shared memory region needs a name")):
            with pytest.raises(InferenceServerException) as info:
                client.register_system_shared_memory(*args)
            assert info.value.status() == f"StatusCode.{status}" and message in info.value.message(), info.value
        client.register_system_shared_memory(name, key, 256)
        with pytest.raises(InferenceServerException) as info:
            client.register_system_shared_memory(name, key, 128)
        assert info.value.status() == "StatusCode.ALREADY_EXISTS"
        assert f"shared memory region '{name}' is already registered (key '{key}'); unregister it first" in \
            info.value.message()
        with pytest.raises(InferenceServerException) as info:
            client.get_system_shared_memory_status("nope")
        assert info.value.status() == "StatusCode.NOT_FOUND" and "no shared memory region 'nope'" in info.value.message()

        x = np.ones((1, 64), np.float32)

        def shm_input(region_name, byte_size, offset=0):
            tensor = grpcclient.InferInput("input", [1, 64], "FP32")
            return [tensor.set_shared_memory(region_name, byte_size, offset)]

        cases = [
            (shm_input("nope", 256), "no shared memory region 'nope' is registered"),
            (shm_input(name, 256, 128), f"shared_memory_offset 128 + shared_memory_byte_size 256 run past the end of "
                                        f"shared memory region '{name}' (256 bytes)"),
            (shm_input(name, 128), "shared_memory_byte_size 128 does not match the 256 bytes of shape [1, 64] FP32"),
        ]
        small_output = grpcclient.InferRequestedOutput("logits")
        small_output.set_shared_memory(name, 8)
        plain = grpcclient.InferInput("input", [1, 64], "FP32")
        plain.set_data_from_numpy(x)
        cases.append(([plain], "output 'logits': shared_memory_byte_size 8 is too small for the 40 bytes of shape "
                               "[1, 10] FP32", [small_output]))
        no_size = grpcclient.InferInput("input", [1, 64], "FP32")
        no_size._input.parameters["shared_memory_region"].string_param = name
        cases.append(([no_size], "parameter 'shared_memory_byte_size' is required with 'shared_memory_region'"))
        offset_only = grpcclient.InferInput("input", [1, 64], "FP32")
        offset_only.set_data_from_numpy(x)
        offset_only._input.parameters["shared_memory_offset"].int64_param = 4
        cases.append(([offset_only], "parameter 'shared_memory_offset' without 'shared_memory_region'"))
        for region_name, size, offset, message in (
                ("nope", 40, 0, "output 'logits': no shared memory region 'nope' is registered"),
                (name, 40, 250, f"output 'logits': shared_memory_offset 250 + shared_memory_byte_size 40 run past the "
                                f"end of shared memory region '{name}' (256 bytes)")):
            output = grpcclient.InferRequestedOutput("logits")
            output.set_shared_memory(region_name, size, offset)
            cases.append(([plain], message, [output]))
        before = client.get_inference_statistics(MODEL).model_stats[0].inference_count
        for case in cases:
            inputs, message = case[0], case[1]
            status, text = _infer_error(client, inputs, case[2] if len(case) > 2 else None)
            assert status == "StatusCode.INVALID_ARGUMENT" and message in text, (status, text)
        # Refused before running: the model counted none of them.
        assert client.get_inference_statistics(MODEL).model_stats[0].inference_count == before

        # The region vanishes under the frontend: its object is truncated (the client destroyed and
        # re-created it smaller). Refused by name, and the frontend keeps serving.
        os.truncate(f"/dev/shm/{key.lstrip('/')}", 64)
        status, text = _infer_error(client, shm_input(name, 256))
        assert status == "StatusCode.INVALID_ARGUMENT"
        assert f"shared memory region '{name}': object '{key}' shrank to 64 bytes since it was registered" in text
        np.testing.assert_allclose(client.infer(MODEL, [plain], timeout=TIMEOUT_US).as_numpy("logits"),
                                   _expected(direct, x), rtol=1e-4, atol=1e-5)
        client.unregister_system_shared_memory(name)
        status, text = _infer_error(client, shm_input(name, 256))          # unregistered: unknown again
        assert status == "StatusCode.INVALID_ARGUMENT" and f"no shared memory region '{name}' is registered" in text

        # The client destroys the object and creates another under the same key: the frontend's
        # mapping is the old memory, which the client no longer writes. Refused by name.
        os.truncate(f"/dev/shm/{key.lstrip('/')}", 256)
        client.register_system_shared_memory(name, key, 256)
        shm.destroy_shared_memory_region(region)
        again = regions(name, 256)
        assert again._shm_key != key
        os.rename(f"/dev/shm/{again._shm_key.lstrip('/')}", f"/dev/shm/{key.lstrip('/')}")
        status, text = _infer_error(client, shm_input(name, 256))
        assert status == "StatusCode.INVALID_ARGUMENT"
        assert f"shared memory region '{name}': object '{key}' was destroyed and created anew since the region was " \
               f"registered" in text
    finally:
        client.unregister_system_shared_memory(name)
        client.close()
        pathlib.Path(f"/dev/shm/{key.lstrip('/')}").unlink(missing_ok=True)


def test_an_object_unlinked_after_registration_still_serves_as_in_triton(cluster, direct):
    client = grpcclient.InferenceServerClient(cluster.frontend)
    name = f"unlinked-{uuid.uuid4().hex[:8]}"
    handle = shm.create_shared_memory_region(name, _key("unlinked"), 256)
    try:
        x = np.random.default_rng(5).standard_normal((1, 64)).astype(np.float32)
        shm.set_shared_memory_region(handle, [x])
        client.register_system_shared_memory(name, handle._shm_key, 256)
        os.unlink(f"/dev/shm/{handle._shm_key.lstrip('/')}")        # gone from the host, still mapped by both
        tensor = grpcclient.InferInput("input", [1, 64], "FP32")
        tensor.set_shared_memory(name, 256)
        np.testing.assert_allclose(client.infer(MODEL, [tensor], timeout=TIMEOUT_US).as_numpy("logits"),
                                   _expected(direct, x), rtol=1e-4, atol=1e-5)
    finally:
        client.unregister_system_shared_memory(name)
        client.close()
        handle._mpsm_handle.close()


def test_http_refuses_shared_memory_mixed_with_data_and_bad_registrations(cluster):
    import json
    import urllib.error
    import urllib.request

    def post(path: str, doc: dict) -> tuple[int, str]:
        request = urllib.request.Request(f"http://{cluster.http}{path}", data=json.dumps(doc).encode(), method="POST")
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())["error"]

    status, error = post(f"/v2/models/{MODEL}/infer", {"inputs": [{
        "name": "input", "datatype": "FP32", "shape": [1, 64], "data": [0.0] * 64,
        "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 256}}]})
    assert status == 400 and error == "input 'input' has both a shared_memory_region and data"
    status, error = post("/v2/systemsharedmemory/region/r/register", {"key": 7, "byte_size": 8})
    assert status == 400 and "'key' must be a string" in error
    status, error = post("/v2/systemsharedmemory/region/r/register", {"key": "/k", "byte_size": -8})
    assert status == 400 and "'byte_size' must be a non-negative integer" in error
    status, error = post("/v2/systemsharedmemory/region/r/register", {"key": "/nexus-test-none", "byte_size": 8})
    assert status == 404 and "no shared-memory object with key '/nexus-test-none'" in error
    try:
        urllib.request.urlopen(f"http://{cluster.http}/v2/systemsharedmemory/region/nope/status", timeout=60)
        raise AssertionError("the status of an unknown region was answered")
    except urllib.error.HTTPError as exc:
        assert exc.code == 404 and json.loads(exc.read())["error"] == "no shared memory region 'nope' is registered"
    status, error = post("/v2/systemsharedmemory/region/r/register", {"key": "a/b", "byte_size": 8})
    assert status == 400 and "shared memory key 'a/b' is not a POSIX shared-memory name" in error
    status, error = post(f"/v2/models/{MODEL}/infer", {"inputs": [{
        "name": "input", "datatype": "FP32", "shape": [1, 64],
        "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 256, "shared_memory_offset": 8}}]})
    assert status == 400 and error == "input 'input': no shared memory region 'r' is registered"


def test_a_restricted_header_guards_the_shared_memory_calls_as_tritons_restricted_protocol():
    header = parse_restricted_header("shm-key=s3cret")
    service = KServeApi(FrontendState(), None, ProtocolAccess(), ProtocolAccess(header))
    calls = [("SystemSharedMemoryStatus", kserve.SystemSharedMemoryStatusRequest()),
             ("SystemSharedMemoryRegister", kserve.SystemSharedMemoryRegisterRequest(name="r", key="/k", byte_size=8)),
             ("SystemSharedMemoryUnregister", kserve.SystemSharedMemoryUnregisterRequest()),
             ("CudaSharedMemoryStatus", kserve.CudaSharedMemoryStatusRequest()),
             ("CudaSharedMemoryUnregister", kserve.CudaSharedMemoryUnregisterRequest())]
    for method, request in calls:
        with pytest.raises(RequestError) as info:
            asyncio.run(getattr(service, method)(request, Call(metadata=(("triton-grpc-protocol-shm-key", "wrong"),))))
        assert info.value.code is grpc.StatusCode.UNAVAILABLE and "this protocol is restricted" in str(info.value)
    admitted = Call(metadata=(("triton-grpc-protocol-shm-key", "s3cret"),))
    assert not asyncio.run(service.SystemSharedMemoryStatus(kserve.SystemSharedMemoryStatusRequest(), admitted)).regions
    open_service = KServeApi(FrontendState())            # Triton's default: open
    asyncio.run(open_service.SystemSharedMemoryUnregister(kserve.SystemSharedMemoryUnregisterRequest(), Call()))
