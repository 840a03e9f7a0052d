"""Backend metrics: the Prometheus text endpoint of a real `nexus backend` process, scraped with urllib;
and a backend asked for a CUDA device it does not have fails with a clear message instead of a crash."""

from __future__ import annotations

import os
import re
import time
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from backend.metrics import registry
from common.config import BackendConfig, SchedulerConfig
from common.pb import control, control_grpc
from common.profile import Profile
from common.sample_models import mlp_small, model_bytes
from nexus.launcher import Child, launch
from tests.conftest import nexus_cli
from harness.ports import free_port


def render(stats: control.BackendStats, device: str = "") -> str:
    """The Prometheus text (format 0.0.4) the backend's collector makes of one stats snapshot."""
    return generate_latest(registry(lambda: stats, device)).decode()


SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*\})? (\S+)$')


def parse(text: str) -> dict[tuple[str, frozenset], float]:
    """Prometheus text format 0.0.4 -> {(name, labels): value}; fails on any malformed line."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            assert not line or line.startswith(("# HELP ", "# TYPE ")), line
            continue
        m = SAMPLE.match(line)
        assert m, f"malformed sample line: {line!r}"
        labels = frozenset(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def test_render_is_valid_prometheus_text_with_a_cumulative_histogram():
    stats = control.BackendStats(node_id="be-1", utilization=0.25, utilization_total=0.5, memory_bytes=1234)
    stats.sessions.append(control.SessionStats(
        model='we"ird', inference_count=7, execution_count=3, queue_length=2, dropped=1, compute_ns=2_000_000_000,
        batch_histogram={1: 1, 2: 1, 4: 1}, memory_bytes=99, prefix_group="g"))
    stats.prefix_groups.append(control.PrefixGroupStats(group="g", sessions=['we"ird'], execution_count=3,
                                                        inference_count=7, memory_bytes=50))
    samples = parse(render(stats, "cpu"))
    model = ("model", 'we\\"ird')
    assert samples[("nexus_backend_inference_count_total", frozenset({model}))] == 7
    assert samples[("nexus_backend_compute_seconds_total", frozenset({model}))] == 2.0
    assert samples[("nexus_backend_utilization", frozenset())] == 0.25
    buckets = {dict(k[1])["le"]: v for k, v in samples.items() if k[0] == "nexus_backend_batch_size_bucket"}
    assert buckets["1"] == 1 and buckets["2"] == 2 and buckets["4"] == 3 and buckets["+Inf"] == 3
    assert samples[("nexus_backend_batch_size_sum", frozenset({model}))] == 7
    assert samples[("nexus_backend_prefix_group_memory_bytes", frozenset({("group", "g")}))] == 50
    types = {f.name: f.type for f in text_string_to_metric_families(render(stats, "cpu"))}
    assert types["nexus_backend_inference_count"] == "counter"       # exposed as ..._total
    assert types["nexus_backend_batch_size"] == "histogram"
    assert types["nexus_backend_queue_length"] == "gauge"


def _launch(config) -> Child:
    child = launch(config, env=dict(os.environ, NEXUS_LOG="WARNING"))
    child.wait_ready(60)
    return child


@pytest.mark.slow
def test_metrics_endpoint_of_a_real_backend(tmp_path):
    scheduler = _launch(SchedulerConfig(listen="127.0.0.1:0", data_dir=tmp_path / "db"))
    port = free_port()
    backend = _launch(BackendConfig(scheduler=scheduler.address, listen="127.0.0.1:0", metrics_port=port, threads=1))
    try:
        model = tmp_path / "mlp.onnx"
        model.write_bytes(model_bytes(mlp_small()))
        profile = tmp_path / "profile.json"
        profile.write_text(Profile.linear(0.2, 1.0, 32, memory_base_mb=5, device_type="cpu").to_json())
        up = nexus_cli("models", "upload", str(model), "--name", "mlp", "--profile", str(profile),
                       "--slo-ms", "1000", "--scheduler", scheduler.address)
        assert up.returncode == 0, up.stderr
        url = f"http://127.0.0.1:{port}/metrics"
        with grpc.insecure_channel(backend.address) as channel:
            stub = control_grpc.BackendStub(channel)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if any(s.model == "mlp" for s in stub.Stats(control.BackendStatsRequest(), timeout=5).sessions):
                    break
                time.sleep(0.2)
            x = np.zeros((3, 64), np.float32)
            for i in range(5):
                reply = stub.ExecuteOne(control.ExecItem(request_id=i, model="mlp", budget_us=5_000_000,
                                                         inputs=[x.tobytes()], rows=3), timeout=30)
                assert reply.status == control.EXEC_OK, reply.message
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.status == 200
            assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            samples = parse(response.read().decode())
        mlp = frozenset({("model", "mlp")})
        assert samples[("nexus_backend_inference_count_total", mlp)] == 15
        assert samples[("nexus_backend_execution_count_total", mlp)] == 5
        assert samples[("nexus_backend_queue_length", mlp)] == 0
        assert samples[("nexus_backend_dropped_total", mlp)] == 0
        assert samples[("nexus_backend_batch_size_bucket", mlp | {("le", "4")})] == 5
        assert samples[("nexus_backend_batch_size_count", mlp)] == 5
        assert samples[("nexus_backend_memory_bytes", mlp)] > 0
        assert 0 < samples[("nexus_backend_utilization", frozenset())] <= 1
        assert samples[("nexus_backend_compute_seconds_total", mlp)] > 0
        lag_count = samples[("nexus_backend_loop_lag_seconds_count", frozenset())]     # a 0.25 s timer
        assert lag_count >= 1 and samples[("nexus_backend_loop_lag_seconds_bucket", frozenset({("le", "+Inf")}))] \
            == lag_count
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/other", timeout=10)
        assert err.value.code == 404
    finally:
        backend.stop()
        scheduler.stop()
    assert backend.proc.returncode == 0


def test_backend_on_a_missing_cuda_device_fails_with_a_clear_message():
    from backend.device_probe import device_problem
    if device_problem("cuda:0") is None:
        pytest.skip("this machine has a usable CUDA device (cuda:0)")
    result = nexus_cli("backend", "--device", "cuda:0", "--scheduler", "127.0.0.1:9", timeout_s=60)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().startswith("nexus backend: error: device cuda:0 is not available"), result.stderr
    assert "--device cpu" in result.stderr


def test_bad_metrics_port_is_refused():
    result = nexus_cli("backend", "--metrics-port", "70000")
    assert result.returncode == 2 and "--metrics-port" in result.stderr
