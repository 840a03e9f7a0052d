"""Issue 18 item 6: a long tail of models on emulated GPUs, served by the real processes.

``--models`` models (default 100) with Zipf rates adding up to ``--rate`` requests/s, GPU-like
profiles l(b) = 3-8 ms + 1-3 ms per item (``harness/workloads.py``, the workload that
``benchmarks/plan_quality.py`` plans offline), SLOs uniform in ``--slo-ms`` (50-200 ms). The real
scheduler, ``--frontends`` frontends and ``--backends`` emulated GPU backends (``nexus backend
--device emulated:<gpu>``: a batch waits its profile's latency) run as separate processes. Every
model is uploaded with its profile and, unless ``--no-expected-rates``, the rate it will get (as a
user who knows the traffic would), so the first plan is made for it. Then one open-loop Poisson
client per model sends through every frontend at once, for ``--duration-s``.

Reported:
- devices: what the scheduler's plan uses, against its tight lower bound (throughput and each
  session's fixed cost per duty cycle) and the throughput-only bound of earlier releases, sampled
  from GetStatus every few seconds; the same planning functions offline, for comparison;
- requests: the share answered within their model's SLO, over the whole run and in its first
  minute (from the first request), per minute, and the shares late, dropped (by status) and failed;
- CPU: cores used by the client (a process of its own), this harness (its watches and meters), the
  scheduler, the frontends and the backends, the whole machine and every other process on it (other
  people's work on a shared machine), second by second, beside the throughput; and what the
  frontends themselves counted late and dropped, to tell the serving path from the client's side.

    python -m benchmarks.long_tail                                   # 150 rps, 20 backends, 10 minutes
    python -m benchmarks.long_tail --rate 300 --backends 60 --duration-s 120
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import pathlib
import sys
import shutil
import time

import numpy as np

from common.config import SchedulerConfig
from common.emulated_gpus import GPU_TYPES
from globalsched.planning.plan import GpuSpec, SessionSpec
from common.sample_models import mlp_small, model_bytes
from globalsched.planning.algorithms import PlannerConfig, solve
from globalsched.planning.algorithms.lower_bound import bounds_gpus
from nexus.bench import BenchReport, LoadClient
from harness.cluster import Cluster, Upload
from harness.meters import CpuMeter, CpuTimeline, LoadSampler, Periodic, favour, favour_tree, uptime
from harness.smoke import add_smoke, parse_args
from nexus.bench.report import OK, write_json
from harness.workloads import long_tail
from nexus.scheduler_client import AdminCallError, fetch_status

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIRST_MINUTE_S = 60.0
MAX_BAD_LISTED = 5000       # requests outside their SLO listed one by one in the JSON
BAD_BURST = 5               # requests outside their SLO sent in one second: a burst


def offline_plan(sessions: list[SessionSpec], gpu: str, args) -> dict:
    """What the scheduler's planning functions give for the offered rates, before anything runs."""
    config = PlannerConfig(network_ms=args.path_allowance_ms, burst_sigma=args.burst_sigma)
    spec = GpuSpec(gpu, GPU_TYPES[gpu].memory_mb)
    plan = solve(sessions, spec, config=config)
    tight, old = bounds_gpus(sessions, spec, config)
    return {"devices": plan.num_gpus, "lower_bound": plan.lower_bound,
            "lower_bound_throughput_only": plan.lower_bound_throughput_only,
            "fractional_bounds": [round(tight, 2), round(old, 2)]}


class StatusWatch:
    """Samples the scheduler's plan (GetStatus) every ``every_s`` seconds on a thread of its own."""

    def __init__(self, scheduler: str, every_s: float) -> None:
        self.scheduler, self.every_s = scheduler, every_s
        self.samples: list[dict] = []
        self._where: dict[str, set[str]] = {}
        self._periodic = Periodic(every_s, self.sample)

    def sample(self) -> dict | None:
        try:
            st = fetch_status(self.scheduler, timeout_s=10)
        except AdminCallError:       # a poll that fails is skipped
            return None
        where: dict[str, set[str]] = {}
        for d in st.devices:
            for x in d.sessions:
                where.setdefault(x.session, set()).add(d.node_id)
        moved = sum(1 for name, nodes in where.items() if name in self._where and nodes - self._where[name])
        self._where = where
        s = {"t": time.monotonic(), "epoch": st.epoch, "planned_devices": st.planned_devices,
             "devices_in_use": st.devices_in_use, "lower_bound": st.lower_bound,
             "lower_bound_throughput_only": st.lower_bound_throughput_only,
             "unplaced": len(st.unplaced), "best_effort": len(st.best_effort),
             "moved": moved}     # sessions now on a backend they were not on at the last sample
        self.samples.append(s)
        return s

    def start(self) -> "StatusWatch":
        self._periodic.start()
        return self

    def stop(self) -> None:
        self._periodic.stop()


def frontend_view(metrics_urls: list[str]) -> dict:
    """What the frontends counted (their /metrics, summed): requests answered, answered after their
    SLO, dropped. Late at the client but not here is time spent outside the serving path's clock."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    out = {"answered": 0, "late": 0, "dropped": 0}
    names = {"nv_inference_request_success": "answered", "nexus_requests_late": "late",
             "nexus_requests_dropped": "dropped"}
    for url in metrics_urls:
        with urllib.request.urlopen(url, timeout=10) as reply:
            text = reply.read().decode()
        for family in text_string_to_metric_families(text):
            key = names.get(family.name)
            if key is not None:
                out[key] += int(sum(sample.value for sample in family.samples
                                    if not sample.name.endswith("_created")))
    return out


async def drive(frontends: list[str], sessions: list[SessionSpec], duration_s: float, seed: int, conn
                ) -> tuple[float, list[BenchReport]]:
    """One open-loop Poisson client per model, all at once, every one balanced over the frontends:
    opened, then said ready on ``conn``, then run once ``conn`` says go. Returns the monotonic time
    the load started and each model's report."""
    clients = [LoadClient(frontends, s.model, seed=seed * 1000 + i) for i, s in enumerate(sessions)]
    for c in clients:
        await c.open()
    try:
        conn.send("ready")
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        start = time.monotonic()
        reports = await asyncio.gather(*(c.run(s.rate_rps, duration_s, s.slo_ms)
                                         for c, s in zip(clients, sessions)))
    finally:
        for c in clients:
            await c.close()
    return start, list(reports)


def client_main(frontends: list[str], sessions: list[SessionSpec], duration_s: float, seed: int, conn) -> None:
    """The load client's process: nothing else runs in it (the watches and meters of the benchmark
    would share its interpreter lock and delay its replies, which it would count as latency)."""
    conn.send(asyncio.run(drive(frontends, sessions, duration_s, seed, conn)))
    conn.recv()          # stays until its CPU time is read


def attainment(reports: list[BenchReport], start_s: float, duration_s: float) -> dict:
    """Requests within SLO, late, dropped and failed, over the run, its first minute and each minute
    (a request belongs to the minute it was sent in, counted from ``start_s``)."""
    sent_at, within, ok, codes = [], [], [], []
    for r in reports:
        s = r.samples
        sent_at.append(s.sent_at - start_s)
        answered = s.outcome == OK
        ok.append(answered)
        within.append(answered & (s.latency_ms <= s.slo_ms))
        codes += s.statuses()
    t, w, a = np.concatenate(sent_at), np.concatenate(within), np.concatenate(ok)
    codes_arr = np.array(codes)

    def window(mask: np.ndarray) -> dict:
        n = int(mask.sum())
        bad = {str(c): int(k) for c, k in zip(*np.unique(codes_arr[mask & ~a], return_counts=True))}
        return {"sent": n, "within_slo": int((mask & w).sum()), "late": int((mask & a & ~w).sum()),
                "not_answered": bad, "attainment": float((mask & w).sum() / n) if n else 1.0,
                "dropped_share": float(sum(bad.values()) / n) if n else 0.0}

    minutes = [window((t >= 60 * m) & (t < 60 * (m + 1))) for m in range(int(np.ceil(duration_s / 60)))]
    seconds, counts = np.unique(np.floor(t[~w]).astype(int), return_counts=True)
    slo = np.concatenate([np.full(len(r.samples.sched_s), r.slo_ms) for r in reports])
    model = np.concatenate([np.full(len(r.samples.sched_s), r.model) for r in reports])
    latency = np.concatenate([r.samples.latency_ms for r in reports])
    order = np.argsort(t[~w])[:MAX_BAD_LISTED]
    bad = [{"t": round(float(tt), 3), "model": str(m), "slo_ms": float(sl), "status": str(c),
            "latency_ms": None if np.isnan(lat) else round(float(lat), 1)}
           for tt, m, sl, c, lat in zip(t[~w][order], model[~w][order], slo[~w][order], codes_arr[~w][order],
                                        latency[~w][order])]
    return {"all": window(np.ones_like(w)), "first_minute": window(t < FIRST_MINUTE_S), "per_minute": minutes,
            # when the requests outside their SLO were sent (second of the run: how many), and their SLOs
            "bad_by_second": dict(zip(seconds.tolist(), counts.tolist())),
            "bad_by_slo_ms": {f"{lo}-{lo + 25}": int(((slo >= lo) & (slo < lo + 25) & ~w).sum())
                              for lo in range(50, 200, 25)},
            "bad_requests": bad}


def run(args) -> dict:
    gpu = args.gpu
    sessions = long_tail(args.models, args.rate, tuple(args.slo_ms), args.seed, device_type=gpu, exponent=args.zipf)
    offline = offline_plan(sessions, gpu, args)
    print(f"offline plan: {offline['devices']} devices, tight bound {offline['lower_bound']}, "
          f"throughput-only bound {offline['lower_bound_throughput_only']}", flush=True)
    work = pathlib.Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    uploads = []
    for i, s in enumerate(sessions):
        path, profile = work / f"{s.model}.onnx", work / f"{s.model}.json"
        path.write_bytes(model_bytes(mlp_small(seed=10_000 + i)))   # distinct weights: no shared prefix
        profile.write_text(s.profile.to_json())
        uploads.append(Upload(path, s.model, str(profile), s.slo_ms,
                              expected_rate_rps=0.0 if args.no_expected_rates else s.rate_rps))
    scheduler = {"burst_sigma": args.burst_sigma, "path_allowance_ms": args.path_allowance_ms,
                 "epoch_s": args.epoch_s}
    t0 = time.monotonic()
    # The scheduler logs every re-plan and its reason at INFO (the other nodes' warnings only).
    env = lambda kind: {"NEXUS_LOG": "INFO"} if kind == "scheduler" else {}  # noqa: E731
    with Cluster(work / "cluster", backends=args.backends, frontends=args.frontends, device=f"emulated:{gpu}",
                 scheduler=scheduler, env=env).start(uploads, timeout_s=600) as cluster:
        for node in cluster.nodes:
            favour_tree(node.pid, args.nice)
        cluster.wait_plan_spread(timeout_s=300)
        ready_s = time.monotonic() - t0
        print(f"cluster ready in {ready_s:.0f} s: {args.backends} backends, {args.frontends} frontends; "
              f"{uptime()}", flush=True)
        watch = StatusWatch(cluster.scheduler.address, args.status_every_s)
        before = watch.sample()
        ours, theirs = multiprocessing.get_context("spawn").Pipe()
        client = multiprocessing.get_context("spawn").Process(
            target=client_main, args=([f.address for f in cluster.frontends], sessions, args.duration_s, args.seed,
                                      theirs), name="long-tail client")
        client.start()
        if not ours.poll(300) or ours.recv() != "ready":
            raise RuntimeError("the load client did not open its connections within 300 s")
        pids = {"client": client.pid, "harness": os.getpid(), "scheduler": cluster.scheduler.pid,
                **{b.name: b.pid for b in cluster.backends}, **{f.name: f.pid for f in cluster.frontends}}
        meter, load, timeline = CpuMeter(pids).start(), LoadSampler().start(), CpuTimeline(pids).start()
        watch.start()
        start_wall = time.time()
        ours.send("go")
        start, reports = ours.recv()
        cpu, loadavg = meter.stop(), load.stop()
        timeline.stop()
        ours.send("bye")
        client.join()
        watch.stop()
        after = watch.sample()
        served = frontend_view([f.info["metrics"] for f in cluster.frontends])
    during = [s for s in watch.samples if s["t"] >= start]
    requests = attainment(reports, start, args.duration_s)
    wall = cpu["wall_s"]
    kinds = {"client": 0.0, "harness": 0.0, "scheduler": 0.0, "frontends": 0.0, "backends": 0.0}
    for name, seconds in cpu["cpu_s"].items():
        kinds["frontends" if name.startswith("frontend") else "backends" if name.startswith("backend") else name] += \
            seconds
    answered = sum(r.ok for r in reports)
    bad_seconds = {int(k) for k, n in requests["bad_by_second"].items() if n >= BAD_BURST}
    others = [(int(t - start), o) for t, _, o in timeline.seconds]
    stalls = [o for sec, o in others if sec in bad_seconds or sec + 1 in bad_seconds]
    return {
        "args": vars(args), "offered_rps": sum(s.rate_rps for s in sessions), "cluster_ready_s": round(ready_s, 1),
        "start_wall": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(start_wall)),
        "offline": offline, "plan_before_load": before, "plan_after_load": after,
        "plan_during_load": {k: [min(s[k] for s in during), max(s[k] for s in during)] for k in
                             ("planned_devices", "devices_in_use", "lower_bound", "lower_bound_throughput_only",
                              "epoch")} if during else {},
        "epochs_during_load": len({s["epoch"] for s in during}),
        "sessions_moved_during_load": sum(s["moved"] for s in during),
        "plan_samples": [{**s, "t": round(s["t"] - start, 1)} for s in watch.samples],
        "requests": requests, "throughput_rps": answered / wall,
        "goodput_rps": requests["all"]["within_slo"] / wall,
        "client_lag_ms_max": max(r.client_lag_ms for r in reports),
        "client_lag_ms_p99": float(np.percentile(np.concatenate([r.samples.lag_s for r in reports]), 99) * 1e3),
        "cpu_cores": {k: round(v / wall, 3) for k, v in kinds.items()},
        "machine_busy_cores": round(cpu["machine_busy_cores"], 3), "other_processes_cores":
            round(cpu["external_cores"], 3), "cpu_us_per_request": {k: round(v / max(answered, 1) * 1e6) for k, v in
                                                                  kinds.items()},
        "loadavg": loadavg, "cores": os.cpu_count(), "frontends_counted": served,
        # other processes' cores, per second of the load, and in the seconds with bursts of misses
        "other_cores_by_second": [round(o, 2) for _, o in others],
        "other_cores_median": round(float(np.median([o for _, o in others])), 2) if others else None,
        "other_cores_in_bursts_median": round(float(np.median(stalls)), 2) if stalls else None,
        "our_cores_by_second": [round(x, 2) for _, x, _ in timeline.seconds],
    }


def summary(r: dict) -> str:
    a, f = r["requests"]["all"], r["requests"]["first_minute"]
    plan = r["plan_after_load"] or {}
    dp = r["plan_during_load"]
    pct = lambda x: f"{100 * x:.3f}%"   # noqa: E731
    lines = [
        f"plan: {plan.get('planned_devices')} devices (range during the load {dp.get('planned_devices')}), "
        f"tight bound {plan.get('lower_bound')}, throughput-only bound {plan.get('lower_bound_throughput_only')}; "
        f"{plan.get('planned_devices', 0) / max(plan.get('lower_bound') or 1, 1):.2f}x the tight bound; "
        f"{r['epochs_during_load']} plan epochs seen during the load, {r['sessions_moved_during_load']} sessions moved; "
        f"offline {r['offline']}",
        f"requests: {a['sent']} sent, {pct(a['attainment'])} within SLO (first minute {pct(f['attainment'])} of "
        f"{f['sent']}), late {a['late']}, not answered {a['not_answered']} ({pct(a['dropped_share'])})",
        "per minute within SLO: " + " ".join(pct(m["attainment"]) for m in r["requests"]["per_minute"]),
        f"throughput {r['throughput_rps']:.1f} rps (offered {r['offered_rps']:.1f}), goodput {r['goodput_rps']:.1f}; "
        f"client lag max {r['client_lag_ms_max']:.0f} ms",
        f"CPU cores: {r['cpu_cores']}; machine busy {r['machine_busy_cores']} of {r['cores']}, other processes "
        f"{r['other_processes_cores']}; load average {r['loadavg']}",
        f"CPU us per answered request: {r['cpu_us_per_request']}",
        f"other processes' cores per second: median {r['other_cores_median']}, in the seconds of bursts of misses "
        f"(>= {BAD_BURST}) and the one before {r['other_cores_in_bursts_median']}",
        f"the frontends counted {r['frontends_counted']}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    defaults = SchedulerConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=100)
    parser.add_argument("--rate", type=float, default=150.0, help="total offered requests/s over every model")
    parser.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of the rates")
    parser.add_argument("--slo-ms", type=float, nargs=2, default=[50.0, 200.0], metavar=("LOW", "HIGH"))
    parser.add_argument("--backends", type=int, default=20)
    parser.add_argument("--frontends", type=int, default=2)
    parser.add_argument("--gpu", default="t4", choices=sorted(GPU_TYPES), help="emulated GPU type")
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--no-expected-rates", action="store_true",
                        help="upload without expected rates: the scheduler plans at its default rate until it "
                             "measures them (a cold start)")
    parser.add_argument("--burst-sigma", type=float, default=defaults.resolved_burst_sigma)
    parser.add_argument("--path-allowance-ms", type=float, default=defaults.path_allowance_ms)
    parser.add_argument("--epoch-s", type=float, default=defaults.epoch_s)
    parser.add_argument("--status-every-s", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload and the arrivals")
    parser.add_argument("--nice", type=int, default=0,
                        help="niceness of the client and every node (and of their autogroups); negative (root) "
                             "favours the benchmark over other load on a shared machine")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "long_tail.json"))
    parser.add_argument("--workdir", default=str(ROOT / "benchmarks" / "out" / "long_tail"),
                        help="model files, profiles, the model database and every node's log (emptied first)")
    add_smoke(parser, outputs=("workdir",), models=4, rate=20.0, backends=2, frontends=2, duration_s=2.0,
              status_every_s=0.5)
    args = parse_args(parser, argv)
    if args.models < 1 or args.backends < 1 or args.frontends < 1 or not args.rate > 0 or not args.duration_s > 0:
        parser.error("--models, --backends, --frontends, --rate and --duration-s must be positive")
    favour(os.getpid(), args.nice)    # before any thread or child: they inherit it
    result = run(args)
    print(summary(result), flush=True)
    write_json(args.out, result, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
