"""Large inputs through system shared memory against the same inputs in the request, in one run.

A scheduler, a frontend and one emulated backend (``emulated:t4``: a batch costs what the datasheet
says, so the request path is what differs) serve ResNet-18 at 64x64. One client on the frontend's
host sends ``--requests`` requests of ``--batch`` rows (48 KiB a row) one after another over gRPC,
alternating: the input in the request (``raw_input_contents``, the baseline) and the same input in a
registered shared-memory region (tritonclient's ``set_shared_memory``). Reported: each way's latency
(median, mean, p90), the ratio shared/raw, the bytes of each request message, and the CPU seconds of
the client and the frontend per request.

    python -m benchmarks.shared_memory [--batch 32] [--requests 200] [--json OUT]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import time
import uuid

import numpy as np

from common.sample_models import write_sample_models
from harness.cluster import Cluster, Upload
from harness.meters import cpu_seconds, uptime
from harness.smoke import add_smoke, parse_args
from nexus.bench.report import write_json

MODEL = "resnet18_64"


def _summary(latencies_s: list[float]) -> dict:
    ms = sorted(t * 1000 for t in latencies_s)
    return {"median_ms": statistics.median(ms), "mean_ms": statistics.fmean(ms), "p90_ms": ms[int(0.9 * len(ms))]}


def _request_bytes(x: np.ndarray, region: str = "") -> int:
    """The size of the ModelInferRequest that sends ``x``: in the request, or naming ``region``."""
    from common.pb import kserve

    request = kserve.ModelInferRequest(model_name=MODEL)
    tensor = request.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    if region:
        tensor.parameters["shared_memory_region"].string_param = region
        tensor.parameters["shared_memory_byte_size"].int64_param = x.nbytes
    else:
        request.raw_input_contents.append(x.tobytes())
    return request.ByteSize()


def run(workdir: pathlib.Path, batch: int, requests: int) -> dict:
    import os

    import tritonclient.grpc as grpcclient
    import tritonclient.utils.shared_memory as shm

    paths = write_sample_models(workdir / "models", [MODEL])
    x = np.random.default_rng(0).standard_normal((batch, 3, 64, 64)).astype(np.float32)
    with Cluster(workdir / "cluster", backends=1, device="emulated:t4") as cluster:
        cluster.start([Upload(paths[MODEL], MODEL, slo_ms=5000)])
        client = grpcclient.InferenceServerClient(cluster.frontend.address)
        key = f"/nexus-bench-{uuid.uuid4().hex[:12]}"
        region = shm.create_shared_memory_region("bench_input", key, x.nbytes)
        try:
            shm.set_shared_memory_region(region, [x])
            client.register_system_shared_memory("bench_input", key, x.nbytes)
            raw = grpcclient.InferInput("input", list(x.shape), "FP32")
            raw.set_data_from_numpy(x)
            shared = grpcclient.InferInput("input", list(x.shape), "FP32")
            shared.set_shared_memory("bench_input", x.nbytes)
            ways = {"raw": raw, "shared_memory": shared}
            sizes = {"raw": _request_bytes(x), "shared_memory": _request_bytes(x, "bench_input")}
            for tensor in ways.values():
                assert client.infer(MODEL, [tensor]).as_numpy("logits").shape[0] == batch   # warm: connections
            latencies: dict[str, list[float]] = {w: [] for w in ways}
            cpu: dict[str, dict[str, float]] = {w: {"client": 0.0, "frontend": 0.0} for w in ways}
            frontend_pid = cluster.frontend.pid
            for i in range(2 * requests):
                way = "raw" if i % 2 == 0 else "shared_memory"
                c0, f0, t0 = cpu_seconds(os.getpid()), cpu_seconds(frontend_pid), time.perf_counter()
                client.infer(MODEL, [ways[way]])
                latencies[way].append(time.perf_counter() - t0)
                cpu[way]["client"] += cpu_seconds(os.getpid()) - c0
                cpu[way]["frontend"] += cpu_seconds(frontend_pid) - f0
            client.unregister_system_shared_memory()
        finally:
            shm.destroy_shared_memory_region(region)
            client.close()
    result = {"batch": batch, "input_bytes": x.nbytes, "requests_each": requests, "load": uptime(),
              "request_message_bytes": sizes}
    for way in ways:
        result[way] = {**_summary(latencies[way]),
                       "client_cpu_ms_per_request": 1000 * cpu[way]["client"] / requests,
                       "frontend_cpu_ms_per_request": 1000 * cpu[way]["frontend"] / requests}
    result["median_ratio_shared_over_raw"] = result["shared_memory"]["median_ms"] / result["raw"]["median_ms"]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32, help="rows per request (48 KiB each)")
    parser.add_argument("--requests", type=int, default=200, help="requests each way")
    parser.add_argument("--json", default="benchmarks/out/shared_memory.json")
    add_smoke(parser, batch=4, requests=10)
    args = parse_args(parser, argv)
    with tempfile.TemporaryDirectory(prefix="nexus-shm-") as workdir:
        result = run(pathlib.Path(workdir), args.batch, args.requests)
    write_json(args.json, result)
    import json
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
