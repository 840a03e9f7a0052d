"""Client side of tests/e2e/test_kubernetes_commands.py, run inside the client's network namespace.

``python -m tests.kube_client ready ADDRESS SERVICE TIMEOUT_S``: poll ``grpc.health.v1`` as a
Kubernetes gRPC probe does until ``SERVICE`` is SERVING (exit 0) or the time is up (exit 1).
``python -m tests.kube_client infer ADDRESS MODEL ROWS FEATURES``: wait for the model, infer a batch
through the KServe v2 gRPC API, print the output's shape and datatype as JSON.
``python -m tests.kube_client scrape URL METRIC TIMEOUT_S``: GET a Prometheus endpoint as a scraper
does until it holds METRIC (exit 1 when the time is up), print every sample as JSON
(``[name, labels, value]``).
"""

from __future__ import annotations

import json
import sys
import time

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from harness import prometheus


def ready(address: str, service: str, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return 0
            except grpc.RpcError as exc:
                last = f"{exc.code().name}: {exc.details()}"
            time.sleep(0.3)
    print(f"{address} service {service!r} not SERVING in {timeout_s} s: {last}", file=sys.stderr)
    return 1


def infer(address: str, model: str, rows: int, features: int) -> int:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(address)
    try:
        deadline = time.monotonic() + 90
        while not client.is_model_ready(model):
            if time.monotonic() > deadline:
                print(f"{model} not ready at {address}", file=sys.stderr)
                return 1
            time.sleep(0.3)
        x = grpcclient.InferInput("input", [rows, features], "FP32")
        x.set_data_from_numpy(np.ones((rows, features), np.float32))
        out = client.infer(model, [x], client_timeout=30).as_numpy("logits")
        print(json.dumps({"shape": list(out.shape), "dtype": str(out.dtype)}))
        return 0
    finally:
        client.close()


def scrape(url: str, metric: str, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            found = prometheus.scrape(url, timeout_s=5)
            samples = [[name, dict(lab), value] for (name, lab), value in found.samples.items()]
            if any(name == metric for name, _, _ in samples):
                print(json.dumps(samples))
                return 0
            last = f"no {metric} among {len(samples)} samples"
        except OSError as exc:
            last = str(exc)
        time.sleep(0.3)
    print(f"{url}: {last} after {timeout_s} s", file=sys.stderr)
    return 1


def main(argv: list[str]) -> int:
    if argv[0] == "ready":
        return ready(argv[1], argv[2], float(argv[3]))
    if argv[0] == "infer":
        return infer(argv[1], argv[2], int(argv[3]), int(argv[4]))
    if argv[0] == "scrape":
        return scrape(argv[1], argv[2], float(argv[3]))
    print(f"unknown command {argv[0]!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
