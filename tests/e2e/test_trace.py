"""``nexus frontend --trace PATH``: per-request timelines whose phases add up (frontend/trace.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest

from common.pb import kserve, kserve_grpc
from common.exec_status import ExecStatus
from frontend.backend_pool import Reply
from frontend.trace import PHASES, Marks, phases
from tests.conftest import NexusProcess

MODEL = "mlp_small"


def test_phases_add_up_to_the_total_and_keep_their_order():
    reply = Reply(ExecStatus.OK, queue_ns=300, compute_ns=500, compute_input_ns=40, backend_ns=1_000, batch_size=2)
    marks = Marks(start=10_000, validated=10_100, sent=10_150, replied=12_150)
    ph = phases(marks, 12_400, reply)
    assert tuple(ph) == PHASES
    assert sum(ph.values()) == 12_400 - 10_000
    assert ph == {"validate": 100, "route": 50, "hop": 1_000, "backend_edge": 200, "queue": 300,
                  "batch_assembly": 40, "compute": 460, "response": 250}


def _infer_request() -> kserve.ModelInferRequest:
    req = kserve.ModelInferRequest(model_name=MODEL)
    req.inputs.add(name="input", datatype="FP32", shape=[1, 64])
    req.raw_input_contents.append(np.ones((1, 64), np.float32).tobytes())
    return req


@pytest.mark.slow
def test_a_traced_frontend_writes_one_consistent_timeline_per_sampled_request(cluster, tmp_path):
    trace = tmp_path / "trace.jsonl"
    token = tmp_path / "token"
    token.write_text(cluster.token + "\n")
    frontend = NexusProcess(tmp_path / "frontend.log", "frontend", "--scheduler", cluster.scheduler,
                            "--listen", "127.0.0.1:0", "--http-listen", "", "--metrics-listen", "",
                            "--report-interval-s", "0.3", "--token-file", str(token),
                            "--trace", str(trace), "--trace-every", "2")
    try:
        with grpc.insecure_channel(frontend.address) as ch:
            stub = kserve_grpc.GRPCInferenceServiceStub(ch)
            deadline = time.monotonic() + 60
            while not stub.ModelReady(kserve.ModelReadyRequest(name=MODEL), timeout=5).ready:
                assert time.monotonic() < deadline, frontend.logs()
                time.sleep(0.2)
            for _ in range(20):
                reply = stub.ModelInfer(_infer_request(), timeout=10)
                assert reply.model_name == MODEL
            deadline = time.monotonic() + 20
            lines: list[str] = []
            while len(lines) < 10 and time.monotonic() < deadline:      # written at each report (0.3 s)
                time.sleep(0.2)
                lines = trace.read_text().splitlines() if trace.exists() else []
    finally:
        frontend.stop()
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(records) == 10            # one in two of the 20 requests
    for r in records:
        assert r["model"] == MODEL and r["rows"] == 1 and r["status"] == "OK" and r["batch_size"] >= 1
        ph = r["phases_ns"]
        assert tuple(ph) == PHASES
        assert sum(ph.values()) == r["total_ns"] > 0
        # Durations nest: the backend's time lies inside the frontend's round trip, queue and compute
        # inside the backend's (1 us of slack for the engine's float clock).
        assert min(ph["validate"], ph["route"], ph["hop"], ph["queue"], ph["batch_assembly"], ph["compute"],
                   ph["response"]) >= 0
        assert ph["backend_edge"] >= -1_000
        assert ph["compute"] > 0


def test_an_unwritable_trace_file_stops_the_frontend_with_the_reason(tmp_path):
    missing = tmp_path / "no-such-dir" / "trace.jsonl"
    proc = subprocess.run([sys.executable, "-m", "nexus", "frontend", "--scheduler", "127.0.0.1:1",
                           "--listen", "127.0.0.1:0", "--http-listen", "", "--metrics-listen", "",
                           "--trace", str(missing)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert f"cannot write --trace {missing}" in proc.stderr
    assert "No such file or directory" in proc.stderr


def test_trace_every_must_be_positive():
    proc = subprocess.run([sys.executable, "-m", "nexus", "frontend", "--trace-every", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "--trace-every: must be positive" in proc.stderr
