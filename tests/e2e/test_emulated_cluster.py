"""An emulated GPU served end to end: a model uploaded with a profile for the emulated device is
served and batched by the real processes.

`nexus serve --device emulated:gtx1080ti --no-samples` runs the real scheduler, frontend and backend
processes; the backend executes each batch by waiting the profile's latency for its size. The test
uploads a model with a gtx1080ti profile through `nexus models upload`, drives open-loop Poisson load
through the frontend (`nexus.bench.run_bench`) and checks the outcome: requests are answered and the
backend's ModelStatistics count batches of growing size, consistently. How closely the measured
batch times follow the profile is a wall-clock figure: ``benchmarks/timing_checks.py`` reports it.
"""

from __future__ import annotations

import json
import time

import pytest
import tritonclient.grpc as grpcclient

from common.profile import Profile
from common.sample_models import mlp_small, model_bytes
from nexus.bench import run_bench
from tests.conftest import nexus_cli, start_serve

pytestmark = pytest.mark.slow

DEVICE_TYPE = "gtx1080ti"
PROFILE = Profile.linear(2.0, 20.0, 24, memory_base_mb=400, memory_per_item_mb=8, device_type=DEVICE_TYPE)
SLO_MS = 200.0


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    c = start_serve(tmp_path_factory.mktemp("emulated"), "--no-samples", "--device", f"emulated:{DEVICE_TYPE}")
    yield c
    c.stop()


def test_emulated_backend_serves_and_batches_an_uploaded_model(emulated, tmp_path):
    model = tmp_path / "mlp.onnx"
    model.write_bytes(model_bytes(mlp_small()))
    profile = tmp_path / "profile.json"
    profile.write_text(PROFILE.to_json())
    up = nexus_cli("models", "upload", str(model), "--name", "emu_mlp", "--profile", str(profile),
                   "--slo-ms", str(SLO_MS), "--scheduler", emulated.scheduler)
    assert up.returncode == 0, up.stderr
    listed = json.loads(nexus_cli("models", "list", "--scheduler", emulated.scheduler, "--json").stdout)
    assert [m["profiles"] for m in listed if m["name"] == "emu_mlp"] == [[DEVICE_TYPE]]

    client = grpcclient.InferenceServerClient(emulated.frontend)
    try:
        deadline = time.monotonic() + 60
        while not client.is_model_ready("emu_mlp") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert client.is_model_ready("emu_mlp")
        sent = failed = 0
        for rate in (20, 240):      # the batch that runs grows with the load
            report = run_bench(emulated.frontend, "emu_mlp", rate, 2.0, SLO_MS, warmup_s=0.3, seed=rate)
            assert report.ok > 0.9 * report.sent, report
            sent += report.ok
            failed += sum(status != "OK" for status in report.samples.statuses())     # warm-up included
        stats = client.get_inference_statistics("emu_mlp").model_stats[0]
    finally:
        client.close()
    sizes = {b.batch_size: b for b in stats.batch_stats}
    assert max(sizes) > 1, sorted(sizes)                       # requests were batched together
    assert sum(b.compute_infer.count for b in sizes.values()) == stats.execution_count
    # Batches count every row they ran; the frontend counts the rows it answered OK. A one-row request
    # that failed after its batch ran (its reply came after its deadline, as on a loaded machine) is in
    # the first count only.
    rows = sum(size * b.compute_infer.count for size, b in sizes.items())
    assert stats.inference_count >= sent and 0 <= rows - stats.inference_count <= failed, (rows, stats, failed)
    assert all(b.compute_infer.ns > 0 for b in sizes.values())
