"""The real tritonclient against `nexus serve`: metadata, config, infer, stream, errors, statistics."""

from __future__ import annotations

import asyncio
import queue
import time

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from tritonclient.utils import InferenceServerException

from common.pb import kserve, kserve_grpc
from common.profile import Profile
from common.sample_models import SAMPLE_MODELS, model_bytes, resnet18_64
from tests.conftest import nexus_cli

pytestmark = pytest.mark.slow

BURST_TIMEOUT_US = 20_000_000  # KServe 'timeout' parameter: this request's own deadline
# Correctness checks give their requests this deadline: a busy CI machine must not turn them into
# deadline drops (those are tested on their own).
CHECK_TIMEOUT_US = BURST_TIMEOUT_US


@pytest.fixture(scope="module")
def client(cluster):
    c = grpcclient.InferenceServerClient(cluster.frontend)
    yield c
    c.close()


def _input(client, model: str, batch: int, seed: int = 0):
    meta = client.get_model_metadata(model)
    inp = meta.inputs[0]
    shape = [batch, *[int(d) for d in inp.shape[1:]]]
    data = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    tensor = grpcclient.InferInput(inp.name, shape, inp.datatype)
    tensor.set_data_from_numpy(data)
    return inp.name, data, tensor


def test_server_health_and_metadata(client):
    assert client.is_server_live()
    assert client.is_server_ready()
    meta = client.get_server_metadata()
    assert meta.name == "nexus"
    assert "statistics" in meta.extensions


@pytest.mark.parametrize("model", list(SAMPLE_MODELS))
def test_model_metadata_config_and_infer_match_onnxruntime(client, direct, model):
    assert client.is_model_ready(model)
    meta = client.get_model_metadata(model)
    session = direct[model]
    assert [i.name for i in meta.inputs] == [i.name for i in session.get_inputs()]
    assert [o.name for o in meta.outputs] == [o.name for o in session.get_outputs()]
    for tensor in list(meta.inputs) + list(meta.outputs):
        assert tensor.shape[0] == -1 and tensor.datatype == "FP32"
    config = client.get_model_config(model).config
    assert config.max_batch_size > 0
    assert [i.name for i in config.input] == [i.name for i in meta.inputs]
    assert list(config.input[0].dims) == list(meta.inputs[0].shape[1:])
    for batch in (1, 3):
        name, data, tensor = _input(client, model, batch, seed=batch)
        result = client.infer(model, [tensor], timeout=CHECK_TIMEOUT_US)
        expected = session.run(None, {name: data})
        for out, exp in zip(meta.outputs, expected):
            got = result.as_numpy(out.name)
            assert got.shape == exp.shape
            np.testing.assert_allclose(got, exp, rtol=1e-5, atol=1e-6)


def test_200_concurrent_async_requests_all_correct(cluster, direct):
    model = "resnet18_64"
    session = direct[model]
    rng = np.random.default_rng(7)
    datas = [rng.standard_normal((1, 3, 64, 64)).astype(np.float32) for _ in range(200)]

    async def main():
        c = aioclient.InferenceServerClient(cluster.frontend)
        try:
            async def one(d):
                t = aioclient.InferInput("input", list(d.shape), "FP32")
                t.set_data_from_numpy(d)
                # A burst of 200 needs more than the 100 ms default SLO on a CPU: ask for 20 s.
                return await c.infer(model, [t], timeout=BURST_TIMEOUT_US)
            return await asyncio.gather(*[one(d) for d in datas])
        finally:
            await c.close()

    results = asyncio.run(main())
    out_name = session.get_outputs()[0].name
    expected = session.run(None, {"input": np.concatenate(datas)})[0]
    for i, r in enumerate(results):
        np.testing.assert_allclose(r.as_numpy(out_name)[0], expected[i], rtol=1e-5, atol=1e-5)


def test_batching_is_real(cluster, client, tmp_path):
    """Under concurrent load, batches hold several requests: execution_count well below inference_count.

    The model is uploaded with a generous profile of its own, so the plan allows batches whatever
    the machine measured for the samples (a busy machine's profile may cap them at one)."""
    model = "batching_r18"
    path = tmp_path / "r18.onnx"
    path.write_bytes(model_bytes(resnet18_64()))
    profile = tmp_path / "profile.json"
    profile.write_text(Profile.linear(3.0, 5.0, 32, memory_base_mb=50, memory_per_item_mb=1,
                                      device_type="cpu").to_json())
    up = nexus_cli("models", "upload", str(path), "--name", model, "--profile", str(profile),
                   "--slo-ms", "2000", "--scheduler", cluster.scheduler)
    assert up.returncode == 0, up.stderr
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and not client.is_model_ready(model):
        time.sleep(0.3)
    before = client.get_inference_statistics(model).model_stats[0]
    data = np.random.default_rng(1).standard_normal((1, 3, 64, 64)).astype(np.float32)

    async def main():
        c = aioclient.InferenceServerClient(cluster.frontend)
        try:
            async def one():
                t = aioclient.InferInput("input", [1, 3, 64, 64], "FP32")
                t.set_data_from_numpy(data)
                return await c.infer(model, [t], timeout=BURST_TIMEOUT_US)
            await asyncio.gather(*[one() for _ in range(120)])
        finally:
            await c.close()

    asyncio.run(main())
    after = client.get_inference_statistics(model).model_stats[0]
    inferences = after.inference_count - before.inference_count
    executions = after.execution_count - before.execution_count
    assert inferences == 120
    assert 0 < executions <= inferences / 2, (inferences, executions)
    assert any(b.batch_size > 1 for b in after.batch_stats)
    assert after.inference_stats.success.count >= 120
    assert after.inference_stats.compute_infer.ns > 0


def test_stream_infer_correct(client, direct):
    model = "vehicle_cls"
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        sent = []
        for i in range(8):
            name, data, tensor = _input(client, model, 1, seed=100 + i)
            client.async_stream_infer(model, [tensor], request_id=str(i), timeout=CHECK_TIMEOUT_US)
            sent.append(data)
        got = {}
        for _ in range(8):
            result, error = results.get(timeout=60)
            assert error is None, error
            response = result.get_response()
            got[response.id] = result
    finally:
        client.stop_stream()
    session = direct[model]
    out_name = session.get_outputs()[0].name
    for i, data in enumerate(sent):
        expected = session.run(None, {"input": data})[0]
        np.testing.assert_allclose(got[str(i)].as_numpy(out_name), expected, rtol=1e-5, atol=1e-6)


def _status(exc: InferenceServerException) -> str:
    return exc.status()


def test_bad_requests_get_precise_errors_and_server_keeps_serving(cluster, client):
    model = "mlp_small"
    name, data, good = _input(client, model, 2)
    shape = list(data.shape)
    with pytest.raises(InferenceServerException) as e:
        client.infer("no_such_model", [good])
    assert "NOT_FOUND" in _status(e.value) and "no_such_model" in e.value.message()

    wrong_dtype = grpcclient.InferInput(name, shape, "FP64")
    wrong_dtype.set_data_from_numpy(data.astype(np.float64))
    with pytest.raises(InferenceServerException) as e:
        client.infer(model, [wrong_dtype])
    assert "INVALID_ARGUMENT" in _status(e.value) and "datatype" in e.value.message()

    bad_shape = [2, shape[1] + 1]
    wrong_shape = grpcclient.InferInput(name, bad_shape, "FP32")
    wrong_shape.set_data_from_numpy(np.zeros(bad_shape, np.float32))
    with pytest.raises(InferenceServerException) as e:
        client.infer(model, [wrong_shape])
    assert "INVALID_ARGUMENT" in _status(e.value) and "shape" in e.value.message()

    # tritonclient always sends consistent bytes; a raw KServe request can lie about its length.
    with grpc.insecure_channel(cluster.frontend) as channel:
        stub = kserve_grpc.GRPCInferenceServiceStub(channel)
        request = kserve.ModelInferRequest(model_name=model, raw_input_contents=[data.tobytes()[:-4]])
        request.inputs.add(name=name, datatype="FP32", shape=shape)
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelInfer(request, timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "bytes" in e.value.details()

    wrong_name = grpcclient.InferInput("nope", shape, "FP32")
    wrong_name.set_data_from_numpy(data)
    with pytest.raises(InferenceServerException) as e:
        client.infer(model, [wrong_name])
    assert "INVALID_ARGUMENT" in _status(e.value) and "nope" in e.value.message()

    with pytest.raises(InferenceServerException) as e:
        client.get_model_metadata("no_such_model")
    assert "NOT_FOUND" in _status(e.value)

    result = client.infer(model, [good], timeout=CHECK_TIMEOUT_US)
    assert result.as_numpy(client.get_model_metadata(model).outputs[0].name).shape[0] == 2
    assert client.is_server_ready()


def test_repository_index_lists_every_model(client):
    index = client.get_model_repository_index()
    names = {m.name: m.state for m in index.models}
    for model in SAMPLE_MODELS:
        assert names.get(model) == "READY"


def test_statistics_of_unknown_model_is_not_found(client):
    with pytest.raises(InferenceServerException) as e:
        client.get_inference_statistics("no_such_model")
    assert "NOT_FOUND" in _status(e.value)
