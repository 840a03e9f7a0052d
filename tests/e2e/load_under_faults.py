"""What the fault tests on real processes share: an emulated device and a fast model on it, a steady
load that counts every request, and a kill of one replica under that load.

The tests assert counts, never times: they wait for the event they need (25 requests in a row sent
after the fault and answered OK) with a generous bound that only guards against a hang."""

from __future__ import annotations

import time

from common.profile import Profile
from common.sample_models import mlp_small, model_bytes
from harness.background_load import BackgroundLoad
from harness.cluster import Cluster
from tests.components import wait_for, wait_ready
from tests.conftest import nexus_cli

DEVICE = "emulated:gtx1080ti"
FAST = Profile.linear(1.0, 5.0, 32, device_type="gtx1080ti")      # l(b) = 5 + b ms
# Generous SLOs: on a loaded machine the only failures then are the ones a fault causes.
FAST_SLO_MS = 2000.0


def steady_load(cluster: Cluster, model: str, rate_rps: float) -> BackgroundLoad:
    """Requests at a steady rate (evenly spaced), each given 10 s: one without an answer by then is lost."""
    return BackgroundLoad(cluster.frontend.address, model, rate_rps, slo_ms=FAST_SLO_MS, cv=0.0).start()


def ok_in_a_row_since(load: BackgroundLoad, since: float, n: int = 25) -> bool:
    """The last ``n`` answered requests were all sent after ``since`` and all answered OK."""
    tail = load.last_answered(n)
    return len(tail) == n and tail[0][1] > since and all(status == "OK" for status, _ in tail)


def upload(cluster: Cluster, tmp_path, name: str, profile: Profile, slo_ms: float, *extra: str) -> None:
    """``nexus models upload`` of the small MLP as ``name`` with ``profile``; returns once it serves."""
    model = tmp_path / f"{name}.onnx"
    model.write_bytes(model_bytes(mlp_small()))
    prof = tmp_path / f"{name}.json"
    prof.write_text(profile.to_json())
    up = nexus_cli("models", "upload", str(model), "--name", name, "--profile", str(prof), "--slo-ms", str(slo_ms),
                   "--scheduler", cluster.scheduler.address, *extra)
    assert up.returncode == 0, up.stderr
    wait_ready(cluster.frontend.address, name)


def kill_one_of_two_replicas_under_load(cluster: Cluster, model: str, rate_rps: float = 100) -> dict[str, int]:
    """Wait for ``model`` to be served by two backends, SIGKILL one under a steady load, and wait until
    25 requests in a row sent after the kill are answered OK. Asserts that every request got an answer
    and that no more failed than were in flight at the kill; returns the load's status counts."""
    wait_for(lambda: len(cluster.serving(model)) >= 2, what=f"two backends serving {model}")
    serving = cluster.serving(model)
    assert len(serving) == 2, [b.name for b in serving]
    load = steady_load(cluster, model, rate_rps)
    wait_for(lambda: ok_in_a_row_since(load, 0.0), what="the load answered")
    in_flight = load.in_flight()
    killed_at = time.monotonic()
    serving[0].kill()
    wait_for(lambda: ok_in_a_row_since(load, killed_at), what="25 requests sent after the kill answered OK in a row")
    codes = load.stop().samples.status_counts()
    print(f"{model}:", codes, "in flight at the kill:", in_flight)
    assert "NO_RESPONSE" not in codes
    assert sum(codes.values()) - codes.get("OK", 0) <= in_flight, codes
    return codes
