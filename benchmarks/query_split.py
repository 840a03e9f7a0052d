"""Issue 6 benchmark: a traffic-style query on emulated GPUs, DP latency split vs even vs proportional.

For each split method the same offered load (Poisson, --rate queries/s, 400 ms SLO) runs against a
real local cluster (`nexus serve --device emulated:gtx1080ti`) with two emulated GPUs more than the
scheduler's planning functions say that split needs at that rate (its defaults for burst
room and path allowance included). The load runs without a break: a warm-up in which the scheduler
measures rate and gamma and re-plans, then the measured window. GPUs needed is the most devices the
scheduler's plan used during that window. Reported: GPUs needed, goodput, bad rate (late + dropped + failed), p99.

    python -m benchmarks.query_split [--rate 27] [--profile-scale 2] [--duration-s 40]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import threading
import time

from common.config import BatchStart, SchedulerConfig
from globalsched.planning.plan import GpuSpec, SessionSpec
from common.profile import Profile
from common.query_def import parse_query
from common.sample_models import detector_64, face_cls, model_bytes, vehicle_cls
from globalsched.planning.algorithms import PlannerConfig, solve
from globalsched.planning.query_sessions import plan_query_sessions
from nexus.bench import run_bench
from harness.cluster import ServeCluster, Upload
from harness.smoke import add_smoke, parse_args
from nexus.bench.report import write_json
from nexus.queries_cmd import list_queries, register_query

ROOT = pathlib.Path(__file__).resolve().parent.parent

GPU = "gtx1080ti"
SPARE_BACKENDS = 2
BOXES = 3   # every detection fans out: gamma = 3 on each edge
# GPU-like profiles at --profile-scale 1: l(b) = alpha*b + beta (ms), memory base + per item (MB).
PROFILES = {"det3": (10.0, 30.0, 800.0, 20.0), "vehicle": (4.0, 15.0, 400.0, 8.0), "face": (4.8, 15.0, 400.0, 8.0)}
QUERY = {
    "name": "traffic", "slo_ms": 400, "inputs": [{"name": "image", "datatype": "FP32", "shape": [3, 64, 64]}],
    "stages": [
        {"name": "detect", "model": "det3", "inputs": {"input": "image"}},
        {"name": "vehicle", "model": "vehicle", "inputs": {"input": "detect.crops"}, "fanout": True},
        {"name": "face", "model": "face", "inputs": {"input": "detect.crops"}, "fanout": True},
    ],
    "outputs": {"vehicles": "vehicle.logits", "faces": "face.logits"},
}


def profile(name: str, scale: float) -> Profile:
    a, b, m0, m1 = PROFILES[name]
    return Profile.linear(a * scale, b * scale, 64, m0, m1, device_type=GPU)


def gpus_needed(method: str, rate: float, scale: float, headroom: float, allowance_ms: float,
                burst_sigma: float) -> tuple[int, dict]:
    """What the scheduler plans for this query at ``rate`` (same functions, same configuration)."""
    q = parse_query(json.dumps(QUERY))
    config = PlannerConfig(network_ms=allowance_ms, burst_sigma=burst_sigma)
    gammas = {("traffic", "detect", "vehicle"): float(BOXES), ("traffic", "detect", "face"): float(BOXES)}
    sessions, plans = plan_query_sessions({"traffic": q}, {"traffic": rate * (1 + headroom)}, gammas,
                                          {m: {GPU: profile(m, scale)} for m in PROFILES}, [GPU], method,
                                          config=config)
    specs = [SessionSpec(s.model, s.model, s.slo_ms, s.rate_rps, s.profiles[GPU]) for s in sessions]
    plan = solve(specs, GpuSpec(GPU, 11000), config=config)
    return len(plan.gpus), dict(plans["traffic"].budgets_ms)


class PlanWatch:
    """Polls the scheduler's view of the query once a second while the load runs."""

    def __init__(self, scheduler: str, creds) -> None:
        self.scheduler = scheduler
        self.creds = creds
        self.samples: list[tuple[float, int, float]] = []   # (time, devices, planned qps)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            try:
                info = next(q for q in list_queries(self.scheduler, self.creds) if q.name == "traffic")
            except Exception:   # a poll that fails is skipped
                continue
            self.samples.append((time.monotonic(), info.devices, info.planned_rate_rps))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def window(self, start: float) -> list[tuple[int, float]]:
        return [(d, r) for t, d, r in self.samples if t >= start]


def run_method(method: str, args, workdir: pathlib.Path) -> dict:
    # Sized for the room a fixed cluster keeps when its idle devices are too few for spares; the
    # scheduler itself judges its Z (unset: by the idle devices it has, globalsched/planning/planner.py).
    sizing_sigma = SchedulerConfig().resolved_burst_sigma if args.burst_sigma is None else args.burst_sigma
    n, budgets = gpus_needed(method, args.rate, args.profile_scale, args.rate_headroom, args.path_allowance_ms,
                             sizing_sigma)
    chosen = [] if args.burst_sigma is None else ["--burst-sigma", str(args.burst_sigma)]
    models = {"det3": detector_64(BOXES), "vehicle": vehicle_cls(), "face": face_cls()}
    # Spare backends: squishy's count is not monotone in the rate, and the scheduler plans for the
    # rate it measures, not the one offered. GPUs needed is what its plan uses.
    cluster = ServeCluster(workdir / method, "--device", f"emulated:{GPU}", "--backends", str(n + SPARE_BACKENDS),
                           "--no-samples",
                           "--latency-split", method, "--epoch-s", str(args.epoch_s),
                           "--rate-headroom", str(args.rate_headroom), *chosen,
                           "--path-allowance-ms", str(args.path_allowance_ms), "--batch-start", args.batch_start)
    try:
        for name, model in models.items():
            path = workdir / f"{name}.onnx"
            path.write_bytes(model_bytes(model))
            prof = workdir / f"{name}.json"
            prof.write_text(profile(name, args.profile_scale).to_json())
            cluster.upload(Upload(path, name, str(prof), 400.0, load=False))
        register_query(cluster.scheduler, json.dumps(QUERY), cluster.creds)
        time.sleep(2)
        # One continuous open-loop run: the warm-up lets the scheduler measure the rate and gamma and
        # re-plan (gaps between runs would read as a falling rate); only the rest is measured.
        watch = PlanWatch(cluster.scheduler, cluster.creds)
        measured_from = time.monotonic() + args.warmup_s
        report = run_bench(cluster.frontend, "traffic", args.rate, args.duration_s, 400.0, seed=args.seed,
                           warmup_s=args.warmup_s)
        watch.stop()
        info = next(q for q in list_queries(cluster.scheduler, cluster.creds) if q.name == "traffic")
    finally:
        cluster.stop()
    window = watch.window(measured_from) or [(info.devices, info.planned_rate_rps)]
    devices = [d for d, _ in window]
    return {"method": method, "gpus": max(devices), "gpus_min": min(devices), "gpus_offline": n,
            "backends": n + SPARE_BACKENDS,
            "sent_rps": report.sent / args.duration_s, "planned_rps": max(r for _, r in window),
            "budgets_ms": dict(info.budgets_ms), "budgets_offline_ms": budgets, "offered_rps": args.rate,
            "goodput_rps": report.goodput_rps, "bad_rate": report.bad_rate, "p50_ms": report.p50_ms,
            "p99_ms": report.p99_ms, "sent": report.sent, "late": report.late, "dropped": report.dropped,
            "failed": report.failed}


def main(argv: list[str] | None = None) -> int:
    defaults = SchedulerConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=27.0, help="offered queries/s")
    parser.add_argument("--profile-scale", type=float, default=2.0,
                        help="multiply every profile latency (a slower GPU: more devices per query/s)")
    parser.add_argument("--duration-s", type=float, default=40.0)
    parser.add_argument("--warmup-s", type=float, default=40.0)
    parser.add_argument("--epoch-s", type=float, default=10.0, help="scheduler re-planning period")
    parser.add_argument("--rate-headroom", type=float, default=defaults.rate_headroom)
    parser.add_argument("--burst-sigma", type=float, default=None,
                        help="the scheduler's --burst-sigma (default: unset, the scheduler's own choice; the "
                             "cluster is then sized for its room on a cluster short of idle devices)")
    parser.add_argument("--path-allowance-ms", type=float, default=defaults.path_allowance_ms)
    parser.add_argument("--batch-start", default=BatchStart.EAGER.value, choices=[m.value for m in BatchStart])
    parser.add_argument("--methods", default="dp,even,proportional")
    parser.add_argument("--seed", type=int, default=2, help="seed of the Poisson arrivals")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "query_split.json"))
    add_smoke(parser, methods="dp", rate=5.0, profile_scale=1.0, duration_s=2.0, warmup_s=1.0)
    args = parse_args(parser, argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for method in args.methods.split(","):
            rows.append(run_method(method, args, pathlib.Path(tmp)))
            r = rows[-1]
            print(f"{method:13s} gpus={r['gpus']} (min {r['gpus_min']}, offline {r['gpus_offline']})  "
                  f"goodput={r['goodput_rps']:.1f}/{r['sent_rps']:.1f} qps sent  "
                  f"bad={100 * r['bad_rate']:.2f}% (late {r['late']}, dropped {r['dropped']}, failed {r['failed']} "
                  f"of {r['sent']})  p50={r['p50_ms']:.0f} p99={r['p99_ms']:.0f} ms  planned={r['planned_rps']:.1f} qps  "
                  f"budgets={ {k: round(v) for k, v in r['budgets_ms'].items()} }", flush=True)
    write_json(args.out, {"args": vars(args), "rows": rows}, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
