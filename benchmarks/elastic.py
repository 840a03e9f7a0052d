"""An elastic cluster on emulated GPUs: `nexus serve --backends auto` under a stepped, bursty,
long-tailed trace (issue 17 item 6; the page is benchmarks/elastic.md).

Two runs, each a fresh `nexus serve --no-samples --device emulated:t4 --backends auto` with
``--models`` models whose shares of the total rate follow Zipf (the library's
:func:`harness.elastic.zipf_models`: l(b) = 2-6 ms + 10-20 ms per item, SLOs of 300-500 ms, Gamma
arrivals with CV 1, 2, 3 and 4 in turn):

* **devices started on demand** (``--min-backends 1``): ``--base-rps`` for ``--warm-s``, then 5x for
  ``--high-s``, then back down for ``--low-s``. Reported: device-seconds (backend processes, and
  registered backends) against the integral of the planner's lower bound, the share within SLO over
  the whole trace, the time until the share within SLO recovers after the step up (a device must be
  started), and the requests that failed while a backend drained;
* **idle devices registered** (``--min-backends --idle-backends``): the same step, shorter; the time
  until recovery. Then two models are uploaded while it runs and take ``--cold-rps`` at once, one
  without and one with ``--expected-rate-rps``: their share within SLO over the first 10 s.

The scale-down cool-down is ``--cooldown-s`` (10 s, not the default 60 s: a run of minutes shows
several removals). CPU: the client's own, that of `nexus serve` and everything below it, and the
whole machine's, beside the rates.

    python -m benchmarks.elastic [--base-rps 40] [--models 24] [--out benchmarks/out/elastic]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import sys
import time
import zlib

from common.sample_models import mlp_small, model_bytes
from common.profile import Profile
from harness.cluster import ServeCluster, Upload, cmdline, descendants, wait_model_served
from harness.elastic import (DEVICE_TYPE, ClusterSampler, LogTail, Requests, TraceModel, drain_windows,
                                 errors_within, failures_in, integral, recovery_s, run_trace, served_before,
                                 share_within, write_elastic_plot,
                                 zipf_models)
from nexus.bench.loadgen import LoadClient
from harness.meters import loadavg, machine_busy, wait_quiet
from harness.smoke import add_smoke, parse_args
from nexus.bench.report import OK, write_json
from nexus.scheduler_client import fetch_status

STEP = 5.0
# l(b) = 2-6 ms + 10-20 ms per item, SLOs of 300-500 ms: at 40 requests/s the planner's lower bound
# is 2-3 devices, at 200 it is 4-6 (the plan used 9-10 with the trace's bursts), and the processes stay
# light enough for this machine (nexus serve and its children: 0.3-0.45 cores, benchmarks/elastic.md).
PER_ITEM_MS, FIXED_MS, SLOS_MS = (10.0, 20.0), (2.0, 6.0), (300.0, 400.0, 500.0)


def _log(message: str) -> None:
    print(f"elastic: {message}", file=sys.stderr, flush=True)


def _upload(cluster: ServeCluster, workdir: pathlib.Path, m: TraceModel, expected_rate_rps: float = 0.0) -> None:
    """A model file of its own (other weights: identical files would share one prefix group)."""
    path, profile = workdir / f"{m.name}.onnx", workdir / f"{m.name}.profile.json"
    path.write_bytes(model_bytes(mlp_small(seed=zlib.crc32(m.name.encode()))))
    profile.write_text(m.profile.to_json())
    cluster.upload(Upload(path, m.name, str(profile), m.slo_ms, expected_rate_rps=expected_rate_rps), wait=False)


def _settle(cluster: ServeCluster, timeout_s: float = 120.0) -> None:
    """Until the policy wants what is registered (the first plan's devices have started)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        d = fetch_status(cluster.scheduler, creds=cluster.creds).decision(DEVICE_TYPE)
        if d is not None and d.desired == d.registered:
            return
        time.sleep(0.5)


def _start(workdir: pathlib.Path, models: list[TraceModel], args, *extra: str) -> tuple[ServeCluster, object]:
    workdir.mkdir(parents=True, exist_ok=True)
    err = (workdir / "serve.log").open("w")
    cluster = ServeCluster(workdir / "data", "--no-samples", "--device", f"emulated:{DEVICE_TYPE}", "--backends",
                           "auto", "--max-backends", str(args.max_backends), "--scale-down-cooldown-s",
                           str(args.cooldown_s), *extra, stderr=err)
    for m in models:
        _upload(cluster, workdir, m)
    cluster.wait_models_ready([m.name for m in models], 180)
    _settle(cluster)
    return cluster, err


def _trace_run(name: str, workdir: pathlib.Path, models: list[TraceModel], steps: list[tuple[float, float]], args,
               *extra: str, after=None) -> dict:
    quiet = wait_quiet(args.wait_quiet_s, args.quiet_cores)
    _log(f"{name}: other processes keep {quiet['busy_cores']} cores busy (waited {quiet['waited_s']} s)")
    cluster, err = _start(workdir, models, args, *extra)
    try:
        sampler = ClusterSampler(lambda: fetch_status(cluster.scheduler, 5.0, cluster.creds), cluster.pid).start()
        tail = LogTail(workdir / "serve.log").start()
        cpu0, busy0, load0 = time.process_time(), machine_busy(), loadavg()
        time.sleep(1.0)
        reports = run_trace(cluster.frontend, models, steps, seed=args.seed)
        client_cpu_s = time.process_time() - cpu0
        busy1 = machine_busy()
        extra_result = after(cluster, workdir) if after is not None else {}
        samples, lines = sampler.stop(), tail.stop()
    finally:
        cluster.stop()
        err.close()
    req = Requests.of(list(reports.values()))
    t0 = min(r.samples.start_s for r in reports.values())
    total_s = sum(d for d, _ in steps)
    end = t0 + total_s
    step_up = t0 + steps[0][0]
    step_down = step_up + steps[1][0]
    ts = [s.t for s in samples]
    in_trace = [s for s in samples if t0 <= s.t <= end]
    cpu_trace = [s.cpu_s for s in in_trace]
    share, sent = share_within(req, t0, end + 60)
    windows = drain_windows(lines)
    drain_lead_s = max(m.slo_ms for m in models) / 1000 + 1.0      # in flight when the drain began
    phases = (("before the step", t0, step_up), ("step up", step_up, step_down),
              ("after the step down", step_down, end + 60))
    result = {
        "run": name, "flags": list(extra), "steps": steps, "requests": sent, "within_slo": share,
        "statuses": {k: req.status.count(k) for k in sorted(set(req.status))},
        "device_s_processes": integral(ts, [s.processes for s in samples], t0, end),
        "device_s_registered": integral(ts, [s.registered for s in samples], t0, end),
        "lower_bound_device_s": integral(ts, [s.lower_bound for s in samples], t0, end),
        "plan_device_s": integral(ts, [s.plan_devices for s in samples], t0, end),
        "max_processes": max((s.processes for s in in_trace), default=0),
        "recovery_s": recovery_s(req, step_up, step_down),
        "within_slo_by_phase": {label: share_within(req, a, b)[0] for label, a, b in phases},
        "errors_by_phase": {label: errors_within(req, a, b) for label, a, b in phases},
        "drains": [{"backend": w.backend, "node_id": w.node_id, "start_s": round(w.start - t0, 1),
                    "end_s": round(w.end - t0, 1), "served": sorted(served_before(samples, w.node_id, w.start))}
                   for w in windows],
        # what a drain could lose: the drained backend's models; and every failure while one ran
        "failed_during_drains": failures_in(req, windows, drain_lead_s, samples),
        "failed_during_drains_any_model": failures_in(req, windows, drain_lead_s),
        "client_cpu_cores": client_cpu_s / total_s,
        "serve_tree_cpu_cores": (cpu_trace[-1] - cpu_trace[0]) / max(in_trace[-1].t - in_trace[0].t, 1e-9)
        if len(in_trace) > 1 else None,
        "machine_busy_cores": (busy1[0] - busy0[0]) / max(busy1[1] - busy0[1], 1) * (os.cpu_count() or 1),
        "loadavg_before": load0, "loadavg_after": loadavg(), "external_busy_cores_before": quiet["busy_cores"],
        "mean_offered_rps": sent / total_s,
        **extra_result,
    }
    result["device_s_ratio"] = result["device_s_processes"] / max(result["lower_bound_device_s"], 1e-9)
    plot = pathlib.Path(args.plot_dir) / f"elastic.{name}.png"
    plot.parent.mkdir(parents=True, exist_ok=True)
    write_elastic_plot(plot, samples, req, t0, end,
                       f"{name}: {len(models)} models, {args.base_rps:g} -> {STEP * args.base_rps:g} -> "
                       f"{args.base_rps:g} rps, Gamma CV 1-4", steps_at=(step_up, step_down))
    result["plot"] = str(plot)
    write_json(workdir / "samples.json", {"t0": t0, "samples": [s.__dict__ for s in samples],
                                          "lines": [(round(t - t0, 2), line) for t, line in lines]})
    return result


def _cold_start(cluster: ServeCluster, workdir: pathlib.Path, rate_rps: float) -> dict:
    """Two models uploaded while the cluster runs, taking ``rate_rps`` at once: without, then with an
    expected rate. Their share within SLO over the first 10 s of traffic."""
    import asyncio

    out = {}
    for name, expected in (("cold_plain", 0.0), ("cold_expected", rate_rps)):
        m = TraceModel(name, Profile.linear(10.0, 10.0, 32, device_type=DEVICE_TYPE), 200.0, 1.0, 1.0)
        _upload(cluster, workdir, m, expected_rate_rps=expected)
        wait_model_served(cluster.frontend, name, 60)

        async def first_10_s():
            async with LoadClient(cluster.frontend, name, seed=7) as client:
                return await client.run(rate_rps, 10.0, m.slo_ms, grace_ms=1000.0)

        report = asyncio.run(first_10_s())
        out[name] = {"expected_rate_rps": expected, "rate_rps": rate_rps, "sent": report.sent,
                     "within_slo": report.good_fraction, "errors": report.errors}
        _log(f"{name}: {report.good_fraction:.2%} of {report.sent} within SLO in the first 10 s")
        time.sleep(3.0)
    return {"cold_start": out}


CPU_MIX = (("resnet18_64", 100.0), ("vehicle_cls", 50.0), ("detector", 100.0), ("mlp_small", 20.0))
CPU_CONFIGS = (("one backend, the runtime's threads", ("--backends", "1")),
               ("two 1-thread backends", ("--backends", "2", "--threads", "1")),
               ("auto: 1-thread backends, one per core", ("--backends", "auto")))


def _cpu_device_model(out: pathlib.Path, args) -> dict:
    """The CPU device model under auto, measured: ResNet-18-64 alone at a 100 ms SLO, and a mix of four
    sample models (equal shares, their own SLOs), against one backend with the runtime's default
    threads, two 1-thread backends, and --backends auto. The largest rate of a ramp (x1.25 per step)
    keeping 99% of each model's requests within SLO."""
    from harness.experiments import ramp_rate

    results = {}
    for label, flags in CPU_CONFIGS:
        quiet = wait_quiet(args.wait_quiet_s, args.quiet_cores)
        workdir = out / "cpu" / flags[1]
        workdir.mkdir(parents=True, exist_ok=True)
        with (workdir / "serve.log").open("w") as err:
            cluster = ServeCluster(workdir / "data", *flags, stderr=err)
            try:
                cluster.wait_models_ready([n for n, _ in CPU_MIX], 300)
                single, steps = ramp_rate(cluster.frontend, "resnet18_64", 100.0, 40.0, 1000.0, 1.25, 8.0)
                mix_rate, mix_steps = 0.0, []
                rate = 40.0
                while rate < 1000.0:
                    models = [TraceModel(n, None, slo, 1 / len(CPU_MIX), 1.0) for n, slo in CPU_MIX]
                    reports = run_trace(cluster.frontend, models, [(12.0, rate)], seed=args.seed)
                    within = {n: float(((r.samples.outcome == OK) & (r.samples.latency_ms <= r.slo_ms))
                                       [r.samples.sched_s >= 4.0].mean()) for n, r in reports.items()}
                    mix_steps.append({"rate_rps": rate, "within_slo": within})
                    if min(within.values()) < 0.99:
                        break
                    mix_rate = rate
                    rate *= 1.25
                backends = len([p for p in descendants(cluster.pid) if " backend " in f" {cmdline(p)} "])
            finally:
                cluster.stop()
        results[label] = {"flags": list(flags), "resnet18_64_rps": single, "mix_rps": mix_rate,
                          "backends_at_the_end": backends, "resnet_steps": steps, "mix_steps": mix_steps,
                          "external_busy_cores_before": quiet["busy_cores"]}
        _log(f"cpu: {label}: resnet18_64 {single:.0f} rps, mix {mix_rate:.0f} rps")
    return {"run": "cpu", "configs": results}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-rps", type=float, default=40.0, help="total rate before and after the 5x step")
    p.add_argument("--models", type=int, default=24)
    p.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of the models' shares")
    p.add_argument("--warm-s", type=float, default=40.0)
    p.add_argument("--high-s", type=float, default=40.0)
    p.add_argument("--low-s", type=float, default=60.0)
    p.add_argument("--cooldown-s", type=float, default=10.0, help="the scheduler's --scale-down-cooldown-s")
    p.add_argument("--max-backends", type=int, default=12)
    p.add_argument("--idle-backends", type=int, default=10, help="--min-backends of the run with idle devices")
    p.add_argument("--cold-rps", type=float, default=150.0,
                   help="rate a newly uploaded model takes at once (its profile serves about 90 per device)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--wait-quiet-s", type=float, default=600.0,
                   help="before each run, wait at most this long for the other processes to leave the machine")
    p.add_argument("--quiet-cores", type=float, default=0.5, help="... until they keep at most this many cores busy")
    p.add_argument("--runs", default="started,idle",
                   help="which runs: started, idle, cpu (the CPU device model; comma-separated)")
    p.add_argument("--floors", action="store_true",
                   help="the started and idle runs as the scheduler ran before 2026-12-05: --surge-floors "
                        "--device-headroom 0 (benchmarks/sim_change.py --floors)")
    p.add_argument("--spare-overbook", type=float, default=None,
                   help="the scheduler's --spare-overbook in the started and idle runs (default: its own)")
    p.add_argument("--burst-sigma", type=float, default=None,
                   help="the scheduler's --burst-sigma in the started and idle runs (default: its own)")
    p.add_argument("--device-headroom", type=float, default=None,
                   help="the scheduler's --device-headroom in the started and idle runs (default: its own, or 0 "
                        "with --floors)")
    p.add_argument("--out", default="benchmarks/out/elastic", help="work folder: model database, logs, samples")
    p.add_argument("--plot-dir", default="benchmarks", help="where elastic.<run>.png goes")
    add_smoke(p, outputs=("plot_dir",), runs="started", models=2, base_rps=4.0, warm_s=1.0, high_s=1.0, low_s=1.0,
              max_backends=2, wait_quiet_s=0.0)
    args = parse_args(p, argv)
    out = pathlib.Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    models = zipf_models(args.models, zipf_s=args.zipf, seed=args.seed, per_item_ms=PER_ITEM_MS, fixed_ms=FIXED_MS,
                         slo_ms=SLOS_MS)
    base = args.base_rps
    scheduler_flags = ("--surge-floors", "--device-headroom", "0") if args.floors else ()
    for flag, value in (("--spare-overbook", args.spare_overbook), ("--burst-sigma", args.burst_sigma),
                        ("--device-headroom", args.device_headroom)):
        if value is not None:
            scheduler_flags += (flag, str(value))
    results = []
    for run in args.runs.split(","):
        if run == "started":
            steps = [(args.warm_s, base), (args.high_s, STEP * base), (args.low_s, base)]
            results.append(_trace_run("started", out / "started", models, steps, args, "--min-backends", "1",
                                      *scheduler_flags))
        elif run == "idle":
            steps = [(20.0, base), (25.0, STEP * base), (10.0, base)]
            results.append(_trace_run("idle", out / "idle", models, steps, args, "--min-backends",
                                      str(args.idle_backends), *scheduler_flags,
                                      after=lambda cluster, workdir: _cold_start(cluster, workdir, args.cold_rps)))
        elif run == "cpu":
            results.append(_cpu_device_model(out, args))
        else:
            p.error(f"--runs: unknown run {run!r} (started, idle, cpu)")
        _log(json.dumps(results[-1], indent=1, default=str))
    write_json(out / "result.json", {"args": vars(args), "models": [
        {"name": m.name, "share": m.share, "cv": m.cv, "slo_ms": m.slo_ms,
         "l1_ms": m.profile.latency_ms(1), "l8_ms": m.profile.latency_ms(8)} for m in models], "runs": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
