"""Fuzzing at scale: requests tried and statuses seen, with the servers checked alive throughout.

Runs the strategies of ``harness/fuzzing.py`` (property-based and byte-mutated ModelInfer requests
against a `nexus serve` cluster; mutated UploadModel streams and registrations against a standalone
scheduler with a cluster token) for ``--examples`` requests each. Every ``--check-every`` requests
it asks the frontend for ServerReady and ModelReady and runs one valid inference, and the scheduler
for its health. Writes ``benchmarks/out/fuzz.json``; the page is ``benchmarks/fuzz.md``.

    python -m benchmarks.fuzz [--examples 1000] [--check-every 100]
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import sys
import time

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings

from common import grpc_util
from common.pb import kserve, kserve_grpc
from common.profile import Profile
from common.sample_models import mlp_small, model_bytes
from common.security import token_metadata
from harness import fuzzing
from harness.cluster import Node, ServeCluster, Upload
from harness.scratch import scratch_dir
from harness.smoke import add_smoke, parse_args
from nexus.bench.report import write_json

ROOT = pathlib.Path(__file__).resolve().parents[1]

MODEL, INPUT, FEATURES = "mlp", "input", 64


def _valid_infer() -> kserve.ModelInferRequest:
    req = kserve.ModelInferRequest(model_name=MODEL)
    req.inputs.add(name=INPUT, datatype="FP32", shape=[2, FEATURES])
    req.raw_input_contents.append(np.ones((2, FEATURES), np.float32).tobytes())
    return req


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=1000, help="requests per kind")
    ap.add_argument("--check-every", type=int, default=100)
    ap.add_argument("-o", "--output", default=str(ROOT / "benchmarks" / "out" / "fuzz.json"))
    add_smoke(ap, outputs=("output",), examples=20, check_every=5)
    args = parse_args(ap, argv)
    with scratch_dir("nexus-fuzz-") as scratch:
        report = _fuzz(args, scratch.path)
        failed = any(report["unexpected"].values()) or report["liveness_failures"]
        scratch.keep = bool(failed)         # its servers' logs
    write_json(args.output, report, indent=2)
    print(json.dumps(report, indent=2))
    return 1 if failed else 0


def _fuzz(args: argparse.Namespace, tmp: pathlib.Path) -> dict:
    """The fuzzing run's report, its servers' folders and logs in ``tmp``."""
    serve_log = (tmp / "serve.log").open("w")
    cluster = ServeCluster(tmp / "data", "--no-samples", "--cpu-layout", "machine", stderr=serve_log)
    token_file = tmp / "token"
    token_file.write_text("fuzz-token\n")
    scheduler = Node("scheduler", ["scheduler", "--listen", "127.0.0.1:0", "--data-dir", str(tmp / "db"),
                                   "--token-file", str(token_file), "--max-upload-mb", "1"],
                     log_path=tmp / "scheduler.log", log_level="INFO")
    seen: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    checks = {"done": 0, "failed": 0}
    sent = [0]
    try:
        model = tmp / "mlp.onnx"
        model.write_bytes(model_bytes(mlp_small()))
        profile = tmp / "profile.json"
        profile.write_text(Profile.linear(0.2, 1.0, 32, memory_base_mb=5, device_type="cpu").to_json())
        scheduler.wait_ready(60)
        cluster.upload(Upload(model, MODEL, str(profile), 1000.0))
        frontend = grpc_util.channel(cluster.frontend)
        control = grpc_util.channel(scheduler.address)
        stub = kserve_grpc.GRPCInferenceServiceStub(frontend)

        def alive() -> None:
            sent[0] += 1
            if sent[0] % args.check_every:
                return
            checks["done"] += 1
            try:
                ok = (stub.ServerReady(kserve.ServerReadyRequest(), timeout=10).ready and _model_ready(stub)
                      and stub.ModelInfer(_valid_infer(), timeout=30).outputs[0].shape == [2, 10]
                      and health_pb2_grpc.HealthStub(control).Check(health_pb2.HealthCheckRequest(), timeout=10)
                      .status == health_pb2.HealthCheckResponse.SERVING)
            except grpc.RpcError:
                ok = False
            checks["failed"] += not ok

        run = settings(max_examples=args.examples, deadline=None, database=None,
                       suppress_health_check=list(HealthCheck))
        meta = token_metadata("fuzz-token")

        @run
        @given(fuzzing.infer_requests(MODEL, INPUT, FEATURES))
        def infer(request):
            seen["ModelInfer, property-based"][fuzzing.call_unary(frontend, fuzzing.KSERVE_INFER,
                                                                  request.SerializeToString())] += 1
            alive()

        @run
        @given(fuzzing.mutated(_valid_infer().SerializeToString()))
        def infer_bytes(payload):
            seen["ModelInfer, mutated bytes"][fuzzing.call_unary(frontend, fuzzing.KSERVE_INFER, payload)] += 1
            alive()

        @run
        @given(fuzzing.upload_streams(model_bytes(mlp_small(8, 8, 2))))
        def upload(stream):
            seen["UploadModel, mutated, with token"][fuzzing.call_stream_unary(control, fuzzing.UPLOAD, stream,
                                                                               metadata=meta)] += 1
            seen["UploadModel, mutated, no token"][fuzzing.call_stream_unary(control, fuzzing.UPLOAD, stream)] += 1
            alive()

        @run
        @given(fuzzing.register_requests())
        def register(payload):
            seen["Register, mutated, with token"][fuzzing.call_unary(control, fuzzing.REGISTER, payload,
                                                                     metadata=meta)] += 1
            seen["Register, mutated, no token"][fuzzing.call_unary(control, fuzzing.REGISTER, payload)] += 1
            alive()

        started = time.monotonic()
        for phase in (infer, infer_bytes, upload, register):
            phase()
        elapsed = time.monotonic() - started
        serve_log.flush()
        logs = (tmp / "serve.log").read_text() + scheduler.logs()
        report = {
            "requests": {k: sum(v.values()) for k, v in seen.items()},
            "statuses": {k: dict(sorted(v.items())) for k, v in seen.items()},
            "unexpected": {k: {c: n for c, n in v.items() if c not in fuzzing.EXPECTED} for k, v in seen.items()},
            "liveness_checks": checks["done"], "liveness_failures": checks["failed"],
            "tracebacks_in_logs": logs.count("Traceback"),
            "undecodable_log_lines": logs.count("refused undecodable request"),
            "elapsed_s": round(elapsed, 1),
        }
        frontend.close()
        control.close()
    finally:
        scheduler.stop()
        cluster.stop()
        serve_log.close()
    return report


def _model_ready(stub) -> bool:
    try:
        return stub.ModelReady(kserve.ModelReadyRequest(name=MODEL), timeout=5).ready
    except grpc.RpcError:
        return False


if __name__ == "__main__":
    sys.exit(main())
