"""The scheduler's CPU at idle: ``nexus serve`` on its defaults (and with N emulated backends), no
traffic, the scheduler process's CPU seconds from /proc over a window.

    python -m benchmarks.idle_scheduler [--backends 1] [--device cpu] [--window-s 30] [--settle-s 20]
    python -m benchmarks.idle_scheduler --backends 10 --device emulated:t4
    python -m benchmarks.idle_scheduler --backends 10 --device emulated:t4 -- --heartbeat-interval-ms 5000
    python -m benchmarks.idle_scheduler --load traffic 20 30      # the idle after 30 s of query traffic

It starts ``nexus serve`` in a temporary data directory (the sample models are built, profiled and
served as for a new user), waits ``--settle-s`` after its ready line for the first plans and
profiles, then measures the CPU seconds (utime + stime) of the scheduler, the frontend and the
first backend over ``--window-s`` with no request sent. With ``--py-spy BIN`` it also samples the
scheduler with py-spy over the same window and prints its busiest functions. One markdown table
row per run, with the CPU model and the load average at start and end (a figure taken at a load
average above 1.5 is marked).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

from harness import pyspy
from harness.cluster import ServeCluster, descendants, cmdline
from harness.background_load import BackgroundLoad
from harness.meters import CpuMeter, loadavg
from harness.smoke import add_smoke, parse_args

BUSY_LOAD = 1.5      # a figure taken at a higher 1-minute load average is marked
LOAD_SLO_MS = 500.0  # of the optional traffic before the idle window


def cpu_model() -> str:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def backend_count(serve_pid: int) -> int:
    return sum(" backend " in f" {cmdline(p)} " for p in descendants(serve_pid))


def measure(backends: int, device: str, window_s: float, settle_s: float, py_spy: str | None,
            serve_args: tuple[str, ...] = (), load: tuple[str, float, float] | None = None) -> dict:
    with tempfile.TemporaryDirectory(prefix="nexus-idle-") as tmp:
        serve = ServeCluster(tmp, "--backends", str(backends), "--device", device, *serve_args,
                             log_path=pathlib.Path(tmp) / "serve.log")
        try:
            if load is not None:            # traffic first: the idle that follows it is measured
                model, rate_rps, seconds = load
                traffic = BackgroundLoad(serve.frontend, model, rate_rps, slo_ms=LOAD_SLO_MS).start()
                time.sleep(seconds)
                traffic.stop()
            time.sleep(settle_s)
            pids = serve.components()
            load0 = loadavg()
            spy = None
            if py_spy:
                out = pathlib.Path(tmp) / "scheduler.pyspy"
                spy = pyspy.record(py_spy, pids["scheduler"], window_s, out)
            meter = CpuMeter(pids).start()
            time.sleep(window_s)
            m = meter.stop()
            top = pyspy.finish(spy, out, window_s) if spy is not None else None
            return {"backends": backend_count(serve.pid), "device": device, "wall_s": round(m["wall_s"], 1),
                    "cpu_s": {k: round(v, 2) for k, v in m["cpu_s"].items()},
                    "scheduler_core_pct": round(100 * m["cpu_s"]["scheduler"] / m["wall_s"], 2),
                    "loadavg_start": load0, "loadavg_end": loadavg(), "cpu_model": cpu_model(), "py_spy": top}
        finally:
            serve.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--window-s", type=float, default=30.0)
    ap.add_argument("--settle-s", type=float, default=20.0)
    ap.add_argument("--py-spy", default=None, help="py-spy binary: also sample the scheduler over the window")
    ap.add_argument("--load", nargs=3, metavar=("MODEL", "RPS", "SECONDS"), default=None,
                    help="send MODEL traffic at RPS for SECONDS first; the idle after it is measured")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("serve_args", nargs="*", help="after --: more nexus serve flags")
    add_smoke(ap, window_s=1.0, settle_s=0.5, load=["mlp_small", "20", "1"], json=True)
    args = parse_args(ap, argv)
    load = (args.load[0], float(args.load[1]), float(args.load[2])) if args.load else None
    r = measure(args.backends, args.device, args.window_s, args.settle_s, args.py_spy, tuple(args.serve_args), load)
    if args.json:
        print(json.dumps(r, indent=1))
    busy = " (load > 1.5)" if max(r["loadavg_start"], r["loadavg_end"]) > BUSY_LOAD else ""
    print("| backends | device | window s | scheduler CPU s | scheduler % of a core | frontend CPU s | "
          "backend-0 CPU s | load avg start/end | CPU model |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | --- | --- |")
    c = r["cpu_s"]
    print(f"| {r['backends']} | {r['device']} | {r['wall_s']} | {c['scheduler']} | {r['scheduler_core_pct']}{busy} | "
          f"{c.get('frontend', float('nan'))} | {c.get('backend', float('nan'))} | "
          f"{r['loadavg_start']:.2f}/{r['loadavg_end']:.2f} | {r['cpu_model']} |")
    if r["py_spy"]:
        print(json.dumps(r["py_spy"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
