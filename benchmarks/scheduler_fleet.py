"""The scheduler's event loop with a fleet registered (issue 24): a real ``nexus scheduler`` process,
``--devices`` stand-in backends and ``--frontends`` stand-in frontends (harness/fleet.py: the production
registration loop, heartbeats and Attach streams; every table accepted; workload reported as
frontends report it).

    python -m benchmarks.scheduler_fleet [--devices 1000] [--frontends 10] [--phase-s 60]
        [--models-cache DIR] [--py-spy BIN]

The models are sim_change's at that size (benchmarks/sim_change.py: 2.4 per device, Zipf shares,
emulated-GPU profiles, 4 rps per device at the base rate), uploaded with their profiles before the
fleet registers. The phases: ``register`` (until every node is registered and the first plan is
pushed), ``base`` (the base rate), ``step`` (5x), ``back`` (the base rate again), ``--phase-s`` each.
Every count is the phase's own.
Per phase it reports the scheduler's loop lag (its ``nexus_scheduler_loop_lag_seconds`` histogram, a
timer due every 0.25 s: the p99 as the bucket bound it falls under, the worst bucket, and how many
ticks ran more than 50 ms late: a p99 under 50 ms allows one in a hundred), the plans
made and pushed, the scheduler's CPU (cores; its planner process's apart), the nodes it removed, and the stand-ins' own loop lag
(a stand-in process that falls behind would delay heartbeats: the figure says whether it kept up).
Target (issue 24): the loop lag's p99 under 50 ms at 1,000 devices.

``--pin-scheduler`` puts the scheduler's process on CPU 0 and everything else (the stand-ins of this
process, the scheduler's planner process) on the other CPUs: on a machine of two cores the stand-ins
take one core, and the scheduler's loop otherwise waits for the CPU as well as for its own work.

Uploading a fleet's models takes minutes; ``--models-cache DIR`` keeps the scheduler's database as it
is once they are uploaded (under DIR, by devices and seed) and starts the next run from a copy. ``--py-spy
BIN`` records the scheduler during one phase (``--py-spy-phase``, the step by default), every thread,
into the output's folder.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import pathlib
import re
import shutil
import subprocess
import time

import grpc
from prometheus_client import generate_latest

from benchmarks.sim_change import MODELS_PER_DEVICE, RPS_PER_DEVICE, workload
from common.pb import control, control_grpc
from common.sample_models import mlp_small, model_bytes
from harness.cluster import Node
from harness.fleet import Fleet
from nexus.launcher import nexus_command
from harness import pyspy
from harness.meters import cpu_seconds, descendants, loadavg
from harness.prometheus import bucket_quantile, buckets, parse, scrape
from harness.scratch import scratch_dir
from harness.smoke import add_smoke, parse_args

LAG_METRIC = "nexus_scheduler_loop_lag_seconds"
STEP = 5.0
EVICTED, STREAM_ENDED = "missed heartbeats", "Attach stream ended"     # the scheduler's log, per node removed
UPLOADS_IN_FLIGHT = 8
TARGET_S = 0.05             # issue 24: the loop lag's p99 under 50 ms (a bucket bound of the histogram)
OTHER_CPUS = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)) if c != 0)     # with --pin-scheduler


def lag_buckets(metrics_url: str) -> dict[float, float]:
    """The scheduler's loop-lag histogram now: cumulative count by bucket bound (s)."""
    found = buckets(scrape(metrics_url), LAG_METRIC)
    if not found:
        raise RuntimeError(f"{LAG_METRIC} not among the scheduler's metrics")
    return found


async def upload_all(scheduler: str, models, base_rps: float) -> None:
    """Every model, with its profile and SLO and its share of ``base_rps`` as its expected rate."""
    onnx = model_bytes(mlp_small())
    queue = list(models)

    async def worker(stub) -> None:
        while queue:
            m = queue.pop()
            header = control.UploadHeader(name=m.name, slo_ms=m.slo_ms, load=True, profile_json=m.profile.to_json(),
                                          expected_rate_rps=m.share * base_rps, runtime="onnxruntime")

            async def chunks():
                yield control.UploadChunk(header=header)
                yield control.UploadChunk(data=onnx)
            await stub.UploadModel(chunks(), timeout=120)

    async with grpc.aio.insecure_channel(scheduler) as channel:
        stub = control_grpc.SchedulerStub(channel)
        await asyncio.gather(*(worker(stub) for _ in range(UPLOADS_IN_FLIGHT)))


def plans_in(log_text: str) -> int:
    return len(re.findall(r"epoch \d+: re-planned", log_text))


def start_scheduler(work: pathlib.Path, pin: bool = False) -> Node:
    """``pin``: the scheduler's process on CPU 0 (its planner process is moved off it: :func:`pin_planner`)."""
    command = ["taskset", "-c", "0", *nexus_command()] if pin else None
    sched = Node("scheduler", ["scheduler", "--listen", "127.0.0.1:0", "--data-dir", str(work / "db"),
                               "--metrics-listen", "127.0.0.1:0"], log_path=work / "scheduler.log", log_level="INFO",
                 command=command)
    sched.wait_ready(60)
    return sched


async def pin_planner(sched: Node, others: str) -> None:
    """The scheduler's planner process (started once the scheduler is ready) and every thread of it onto
    CPUs ``others``."""
    deadline = time.monotonic() + 30
    while not descendants(sched.pid):
        if time.monotonic() > deadline:
            raise RuntimeError("the scheduler started no planner process within 30 s")
        await asyncio.sleep(0.1)
    for child in descendants(sched.pid):
        subprocess.run(["taskset", "-a", "-p", "-c", others, str(child)], check=True, stdout=subprocess.DEVNULL)


async def run(args) -> dict:
    with scratch_dir("scheduler-fleet-") as scratch:
        return await _run(args, scratch.path)


async def _run(args, work: pathlib.Path) -> dict:
    log_path = work / "scheduler.log"
    trace, _ = workload(args.devices, args.seed)
    base_rps = RPS_PER_DEVICE * args.devices
    cached = pathlib.Path(args.models_cache) / f"devices-{args.devices}-seed-{args.seed}" if args.models_cache else None
    uploaded_s = None
    reuse = cached is not None and cached.exists()
    if reuse:
        shutil.copytree(cached, work / "db")
        print(f"models from {cached}", flush=True)
    sched = start_scheduler(work, args.pin_scheduler)
    fleet = None
    try:
        if not reuse:
            started = time.monotonic()
            await upload_all(sched.address, trace, base_rps)
            uploaded_s = time.monotonic() - started
            print(f"uploaded {len(trace)} models in {uploaded_s:.0f} s", flush=True)
            if cached is not None:          # kept as a stopped scheduler leaves it
                sched.stop()
                shutil.copytree(work / "db", cached)
                sched = start_scheduler(work, args.pin_scheduler)
        metrics = sched.info["metrics"]
        fleet = Fleet(sched.address, args.devices, args.frontends, seed=args.seed)
        rates = {m.name: m.share * base_rps for m in trace}
        phases = [("register", None, 0.0), ("base", 1.0, args.phase_s), ("step", STEP, args.phase_s),
                  ("back", 1.0, args.phase_s)]
        rows = []
        for name, factor, duration_s in phases:
            lag0, cpu0, t0 = lag_buckets(metrics), cpu_seconds(sched.pid), time.monotonic()
            planner0 = _children_cpu(sched.pid)
            fleet_lag0 = _fleet_buckets(fleet)
            tables0 = fleet.received.model_tables
            text0 = log_path.read_text()
            plans0, evicted0, ended0 = plans_in(text0), text0.count(EVICTED), text0.count(STREAM_ENDED)
            if name == "register":
                if args.pin_scheduler:
                    await pin_planner(sched, OTHER_CPUS)
                await fleet.start()
                deadline = time.monotonic() + args.register_timeout_s
                while time.monotonic() < deadline and (fleet.registered() < args.devices + args.frontends
                                                       or fleet.received.model_tables < args.devices):
                    await asyncio.sleep(0.5)
            else:
                fleet.set_rates({m: r * factor for m, r in rates.items()})
                spy = spy_out = None
                if args.py_spy and name == args.py_spy_phase:
                    spy_out = pathlib.Path(args.out).parent / f"scheduler_fleet_{name}.pyspy.txt"
                    spy_out.parent.mkdir(parents=True, exist_ok=True)
                    spy = pyspy.record(args.py_spy, sched.pid, duration_s, spy_out)
                await asyncio.sleep(duration_s)
                if spy is not None:
                    top = pyspy.finish(spy, spy_out, duration_s)
                    print(json.dumps({"py_spy": str(spy_out), "threads": top.get("thread_cores")}), flush=True)
            elapsed = time.monotonic() - t0
            lag1 = lag_buckets(metrics)
            text = log_path.read_text()
            p99, count = bucket_quantile(lag0, lag1, 0.99)
            worst, _ = bucket_quantile(lag0, lag1, 1.0)
            fp99, _ = bucket_quantile(fleet_lag0, _fleet_buckets(fleet), 0.99)
            over = count - int(lag1.get(TARGET_S, 0.0) - lag0.get(TARGET_S, 0.0))
            row = {"phase": name, "seconds": round(elapsed, 1), "lag_samples": count, "lag_p99_le_s": p99,
                   "lag_over_50ms": over,
                   "lag_worst_le_s": worst, "plans": plans_in(text) - plans0,
                   "model_tables": fleet.received.model_tables - tables0,
                   "scheduler_cores": round((cpu_seconds(sched.pid) - cpu0) / elapsed, 2),
                   "planner_cores": round((_children_cpu(sched.pid) - planner0) / elapsed, 2),
                   "registered": fleet.registered(), "evicted": text.count(EVICTED) - evicted0,
                   "streams_ended": text.count(STREAM_ENDED) - ended0, "fleet_lag_p99_le_s": fp99,
                   "reports_failed": fleet.reports_failed, "load_average": round(loadavg(), 2)}
            rows.append(row)
            print(json.dumps(row), flush=True)
        return {"devices": args.devices, "frontends": args.frontends, "models": len(trace),
                "pinned": "scheduler on CPU 0, the rest on " + OTHER_CPUS if args.pin_scheduler else "",
                "models_per_device": MODELS_PER_DEVICE, "base_rps": base_rps,
                "upload_s": round(uploaded_s, 1) if uploaded_s is not None else None,
                "phases": rows}
    finally:
        if fleet is not None:
            await fleet.stop()
        sched.stop()


def _children_cpu(pid: int) -> float:
    """CPU seconds of the scheduler's child processes alive now (its planner process)."""
    return sum(c for c in (cpu_seconds(child) for child in descendants(pid)) if c == c)


def _fleet_buckets(fleet: Fleet) -> dict[float, float]:
    return buckets(parse(generate_latest(fleet.registry).decode()), "fleet_loop_lag_seconds")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=1000)
    p.add_argument("--frontends", type=int, default=10)
    p.add_argument("--phase-s", type=float, default=60.0)
    p.add_argument("--register-timeout-s", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default="benchmarks/out/scheduler_fleet.json")
    p.add_argument("--models-cache", default="", help="keep the uploaded models' database here and reuse it")
    p.add_argument("--py-spy", default="", help="py-spy's binary: record the scheduler in one phase")
    p.add_argument("--py-spy-phase", default="step", choices=("base", "step", "back"))
    p.add_argument("--pin-scheduler", action="store_true",
                   help="the scheduler's process on CPU 0, its planner process and this one (the stand-ins) on the "
                        "other CPUs: the scheduler's loop as on a machine of its own")
    add_smoke(p, devices=10, frontends=2, phase_s=3.0)
    args = parse_args(p, argv)
    if args.pin_scheduler:
        if len(os.sched_getaffinity(0)) < 2:
            p.error("--pin-scheduler: needs at least two CPUs")
        os.sched_setaffinity(0, {int(c) for c in OTHER_CPUS.split(",")})
    logging.getLogger("nexus.registration").setLevel(logging.ERROR)     # a thousand stand-ins' routine lines
    result = asyncio.run(run(args))
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    worst = max(r["lag_p99_le_s"] for r in result["phases"])
    print(f"loop lag p99 at {args.devices} devices: under {worst * 1000:g} ms in every phase "
          f"(target: under 50 ms): {'met' if worst <= TARGET_S else 'MISSED'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
