"""A tiny model's peak throughput, Nexus against a tuned Triton, by perf_analyzer's concurrency sweep
(issue 25: "tiny model, peak infer/s of a concurrency sweep 1-16").

    python -m benchmarks.tiny_sweep [--concurrency 1,2,4,6,8,12,16] [--window-ms 3000] [--nice -15]
                                    [--servers triton,nexus] [--triton-candidates N] [--repeats 1]

The model is the sample MLP (``mlp_small``: 64 FP32 in, 10 out, 38 KB) at a 20 ms SLO, the mix's
MLP (harness/triton_compare.py). Where a model computes in microseconds, the serving path is all
there is to measure.

THE TOOL. perf_analyzer 2.50 (:mod:`harness.perf_analyzer`) in concurrency mode: closed loop, N
requests outstanding over gRPC, each sent when one returns; windows of ``--window-ms`` that must
agree within ``--stability-pct`` (p99 and throughput) in ``--max-trials`` windows. A level that
perf_analyzer cannot complete (a failed request, or no stable windows) has no figure. Every server
is started once; at each concurrency, the servers are measured one right after the other (paired,
in an order that rotates from level to level), so that drifting load on this shared machine hits
them alike. A server's peak is its highest completed infer/s over the sweep; the ratio is taken
against the best Triton candidate's peak. CPU: the server's processes, perf_analyzer's (this
process's children) and the whole machine, in cores, beside every level.

SERVERS. Triton 2.51 (PyTriton, ``--triton-python``; benchmarks/triton_model.py) with dynamic
batching, max batch b* of ORT called directly (at least 8), one ORT thread per instance: one
instance at a 0.5 or 2 ms (SLO/10) queue delay, or two at 0.5 ms
(:func:`harness.triton_compare.triton_candidates`, scenario ``tiny``). Nexus: ``nexus serve
--no-samples`` with the model uploaded at its SLO and profiled by the backend, as a user would
(``--nexus-config`` as in benchmarks/vs_triton.py; default: ``default``), once with the model's late
requests dropped (the default) and once served late, as Triton does (``--late-requests``).

Output: a table on stdout and benchmarks/out/tiny_sweep.json, with the load average of the run.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import sys
import tempfile
import time

from benchmarks.vs_triton import OUT, Running, children_cpu_s, nexus_label, ort_limit, start_nexus, start_triton
from harness import perf_analyzer as pa
from harness.cluster import descendants
from harness.meters import CpuMeter, LoadSampler, favour
from harness.smoke import add_smoke, parse_args
from harness.triton_compare import MODELS, build_models, parse_late_requests, parse_nexus_configs, triton_candidates
from nexus.bench.report import write_json

SCENARIO = "tiny"
MODEL = "mlp"
SMOKE_HELP = ("--smoke runs the Nexus side only (Triton needs nvidia-pytriton's own virtualenv) at concurrency 1 "
              "and 4 in 1 s windows; where perf_analyzer has not been fetched, the server only starts and serves.")


def measure(tool, server: Running, concurrency: int, args, work: pathlib.Path) -> dict:
    """One concurrency level against one server, with the CPU of its processes, perf_analyzer's and the machine's."""
    binary, env = tool
    pids = [server.pid, *descendants(server.pid)]
    meter = CpuMeter({str(p): p for p in pids}).start()
    c0 = children_cpu_s()
    level = pa.run_concurrency(binary, env, server.address, MODEL, concurrency, work / "pa", window_ms=args.window_ms,
                               stability_pct=args.stability_pct, max_trials=args.max_trials)
    cpu = meter.stop()
    wall = max(cpu["wall_s"], 1e-9)
    server_s = sum(v for v in cpu["cpu_s"].values() if v == v)     # NaN: a process gone meanwhile
    out = {"concurrency": concurrency, "completed": level.completed, "infer_per_s": round(level.throughput_rps, 1),
           "p50_ms": round(level.p50_us / 1000, 2), "p99_ms": round(level.p99_us / 1000, 2), "error": level.error,
           "cores": {"server": round(server_s / wall, 3), "client": round((children_cpu_s() - c0) / wall, 3),
                     "machine": round(cpu["machine_busy_cores"], 3)},
           "load_average": round(os.getloadavg()[0], 2)}
    figure = (f"{out['infer_per_s']:7.1f} infer/s p50 {out['p50_ms']:.2f} p99 {out['p99_ms']:.2f} ms"
              if level.completed else f"FAILED: {level.error[:100]}")
    print(f"  c={concurrency:2d} [{server.label}] {figure} | cores server {out['cores']['server']:.2f} client "
          f"{out['cores']['client']:.2f} machine {out['cores']['machine']:.2f} | load {out['load_average']:.1f}",
          flush=True)
    return out


def sweep(tool, servers: list[Running], args, work: pathlib.Path) -> dict[str, list[dict]]:
    """Every concurrency of ``--concurrency`` against every server, paired and rotating."""
    levels: dict[str, list[dict]] = {s.label: [] for s in servers}
    for i, concurrency in enumerate(args.concurrency):
        order = servers[i % len(servers):] + servers[:i % len(servers)]
        for server in order:
            time.sleep(args.cooldown_s)
            levels[server.label].append(measure(tool, server, concurrency, args, work))
    return levels


def peaks(result: dict) -> list[dict]:
    """Per repeat and server: the peak completed infer/s, at which concurrency, and the ratio to the best Triton."""
    rows = []
    for i, rep in enumerate(result["repeats"], start=1):
        best_of = {label: max((lv for lv in levels if lv["completed"]), key=lambda lv: lv["infer_per_s"], default=None)
                   for label, levels in rep.items()}
        triton = max((b["infer_per_s"] for label, b in best_of.items() if label.startswith("triton") and b), default=0)
        for label, b in best_of.items():
            rows.append({"repeat": i, "server": label, "peak_infer_per_s": b["infer_per_s"] if b else 0.0,
                         "at_concurrency": b["concurrency"] if b else None,
                         "vs_best_triton": round(b["infer_per_s"] / triton, 2) if b and triton else None,
                         "server_cores": b["cores"]["server"] if b else None,
                         "p99_ms": b["p99_ms"] if b else None})
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=SMOKE_HELP)
    p.add_argument("--concurrency", default="1,2,4,6,8,12,16", help="comma-separated concurrency levels")
    p.add_argument("--servers", default="triton,nexus", help="comma-separated: triton, nexus")
    p.add_argument("--nexus-config", action="append", default=[], metavar="NAME[=FLAGS]",
                   help="as in benchmarks/vs_triton.py (default: default)")
    p.add_argument("--late-requests", default="drop,serve", metavar="drop,serve",
                   help="the MLP's late requests on Nexus (common/late_requests.py); both: Nexus twice")
    p.add_argument("--triton-python", default=str(OUT / "pytriton-venv" / "bin" / "python"))
    p.add_argument("--triton-candidates", type=int, default=0, help="the first N Triton candidates (0: all)")
    p.add_argument("--perf-analyzer", default="", help="perf_analyzer binary (default: fetched)")
    p.add_argument("--window-ms", type=int, default=3000)
    p.add_argument("--stability-pct", type=float, default=25.0)
    p.add_argument("--max-trials", type=int, default=6)
    p.add_argument("--cooldown-s", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=1, help="sweeps, every server started once")
    p.add_argument("--ort-repeats", type=int, default=5)
    p.add_argument("--nice", type=int, default=0, help="as root: favour the benchmark over other load")
    p.add_argument("--out", default=str(OUT / "tiny_sweep.json"))
    add_smoke(p, servers="nexus", concurrency="1,4", late_requests="serve", window_ms=1000, stability_pct=100.0, max_trials=4,
              cooldown_s=0.0, ort_repeats=1)
    args = parse_args(p, argv)
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
        if not args.concurrency or min(args.concurrency) < 1:
            raise ValueError
    except ValueError:
        p.error(f"--concurrency: expected positive integers separated by commas, got {args.concurrency!r}")
    try:
        args.late_requests = parse_late_requests(args.late_requests)
    except ValueError as exc:
        p.error(str(exc))
    servers = [s for s in args.servers.split(",") if s]
    if [s for s in servers if s not in ("triton", "nexus")]:
        p.error(f"--servers: expected triton and/or nexus, got {args.servers!r}")
    try:
        configs = parse_nexus_configs(args.nexus_config or ["default"])
    except ValueError as exc:
        p.error(str(exc))
    if "triton" in servers and not pathlib.Path(args.triton_python).exists():
        p.error(f"--triton-python {args.triton_python} does not exist (see benchmarks/vs_triton.py)")
    try:
        tool = pa.driver_tool(args.perf_analyzer, args.smoke)
    except pa.ToolUnavailable as exc:
        p.error(f"perf_analyzer unavailable: {exc}")
    if tool is None:
        print("smoke: perf_analyzer not available here: the server starts and serves, no sweep", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit(143)))
    favour(os.getpid(), args.nice)
    sampler = LoadSampler().start()
    t0 = time.monotonic()
    result: dict = {"command": " ".join(["python", "-m", "benchmarks.tiny_sweep", *argv]), "model": MODEL,
                    "slo_ms": MODELS[MODEL].slo_ms, "cpus": os.cpu_count(), "repeats": []}
    running: list[Running] = []
    with tempfile.TemporaryDirectory(prefix="tiny-sweep-") as tmp:
        work = pathlib.Path(tmp)
        paths = build_models(work, [MODEL])
        result["ort_direct"] = ort_limit(paths[MODEL], MODELS[MODEL], args.ort_repeats)
        print(f"ORT direct: {result['ort_direct']}", flush=True)
        try:
            if "triton" in servers:
                candidates = triton_candidates(SCENARIO, {MODEL: result["ort_direct"]})
                for cand in candidates[:args.triton_candidates or None]:
                    running.append(start_triton(args, SCENARIO, cand, paths, work))
            if "nexus" in servers:
                running += [start_nexus(args, SCENARIO, paths, flags, nexus_label(label, late), work, late)
                            for label, flags in configs.items() for late in args.late_requests]
            result["servers"] = {r.label: r.info for r in running}
            for i in range(args.repeats if tool is not None else 0):
                print(f"sweep {i + 1} of {args.repeats}", flush=True)
                result["repeats"].append(sweep(tool, running, args, work))
        finally:
            for r in running:
                r.stop()
    result["load_average"] = sampler.stop()
    result["wall_s"] = round(time.monotonic() - t0, 1)
    result["peaks"] = peaks(result)
    out = write_json(args.out, result)
    print(f"\nwall {result['wall_s']} s; load average (1 min) during the run: {result['load_average']}")
    for row in result["peaks"]:
        print(json.dumps(row))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
