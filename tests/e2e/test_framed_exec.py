"""The framed execute channel between frontends and backends (common/exec_frames.py), on real processes:
the frontend uses it, a backend without it is served on the gRPC stream, and a stranger's bytes on
its port (garbage, a wrong token, an oversized or unknown frame, an undecodable item) are refused on
that connection alone: the backend serves on, and nothing logs a traceback.
"""

from __future__ import annotations

import socket
import struct

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from common import grpc_util
from common.exec_frames import HEADER, MAX_FRAME_BYTES, MAX_HELLO_BYTES, PROTOCOL, FrameKind, FrameReader, hello
from common.exec_status import ExecStatus
from common.pb import control, control_grpc
from common.profile import Profile
from common.sample_models import mlp_small, model_bytes
from common.security import Credentials
from tests.components import wait_for
from tests.conftest import NexusProcess, nexus_cli

TOKEN = "framed-token"
MODEL = "mlp"


class Served:
    """A scheduler, one backend and one frontend with a cluster token, MODEL ready."""

    def __init__(self, tmp, *backend_args: str) -> None:
        token = tmp / "token"
        token.write_text(TOKEN + "\n")
        self.procs: list[NexusProcess] = []

        def start(name: str, *argv: str) -> NexusProcess:
            proc = NexusProcess(tmp / f"{name}.log", *argv, "--token-file", str(token))
            self.procs.append(proc)
            return proc

        try:
            self.scheduler = start("scheduler", "scheduler", "--listen", "127.0.0.1:0", "--data-dir", str(tmp / "db"))
            self.backend = start("backend", "backend", "--scheduler", self.scheduler.address, "--listen",
                                 "127.0.0.1:0", "--threads", "1", *backend_args)
            self.frontend = start("frontend", "frontend", "--scheduler", self.scheduler.address, "--listen",
                                  "127.0.0.1:0")
            model = tmp / "mlp.onnx"
            model.write_bytes(model_bytes(mlp_small()))
            profile = tmp / "profile.json"
            profile.write_text(Profile.linear(0.2, 1.0, 32, memory_base_mb=5, device_type="cpu").to_json())
            up = nexus_cli("models", "upload", str(model), "--name", MODEL, "--profile", str(profile), "--slo-ms",
                           "1000", "--scheduler", self.scheduler.address, "--token-file", str(token))
            assert up.returncode == 0, up.stderr
            client = grpcclient.InferenceServerClient(self.frontend.address)
            wait_for(lambda: _ready(client), timeout_s=90, what=f"{MODEL} ready")
            with grpc_util.channel(self.backend.address, Credentials(token=TOKEN)) as ch:
                self.exec_port = control_grpc.BackendStub(ch).ExecEndpoint(control.ExecEndpointRequest(),
                                                                           timeout=10).port
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    served = Served(tmp_path_factory.mktemp("framed"))
    yield served
    served.stop()


def _ready(client) -> bool:
    try:
        return client.is_model_ready(MODEL)
    except Exception:
        return False


def _infer(frontend_address: str, rows: int = 2) -> np.ndarray:
    client = grpcclient.InferenceServerClient(frontend_address)
    inp = grpcclient.InferInput("input", [rows, 64], "FP32")
    inp.set_data_from_numpy(np.ones((rows, 64), np.float32))
    result = client.infer(MODEL, [inp])
    return result.as_numpy(result.get_response().outputs[0].name)


def _frame(kind: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(len(payload), kind) + payload


def _exchange(port: int, data: bytes, expect_frames: int = 1, timeout_s: float = 10) -> tuple[list, bool]:
    """Send ``data`` to the exec port; the frames read back (up to ``expect_frames``) and whether the
    backend closed the connection."""
    reader, frames, closed = FrameReader(), [], False
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(data)
        while len(frames) < expect_frames:
            chunk = sock.recv(65536)
            if not chunk:
                closed = True
                break
            frames += reader.feed(chunk)
        if not closed:
            sock.settimeout(1.0)
            try:
                closed = sock.recv(65536) == b""
            except socket.timeout:
                closed = False
    return frames, closed


def _item(request_id: int, rows: int = 1, model: str = MODEL) -> control.ExecItem:
    return control.ExecItem(request_id=request_id, model=model, budget_us=5_000_000, rows=rows,
                            inputs=[np.ones((rows, 64), np.float32).tobytes()])


def test_the_frontend_sends_on_the_framed_channel(cluster):
    assert cluster.exec_port > 0
    assert _infer(cluster.frontend.address).shape == (2, 10)
    assert f"requests to backend {cluster.backend.address} go on its framed execute channel" \
        in cluster.frontend.logs()
    assert "using its gRPC stream" not in cluster.frontend.logs()


def test_a_peer_with_the_token_is_served_frame_by_frame(cluster):
    port = cluster.exec_port
    data = (_frame(FrameKind.HELLO, hello(TOKEN)) + _frame(FrameKind.ITEM, _item(1, rows=3).SerializeToString())
            + _frame(FrameKind.ITEM, _item(2, model="nope").SerializeToString()) + _frame(FrameKind.PING))
    frames, closed = _exchange(port, data, expect_frames=4)
    assert not closed
    kinds = [k for k, _ in frames]
    assert kinds[0] is FrameKind.ACCEPTED and FrameKind.PONG in kinds
    results = {r.request_id: r for r in (control.ExecResult.FromString(p) for k, p in frames
                                         if k is FrameKind.RESULT)}
    assert results[1].status == ExecStatus.OK and len(results[1].outputs[0]) == 3 * 10 * 4
    assert list(results[1].output_shapes[0].shape) == [3, 10]
    assert results[2].status == ExecStatus.NOT_FOUND and "nope" in results[2].message


def test_a_frame_split_across_writes_is_reassembled(cluster):
    port = cluster.exec_port
    data = _frame(FrameKind.HELLO, hello(TOKEN)) + _frame(FrameKind.ITEM, _item(7).SerializeToString())
    reader, frames = FrameReader(), []
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        for i in range(0, len(data), 7):        # 7 bytes at a time: headers and payloads cut anywhere
            sock.sendall(data[i:i + 7])
        while len(frames) < 2:
            chunk = sock.recv(65536)
            assert chunk, "the backend closed the connection"
            frames += reader.feed(chunk)
    assert frames[0][0] is FrameKind.ACCEPTED
    assert control.ExecResult.FromString(frames[1][1]).status == ExecStatus.OK


@pytest.mark.parametrize("data, reason", [
    (_frame(FrameKind.HELLO, hello("not-the-token")), b"wrong cluster token"),
    (_frame(FrameKind.HELLO, hello(None)), b"missing cluster token"),
    (_frame(FrameKind.HELLO, b"http/1.1\n" + TOKEN.encode()), b"expected protocol " + PROTOCOL),
    (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"unknown frame kind"),
    (_frame(FrameKind.ITEM, _item(1).SerializeToString()), b"unexpected ITEM frame before the hello"),
    (struct.pack("<IB", MAX_HELLO_BYTES + 1, FrameKind.HELLO), b"HELLO frame of 4097 bytes is over the limit of 4096"),
    (_frame(FrameKind.HELLO, hello(TOKEN)) + struct.pack("<IB", MAX_FRAME_BYTES + 1, FrameKind.ITEM),
     b"over the limit of 268435456"),
    (_frame(FrameKind.HELLO, hello(TOKEN)) + _frame(FrameKind.ITEM, b"\xff\xff\xff"), b""),
    (_frame(FrameKind.HELLO, hello(TOKEN)) + _frame(FrameKind.RESULT, b""), b"unexpected RESULT frame"),
], ids=["wrong-token", "no-token", "other-protocol", "http", "item-first", "oversized-hello", "oversized-item",
        "undecodable-item",
        "result-frame"])
def test_a_stranger_is_refused_on_its_connection_alone(cluster, data, reason):
    frames, closed = _exchange(cluster.exec_port, data, expect_frames=3)
    assert closed
    denied = [p for k, p in frames if k is FrameKind.DENIED]
    assert len(denied) == 1 and reason in denied[0], frames
    assert _infer(cluster.frontend.address).shape == (2, 10)      # everyone else is served on


def test_zz_no_log_has_a_traceback_and_refusals_are_logged(cluster):
    assert "framed execute connection from 127.0.0.1" in cluster.backend.logs()
    for p in cluster.procs:
        assert "Traceback" not in p.logs(), p.log_path


def test_a_backend_without_the_channel_is_served_on_the_grpc_stream(tmp_path):
    served = Served(tmp_path, "--exec-port", "-1")
    try:
        assert served.exec_port == 0
        assert _infer(served.frontend.address).shape == (2, 10)
        logs = served.frontend.logs()
        assert f"requests to backend {served.backend.address} go on its gRPC Execute stream" in logs
        assert "framed" not in logs
    finally:
        served.stop()


def test_exec_port_out_of_range_is_refused(tmp_path):
    out = nexus_cli("backend", "--exec-port", "70000", "--scheduler", "127.0.0.1:1")
    assert out.returncode == 2 and "--exec-port: expected -1 (none), 0 (any free port) or a port number" in out.stderr


def test_exec_port_taken_is_named(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = nexus_cli("backend", "--exec-port", str(port), "--listen", "127.0.0.1:0", "--scheduler", "127.0.0.1:1")
    assert out.returncode != 0 and f"cannot serve --exec-port {port} on 127.0.0.1" in out.stderr
