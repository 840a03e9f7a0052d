"""The per-request path (issue 12, item 2): A/B of code versions and settings in one run, and the
per-request timeline from ``nexus frontend --trace``.

    python -m benchmarks.hotpath ab --before DIR [--repeats 3] [--model mlp_small]
    python -m benchmarks.hotpath threads [--repeats 3] [--model resnet18_64]
    python -m benchmarks.hotpath trace [--model mlp_small] [--low-rate 50] [--high-rate 600]

``ab``: the same local cluster as benchmarks/serving.py (``harness.experiments.SampleCluster``:
scheduler, one CPU backend, one frontend as separate processes) for each variant, variants in
rotating order per repeat so that drift in the machine's background load hits them alike:

- ``before``: the components run from ``--before DIR``, a checkout of the code before the change
  (``git archive <commit> | tar -x -C DIR``), on asyncio's event loop;
- ``after-asyncio``: this checkout with ``NEXUS_EVENT_LOOP=asyncio``;
- ``after``: this checkout as ``nexus serve`` runs it (uvloop).

Per variant it measures the low-rate p50/p99 (``--low-rate``, batch 1), the CPU milliseconds per
request of the frontend and the backend at a fixed rate (``--cpu-rate``, /proc/PID/stat), and the
capacity: completions per second under overload (``--cap-rate`` offered, at most ``--cap-inflight``
outstanding, deadline ``--cap-deadline-ms``). Ratios are taken within each repeat, then the median.

``threads``: this checkout with ``--threads 1`` and ``--threads 2`` on the backend (the same three
measurements, the last one with the model's SLO as the deadline: completions within the SLO per
second; with ``--cap-inflight 0`` an open-loop Poisson run at ``--cap-rate``, i.e. its goodput).

``trace``: this checkout with ``--trace``: the median of each phase at a low and a high rate.

JSON goes to benchmarks/out/hotpath-<mode>.json (``--out-dir``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

from harness.experiments import SampleCluster, add_path_arguments, exit_on_sigterm, low_and_cpu_runs
from harness.meters import uptime, wait_quiet
from harness.smoke import add_smoke, parse_args
from nexus.bench.report import step_summary

OUT = pathlib.Path(__file__).resolve().parent / "out"


def measure(args, tag: str, *, code_dir=None, env=None, backend=None, cap_deadline_ms: float | None = None) -> dict:
    from common.sample_models import SAMPLE_MODELS
    from nexus.bench import run_bench

    slo = args.slo_ms or SAMPLE_MODELS[args.model].slo_ms
    res: dict = {"quiet": wait_quiet(args.quiet_wait_s), "uptime_before": uptime()}
    with SampleCluster([args.model], threads=0, tag=tag, code_dir=code_dir, env=env, backend=backend) as c:
        runs, _ = low_and_cpu_runs(c, args, slo, warmup_rate=args.low_rate)
        res.update(runs)
        time.sleep(1.0)
        deadline = cap_deadline_ms or args.cap_deadline_ms
        r = run_bench(c.frontend.address, args.model, args.cap_rate, args.cap_s, deadline,
                      concurrency_limit=args.cap_inflight or None, warmup_s=args.cap_warmup_s)
        res["capacity"] = step_summary(r)
        res["capacity_rps"] = r.goodput_rps
    res["uptime_after"] = uptime()
    cpu = res["cpu_ms_per_request"]
    if res["low"]["p50_ms"] is None:
        print(f"  {tag:24s}: no request succeeded at the low rate: {res['low']}", flush=True)
        return res
    print(f"  {tag:24s}: low p50 {res['low']['p50_ms']:.2f} ms p99 {res['low']['p99_ms']:.2f} ms | CPU ms/req "
          f"frontend {cpu['frontend']:.3f} backend {cpu['backend']:.3f} | capacity {res['capacity_rps']:.0f} rps "
          f"| {res['uptime_after'].split('load average:')[-1].strip()}", flush=True)
    return res


def _summary(runs: list[dict], names: list[str], base: str) -> dict:
    def med(name, f):
        return statistics.median(f(r[name]) for r in runs)

    out = {}
    for n in names:
        out[n] = {
            "low_p50_ms": med(n, lambda x: x["low"]["p50_ms"]),
            "low_p99_ms": med(n, lambda x: x["low"]["p99_ms"]),
            "frontend_cpu_ms": med(n, lambda x: x["cpu_ms_per_request"]["frontend"]),
            "backend_cpu_ms": med(n, lambda x: x["cpu_ms_per_request"]["backend"]),
            "capacity_rps": med(n, lambda x: x["capacity_rps"]),
            # same-repeat ratios against the base variant, then their median
            "capacity_ratio": statistics.median(r[n]["capacity_rps"] / max(r[base]["capacity_rps"], 1e-9) for r in runs),
            "p50_ratio": statistics.median(r[n]["low"]["p50_ms"] / max(r[base]["low"]["p50_ms"], 1e-9) for r in runs),
            "frontend_cpu_ratio": statistics.median(
                r[n]["cpu_ms_per_request"]["frontend"] / max(r[base]["cpu_ms_per_request"]["frontend"], 1e-9)
                for r in runs),
            "backend_cpu_ratio": statistics.median(
                r[n]["cpu_ms_per_request"]["backend"] / max(r[base]["cpu_ms_per_request"]["backend"], 1e-9)
                for r in runs),
        }
    print()
    print(f"medians over {len(runs)} repeats (ratios: same repeat, against {base}):")
    print("| variant | low-rate p50 ms | p99 ms | frontend CPU ms/req | backend CPU ms/req | capacity rps | "
          "capacity ratio | p50 ratio | frontend CPU ratio | backend CPU ratio |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in names:
        s = out[n]
        print(f"| {n} | {s['low_p50_ms']:.2f} | {s['low_p99_ms']:.2f} | {s['frontend_cpu_ms']:.3f} | "
              f"{s['backend_cpu_ms']:.3f} | {s['capacity_rps']:.0f} | {s['capacity_ratio']:.2f} | "
              f"{s['p50_ratio']:.2f} | {s['frontend_cpu_ratio']:.2f} | {s['backend_cpu_ratio']:.2f} |")
    return out


def run_variants(args, variants: dict[str, dict], base: str) -> dict:
    names = list(variants)
    runs = []
    for i in range(args.repeats):
        order = names[i % len(names):] + names[:i % len(names)]
        print(f"repeat {i}:", flush=True)
        runs.append({n: measure(args, f"{args.mode}{i}-{n}", **variants[n]) for n in order})
    return {"runs": runs, "median": _summary(runs, names, base)}


def trace_breakdown(args) -> dict:
    from common.sample_models import SAMPLE_MODELS
    from frontend.trace import PHASES
    from nexus.bench import run_bench

    slo = args.slo_ms or SAMPLE_MODELS[args.model].slo_ms
    out: dict = {"quiet": wait_quiet(args.quiet_wait_s)}
    out_dir = pathlib.Path(args.out_dir)
    path = out_dir / f"hotpath-trace-{args.model}.jsonl"
    out_dir.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    with SampleCluster([args.model], tag="trace", frontend={"trace": str(path), "report_interval_s": 0.5}) as c:
        run_bench(c.frontend.address, args.model, args.low_rate, 2, slo)
        for load, rate in (("low", args.low_rate), ("high", args.high_rate)):
            time.sleep(1.0)
            t0 = time.time()
            r = run_bench(c.frontend.address, args.model, rate, args.trace_s, slo, warmup_s=1.0)
            t1 = time.time()
            time.sleep(1.5)                      # the frontend writes its trace at each report
            recs = [json.loads(line) for line in path.read_text().splitlines()]
            recs = [x for x in recs if t0 + 1.0 <= x["time"] <= t1 and x["status"] == "OK"]
            if not recs:
                print(f"{load}: no traced request in the window; client report {step_summary(r)}", flush=True)
                return out
            med = {p: statistics.median(x["phases_ns"][p] for x in recs) / 1e3 for p in PHASES}
            out[load] = {"rate": rate, "report": step_summary(r), "traced": len(recs),
                         "median_us": med, "median_total_us": statistics.median(x["total_ns"] for x in recs) / 1e3,
                         "median_batch": statistics.median(x["batch_size"] for x in recs),
                         "uptime": uptime()}
    print(f"model {args.model}; medians in microseconds of each phase (the medians need not add up to the "
          f"median total)")
    print("| load | rate rps | traced | " + " | ".join(PHASES) + " | total | client p50 ms | median batch |")
    print("| --- | ---: | ---: | " + " | ".join("---:" for _ in PHASES) + " | ---: | ---: | ---: |")
    for load in ("low", "high"):
        x = out[load]
        print(f"| {load} | {x['rate']:.0f} | {x['traced']} | " + " | ".join(f"{x['median_us'][p]:.0f}" for p in PHASES)
              + f" | {x['median_total_us']:.0f} | {x['report']['p50_ms']:.2f} | {x['median_batch']:.0f} |")
    print(out["high"]["uptime"])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", nargs="?", choices=("ab", "threads", "trace"), help="required but with --smoke (trace)")
    p.add_argument("--before", default="", help="ab: a checkout of the code before the change")
    p.add_argument("--model", default="")
    add_path_arguments(p, cap_s=6.0)
    p.add_argument("--high-rate", type=float, default=600.0)
    p.add_argument("--trace-s", type=float, default=8.0)
    p.add_argument("--cap-warmup-s", type=float, default=0.0, help="unmeasured lead-in of the capacity run")
    p.add_argument("--cap-deadline-ms", type=float, default=2000.0)
    p.add_argument("--quiet-wait-s", type=float, default=30.0)
    p.add_argument("--out-dir", default=str(OUT), help="where the JSON goes")
    add_smoke(p, low_rate=20.0, high_rate=50.0, trace_s=2.0, quiet_wait_s=0.0)
    args = parse_args(p, argv)
    if args.smoke and args.mode is None:
        args.mode = "trace"
    if args.mode is None:
        p.error("the following arguments are required: mode")
    exit_on_sigterm()
    args.model = args.model or ("resnet18_64" if args.mode == "threads" else "mlp_small")
    print(uptime(), flush=True)
    if args.mode == "ab":
        if not args.before:
            p.error("ab needs --before DIR")
        result = run_variants(args, {"before": {"code_dir": pathlib.Path(args.before),
                                                "env": {"NEXUS_EVENT_LOOP": "asyncio"}},
                                     "after-asyncio": {"env": {"NEXUS_EVENT_LOOP": "asyncio"}},
                                     "after": {}}, "before")
    elif args.mode == "threads":
        from common.sample_models import SAMPLE_MODELS
        slo = args.slo_ms or SAMPLE_MODELS[args.model].slo_ms
        result = run_variants(args, {"threads1": {"backend": {"threads": 1}, "cap_deadline_ms": slo},
                                     "threads2": {"backend": {"threads": 2}, "cap_deadline_ms": slo}},
                              "threads1")
    else:
        result = trace_breakdown(args)
    result["args"] = vars(args)
    out_dir = pathlib.Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"hotpath-{args.mode}.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
