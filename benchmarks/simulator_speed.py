"""How fast ``nexus simulate`` runs (issue 23 item 5; the page is benchmarks/simulator.md).

Two cases, each one process on one core, timed in CPU seconds (this machine is shared and noisy: CPU
time is what the simulation itself spends), with where the time went (the planner, the scaling
policy's ticks, the rest: requests, reports, tables):

* ``hour``: an hour of Poisson traffic at 2,000 requests/s to 500 Zipf-popular models on 100
  emulated T4s; target: at most 5 minutes;
* ``big``: 1,000 devices, 5,000 models, 20,000 requests/s for 10 simulated minutes: its time.

Every model is uploaded with its expected rate (so the first plan is made for the traffic, as
benchmarks/long_tail.py does on real processes), and the devices are registered from the start:
what is timed is serving, not a cold start (on one backend, loading 5,000 models before the first
routing table takes longer than the case).

    python -m benchmarks.simulator_speed hour [--duration-s 3600]
    python -m benchmarks.simulator_speed big [--duration-s 600]

``--duration-s`` shortens a case (the result says how long it simulated). Every model has the
same linear profile l(b) = 2b + 10 ms on the device and a 200 ms SLO.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time

from harness.smoke import add_smoke, parse_args
from nexus.simulate.config import SimConfig
from nexus.simulate.models import linear_models
from nexus.simulate.report import summarize, text
from nexus.simulate.run import Simulation
from nexus.simulate.workload import parse_schedule, scheduled_arrivals, zipf_shares

CASES = {"hour": (500, 2000.0, 100, 3600.0), "big": (5000, 20000.0, 1000, 600.0)}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def measure(case: str, duration_s: float | None, seed: int = 1) -> dict:
    models_n, rps, devices, default_s = CASES[case]
    duration_s = duration_s or default_s
    shares = zipf_shares([f"m{i:04d}" for i in range(models_n)], 1.0)
    models = tuple(dataclasses.replace(m, expected_rate_rps=rps * shares[m.name])
                   for m in linear_models(models_n, 200.0, 2.0, 10.0, 32, memory_mb=500))
    started = time.process_time()
    arrivals = scheduled_arrivals(parse_schedule(f"0:{rps}"), shares, duration_s, seed=seed)
    generated = time.process_time()
    config = SimConfig(backends=devices, max_backends=devices, seed=seed)
    sim = Simulation(models, arrivals, config)
    spent = {"plan": 0.0, "scale": 0.0}
    scheduler = sim.scheduler
    for name, key in (("_plan", "plan"), ("_scale", "scale")):
        inner = getattr(scheduler, name)

        def timed(*args, _inner=inner, _key=key):
            t = time.process_time()
            try:
                return _inner(*args)
            finally:
                spent[_key] += time.process_time() - t
        setattr(scheduler, name, timed)
    sim.run()
    ran = time.process_time()
    result = summarize(sim)
    summarized = time.process_time()
    return {"case": case, "models": models_n, "rate_rps": rps, "max_devices": devices, "simulated_s": duration_s,
            "requests": arrivals.count(), "cpu_s": {"arrivals": round(generated - started, 1),
                                                    "run": round(ran - generated, 1),
                                                    "planner": round(spent["plan"], 1),
                                                    "scaling_ticks": round(spent["scale"], 1),
                                                    "summary": round(summarized - ran, 1)},
            "us_per_request_outside_planner": round((ran - generated - spent["plan"] - spent["scale"])
                                                    / max(arrivals.count(), 1) * 1e6, 1),
            "plans": result["plans"], "within_slo": result["within_slo"], "summary": text(result),
            "cpu_model": cpu_model(), "loadavg": os.getloadavg()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("case", nargs="?", choices=sorted(CASES),
                   help="required, except with --smoke, which runs 'hour' ('big' is the same code, but its "
                        "first plan alone takes 10 s)")
    p.add_argument("--duration-s", type=float, default=None)
    p.add_argument("--out", default="")
    add_smoke(p, duration_s=5.0, out="simulator_speed.json")
    args = parse_args(p, argv)
    if args.case is None:
        if not args.smoke:
            p.error("the following arguments are required: case")
        args.case = "hour"
    before = os.getloadavg()
    out = measure(args.case, args.duration_s)
    out["loadavg_before"] = before
    print(json.dumps({k: v for k, v in out.items() if k != "summary"}, indent=1))
    print(out["summary"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
