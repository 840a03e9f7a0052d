"""A fleet of models far larger than the devices' memory, in the simulator (``nexus simulate``'s engine,
which runs the scheduler's own planner, residency choice and handover, the frontend's routing, page-in
and report clock, and the backend's batching).

``--models`` models of one linear profile l(b) = alpha * b + beta, each holding ``--model-mb`` of
memory, on ``--devices`` devices of ``--memory-mb``: by default 2,000 models on 8 T4-sized devices
whose memory holds 200. Arrivals follow the Azure-Functions-like per-minute model of
:func:`nexus.simulate.workload.synthetic_azure` (lognormal popularity of sigma ``--popularity-sigma``,
per-minute bursts of CV ``--burst-cv``, each model idle a ``--idle-fraction`` of its minutes) at
``--rate`` requests per second in total.

Reported, beside the simulator's own summary:

* requests that found their model resident, within their SLO: over the whole trace and from
  ``--settle-s`` on (the cluster's own start, when the first plan loads every resident model, is the
  first second or two);
* requests that found their model cold: how much longer than its SLO they took, for all of them and
  for the first request of each wait (not one that came while the model's previous request still
  waited for the same page-in), p50 and p99;
* requests lost to an eviction (failed after their backend unloaded the model for going cold).

Run from the repository root: ``python -m benchmarks.fleet_sim [--duration-s 600] [--json OUT.json]``;
``--smoke`` runs a small fleet for a few seconds (the CI checks the driver with it).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import numpy as np

from harness.meters import loadavg
from harness.smoke import add_smoke, parse_args as smoke_parse_args
from nexus.simulate import report
from nexus.simulate.config import SimConfig
from nexus.simulate.models import linear_models
from nexus.simulate.outcomes import FAILED, Loss, Status
from nexus.simulate.run import Simulation
from nexus.simulate.workload import synthetic_azure


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=int, default=2000)
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--memory-mb", type=float, default=16000.0, help="of each device (default: a T4's)")
    p.add_argument("--model-mb", type=float, default=630.0, help="each model's memory (default: 25 to a device)")
    p.add_argument("--slo-ms", type=float, default=100.0)
    p.add_argument("--alpha-ms", type=float, default=0.5, help="l(b) = alpha * b + beta")
    p.add_argument("--beta-ms", type=float, default=1.5)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--rate", type=float, default=200.0, help="requests per second, in total")
    p.add_argument("--duration-s", type=float, default=600.0)
    p.add_argument("--popularity-sigma", type=float, default=2.0)
    p.add_argument("--burst-cv", type=float, default=1.5)
    p.add_argument("--idle-fraction", type=float, default=0.5)
    p.add_argument("--settle-s", type=float, default=10.0, help="the cluster's own start, reported apart")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", default="", metavar="OUT.json", help="the simulator's summary and this driver's figures")
    # --smoke: 200 models on 2 devices for 20 s, checks the driver runs
    add_smoke(p, models=200, devices=2, duration_s=20.0, rate=40.0, settle_s=5.0, json="fleet_sim.json")
    return smoke_parse_args(p, argv)


def fleet_figures(sim: Simulation, settle_s: float) -> dict:
    """The figures of the module docstring, from a finished simulation."""
    out = sim.outcomes
    status, cold = out.status, out.cold
    settled = sim.arrivals.times_s >= settle_s
    resident = ~cold
    failed = np.isin(status, [int(s) for s in FAILED])

    def within(mask: np.ndarray) -> float | None:
        n = int(mask.sum())
        return round(float(np.sum(mask & (status == Status.ON_TIME)) / n), 6) if n else None

    summary = report.summarize(sim)
    return {
        "requests": int(status.size),
        "resident_requests": int(resident.sum()),
        "resident_within_slo": within(resident),
        "resident_within_slo_settled": within(resident & settled),
        "resident_failed_settled": int(np.sum(resident & settled & failed)),
        "cold_requests": int(cold.sum()),
        "cold": summary["cold"]["cold"],
        "first_of_wait": summary["cold"]["first_of_wait"],
        "page_in_reports": summary["cold"]["page_ins"],
        "lost_to_eviction": int(np.sum(failed & (out.loss == Loss.EVICTED))),
        "plans": summary["plans"],
        "summary": summary,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    models = linear_models(args.models, args.slo_ms, args.alpha_ms, args.beta_ms, args.max_batch,
                           memory_mb=args.model_mb)
    arrivals = synthetic_azure([m.name for m in models], args.duration_s, args.rate, seed=args.seed,
                               popularity_sigma=args.popularity_sigma, burst_cv=args.burst_cv,
                               idle_fraction=args.idle_fraction)
    config = SimConfig(backends=args.devices, memory_mb=args.memory_mb, seed=args.seed)
    load_before = loadavg()
    began = time.monotonic()
    sim = Simulation(models, arrivals, config)
    sim.run()
    wall_s = time.monotonic() - began
    figures = fleet_figures(sim, args.settle_s)
    holds = int(args.memory_mb // args.model_mb) * args.devices
    print(f"{args.models:,} models on {args.devices} devices whose memory holds {holds}; {arrivals.count():,} "
          f"requests over {args.duration_s:g} s (simulated in {wall_s:.0f} s; load average {load_before:.2f} "
          f"before, {loadavg():.2f} after)")
    print(report.text(figures["summary"]), end="")
    first, all_cold = figures["first_of_wait"], figures["cold"]
    print(f"resident models: {100 * (figures['resident_within_slo'] or 0):.3f}% within SLO over the trace, "
          f"{100 * (figures['resident_within_slo_settled'] or 0):.3f}% from {args.settle_s:g} s "
          f"({figures['resident_failed_settled']} failed)")
    print(f"cold models: {figures['cold_requests']:,} requests; over the SLO p50 {all_cold['over_slo_p50_ms']} ms, "
          f"p99 {all_cold['over_slo_p99_ms']} ms; first of each wait ({first['requests']:,}): p50 "
          f"{first['over_slo_p50_ms']} ms, p99 {first['over_slo_p99_ms']} ms; {all_cold['failed']} failed; "
          f"lost to eviction {figures['lost_to_eviction']}")
    if args.json:
        options = {k: v for k, v in vars(args).items() if not k.startswith("_")}   # not add_smoke's own
        pathlib.Path(args.json).write_text(json.dumps({"args": options, "wall_s": round(wall_s, 1),
                                                       **{k: v for k, v in figures.items() if k != "summary"}},
                                                      indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
