"""An emulated GPU served end to end: batch latencies follow the uploaded profile within 10%.

`nexus serve --device emulated:gtx1080ti --no-samples` runs the real scheduler, frontend and backend
processes; the backend executes each batch by waiting the profile's latency for its size. The test
uploads a model with a gtx1080ti profile through `nexus models upload`, drives open-loop Poisson load
through the frontend (`nexus.bench.run_bench`), and reads the per-batch-size compute times that the
backend measured from Triton's ModelStatistics (batch_stats: compute_infer ns / count).
"""

from __future__ import annotations

import json
import time

import pytest
import tritonclient.grpc as grpcclient

from common.profile import Profile
from common.sample_models import mlp_small, model_bytes
from nexus.bench import run_bench
from tests.conftest import nexus_cli, start_cluster

pytestmark = pytest.mark.slow

DEVICE_TYPE = "gtx1080ti"
# l(b) = 20 + 2 b ms up to b = 24: every latency is long enough that 10% (>= 2 ms) is well above timer
# and scheduling noise.
PROFILE = Profile.linear(2.0, 20.0, 24, memory_base_mb=400, memory_per_item_mb=8, device_type=DEVICE_TYPE)
SLO_MS = 200.0
MIN_BATCHES = 8        # batch sizes seen fewer times than this in a round are not compared
MAX_ROUNDS = 5
MIN_SIZES = 2          # batch sizes compared in a round (the batch grows with the load)


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    c = start_cluster(tmp_path_factory.mktemp("emulated"), "--no-samples", "--device", f"emulated:{DEVICE_TYPE}")
    yield c
    c.stop()


def test_emulated_backend_batch_latencies_follow_the_profile(emulated, tmp_path):
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
        # The emulated device sleeps; on a machine other processes keep busy, a wake-up can come late.
        # Such noise is transient: a round whose ratios miss is measured again (at most 5 rounds).
        rounds = []
        for attempt in range(MAX_ROUNDS):
            compared = _measure_round(client, emulated.frontend, seed=attempt)
            rounds.append(compared)
            if len(compared) >= MIN_SIZES and all(0.98 <= r <= 1.10 for r in compared.values()):
                break
    finally:
        client.close()
    print("measured / profile latency by batch size, per round:",
          [{k: round(v, 3) for k, v in sorted(c.items())} for c in rounds])
    compared = rounds[-1]
    assert len(compared) >= MIN_SIZES, compared
    for size, ratio in compared.items():
        # Measured compute time of a batch / the profile's l(b): within 10% (it never runs faster).
        assert 0.98 <= ratio <= 1.10, (size, ratio, rounds)


def _batch_stats(client) -> dict[int, tuple[int, int]]:
    stats = client.get_inference_statistics("emu_mlp").model_stats[0]
    return {b.batch_size: (b.compute_infer.count, b.compute_infer.ns) for b in stats.batch_stats}


def _measure_round(client, frontend: str, seed: int) -> dict[int, float]:
    """Drive four load levels (the planned batch, and so the batch that runs, grows with the rate);
    return measured / profile latency per batch size
    seen at least MIN_BATCHES times in this round."""
    before = _batch_stats(client)
    for rate in (20, 60, 120, 240):
        report = run_bench(frontend, "emu_mlp", rate, 3.0, SLO_MS, warmup_s=0.5, seed=seed * 1000 + rate)
        assert report.ok > 0.9 * report.sent, report
    after = _batch_stats(client)
    compared = {}
    for size, (count, ns) in after.items():
        count -= before.get(size, (0, 0))[0]
        ns -= before.get(size, (0, 0))[1]
        if count >= MIN_BATCHES:
            compared[size] = (ns / count / 1e6) / PROFILE.latency_ms(size)
    return compared
