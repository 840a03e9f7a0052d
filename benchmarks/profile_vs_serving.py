"""Profile vs serving (issue 5): per batch size, the latency the backend sees under load vs the profile.

    python -m benchmarks.profile_vs_serving [--models resnet18_64,vehicle_cls,face_cls,mlp_small]
                                            [--threads 1] [--phase-s 4] [--repeats 2]

One local cluster (scheduler, one CPU backend, one frontend as separate processes;
``harness.experiments.SampleCluster``, as in benchmarks/serving.py) serves the sample models;
the backend profiles each one when it registers, as in ``nexus serve``. Then, one model at a time,
Poisson load at a mix of rates (fractions of the model's saturated throughput from its profile, low
to slightly over, so that many batch sizes occur) goes through the frontend, and ModelStatistics
gives, per batch size, the backend's compute_infer time (ns / count: running the batch; gathering
its inputs is compute_input). After the cluster stops, the profile the scheduler holds is read from
its model database.

Per batch size b up to the backend's largest batch (the largest b with 2*l(b) <= SLO under the
profile, what the backend will run) it reports the served mean against the profile's mean (the
measured mean, interpolated between measured sizes) and against the planning latency l(b)
(conservative: max((mean+std)*1.15, p99)). Target: served/profile mean within 15% and served mean
below the planning latency. With ``--reprofile`` it also profiles each model in this process right
after its load (same thread count, machine otherwise as during serving) to tell a stale or noisy
profile from a serving slowdown.

Writes benchmarks/out/profile_vs_serving.json.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys

from harness.experiments import PIN_OTHER, SampleCluster, exit_on_sigterm, on_exec_cpus
from harness.meters import CpuMeter, uptime, wait_quiet
from harness.smoke import add_smoke, parse_args
from nexus.bench.report import write_json
from harness.stats import model_stats, stats_delta

OUT = pathlib.Path(__file__).resolve().parent / "out"

RATE_MIX = (0.05, 0.15, 0.3, 0.5, 0.7, 0.85, 1.0, 1.15)


def saturated(profile, slo_ms: float) -> tuple[int, float]:
    """(largest b with 2*l(b) <= SLO, its throughput b/l(b) in rps) under the planning latency."""
    from backend.sessions import session_max_batch

    b = session_max_batch(profile, slo_ms)
    return b, b * 1000.0 / profile.latency_ms(b)


def drive(c: SampleCluster, model: str, slo_ms: float, capacity_rps: float, phase_s: float, mix,
          max_rate_rps: float) -> dict:
    from nexus.bench import run_bench

    frontend = c.frontend.address
    before = model_stats(frontend, model)
    meter = CpuMeter({"frontend": c.frontend.pid, "backend": c.backends[0].pid, "client": os.getpid()}).start()
    phases = []
    for f in mix:
        rate = min(max(2.0, f * capacity_rps), max_rate_rps)
        r = run_bench(frontend, model, rate, phase_s, slo_ms, seed=int(f * 1000))
        phases.append({"rate": rate, "within_slo": r.within_slo, "sent": r.sent, "p50_ms": r.p50_ms,
                       "p99_ms": r.p99_ms})
    cpu = meter.stop()
    d = stats_delta(model_stats(frontend, model), before)
    return {"phases": phases, "batches": d["batches"], "cpu": cpu,
            "external_cores": cpu["external_cores"]}


def reprofile(model: str, threads: int, max_batch: int):
    from common.sample_models import build_sample_model, model_bytes
    from profiler.profiling import profile_model

    sizes = sorted({1, 2, 4, 8, 16, 32} | {max_batch})
    sizes = [b for b in sizes if b <= max(max_batch, 1) or b == 1]
    return profile_model(model_bytes(build_sample_model(model)), "cpu", "onnxruntime", sizes, warmup=2,
                         iters=10, min_iters=3, time_budget_s=20.0, threads=threads or None)


def one_repeat(args, i: int) -> dict:
    from common.sample_models import SAMPLE_MODELS

    models = [m for m in args.models.split(",") if m]
    res: dict = {"quiet": wait_quiet(args.quiet_wait_s), "uptime_before": uptime(), "models": {}}
    with SampleCluster(models, threads=args.threads, pin=args.pin, tag=f"pvs{i}") as c:
        profiles = c.live_profiles(models)    # what the scheduler planned with; the rate mix comes from it
        for model in models:
            slo = SAMPLE_MODELS[model].slo_ms
            prof = profiles[model].get("cpu")
            if prof is None:
                print(f"[{i}] {model}: no cpu profile in the database", flush=True)
                continue
            b_max, cap = saturated(prof, slo)
            print(f"[{i}] {model}: SLO {slo:g} ms, backend max batch {b_max}, planned capacity {cap:.0f} rps",
                  flush=True)
            run = drive(c, model, slo, cap, args.phase_s, RATE_MIX, args.max_rate)
            entry = {"slo_ms": slo, "max_batch": b_max, "capacity_rps": cap, **run}
            if args.reprofile:
                with on_exec_cpus(args.pin):
                    entry["reprofile"] = reprofile(model, args.threads, b_max).to_json_obj()
            res["models"][model] = entry
        c.stop()
        final = c.profiles(models)
    for model, entry in res["models"].items():
        prof = final[model]["cpu"]
        entry["profile"] = prof.to_json_obj()
        rows = []
        again = None
        if "reprofile" in entry:
            from common.profile import Profile
            again = Profile.from_json_obj(entry["reprofile"])
        for b in range(1, entry["max_batch"] + 1):
            count, ns = entry["batches"].get(b, (0, 0))
            row = prof.rows[b - 1] if b <= prof.max_batch else None
            served = ns / count / 1e6 if count else None
            mean = row.mean_ms if row is not None else None
            rows.append({
                "batch": b, "count": count, "served_mean_ms": served, "profile_mean_ms": mean,
                "profile_latency_ms": row.latency_ms if row is not None else None,
                "measured": b in prof.meta.get("measured_batches", []),
                "ratio_mean": served / mean if served and mean else None,
                "ratio_planning": served / row.latency_ms if served and row is not None else None,
                "reprofile_mean_ms": (again.rows[b - 1].mean_ms if again is not None and b <= again.max_batch
                                      else None),
            })
        entry["rows"] = rows
    res["uptime_after"] = uptime()
    return res


def _cell(value: float | None) -> str:
    """A table cell: three decimals, or '-' where the run has no figure (a profile row without a
    mean, a batch the clock timed at 0)."""
    return "-" if value is None else f"{value:.3f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="resnet18_64,vehicle_cls,face_cls,mlp_small")
    p.add_argument("--threads", type=int, default=1, help="backend intra-op threads (0: ORT default)")
    p.add_argument("--phase-s", type=float, default=4.0, help="seconds per rate of the mix")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-rate", type=float, default=1000.0,
                   help="cap on any rate of the mix (mlp_small's planned capacity is far beyond what the RPC path "
                        "and the client can carry on 2 cores)")
    p.add_argument("--min-count", type=int, default=5, help="batches of a size needed to report a ratio")
    p.add_argument("--reprofile", action="store_true", help="also profile each model in-process after its load")
    p.add_argument("--pin", action="store_true",
                   help="experiment (see benchmarks/serving.py): the backend's executor thread alone on the last CPU")
    p.add_argument("--quiet-wait-s", type=float, default=60.0)
    p.add_argument("--out", default=str(OUT / "profile_vs_serving.json"))
    add_smoke(p, models="mlp_small", phase_s=0.5, repeats=1, max_rate=100.0, reprofile=True, quiet_wait_s=0.0)
    args = parse_args(p, argv)
    exit_on_sigterm()
    if args.pin:
        os.sched_setaffinity(0, set(PIN_OTHER))
    print(uptime(), flush=True)
    runs = [one_repeat(args, i) for i in range(args.repeats)]

    print()
    summary = {}
    for model in runs[0]["models"]:
        print(f"### {model} (SLO {runs[0]['models'][model]['slo_ms']:g} ms; backend max batch per repeat: "
              f"{', '.join(str(r['models'][model]['max_batch']) for r in runs if model in r['models'])})")
        print()
        hdr = "| b | " + " | ".join(f"r{i} n | r{i} served ms | r{i} profile mean ms | r{i} served/mean | "
                                       f"r{i} served/l(b)" for i in range(len(runs))) + " |"
        print(hdr)
        print("| ---: |" + " ---: |" * (5 * len(runs)))
        worst = []
        absdev = []
        n_b = max(r["models"][model]["max_batch"] for r in runs if model in r["models"])
        for b in range(1, n_b + 1):
            cells = []
            for r in runs:
                e = r["models"].get(model)
                row = e["rows"][b - 1] if e and b <= len(e["rows"]) else None
                if row is None or row["count"] == 0:
                    cells.append("0 | - | - | - | -")
                    continue
                ok = row["count"] >= args.min_count
                if ok and row["ratio_mean"] is not None:
                    worst.append(abs(row["ratio_mean"] - 1.0))
                    absdev.append(abs(row["served_mean_ms"] - row["profile_mean_ms"]))
                mark = "" if ok else " (few)"
                cells.append(f"{row['count']} | {_cell(row['served_mean_ms'])} | {_cell(row['profile_mean_ms'])}"
                             f"{'' if row['measured'] else '*'} | {_cell(row['ratio_mean'])}{mark} | "
                             f"{_cell(row['ratio_planning'])}")
            print(f"| {b} | " + " | ".join(cells) + " |")
        within = sum(1 for w in worst if w <= 0.15)
        within_abs = sum(1 for w, a in zip(worst, absdev) if w <= 0.15 or a <= 0.2)
        summary[model] = {"sizes_compared": len(worst), "within_15pct": within, "within_15pct_or_0.2ms": within_abs,
                          "median_abs_dev": statistics.median(worst) if worst else None,
                          "max_abs_dev": max(worst) if worst else None}
        print()
        print(f"{model}: {within}/{len(worst)} (size, repeat) pairs within 15% of the profile mean "
              f"(median |dev| {summary[model]['median_abs_dev'] or 0:.3f}, max {summary[model]['max_abs_dev'] or 0:.3f}); "
              f"{within_abs}/{len(worst)} within 15% or 0.2 ms; * = interpolated profile row")
        print()
    print(uptime())
    print(f"wrote {write_json(args.out, {'args': vars(args), 'runs': runs, 'summary': summary})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
