"""Time to ready: a fresh ``nexus serve``, its restart, and a model from its upload to serving.

Three measurements, each repeated:

- ``start``: ``nexus serve`` on an empty data directory (the first start builds, stores and profiles
  the sample models), then again on the same directory (profiles kept): from the command to its
  ready line, with the phases its banner reports;
- ``upload``: on ``nexus serve --no-samples``, models the cluster has never seen (a new seed each
  time, so no profile is reused): a 0.1 MB MLP, a 5 MB classifier and the 47 MB ResNet-18 at 64x64.
  Timed from the upload call to the upload command's answer (``wait_model_ready``), with the stages
  the scheduler recorded (stored, profiled, planned, loaded, routed) and the frontend's own
  ``ModelReady`` right after, which must already say ready;
- ``under-load``: on ``nexus serve`` with the sample models (``--cpu-layout`` as given), a new
  ResNet-18 at 64x64 uploaded while the sample ``resnet18_64`` serves ``--rate-rps`` (open-loop
  Poisson, 100 ms SLO): its time to ready, and the served model's requests that arrived from the
  upload to half a second after its answer (count, p99, max, how many missed the SLO or failed)
  beside the rest of the load's window.

Run from the repository root: ``python -m benchmarks.ready_time [--repeats 3] [--only under-load
--rate-rps 130 --cpu-layout machine]``.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from common import grpc_util
from common.pb import kserve, kserve_grpc
from common.sample_models import backbone_variant, mlp_small, model_bytes, resnet18_64
from harness.cluster import ServeCluster
from harness.meters import loadavg
from harness.smoke import add_smoke, parse_args
from nexus.bench.loadgen import run_bench
from nexus.bench.report import OK, BenchSamples
from nexus.launcher import nexus_command
from nexus.scheduler_client import upload_model, wait_model_ready


def _start_once(data_dir: pathlib.Path) -> tuple[float, str]:
    """Seconds from ``nexus serve`` to its ready line, and the banner's ``started in`` line."""
    began = time.monotonic()
    proc = subprocess.Popen([*nexus_command(), "serve", "--data-dir", str(data_dir), "--frontend-port", "0",
                             "--scheduler-port", "0", "--metrics-port", "0", "--http-port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    banner, seen = "", []
    try:
        for line in proc.stdout:
            seen.append(line)
            if line.strip().startswith("started in"):
                banner = line.strip()
            if line.startswith("NEXUS-READY"):
                return time.monotonic() - began, banner
        raise RuntimeError(f"nexus serve ended before its ready line: {''.join(seen)[-2000:]}")
    finally:
        proc.send_signal(2)
        proc.communicate(timeout=60)         # read to the end: a full pipe would hold its stop


def measure_start(repeats: int) -> None:
    print("start: fresh data directory, then the same again (profiles kept)")
    for i in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            for which in ("fresh", "restart"):
                seconds, banner = _start_once(pathlib.Path(tmp) / "data")
                print(f"  {which:8s} {seconds:5.1f} s  [{banner}]  load {loadavg():.2f}", flush=True)


def measure_upload(repeats: int) -> None:
    print("upload to ready on nexus serve --no-samples (models never seen before)")
    rows: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        cluster = ServeCluster(work / "data", "--no-samples")
        try:
            with grpc_util.channel(cluster.frontend, cluster.creds) as channel:
                frontend = kserve_grpc.GRPCInferenceServiceStub(channel)
                for i in range(repeats):
                    models = {"mlp 0.1 MB": mlp_small(seed=100 + i, hidden=96 + i),
                              "classifier 5 MB": backbone_variant(20 + i),
                              "resnet18_64 47 MB": resnet18_64(seed=200 + i)}
                    for label, model in models.items():
                        name = f"m{i}_{label.split()[0]}"
                        path = work / f"{name}.onnx"
                        path.write_bytes(model_bytes(model))
                        began = time.monotonic()
                        upload_model(cluster.scheduler, path, name, creds=cluster.creds)
                        desc = wait_model_ready(cluster.scheduler, name, 0, 120.0, cluster.creds)
                        seconds = time.monotonic() - began
                        ready_at_frontend = frontend.ModelReady(kserve.ModelReadyRequest(name=name), timeout=10).ready
                        stages = ", ".join(f"{s.stage} {s.after_s:.2f}" for s in desc.ready_stages)
                        print(f"  {label:18s} {seconds:5.2f} s to the answer (scheduler: ready {desc.ready_after_s:.2f} "
                              f"s: {stages}); frontend ModelReady {ready_at_frontend}; load {loadavg():.2f}",
                              flush=True)
                        rows.setdefault(label, []).append(seconds)
        finally:
            cluster.stop()
    for label, values in rows.items():
        print(f"  {label:18s} median {statistics.median(values):.2f} s over {len(values)}")


def measure_under_load(repeats: int, rate_rps: float, load_s: float, layout: str) -> None:
    print(f"upload to ready while resnet18_64 serves {rate_rps:g} requests/s (nexus serve --cpu-layout {layout})")
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        cluster = ServeCluster(work / "data", "--cpu-layout", layout)
        try:
            for i in range(repeats):
                name = f"resnet_new{i}"
                path = work / f"{name}.onnx"
                path.write_bytes(model_bytes(resnet18_64(seed=300 + i)))
                load: dict = {}
                loader = threading.Thread(target=lambda: load.update(report=run_bench(
                    cluster.frontend, "resnet18_64", rate_rps, load_s, 100.0, warmup_s=5.0)))
                loader.start()
                time.sleep(5.0 + 0.3 * load_s)
                began = time.monotonic()
                upload_model(cluster.scheduler, path, name, creds=cluster.creds)
                desc = wait_model_ready(cluster.scheduler, name, 0, 120.0, cluster.creds)
                answered = time.monotonic()
                loader.join()
                during, rest = _split(load["report"].samples, began, answered + 0.5)
                stages = ", ".join(f"{s.stage} {s.after_s:.2f}" for s in desc.ready_stages)
                print(f"  ready {desc.ready_after_s:.2f} s ({stages}); served model during the upload: {during}; "
                      f"the rest of the window: {rest}; load {loadavg():.2f}", flush=True)
        finally:
            cluster.stop()


def _split(samples: BenchSamples, start_s: float, end_s: float) -> tuple[str, str]:
    """The requests of the measured window that arrived between ``start_s`` and ``end_s`` (monotonic
    seconds), and the others: count, p99 and max latency (a request without an answer counts as
    infinitely late), and how many missed the SLO."""
    arrived = samples.start_s + samples.sched_s
    latency = np.where(samples.outcome == OK, samples.latency_ms, np.inf)
    measured = samples.sched_s >= samples.warmup_s
    within = (arrived >= start_s) & (arrived <= end_s) & measured

    def summary(mask) -> str:
        values = latency[mask]
        if not len(values):
            return "no requests"
        p99 = np.percentile(values, 99, method="higher")
        return (f"{len(values)} requests, p99 {p99:.1f} ms, max {values.max():.1f} ms, "
                f"{int((values > samples.slo_ms).sum())} missed")
    return summary(within), summary(measured & ~within)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--only", choices=["start", "upload", "under-load"], help="one of the measurements")
    p.add_argument("--rate-rps", type=float, default=130.0, help="under-load: the served model's rate")
    p.add_argument("--load-s", type=float, default=40.0, help="under-load: the load's measured window")
    p.add_argument("--cpu-layout", default="machine", help="under-load: nexus serve's --cpu-layout")
    add_smoke(p, repeats=1, load_s=4.0, rate_rps=20.0)
    args = parse_args(p, argv)
    print(f"CPU: {_cpu_model()}; load average {os.getloadavg()[0]:.2f}")
    if args.only in (None, "start"):
        measure_start(args.repeats)
    if args.only in (None, "upload"):
        measure_upload(args.repeats)
    if args.only in (None, "under-load"):
        measure_under_load(args.repeats, args.rate_rps, args.load_s, args.cpu_layout)
    return 0


def _cpu_model() -> str:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
