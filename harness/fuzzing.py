"""Hostile input for tests/e2e/test_fuzz.py and benchmarks/fuzz.py: hypothesis strategies and raw senders
(hypothesis is a test dependency: ``pip install -e ".[test]"``).

- :func:`infer_requests`: KServe ``ModelInferRequest`` messages, from well formed to absurd (names,
  datatypes, shapes, raw contents, typed contents, parameters, requested outputs).
- :func:`mutated`: byte-level mutations (flips, truncation, insertion, deletion, duplication) of a
  valid serialised message, sent as raw bytes so that the server sees exactly them.
- :func:`upload_streams`: UploadModel streams of mutated header and data chunks.
Every call's status code is returned by name; :data:`EXPECTED` lists the codes a server may answer.
"""

from __future__ import annotations

import grpc
from hypothesis import strategies as st

from common.pb import control, kserve

EXPECTED = frozenset({"OK", "INVALID_ARGUMENT", "NOT_FOUND", "UNAUTHENTICATED", "RESOURCE_EXHAUSTED", "UNAVAILABLE",
                      "DEADLINE_EXCEEDED", "FAILED_PRECONDITION"})
KSERVE_INFER = "/inference.GRPCInferenceService/ModelInfer"
UPLOAD = "/nexus.control.Scheduler/UploadModel"
REGISTER = "/nexus.control.Scheduler/Register"
DATATYPES = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32", "FP64",
             "BF16", "BYTES"]
_IDENTITY = dict(request_serializer=lambda b: b, response_deserializer=lambda b: b)


def infer_requests(model: str, input_name: str, features: int):
    """ModelInferRequests for a model with one FP32 input [batch, features]: about a third well formed."""
    names = st.one_of(st.just(model), st.just(model), st.just(""), st.text(max_size=12))
    tensor_names = st.one_of(st.just(input_name), st.text(max_size=8))
    datatypes = st.one_of(st.sampled_from(DATATYPES), st.text(max_size=6))
    dims = st.one_of(st.integers(-3, 70), st.sampled_from([0, features, 2 ** 31, 2 ** 40, 2 ** 62, -2 ** 62]))
    shapes = st.lists(dims, max_size=4)

    @st.composite
    def valid(draw):
        rows = draw(st.integers(1, 8))
        req = kserve.ModelInferRequest(model_name=model)
        req.inputs.add(name=input_name, datatype="FP32", shape=[rows, features])
        req.raw_input_contents.append(draw(st.binary(min_size=rows * features * 4, max_size=rows * features * 4)))
        if draw(st.booleans()):
            req.parameters["timeout"].int64_param = draw(st.integers(-2 ** 63, 2 ** 63 - 1))
        if draw(st.booleans()):
            req.outputs.add(name=draw(st.one_of(st.just("logits"), st.text(max_size=6))))
        return req

    @st.composite
    def arbitrary(draw):
        req = kserve.ModelInferRequest(model_name=draw(names), model_version=draw(st.sampled_from(["", "1", "7"])),
                                       id=draw(st.text(max_size=8)))
        for _ in range(draw(st.integers(0, 3))):
            t = req.inputs.add(name=draw(tensor_names), datatype=draw(datatypes), shape=draw(shapes))
            if draw(st.booleans()):
                t.contents.fp32_contents.extend(draw(st.lists(st.floats(width=32), max_size=70)))
            if draw(st.booleans()):
                t.contents.int_contents.extend(draw(st.lists(st.integers(-2 ** 31, 2 ** 31 - 1), max_size=10)))
        for _ in range(draw(st.integers(0, 3))):
            req.raw_input_contents.append(draw(st.binary(max_size=600)))
        if draw(st.booleans()):
            kind = draw(st.sampled_from(["int64_param", "string_param", "bool_param", "double_param"]))
            value = {"int64_param": st.integers(-2 ** 63, 2 ** 63 - 1), "string_param": st.text(max_size=5),
                     "bool_param": st.booleans(), "double_param": st.floats()}[kind]
            setattr(req.parameters[draw(st.sampled_from(["timeout", "priority", "x"]))], kind, draw(value))
        return req

    return st.one_of(valid(), arbitrary())


@st.composite
def mutated(draw, data: bytes):
    """``data`` after one to four random byte-level edits."""
    buf = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "delete", "duplicate", "set"]))
        at = draw(st.integers(0, max(len(buf) - 1, 0)))
        if op == "flip" and buf:
            buf[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and buf:
            buf[at] = draw(st.sampled_from([0x00, 0xFF, 0x7F, 0x80, 0x0A, 0x12]))
        elif op == "truncate":
            del buf[at:]
        elif op == "insert":
            buf[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete":
            del buf[at:at + draw(st.integers(1, 16))]
        elif op == "duplicate":
            buf[at:at] = buf[at:at + draw(st.integers(1, 32))]
    return bytes(buf)


def upload_streams(model_file: bytes):
    """Raw UploadModel streams: a mutated header chunk, then zero to three data chunks, each either
    intact or mutated, sometimes a second header."""
    header = control.UploadChunk(header=control.UploadHeader(name="fuzzed", runtime="onnxruntime", load=False))
    data = control.UploadChunk(data=model_file).SerializeToString()
    head = st.one_of(mutated(header.SerializeToString()), st.just(header.SerializeToString()))
    body = st.lists(st.one_of(st.just(data), mutated(data), st.binary(max_size=64)), max_size=3)
    return st.tuples(head, body).map(lambda hb: [hb[0], *hb[1]])


def register_requests():
    base = control.RegisterRequest(kind=control.NODE_KIND_FRONTEND, address="127.0.0.1:9", device="fuzz",
                                   device_type="fuzz", memory_mb=1.0).SerializeToString()
    return mutated(base)


def call_unary(channel: grpc.Channel, method: str, payload: bytes, metadata=(), timeout_s: float = 10) -> str:
    """Send ``payload`` as the raw request of ``method``; the status code's name."""
    try:
        channel.unary_unary(method, **_IDENTITY)(payload, metadata=metadata, timeout=timeout_s)
        return "OK"
    except grpc.RpcError as exc:
        return exc.code().name


def call_stream_unary(channel: grpc.Channel, method: str, payloads: list[bytes], metadata=(),
                      timeout_s: float = 10) -> str:
    try:
        channel.stream_unary(method, **_IDENTITY)(iter(payloads), metadata=metadata, timeout=timeout_s)
        return "OK"
    except grpc.RpcError as exc:
        return exc.code().name
