"""Hostile input on every port: property-based and byte-mutated requests against real processes.

A cluster (`nexus serve`, one CPU backend, a tiny MLP) takes the KServe fuzzing; a standalone
scheduler with a cluster token takes the control protocol's (Register, UploadModel), so that
fuzzed registrations that happen to decode cannot move the served model. Only the codes in
``harness.fuzzing.EXPECTED`` may come back, never UNKNOWN or INTERNAL; afterwards every server is
ready, the model still answers, and no log holds a traceback. Examples are bounded and derandomised
so the test takes well under a minute.
"""

from __future__ import annotations

import asyncio
import collections
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings

from common import grpc_util
from common.health import Health
from common.pb import control, control_grpc, kserve, kserve_grpc
from common.profile import Profile
from common.sample_models import mlp_small, model_bytes
from common.security import Credentials, token_metadata
from harness import fuzzing
from tests.conftest import NexusProcess, ServedModel, serve_models

pytestmark = pytest.mark.slow

MODEL, INPUT, FEATURES = "mlp", "input", 64
FUZZ = settings(max_examples=100, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SEEN: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(cluster, its log file, a channel to its frontend) with MODEL ready."""
    tmp = tmp_path_factory.mktemp("fuzz")
    log_path = tmp / "serve.log"
    model = tmp / "mlp.onnx"
    model.write_bytes(model_bytes(mlp_small()))
    profile = Profile.linear(0.2, 1.0, 32, memory_base_mb=5, device_type="cpu")
    with log_path.open("w") as log:
        cluster = serve_models(tmp, [ServedModel(model, MODEL, 1000, profile)], stderr=log)
    try:
        channel = grpc_util.channel(cluster.frontend)
        _wait_ready(channel)
        yield cluster, log_path, channel
        channel.close()
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def scheduler(tmp_path_factory):
    """A standalone scheduler with a cluster token: (process, token)."""
    tmp = tmp_path_factory.mktemp("fuzz-scheduler")
    token = tmp / "token"
    token.write_text("fuzz-token\n")
    proc = NexusProcess(tmp / "scheduler.log", "scheduler", "--listen", "127.0.0.1:0", "--data-dir", str(tmp / "db"),
                        "--token-file", str(token), "--max-upload-mb", "1")
    yield proc, "fuzz-token"
    proc.stop()


def _wait_ready(channel, timeout_s: float = 120) -> None:
    stub = kserve_grpc.GRPCInferenceServiceStub(channel)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if stub.ModelReady(kserve.ModelReadyRequest(name=MODEL), timeout=5).ready:
                return
        except grpc.RpcError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{MODEL} not ready in {timeout_s} s")


def _valid_infer() -> kserve.ModelInferRequest:
    req = kserve.ModelInferRequest(model_name=MODEL)
    req.inputs.add(name=INPUT, datatype="FP32", shape=[2, FEATURES])
    req.raw_input_contents.append(np.ones((2, FEATURES), np.float32).tobytes())
    return req


def _check(kind: str, code: str) -> None:
    SEEN[kind][code] += 1
    assert code in fuzzing.EXPECTED, f"{kind}: {code}"


@FUZZ
@given(request=fuzzing.infer_requests(MODEL, INPUT, FEATURES))
def test_property_based_infer_requests_get_expected_statuses(served, request):
    _, _, channel = served
    _check("ModelInfer (property-based)", fuzzing.call_unary(channel, fuzzing.KSERVE_INFER,
                                                             request.SerializeToString()))


@FUZZ
@given(payload=fuzzing.mutated(_valid_infer().SerializeToString()))
def test_mutated_infer_bytes_get_expected_statuses(served, payload):
    _, _, channel = served
    _check("ModelInfer (mutated bytes)", fuzzing.call_unary(channel, fuzzing.KSERVE_INFER, payload))


@settings(FUZZ, max_examples=50)
@given(stream=fuzzing.upload_streams(model_bytes(mlp_small(8, 8, 2))))
def test_mutated_upload_streams_get_expected_statuses(scheduler, stream):
    proc, token = scheduler
    with grpc_util.channel(proc.address) as channel:
        code = fuzzing.call_stream_unary(channel, fuzzing.UPLOAD, stream, metadata=token_metadata(token))
        _check("UploadModel (mutated, with token)", code)
        code = fuzzing.call_stream_unary(channel, fuzzing.UPLOAD, stream)
        assert code == "UNAUTHENTICATED"
        _check("UploadModel (mutated, no token)", code)


@settings(FUZZ, max_examples=50)
@given(payload=fuzzing.register_requests())
def test_mutated_registrations_get_expected_statuses(scheduler, payload):
    proc, token = scheduler
    with grpc_util.channel(proc.address) as channel:
        _check("Register (mutated, with token)",
               fuzzing.call_unary(channel, fuzzing.REGISTER, payload, metadata=token_metadata(token)))
        code = fuzzing.call_unary(channel, fuzzing.REGISTER, payload)
        assert code == "UNAUTHENTICATED"
        _check("Register (mutated, no token)", code)


def test_garbage_on_every_port_is_invalid_argument_with_one_log_line(served, scheduler):
    cluster, log_path, channel = served
    garbage = [b"\xff" * n for n in (1, 3, 17)] + [_valid_infer().SerializeToString()[:9]]
    for payload in garbage * 50:                       # 200 requests, as in the report
        assert fuzzing.call_unary(channel, fuzzing.KSERVE_INFER, payload) == "INVALID_ARGUMENT"
    stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer",
                                   request_serializer=lambda b: b, response_deserializer=lambda b: b)
    with pytest.raises(grpc.RpcError) as err:
        list(stream(iter([_valid_infer().SerializeToString(), b"\xff\xff"]), timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "undecodable" in err.value.details()
    # The frontend's control service: garbage with the token is undecodable; without, refused first.
    routing = "/nexus.control.Frontend/UpdateRoutingTable"
    assert fuzzing.call_unary(channel, routing, b"\xff\xfe", metadata=token_metadata(cluster.token)) \
        == "INVALID_ARGUMENT"
    assert fuzzing.call_unary(channel, routing, b"\xff\xfe") == "UNAUTHENTICATED"
    proc, token = scheduler
    with grpc_util.channel(proc.address, Credentials(token=token)) as sched:
        with pytest.raises(grpc.RpcError) as err:
            sched.unary_unary(fuzzing.REGISTER, request_serializer=lambda b: b)(b"\x0a\xff\xff", timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("undecodable RegisterRequest")
    warnings = [line for line in log_path.read_text().splitlines() if "refused undecodable request" in line]
    assert 1 <= len(warnings) <= 3, warnings     # rate-limited: one line per 10 s at most
    assert all(len(line) < 400 for line in warnings)


def test_decode_guard_covers_every_kind_of_rpc():
    """In process: unary, server-streaming, client-streaming and bidirectional methods."""
    class Backend(control_grpc.BackendServicer):
        async def Stats(self, request, context):
            return control.BackendStats()

        async def Execute(self, request_iterator, context):
            async for item in request_iterator:
                yield control.ExecResult(request_id=item.request_id)

    class Scheduler(control_grpc.SchedulerServicer):
        async def UploadModel(self, request_iterator, context):
            return control.UploadReply(model=control.ModelDesc(name=str(len([c async for c in request_iterator]))))

        async def DownloadModel(self, request, context):
            yield control.DownloadChunk(data=b"x")

    async def main():
        server = grpc_util.server()
        control_grpc.add_BackendServicer_to_server(Backend(), server)
        control_grpc.add_SchedulerServicer_to_server(Scheduler(), server)
        health = await Health.attach(server)
        address = grpc_util.bind(server, "127.0.0.1:0")
        await server.start()
        ident = dict(request_serializer=lambda b: b, response_deserializer=lambda b: b)
        codes = {}
        try:
            async with grpc_util.aio_channel(address) as ch:
                for name, call in (
                        ("unary", lambda p: ch.unary_unary("/nexus.control.Backend/Stats", **ident)(p, timeout=5)),
                        ("health", lambda p: ch.unary_unary("/grpc.health.v1.Health/Check", **ident)(p, timeout=5)),
                        ("server-stream", lambda p: _drain(ch.unary_stream(
                            "/nexus.control.Scheduler/DownloadModel", **ident)(p, timeout=5))),
                        ("client-stream", lambda p: ch.stream_unary(
                            "/nexus.control.Scheduler/UploadModel", **ident)(_aiter([b"", p]), timeout=5)),
                        ("bidi", lambda p: _drain(ch.stream_stream("/nexus.control.Backend/Execute", **ident)(
                            _aiter([control.ExecItem(request_id=1).SerializeToString(), p]), timeout=5)))):
                    for label, payload in (("good", b""), ("bad", b"\x0a\x05ab")):
                        try:
                            await call(payload)
                            codes[name, label] = "OK"
                        except grpc.aio.AioRpcError as exc:
                            codes[name, label] = exc.code().name
                check = health_pb2_grpc.HealthStub(ch).Check
                await health.set_ready(True)
                status = (await check(health_pb2.HealthCheckRequest(), timeout=5)).status
        finally:
            await server.stop(0)
        return codes, status

    codes, status = asyncio.run(main())
    assert {k: v for k, v in codes.items() if k[1] == "good"} == {(n, "good"): "OK" for n, _ in codes}
    assert {k: v for k, v in codes.items() if k[1] == "bad"} == {(n, "bad"): "INVALID_ARGUMENT" for n, _ in codes}
    assert status == health_pb2.HealthCheckResponse.SERVING


def test_a_stream_read_in_a_task_of_its_own_is_refused_without_racing_its_writes():
    """A servicer that reads its requests in a task while it writes responses (as the frontend's
    ModelStreamInfer and the backend's Execute do): the undecodable message arrives while a
    response is being written. The refusal must still come back as INVALID_ARGUMENT, every time; an
    abort from inside the reading task raced the write (GRPC_CALL_ERROR_TOO_MANY_OPERATIONS, a
    traceback, and the client left to its deadline)."""
    class Backend(control_grpc.BackendServicer):
        async def Execute(self, request_iterator, context):
            out: asyncio.Queue = asyncio.Queue()

            async def reader():
                try:
                    async for item in request_iterator:
                        for _ in range(20):       # responses in flight while the next message is read
                            out.put_nowait(control.ExecResult(request_id=item.request_id, outputs=[b"x" * 4096]))
                finally:
                    out.put_nowait(None)

            task = asyncio.create_task(reader())
            try:
                while (item := await out.get()) is not None:
                    yield item
                if task.exception() is not None:
                    raise task.exception()
            finally:
                task.cancel()

    async def main():
        server = grpc_util.server()
        control_grpc.add_BackendServicer_to_server(Backend(), server)
        address = grpc_util.bind(server, "127.0.0.1:0")
        await server.start()
        codes = collections.Counter()
        try:
            async with grpc_util.aio_channel(address) as ch:
                call = ch.stream_stream("/nexus.control.Backend/Execute", request_serializer=lambda b: b,
                                        response_deserializer=lambda b: b)
                for i in range(40):
                    try:
                        await _drain(call(_aiter([control.ExecItem(request_id=i).SerializeToString(), b"\x0a\x05ab"]),
                                          timeout=5))
                        codes["OK"] += 1
                    except grpc.aio.AioRpcError as exc:
                        codes[exc.code().name] += 1
        finally:
            await server.stop(0)
        return codes

    assert asyncio.run(main()) == {"INVALID_ARGUMENT": 40}


async def _drain(call):
    return [m async for m in call]


async def _aiter(items):
    for item in items:
        yield item


def test_zz_everything_still_serves_and_no_log_has_a_traceback(served, scheduler):
    cluster, log_path, channel = served
    stub = kserve_grpc.GRPCInferenceServiceStub(channel)
    assert stub.ServerReady(kserve.ServerReadyRequest(), timeout=10).ready
    assert stub.ModelReady(kserve.ModelReadyRequest(name=MODEL), timeout=10).ready
    reply = stub.ModelInfer(_valid_infer(), timeout=30)
    assert reply.outputs[0].shape == [2, 10]
    proc, token = scheduler
    with grpc_util.channel(proc.address, Credentials(token=token)) as ch:
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        control_grpc.SchedulerStub(ch).ListModels(control.ListModelsRequest(), timeout=10)
    for text in (log_path.read_text(), proc.logs()):
        assert "Traceback" not in text
    total = sum(sum(c.values()) for c in SEEN.values())
    print("fuzz statuses:", {k: dict(v) for k, v in SEEN.items()}, "total", total)
