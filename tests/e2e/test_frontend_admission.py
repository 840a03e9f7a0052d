"""Every transport is taken in alike by the frontend's dispatch core (frontend/frontend_state.py):
- a request sent the moment a restarted frontend listens, over HTTP/REST, gRPC or ModelStreamInfer,
  waits for the frontend's first routing table and is answered (not 404 / NOT_FOUND);
- a ModelStreamInfer request in flight when the frontend gets SIGTERM is answered before it exits.

Real processes: a scheduler, an emulated backend and a frontend. The frontend reaches the scheduler
through a TCP gate that holds new connections while closed, which holds its first table back; the
scheduler is paused (SIGSTOP) and the backend killed to keep a request from any backend while the
frontend drains."""

from __future__ import annotations

import http.client
import json
import os
import queue
import signal
import socket
import threading
import urllib.request

import grpc
import numpy as np
import pytest

from common.config import BackendConfig, FrontendConfig, SchedulerConfig, split_host_port
from common.pb import kserve, kserve_grpc
from common.profile import Profile
from common.sample_models import mlp_small, model_bytes
from nexus.launcher import launch
from tests.components import infer_request, wait_for, wait_ready
from tests.conftest import nexus_cli
from tests.tcp_relay import TcpRelay

pytestmark = pytest.mark.slow

MODEL = "mlp"
DEVICE = "t4"


def in_flight(metrics_url: str) -> int:
    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith("nexus_requests_in_flight "):
                return int(float(line.split()[1]))
    return -1


class Stream:
    """One ModelStreamInfer call, read on a thread: every response by request id, and how the call ended."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.requests: queue.Queue = queue.Queue()
        self.responses: dict[str, kserve.ModelStreamInferResponse] = {}
        self.ended: str | None = None           # "OK", or the status the call ended with
        call = kserve_grpc.GRPCInferenceServiceStub(self.channel).ModelStreamInfer(iter(self.requests.get, None))
        threading.Thread(target=self._read, args=(call,), daemon=True).start()

    def _read(self, call) -> None:
        try:
            for response in call:
                self.responses[response.infer_response.id] = response
            self.ended = "OK"
        except grpc.RpcError as exc:
            self.ended = exc.code().name

    def send(self, request_id: str, timeout_us: int = 0) -> None:
        request = infer_request(MODEL, timeout_us=timeout_us)
        request.id = request_id
        self.requests.put(request)

    def answer(self, request_id: str, timeout_s: float = 60) -> kserve.ModelStreamInferResponse | str:
        """The response to ``request_id``, or how the call ended without one."""
        return wait_for(lambda: self.responses.get(request_id) or self.ended, timeout_s, f"{request_id} answered")

    def close(self) -> None:
        self.requests.put(None)
        self.channel.close()


def http_infer(address: str) -> tuple[int, dict]:
    body = json.dumps({"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": [0.5] * 64}]})
    conn = http.client.HTTPConnection(address, timeout=60)
    try:
        conn.request("POST", f"/v2/models/{MODEL}/infer", body=body, headers={"Content-Type": "application/json"})
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read())
    finally:
        conn.close()


def grpc_infer(address: str) -> str:
    with grpc.insecure_channel(address) as channel:
        try:
            kserve_grpc.GRPCInferenceServiceStub(channel).ModelInfer(infer_request(MODEL), timeout=60)
            return "OK"
        except grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()}"


def in_thread(fn, *args) -> list:
    """Run ``fn(*args)`` on a thread; its result lands in the returned list."""
    out: list = []
    threading.Thread(target=lambda: out.append(fn(*args)), daemon=True).start()
    return out


@pytest.fixture
def nodes(tmp_path):
    """A scheduler serving MODEL on one emulated backend, a gate in front of it, and a function that
    starts a frontend registering through the gate."""
    env = dict(os.environ, NEXUS_LOG="WARNING")
    scheduler = launch(SchedulerConfig(listen="127.0.0.1:0", data_dir=tmp_path / "db"), env=env)
    started = [scheduler]
    try:
        s = scheduler.wait_ready(60)
        model, profile = tmp_path / "mlp.onnx", tmp_path / "profile.json"
        model.write_bytes(model_bytes(mlp_small()))
        profile.write_text(Profile.linear(0.1, 2.0, 16, device_type=DEVICE).to_json())
        up = nexus_cli("models", "upload", str(model), "--name", MODEL, "--profile", str(profile),
                       "--slo-ms", "1000", "--scheduler", s)
        assert up.returncode == 0, up.stderr
        started.append(launch(BackendConfig(scheduler=s, listen="127.0.0.1:0", device=f"emulated:{DEVICE}"), env=env))
        started[-1].wait_ready(60)

        gate = TcpRelay(s)

        def frontend():
            child = launch(FrontendConfig(scheduler=gate.address, listen="127.0.0.1:0", drain_grace_s=30), env=env)
            started.append(child)
            child.wait_ready(60)
            return child

        yield scheduler, started[1], gate, frontend
        gate.close()
    finally:
        scheduler.signal(signal.SIGCONT)
        for child in reversed(started):
            child.stop(timeout_s=60)


def test_a_request_on_any_transport_as_a_restarted_frontend_opens_waits_for_its_first_table(nodes):
    _, _, gate, start_frontend = nodes
    frontend = start_frontend()
    wait_ready(frontend.address, MODEL)
    assert frontend.stop(timeout_s=60) == 0
    gate.opened.clear()                        # the restarted frontend gets no table until it opens
    frontend.start()
    frontend.wait_ready(60)
    address, http_address, metrics = frontend.address, frontend.info["http"], frontend.info["metrics"]
    stream = Stream(address)
    try:
        over_http = in_thread(http_infer, http_address)
        over_grpc = in_thread(grpc_infer, address)
        stream.send("held")
        # All three reach the frontend before its table (or, where they are not held, are answered at once).
        wait_for(lambda: in_flight(metrics) == 3 or (over_http and over_grpc and stream.responses), 30,
                 "three requests held, or answered")
        gate.opened.set()
        status, body = wait_for(lambda: over_http and over_http[0], 60, "HTTP answered")
        assert status == 200, body
        assert body["outputs"][0]["name"] == "logits" and body["outputs"][0]["shape"] == [1, 10]
        assert wait_for(lambda: over_grpc and over_grpc[0], 60, "gRPC answered") == "OK"
        answer = stream.answer("held")
        assert not isinstance(answer, str) and not answer.error_message, answer
        logits = np.frombuffer(answer.infer_response.raw_output_contents[0], np.float32)
        assert logits.shape == (10,)
    finally:
        stream.close()


def test_a_stream_request_in_flight_at_sigterm_is_answered_before_the_frontend_exits(nodes):
    scheduler, backend, _, start_frontend = nodes
    frontend = start_frontend()
    wait_ready(frontend.address, MODEL)
    stream = Stream(frontend.address)
    try:
        stream.send("first")
        first = stream.answer("first")
        assert not isinstance(first, str) and not first.error_message, first
        # No backend, and no scheduler to repair the plan: the next request waits at the frontend,
        # not at a backend, until its own deadline (4 s), which the drain must wait for.
        scheduler.signal(signal.SIGSTOP)
        backend.proc.kill()
        backend.proc.wait()
        stream.send("in-flight", timeout_us=4_000_000)
        frontend.signal(signal.SIGTERM)
        answer = stream.answer("in-flight")
        assert not isinstance(answer, str), f"the stream ended ({answer}) without answering the request"
        assert answer.error_message.startswith("UNAVAILABLE: model 'mlp' is not available"), answer
        assert frontend.proc.wait(timeout=60) == 0
    finally:
        stream.close()


def refuses_connections(address: str) -> bool:
    try:
        socket.create_connection(split_host_port(address), timeout=5).close()
        return False
    except ConnectionRefusedError:
        return True


def test_a_request_on_an_idle_keep_alive_connection_as_the_frontend_drains_is_answered_and_closes_it(nodes):
    # A drain that closed idle keep-alive connections at once would lose a request the client was
    # sending on one just then; the drain answers it instead, and says the connection closes.
    _, _, _, start_frontend = nodes
    frontend = start_frontend()
    wait_ready(frontend.address, MODEL)
    body = json.dumps({"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": [0.5] * 64}]})
    conn = http.client.HTTPConnection(frontend.info["http"], timeout=60)
    try:
        for when in ("before", "draining"):
            if when == "draining":
                frontend.signal(signal.SIGTERM)
                wait_for(lambda: refuses_connections(frontend.info["http"]), 30, "the HTTP port closed")
            conn.request("POST", f"/v2/models/{MODEL}/infer", body=body, headers={"Content-Type": "application/json"})
            reply = conn.getresponse()
            assert reply.status == 200, (when, reply.read())
            assert json.loads(reply.read())["outputs"][0]["shape"] == [1, 10]
            assert (reply.getheader("Connection") == "close") == (when == "draining"), reply.getheaders()
    finally:
        conn.close()
    assert frontend.proc.wait(timeout=60) == 0
