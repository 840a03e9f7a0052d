"""Frontend-to-backend path (issue 2): one long-lived Execute stream per backend vs one ExecuteOne RPC per request.

    python -m benchmarks.frontend_path [--repeats 3] [--step-s 5] [--model mlp_small]

The same local cluster as benchmarks/serving.py (``harness.experiments.SampleCluster``:
scheduler, one CPU backend, one frontend as separate processes; only ``--model`` uploaded), started
once per path and repeat with the frontend flag ``--exec-path stream|unary``, in alternating order
(stream, unary, unary, stream, ...) so that drift in the machine's background load hits both paths
alike. On a cheap model (mlp_small, ~10 us of compute) the RPC path is what limits. Per path it
measures:

- p50 / p99 latency at a low rate (``--low-rate``, batch 1);
- CPU milliseconds per request of the frontend, the backend and the load client at a fixed
  moderate rate (``--cpu-rate``), from /proc/PID/stat;
- the capacity: completed requests per second under overload (``--cap-rate`` offered, at most
  ``--cap-inflight`` outstanding so that no backlog builds, deadline 2 s): what each path serves;
- with ``--search``, also the largest Poisson rate at which 99% of requests finish within the
  model's SLO (``nexus.bench.find_max_rate``). Off by default: with the backend's duty-cycle
  batching (planned batch and duty cycle re-planned from smoothed rates) that rate is set by the
  plan and its lag behind rate changes, the same for both paths (benchmarks/frontend_path.md).

It prints a table per repeat and the medians, and writes benchmarks/out/frontend_path.json.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

from harness.experiments import SampleCluster, add_path_arguments, exit_on_sigterm, low_and_cpu_runs, max_rate
from harness.meters import CpuMeter, uptime, wait_quiet
from harness.smoke import add_smoke, parse_args
from nexus.bench.report import step_summary, write_json

OUT = pathlib.Path(__file__).resolve().parent / "out"


def measure_path(path: str, args, tag: str) -> dict:
    from common.sample_models import SAMPLE_MODELS
    from nexus.bench import run_bench

    slo = args.slo_ms or SAMPLE_MODELS[args.model].slo_ms
    res: dict = {"path": path, "quiet": wait_quiet(args.quiet_wait_s)}
    res["uptime_before"] = uptime()
    with SampleCluster([args.model], threads=args.threads, exec_path=path, tag=tag) as c:
        runs, cpu = low_and_cpu_runs(c, args, slo, warmup_rate=50)
        res.update(runs)
        res["external_cores"] = cpu["external_cores"]
        pids = c.pids()
        rate, steps = 0.0, []
        if args.search:
            rate, steps = max_rate(c.frontend.address, args.model, slo, args.lo, None, args.step_s, rel_tol=0.04,
                                   max_steps=args.max_steps, pids=pids, warmup_s=args.warmup_s)
        res["max_rate"] = rate
        res["steps"] = steps
        # Capacity: offered overload with at most --cap-inflight requests outstanding (the rest is
        # dropped by the client, so no backlog builds) and a generous deadline: completions per second.
        time.sleep(1.0)
        meter = CpuMeter(pids).start()
        r = run_bench(c.frontend.address, args.model, args.cap_rate, args.cap_s, 2000.0,
                      concurrency_limit=args.cap_inflight or None)
        cpu = meter.stop()
        res["capacity"] = step_summary(r)
        res["capacity_rps"] = r.throughput_rps
        res["capacity_cores"] = {k: v / cpu["wall_s"] for k, v in cpu["cpu_s"].items()}
    res["uptime_after"] = uptime()
    cpu = res["cpu_ms_per_request"]
    print(f"  {path:6s}: low p50 {res['low']['p50_ms']:.2f} ms p99 {res['low']['p99_ms']:.2f} ms | CPU ms/req "
          f"frontend {cpu['frontend']:.3f} backend {cpu['backend']:.3f} client {cpu['client']:.3f} | max rate "
          f"{rate:.0f} rps | capacity {res['capacity_rps']:.0f} rps | external load {res['external_cores']:.2f} "
          f"cores", flush=True)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mlp_small")
    add_path_arguments(p, cap_s=5.0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--search", action="store_true",
                   help="also search the largest rate with 99%% within the SLO (see frontend_path.md: with the "
                        "backend's duty-cycle batching that rate measures the plan, not the path)")
    p.add_argument("--lo", type=float, default=100.0)
    p.add_argument("--step-s", type=float, default=5.0)
    p.add_argument("--warmup-s", type=float, default=4.0, help="unmeasured lead-in of each step (re-planning)")
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--quiet-wait-s", type=float, default=60.0,
                   help="wait up to this long before each cluster for the machine's other load to drop")
    p.add_argument("--out", default=str(OUT / "frontend_path.json"))
    add_smoke(p, repeats=1, low_rate=20.0, low_s=0.5, cpu_rate=50.0, cpu_s=0.5, cap_rate=200.0, cap_s=0.5,
              quiet_wait_s=0.0)
    args = parse_args(p, argv)
    exit_on_sigterm()
    print(uptime(), flush=True)
    runs = []
    for i in range(args.repeats):
        order = ("stream", "unary") if i % 2 == 0 else ("unary", "stream")
        print(f"repeat {i}:", flush=True)
        rep = {path: measure_path(path, args, f"path{i}{path}") for path in order}
        runs.append(rep)
    med = {}
    for path in ("stream", "unary"):
        med[path] = {
            "max_rate": statistics.median(r[path]["max_rate"] for r in runs),
            "capacity_rps": statistics.median(r[path]["capacity_rps"] for r in runs),
            "low_p50_ms": statistics.median(r[path]["low"]["p50_ms"] for r in runs),
            "low_p99_ms": statistics.median(r[path]["low"]["p99_ms"] for r in runs),
            "frontend_cpu_ms": statistics.median(r[path]["cpu_ms_per_request"]["frontend"] for r in runs),
            "backend_cpu_ms": statistics.median(r[path]["cpu_ms_per_request"]["backend"] for r in runs),
        }
    rate_ratios = [r["stream"]["max_rate"] / r["unary"]["max_rate"] for r in runs if r["unary"]["max_rate"] > 0]
    cap_ratios = [r["stream"]["capacity_rps"] / max(r["unary"]["capacity_rps"], 1e-9) for r in runs]
    p50_ratios = [r["stream"]["low"]["p50_ms"] / r["unary"]["low"]["p50_ms"] for r in runs]
    print()
    print("| repeat | path | max rate rps (99% in SLO) | capacity rps | low-rate p50 ms | p99 ms | frontend CPU ms/req | "
          "backend CPU ms/req | client CPU ms/req | external load (cores) |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for i, r in enumerate(runs):
        for path in ("stream", "unary"):
            x = r[path]
            cpu = x["cpu_ms_per_request"]
            print(f"| {i} | {path} | {x['max_rate']:.0f} | {x['capacity_rps']:.0f} | {x['low']['p50_ms']:.2f} | "
                  f"{x['low']['p99_ms']:.2f} | "
                  f"{cpu['frontend']:.3f} | {cpu['backend']:.3f} | {cpu['client']:.3f} | {x['external_cores']:.2f} |")
    print()
    print("| path | median max rate rps | median capacity rps | median p50 ms | median frontend CPU ms/req | "
          "median backend CPU ms/req |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for path in ("stream", "unary"):
        m = med[path]
        print(f"| {path} | {m['max_rate']:.0f} | {m['capacity_rps']:.0f} | {m['low_p50_ms']:.2f} | "
              f"{m['frontend_cpu_ms']:.3f} | {m['backend_cpu_ms']:.3f} |")
    if rate_ratios:
        print(f"\nstream/unary max rate (99% in SLO): median {statistics.median(rate_ratios):.3f} "
              f"(per repeat {', '.join(f'{x:.3f}' for x in rate_ratios)})")
    print(f"\n"
          f"stream/unary capacity: median {statistics.median(cap_ratios):.3f} "
          f"(per repeat {', '.join(f'{x:.3f}' for x in cap_ratios)}); "
          f"stream/unary p50: median {statistics.median(p50_ratios):.3f} "
          f"(per repeat {', '.join(f'{x:.3f}' for x in p50_ratios)})")
    faster = "stream" if statistics.median(cap_ratios) >= 1.0 else "unary"
    print(f"serves more (capacity): {faster}")
    print(uptime())
    out = write_json(args.out, {"args": vars(args), "runs": runs, "medians": med, "rate_ratios": rate_ratios,
                                "p50_ratios": p50_ratios, "cap_ratios": cap_ratios, "faster": faster})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
