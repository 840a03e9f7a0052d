"""CPU per request on the serving path (issue 18, item 7): the frontend's and the backend's
non-compute CPU per single-row request, as ratios to a bare grpc.aio echo server measured in the
same run, with the same client at the same rate.

    python -m benchmarks.cpu_per_request [--model mlp_small] [--rate 200] [--duration-s 10] [--repeats 3]
                                         [--before DIR] [--py-spy BIN]

Set-up, all on this machine's loopback:

- NEXUS: ``nexus serve --no-samples --threads 1`` (a scheduler, a frontend and one CPU backend as
  separate processes, its cluster token on, as a user gets it), with the sample ``--model`` uploaded
  (profiled by the backend) at its SLO. One ORT thread, so that the time of the batches that
  ModelStatistics reports (``compute_input + compute_infer + compute_output``, per batch) is the
  backend's compute CPU; the backend's non-compute CPU is its CPU less that.
- ECHO: ``harness.fake_kserve`` with no delay (a bare grpc.aio server on the components' event
  loop, uvloop): ModelInfer parses the request and answers a prepared response of the model's output
  shapes; with ``--echo-wait-ms MS``, after an awaited sleep of MS. It serves the model under the same name, inputs and outputs as the frontend describes.
- CLIENT: the project's load generator (``nexus.bench.LoadClient``), Poisson arrivals at ``--rate``,
  single-row requests, one connection, the same for both servers.

With ``--before DIR`` (a checkout of older code: ``git archive COMMIT | tar -x -C DIR``) a second
``nexus serve`` runs from DIR (``PYTHONPATH``), so that old and new code are measured in the same run.

Per repeat, the servers are measured one after the other, in an order that rotates between
repeats. CPU comes from ``/proc/PID/stat`` of each process over the measured window (the echo
server; nexus's frontend, backend and scheduler; the client), divided by the requests sent. The
figures are medians over repeats of microseconds per request, and the ratios are medians of each
repeat's ratios. ``--py-spy BIN`` samples the frontend and the backend during one more window and prints the
functions that take its busy samples. JSON to benchmarks/out/cpu_per_request.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import statistics
import sys
import tempfile
import time

from harness import pyspy
from nexus.bench import LoadClient
from harness.cluster import ServeCluster, Upload
from harness.fake_kserve import spawn
from harness.meters import CpuMeter, uptime
from harness.smoke import add_smoke, parse_args
from nexus.bench.report import step_summary, write_json
from harness.stats import model_stats, stats_delta

OUT = pathlib.Path(__file__).resolve().parent / "out"


def echo_config(metadata, name: str, wait_ms: float = 0.0) -> dict:
    """The echo server's model: the served model's name, inputs and outputs (from its KServe metadata),
    answered after ``wait_ms``."""
    def tensors(specs):
        return [[t.name, t.datatype, list(t.shape)] for t in specs]

    return {"models": {name: {"inputs": tensors(metadata.inputs), "outputs": tensors(metadata.outputs),
                              "latency_ms": wait_ms}}}


async def metered_run(address: str, model: str, pids: dict[str, int], args, slo_ms: float, seed: int):
    """One window at ``--rate`` with the CPU of ``pids`` (and this client) metered: (report, CPU seconds)."""
    async with LoadClient(address, model, seed=seed) as client:
        await client.run(args.rate, 1.0, slo_ms, seed=seed)          # connection and code paths warm
        meter = CpuMeter({**pids, "client": os.getpid()}).start()
        report = await client.run(args.rate, args.duration_s, slo_ms, seed=seed + 1)
        cpu = meter.stop()
    return report, cpu


def per_request_us(cpu: dict, sent: int) -> dict[str, float]:
    return {k: round(v * 1e6 / max(sent, 1), 1) for k, v in cpu["cpu_s"].items()}


def measure_echo(address: str, args, slo_ms: float, seed: int, echo_pid: int) -> dict:
    report, cpu = asyncio.run(metered_run(address, args.model, {"echo": echo_pid}, args, slo_ms, seed))
    return {"step": step_summary(report, 3), "us_per_request": per_request_us(cpu, report.sent),
            "machine_busy_cores": round(cpu["machine_busy_cores"], 2), "external_cores": round(cpu["external_cores"], 2)}


def measure_nexus(srv: ServeCluster, args, slo_ms: float, seed: int, pids: dict[str, int]) -> dict:
    """One window against ``nexus serve`` ``srv``: CPU per request of its processes and this client,
    and the backend's CPU split into the model's compute and the rest."""
    before = model_stats(srv.frontend, args.model)
    report, cpu = asyncio.run(metered_run(srv.frontend, args.model, pids, args, slo_ms, seed))
    delta = stats_delta(model_stats(srv.frontend, args.model), before)
    us = per_request_us(cpu, report.sent)
    # The model's own time: the infer phase of every batch (ModelStatistics' batch_stats, once per
    # batch). Gathering inputs and splitting outputs count as the backend's non-compute path.
    compute_s = sum(ns for _, ns in delta["batches"].values()) / 1e9
    us["backend_compute"] = round(compute_s * 1e6 / max(report.sent, 1), 1)
    us["backend_non_compute"] = round(us["backend"] - us["backend_compute"], 1)
    return {"step": step_summary(report, 3), "us_per_request": us, "batches": delta["execution_count"],
            "machine_busy_cores": round(cpu["machine_busy_cores"], 2), "external_cores": round(cpu["external_cores"], 2)}


def spy(srv: ServeCluster, args, slo_ms: float, pids: dict[str, int], work: pathlib.Path) -> dict:
    """py-spy of the frontend and the backend during one more window: each one's top functions."""
    raws = {name: work / f"spy-{name}.txt" for name in ("frontend", "backend")}
    procs = {name: pyspy.record(args.py_spy, pids[name], args.duration_s, raw) for name, raw in raws.items()}
    time.sleep(0.5)
    asyncio.run(metered_run(srv.frontend, args.model, {}, args, slo_ms, 7))
    tops = {name: pyspy.finish(procs[name], raw, args.duration_s) for name, raw in raws.items()}
    OUT.mkdir(parents=True, exist_ok=True)
    for name, raw in raws.items():
        if raw.exists():
            (OUT / f"cpu_per_request.spy-{name}.txt").write_text(raw.read_text())
    return tops


def summarise(repeats: list[dict], variants: list[str]) -> dict:
    """Medians over repeats: microseconds per request of each process, and each repeat's ratios to echo."""
    def med(f):
        return round(statistics.median(f(r) for r in repeats), 2)

    def echo(r):
        return r["echo"]["us_per_request"]["echo"]

    out = {"echo_us": med(echo), "client_us_echo": med(lambda r: r["echo"]["us_per_request"]["client"])}
    for v in variants:
        def us(r, key, v=v):
            return r[v]["us_per_request"][key]
        out[v] = {key: med(lambda r, key=key: us(r, key)) for key in
                  ("frontend", "backend", "backend_compute", "backend_non_compute", "scheduler", "client")}
        out[v]["frontend_over_echo"] = med(lambda r: us(r, "frontend") / echo(r))
        out[v]["backend_non_compute_over_echo"] = med(lambda r: us(r, "backend_non_compute") / echo(r))
    return out


def start_nexus(work: pathlib.Path, tag: str, path: pathlib.Path, args, slo_ms: float,
                code_dir: str | None = None) -> tuple[ServeCluster, dict[str, int]]:
    """``nexus serve`` (from ``code_dir`` when given) with the model uploaded; returns it and its components' pids."""
    env = {"PYTHONPATH": str(pathlib.Path(code_dir).resolve())} if code_dir else None
    srv = ServeCluster(work / f"data-{tag}", "--no-samples", "--threads", "1", *args.serve_flag, timeout_s=180,
                       log_path=work / f"nexus-{tag}.log", env=env)
    try:
        srv.upload(Upload(path, args.model, slo_ms=slo_ms), timeout_s=180)
    except BaseException:
        srv.stop()
        raise
    return srv, srv.components()


def served_metadata(frontend: str, model: str):
    from common import grpc_util
    from common.pb import kserve, kserve_grpc

    with grpc_util.channel(frontend) as ch:
        return kserve_grpc.GRPCInferenceServiceStub(ch).ModelMetadata(kserve.ModelMetadataRequest(name=model),
                                                                     timeout=10)


def main(argv: list[str] | None = None) -> int:
    from common.sample_models import SAMPLE_MODELS, write_sample_models

    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="mlp_small", choices=sorted(SAMPLE_MODELS))
    p.add_argument("--rate", type=float, default=200.0, help="Poisson arrivals per second, every server")
    p.add_argument("--echo-wait-ms", type=float, default=0.0, metavar="MS",
                   help="the echo server answers after MS (an awaited sleep): what grpc.aio charges a handler "
                        "that waits, as the frontend's waits for its backend")
    p.add_argument("--duration-s", type=float, default=10.0, help="each measured window")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--before", metavar="DIR", help="a checkout of older code: measure its nexus serve too")
    p.add_argument("--py-spy", metavar="BIN", help="py-spy binary: sample the frontend and the backend in one more window")
    p.add_argument("--serve-flag", action="append", default=[], metavar="FLAG",
                   help="one more flag for nexus serve (repeat; e.g. --serve-flag=--threads=2)")
    p.add_argument("--out", default=str(OUT / "cpu_per_request.json"))
    add_smoke(p, rate=50.0, duration_s=1.0, repeats=1)
    args = parse_args(p, argv)
    if args.rate <= 0 or args.duration_s <= 0 or args.repeats < 1:
        p.error("--rate and --duration-s must be positive, --repeats at least 1")
    if args.before and not (pathlib.Path(args.before) / "nexus" / "cli.py").is_file():
        p.error(f"--before {args.before} is not a checkout of this project")
    slo_ms = SAMPLE_MODELS[args.model].slo_ms
    variants = ["nexus"] + (["before"] if args.before else [])
    result: dict = {"command": " ".join(["python", "-m", "benchmarks.cpu_per_request", *argv]),
                    "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "uptime_before": uptime(),
                    "model": args.model, "rate_rps": args.rate, "duration_s": args.duration_s, "repeats": []}
    with tempfile.TemporaryDirectory(prefix="cpu-per-request-") as tmp:
        work = pathlib.Path(tmp)
        path = write_sample_models(work / "models", [args.model])[args.model]
        clusters: dict[str, tuple[ServeCluster, dict[str, int]]] = {}
        echo_proc = None
        try:
            clusters["nexus"] = start_nexus(work, "nexus", path, args, slo_ms)
            if args.before:
                clusters["before"] = start_nexus(work, "before", path, args, slo_ms, args.before)
            echo_proc, echo_address = spawn(echo_config(served_metadata(clusters["nexus"][0].frontend, args.model),
                                                        args.model, args.echo_wait_ms))
            print(f"echo at {echo_address}; " + "; ".join(f"{v} at {c.frontend} (pids {pids})"
                                                         for v, (c, pids) in clusters.items()), flush=True)
            names = ["echo", *variants]
            for i in range(args.repeats):
                rep = {}
                for which in names[i % len(names):] + names[:i % len(names)]:
                    if which == "echo":
                        rep["echo"] = measure_echo(echo_address, args, slo_ms, 10 * i, echo_proc.pid)
                    else:
                        srv, pids = clusters[which]
                        rep[which] = measure_nexus(srv, args, slo_ms, 10 * i, pids)
                result["repeats"].append(rep)
                e = rep["echo"]["us_per_request"]
                line = [f"  repeat {i + 1}: echo {e['echo']:.0f} us/req (client {e['client']:.0f})"]
                for v in variants:
                    n = rep[v]["us_per_request"]
                    line.append(f"{v}: frontend {n['frontend']:.0f} ({n['frontend'] / e['echo']:.2f}x echo), backend "
                                f"{n['backend']:.0f} = compute {n['backend_compute']:.0f} + non-compute "
                                f"{n['backend_non_compute']:.0f} ({n['backend_non_compute'] / e['echo']:.2f}x echo), "
                                f"p50 {rep[v]['step']['p50_ms']} ms, other load {rep[v]['external_cores']} cores")
                print(" | ".join(line), flush=True)
            if args.py_spy:
                srv, pids = clusters["nexus"]
                result["py_spy"] = spy(srv, args, slo_ms, pids, work)
                for name, top in result["py_spy"].items():
                    print(f"  py-spy, {name}: {top}", flush=True)
        finally:
            if echo_proc is not None:
                echo_proc.terminate()
                echo_proc.wait()
            for srv, _ in clusters.values():
                srv.stop()
    result["uptime_after"] = uptime()
    result["summary"] = summarise(result["repeats"], variants)
    out = write_json(args.out, result)
    print(f"summary (medians over {args.repeats} repeats, us of CPU per request): {result['summary']}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
