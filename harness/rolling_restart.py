"""A rolling restart of every backend and every frontend under steady load (benchmarks/rolling_restart.py
and tests/e2e/test_rolling_restart.py): requests sent, answered, failed by status, without a response.

A scheduler, ``frontends`` frontends and ``backends`` emulated backends (:class:`~harness.cluster.Cluster`)
serve one model, the 64-input MLP with l(b) = 0.5*b + 5 ms on an emulated T4 at a 200 ms SLO, while a
:class:`~nexus.bench.loadgen.BackgroundLoad` sends Poisson arrivals at ``rate_rps`` through the
frontends (one gRPC channel balancing round-robin over those whose health check says SERVING, as a
client behind a load balancer would). One backend after another gets SIGTERM (it leaves the plan,
drains and exits), is started again and waits until it is ready; then each frontend the same way (it
turns NOT_SERVING, refuses new calls, finishes those in flight), back on the same address; ``rounds``
times over. A request not answered within the client's deadline (50x the SLO) got no response.
"""

from __future__ import annotations

import pathlib
import time
from typing import Callable

from common.profile import Profile
from common.sample_models import mlp_small, model_bytes
from harness.cluster import Cluster, Upload
from harness.background_load import BackgroundLoad

MODEL = "mlp"
DEVICE_TYPE = "t4"
SLO_MS = 200.0
CLIENT_TIMEOUT_S = 10.0       # 50x the SLO: a request not answered by then got no response


def model_upload(workdir: pathlib.Path, name: str = MODEL) -> Upload:
    """The scenario's model and profile, written to ``workdir``."""
    model, profile = workdir / f"{name}.onnx", workdir / f"{name}.profile.json"
    model.write_bytes(model_bytes(mlp_small()))
    profile.write_text(Profile.linear(0.5, 5.0, 32, device_type=DEVICE_TYPE).to_json())
    return Upload(model, name, str(profile), SLO_MS)


def rolling_restart(workdir: pathlib.Path, *, rate_rps: float, backends: int = 2, frontends: int = 1,
                    rounds: int = 1, settle_s: float = 2.0, log: Callable[[str], None] = print) -> dict:
    """Run the scenario in ``workdir``; return the counts and the components' exit statuses."""
    # gRPC only: HTTP and /metrics would want the same ports on every frontend once pinned for restarts.
    cluster = Cluster(workdir, backends=backends, frontends=frontends, device=f"emulated:{DEVICE_TYPE}",
                      frontend={"http_listen": "", "metrics_listen": ""})
    statuses: dict[str, list[int]] = {"backend": [], "frontend": []}
    cluster.start([model_upload(workdir)], wait_serving=True, timeout_s=120)
    try:
        load = BackgroundLoad([f.address for f in cluster.frontends], MODEL, rate_rps, slo_ms=SLO_MS,
                              timeout_s=CLIENT_TIMEOUT_S, seed=1).start()
        time.sleep(settle_s)
        for r in range(rounds):
            for kind, nodes in (("backend", cluster.backends), ("frontend", cluster.frontends if frontends > 1 else [])):
                for node in nodes:
                    statuses[kind].append(cluster.restart(node))
                    log(f"round {r + 1}: {node.name} restarted; so far {load.counts()}")
                    time.sleep(settle_s)
        load.stop()
    finally:
        cluster.stop(timeout_s=30)
    return {**load.counts(), "backend_exit_statuses": statuses["backend"],
            "frontend_exit_statuses": statuses["frontend"], "rate_rps": rate_rps, "backends": backends,
            "frontends": frontends, "rounds": rounds}
