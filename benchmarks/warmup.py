"""The first request after a load or a move, against the steady-state p50, with and without warm-up.

One run, repeated ``--reps`` times, alternating the two modes (warm: backends as shipped; cold: the
same backends with ``--no-warmup``) so that both see the same machine: a scheduler, a frontend and
two CPU backends (ONNX Runtime, started by the library's harness, ``harness.cluster.Cluster``) serve
``resnet18_64`` (a sample model), uploaded with a CPU profile measured once at the start so that no
backend has run the model before it is placed there.

- **load**: the model is uploaded and loaded; once the frontend says it is ready, one request
  (batch 1), then ``--steady`` requests one at a time, ``--gap-ms`` apart: their median is the
  steady-state p50.
- **move**: the backend serving it gets SIGTERM (it leaves the plan: the scheduler moves the session
  to the other backend, then the first one drains and exits); then one request and the steady ones
  again, now served by the other backend.

Each request's latency is measured by the client (one gRPC channel to the frontend, connected
before the model is loaded). The backend's own time for the first request's batch (its ``compute_ns``
in ``Stats``) is kept too, to tell a runtime's first-run cost from the rest of the path.

    python -m benchmarks.warmup [--reps 5] [--steady 60] [--gap-ms 20] [--threads 0] [--json OUT]

Target (issue 20): with warm-up, the first request after a load or a move is at most 1.5x the
steady-state p50. Numbers: benchmarks/warmup.md.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

import grpc
import numpy as np

from common.pb import control, control_grpc, kserve, kserve_grpc
from common.sample_models import build_sample_model, model_bytes
from harness.cluster import Cluster, Upload
from harness.smoke import add_smoke, parse_args

MODEL = "resnet18_64"
SHAPE = (1, 3, 64, 64)
SLO_MS = 200.0
TARGET_RATIO = 1.5


def measure_profile(path: pathlib.Path, threads: int) -> pathlib.Path:
    """The model's CPU profile, measured here once (so no backend runs the model before it is placed)."""
    from profiler.profiling import profile_model

    profile = profile_model(path.read_bytes(), "cpu", "onnxruntime", [1, 2, 4, 8], warmup=2, iters=10, min_iters=3,
                            time_budget_s=10, threads=threads or None, device_type="cpu")
    out = path.with_suffix(".profile.json")
    out.write_text(profile.to_json())
    return out


def start_cluster(workdir: pathlib.Path, warmup: bool, threads: int) -> Cluster:
    """Scheduler, frontend and two CPU backends (``warmup`` on or off); logs in ``workdir``. No spare
    replicas: the model is on one backend until it moves, and the other has never run it."""
    return Cluster(workdir, backends=2, device="cpu", scheduler={"spare_replicas": False},
                   backend={"threads": threads, "warmup": warmup},
                   frontend={"http_listen": "", "metrics_listen": "", "report_interval_s": 0.5}).start(timeout_s=60)


def _session(backend: str) -> control.SessionStats | None:
    with grpc.insecure_channel(backend) as ch:
        stats = control_grpc.BackendStub(ch).Stats(control.BackendStatsRequest(), timeout=10)
    return next((s for s in stats.sessions if s.model == MODEL), None)


class Client:
    """One channel to the frontend, connected before anything is measured; a request is one batch-1 infer."""

    def __init__(self, frontend: str) -> None:
        self.channel = grpc.insecure_channel(frontend)
        self.stub = kserve_grpc.GRPCInferenceServiceStub(self.channel)
        req = kserve.ModelInferRequest(model_name=MODEL)
        req.inputs.add(name="input", datatype="FP32", shape=list(SHAPE))
        req.raw_input_contents.append(np.random.default_rng(0).random(SHAPE, dtype=np.float32).tobytes())
        self.request = req
        self.stub.ServerLive(kserve.ServerLiveRequest(), timeout=10)

    def ready(self) -> bool:
        return self.stub.ModelReady(kserve.ModelReadyRequest(name=MODEL), timeout=10).ready

    def infer_ms(self) -> float | None:
        """The request's latency; None when it failed (on a loaded machine one may miss its 200 ms SLO)."""
        start = time.perf_counter()
        try:
            self.stub.ModelInfer(self.request, timeout=10)
        except grpc.RpcError:
            return None
        return (time.perf_counter() - start) * 1000

    def close(self) -> None:
        self.channel.close()


def first_and_steady(client: Client, backend: str, steady: int, gap_s: float) -> dict:
    """The first request now, then ``steady`` more; client latencies and the backend's compute times."""
    before = _session(backend)
    first_ms = client.infer_ms()
    after = _session(backend)
    first_compute_ms = (after.compute_ns - before.compute_ns) / 1e6
    latencies, computes, failed = [], [], 0
    for _ in range(steady):
        time.sleep(gap_s)
        before = after
        latency = client.infer_ms()
        after = _session(backend)
        if latency is None:
            failed += 1
            continue
        latencies.append(latency)
        computes.append((after.compute_ns - before.compute_ns) / 1e6)
    if first_ms is None:
        raise RuntimeError("the first request failed")
    p50 = statistics.median(latencies)
    return {"first_ms": round(first_ms, 2), "p50_ms": round(p50, 2), "ratio": round(first_ms / p50, 2),
            "steady_failed": failed,
            "first_compute_ms": round(first_compute_ms, 2), "p50_compute_ms": round(statistics.median(computes), 2),
            "warmup_batches": after.warmup_count, "warmup_ms": round(after.warmup_ns / 1e6, 1)}


def one_run(workdir: pathlib.Path, model: pathlib.Path, profile: pathlib.Path, warmup: bool, args) -> dict:
    cluster = start_cluster(workdir, warmup, args.threads)
    client = Client(cluster.frontend.address)
    try:
        cluster.upload(Upload(model, MODEL, str(profile), SLO_MS), wait=False)
        deadline = time.monotonic() + 120
        while not client.ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{MODEL} not ready within 120 s")
            time.sleep(0.02)
        [source] = cluster.serving(MODEL)
        load = first_and_steady(client, source.address, args.steady, args.gap_ms / 1000)
        source.stop(timeout_s=60)          # SIGTERM: Leave moves the session, then it drains and exits
        [target] = cluster.serving(MODEL)
        move = first_and_steady(client, target.address, args.steady, args.gap_ms / 1000)
    finally:
        client.close()
        cluster.stop()
    return {"load": load, "move": move}


def _median(values) -> float:
    return round(statistics.median(list(values)), 2)


def summary(runs: list[dict]) -> dict:
    out = {}
    for mode in ("warm", "cold"):
        for case in ("load", "move"):
            rows = [r[case] for r in runs if r["mode"] == mode]
            out[f"{mode}_{case}"] = {
                "median_ratio": _median(r["ratio"] for r in rows), "max_ratio": max(r["ratio"] for r in rows),
                "median_first_ms": _median(r["first_ms"] for r in rows),
                "median_p50_ms": _median(r["p50_ms"] for r in rows),
                # The first batch's time on the backend over the steady batches': the runtime's own first-run cost.
                "median_compute_ratio": _median(r["first_compute_ms"] / r["p50_compute_ms"] for r in rows),
                # The first request's time outside the batch, minus the steady requests': the path's first-time cost.
                "median_extra_path_ms": _median((r["first_ms"] - r["first_compute_ms"])
                                                - (r["p50_ms"] - r["p50_compute_ms"]) for r in rows)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="runs of each mode, alternating")
    parser.add_argument("--steady", type=int, default=60, help="requests after the first one (steady state)")
    parser.add_argument("--gap-ms", type=float, default=20.0, help="pause between two steady requests")
    parser.add_argument("--threads", type=int, default=0, help="backend intra-op threads (0: the runtime's default)")
    parser.add_argument("--json", help="write every run and the summary here")
    parser.add_argument("--workdir", help="keep the components' logs here")
    add_smoke(parser, reps=1, steady=5, gap_ms=5.0, json="warmup.json")
    args = parse_args(parser, argv)
    workdir = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="nexus-warmup-"))
    workdir.mkdir(parents=True, exist_ok=True)
    runs = []
    try:
        model = workdir / f"{MODEL}.onnx"
        model.write_bytes(model_bytes(build_sample_model(MODEL)))
        profile = measure_profile(model, args.threads)
        for rep in range(args.reps):
            for warmup in ((True, False) if rep % 2 == 0 else (False, True)):
                mode = "warm" if warmup else "cold"
                run_dir = workdir / f"{mode}-{rep}"
                run_dir.mkdir()
                run = {"mode": mode, "rep": rep, **one_run(run_dir, model, profile, warmup, args)}
                runs.append(run)
                print(json.dumps(run), flush=True)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    result = {"model": MODEL, "reps": args.reps, "steady": args.steady, "gap_ms": args.gap_ms,
              "threads": args.threads, "summary": summary(runs), "runs": runs}
    print(json.dumps(result["summary"], indent=2))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=2))
    warm = result["summary"]
    met = all(warm[f"warm_{case}"]["median_ratio"] <= TARGET_RATIO for case in ("load", "move"))
    print(f"target (first request <= {TARGET_RATIO}x p50 with warm-up): {'met' if met else 'missed'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
