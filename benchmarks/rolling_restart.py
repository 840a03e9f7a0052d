"""Rolling restart of every backend and every frontend under steady load: requests sent, answered,
failed by status.

A scheduler, ``--frontends`` frontends and ``--backends`` emulated backends (started by
nexus/launcher.py, as ``nexus serve`` starts them) serve one model while a client sends Poisson
arrivals at ``--rate`` through the frontends (one gRPC channel balancing round-robin over their
addresses, as a client behind a load balancer would). One backend after another gets SIGTERM (it
leaves the plan, drains and exits), is started again and waits until it is ready; then each
frontend the same way (it turns NOT_SERVING, refuses new calls, finishes those in flight), back on
the same address; ``--rounds`` times over. Every request's outcome is counted: answered, failed
with a gRPC status (by status), or without a response (the client gave up first: its timeout is
far above the SLO, so that means none came).

    python benchmarks/rolling_restart.py [--rate 100] [--backends 2] [--frontends 2] [--rounds 2] [--json OUT]

Target (issue 10): zero requests without a response, failures at most 0.1% of requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import random
import shutil
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import numpy as np  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from common import grpc_util  # noqa: E402
from common.config import BackendConfig, FrontendConfig, SchedulerConfig  # noqa: E402
from common.pb import kserve, kserve_grpc  # noqa: E402
from common.profile import Profile  # noqa: E402
from common.sample_models import mlp_small, model_bytes  # noqa: E402
from nexus.launcher import Child, launch, pin_listen  # noqa: E402
from nexus.scheduler_client import upload_model  # noqa: E402
from nexus.serve_cmd import wait_models_ready  # noqa: E402

MODEL = "mlp"
DEVICE_TYPE = "t4"
SLO_MS = 200.0
CLIENT_TIMEOUT_S = 10.0       # 50x the SLO: a request not answered by then got no response
# A client of several frontends, as a load balancer would be: round-robin over those whose gRPC
# health check says SERVING (gRPC's client-side health checking watches them), reconnecting to a
# restarted one within a second.
BALANCED_CLIENT_OPTIONS = [
    ("grpc.service_config", json.dumps({"loadBalancingConfig": [{"round_robin": {}}],
                                        "healthCheckConfig": {"serviceName": ""}})),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class Load:
    """Open-loop Poisson load on one model through a frontend, on its own thread and event loop."""

    def __init__(self, frontends: str | list[str], rate_rps: float, seed: int = 1) -> None:
        self.frontends = [frontends] if isinstance(frontends, str) else list(frontends)
        self.rate_rps = rate_rps
        self.rng = random.Random(seed)
        self.sent = 0
        self.answered = 0
        self.failed: dict[str, int] = {}
        self.no_response = 0
        self.examples: dict[str, str] = {}    # status -> the first failure's message
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> "Load":
        self._thread.start()
        return self

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return self.counts()

    def counts(self) -> dict:
        return {"sent": self.sent, "answered": self.answered, "failed": dict(sorted(self.failed.items())),
                "failed_total": sum(self.failed.values()), "no_response": self.no_response,
                "examples": dict(self.examples)}

    def _request(self) -> kserve.ModelInferRequest:
        request = kserve.ModelInferRequest(model_name=MODEL)
        request.inputs.add(name="input", datatype="FP32", shape=[1, 64])
        request.raw_input_contents.append(np.ones((1, 64), np.float32).tobytes())
        return request

    async def _one(self, stub, request) -> None:
        started = time.monotonic()
        try:
            await stub.ModelInfer(request, timeout=CLIENT_TIMEOUT_S)
            self.answered += 1
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - started >= CLIENT_TIMEOUT_S:
                self.no_response += 1
            else:
                self.failed[exc.code().name] = self.failed.get(exc.code().name, 0) + 1
                self.examples.setdefault(exc.code().name, exc.details() or "")

    async def _run(self) -> None:
        if len(self.frontends) == 1:
            channel = grpc_util.aio_channel(self.frontends[0])
        else:
            channel = grpc.aio.insecure_channel("ipv4:" + ",".join(self.frontends),
                                                options=[*grpc_util.CHANNEL_OPTIONS, *BALANCED_CLIENT_OPTIONS])
        stub = kserve_grpc.GRPCInferenceServiceStub(channel)
        request = self._request()
        tasks = set()
        next_at = time.monotonic()
        while not self._stop.is_set():
            next_at += self.rng.expovariate(self.rate_rps)
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            self.sent += 1
            task = asyncio.create_task(self._one(stub, request))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)
        await channel.close()


def serving(address: str) -> bool:
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def wait_serving(address: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not serving(address):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{address} not ready within {timeout_s:.0f} s")
        time.sleep(0.1)


class Cluster:
    """Scheduler, frontend and emulated backends, started through nexus.launcher."""

    def __init__(self, workdir: pathlib.Path, backends: int, frontends: int = 1, log_level: str = "WARNING") -> None:
        self.workdir = workdir
        self.env = dict(os.environ, NEXUS_LOG=log_level)
        self.logs = []
        self.scheduler = self._launch(SchedulerConfig(listen="127.0.0.1:0", data_dir=workdir / "db"), "scheduler")
        self.scheduler_address = self.scheduler.wait_ready(60)
        model = workdir / "mlp.onnx"
        model.write_bytes(model_bytes(mlp_small()))
        profile = workdir / "profile.json"
        profile.write_text(Profile.linear(0.5, 5.0, 32, device_type=DEVICE_TYPE).to_json())
        upload_model(self.scheduler_address, model, MODEL, profile_path=str(profile), slo_ms=SLO_MS)
        self.backends = [self._launch(BackendConfig(scheduler=self.scheduler_address, listen="127.0.0.1:0",
                                                    device=f"emulated:{DEVICE_TYPE}"), f"backend-{i}")
                         for i in range(backends)]
        # gRPC only: HTTP and /metrics would want the same default ports on every frontend once pinned
        frontend = FrontendConfig(scheduler=self.scheduler_address, listen="127.0.0.1:0", http_listen="",
                                  metrics_listen="")
        self.frontends = [self._launch(frontend, f"frontend-{i}") for i in range(frontends)]
        for b in self.backends:
            wait_serving(b.wait_ready(60))
        for f in self.frontends:
            f.wait_ready(60)
            pin_listen(f, frontend)
            wait_serving(f.address)
            if wait_models_ready(f.address, [MODEL], 120):
                raise RuntimeError(f"{MODEL} not ready on {f.address}")
        self.frontend_addresses = [f.address for f in self.frontends]

    def _launch(self, config, name: str) -> Child:
        log = open(self.workdir / f"{name}.log", "a")
        self.logs.append(log)
        return launch(config, name, env=self.env, stderr=log)

    @staticmethod
    def restart(child: Child) -> int:
        """SIGTERM ``child`` (it drains), start it again, wait until it is ready; its exit status."""
        status = child.stop(timeout_s=60)
        child.start()
        wait_serving(child.wait_ready(60))
        return status

    def stop(self) -> None:
        for c in [*self.frontends, *self.backends, self.scheduler]:
            c.stop(timeout_s=30)
        for log in self.logs:
            log.close()


def rolling_restart(workdir: pathlib.Path, *, rate_rps: float, backends: int = 2, frontends: int = 1,
                    rounds: int = 1, settle_s: float = 2.0, log=print) -> dict:
    """Run the scenario in ``workdir``; return the counts and the components' exit statuses."""
    cluster = Cluster(workdir, backends, frontends)
    statuses: dict[str, list[int]] = {"backend": [], "frontend": []}
    try:
        load = Load(cluster.frontend_addresses, rate_rps).start()
        time.sleep(settle_s)
        for r in range(rounds):
            for kind, children in (("backend", cluster.backends), ("frontend", cluster.frontends if frontends > 1 else [])):
                for child in children:
                    statuses[kind].append(cluster.restart(child))
                    log(f"round {r + 1}: {child.name} restarted; so far {load.counts()}")
                    time.sleep(settle_s)
        counts = load.stop()
    finally:
        cluster.stop()
    return {**counts, "backend_exit_statuses": statuses["backend"], "frontend_exit_statuses": statuses["frontend"],
            "rate_rps": rate_rps, "backends": backends, "frontends": frontends, "rounds": rounds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=100.0, help="requests per second (Poisson)")
    parser.add_argument("--backends", type=int, default=2)
    parser.add_argument("--frontends", type=int, default=2, help="restarted too when more than one")
    parser.add_argument("--rounds", type=int, default=2, help="times every backend is restarted")
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--workdir", help="keep the model database and the components' logs here")
    args = parser.parse_args()
    workdir = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="nexus-rolling-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        result = rolling_restart(workdir, rate_rps=args.rate, backends=args.backends, frontends=args.frontends,
                                 rounds=args.rounds)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    result["failure_rate"] = result["failed_total"] / max(result["sent"], 1)
    print(json.dumps(result, indent=2))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if result["no_response"] == 0 and result["failure_rate"] <= 0.001 else 1


if __name__ == "__main__":
    sys.exit(main())
