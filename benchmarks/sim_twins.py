"""Simulated twins of the real-process benchmarks, at ``--scale`` times their size (issue 23 item 6).

Each twin runs the workload of its real benchmark through ``nexus simulate``'s engine (the
scheduler's, the scaling policy's, the actuator's, the frontends' and the engines' own decision
code on a virtual clock), with every count of models, devices and requests per second multiplied
by ``--scale`` (default 10):

* ``elastic`` (benchmarks/elastic.py, "devices started on demand"): Zipf models of its GPU-like
  profiles and SLOs (harness.elastic.zipf_models, as it calls it), Gamma arrivals of CV 1-4 by model, ``--base-rps`` for
  40 s, 5x for 40 s, back for 60 s, ``--backends auto`` from 1 to 12 (times the scale), a 10 s
  scale-down cool-down;
* ``long_tail`` (benchmarks/long_tail.py): 100 models (times the scale) of the issue-18 long tail
  (harness.workloads.long_tail), 150 requests/s in all (times the scale), Poisson, each model
  uploaded with its expected rate, 20 emulated T4s (times the scale), 10 minutes;
* ``failover``: 100 devices (times the scale) serving 100 models (times the scale) at a steady
  rate; the 1% of backends carrying the most load are killed at 30 s: with one replica per model
  and no spare replicas (``--no-spare-replicas``), with one and spares on the idle devices (the
  default), and with two (``--min-replicas 2``).

Each trace starts after ``--lead-s`` (10 s) of silence in which the cluster registers and plans, as
the real benchmarks let theirs settle.

    python -m benchmarks.sim_twins elastic [--scale 10] [--out benchmarks/out/sim_twins]

Each prints the simulator's text summary and writes ``<case>.json`` and ``<case>.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import time

from benchmarks.elastic import FIXED_MS, PER_ITEM_MS, SLOS_MS
from common.config import SchedulerConfig
from harness.elastic import zipf_models
from harness.smoke import add_smoke, parse_args
from harness.workloads import long_tail
from nexus.simulate.config import Fault, FaultKind, SimConfig
from nexus.simulate.models import SimModel
from nexus.simulate.plot import plot
from nexus.simulate.report import dumps, summarize, text
from nexus.simulate.run import Simulation
from nexus.simulate.workload import Arrivals, parse_schedule, scheduled_arrivals


def elastic(scale: int, seed: int, base_rps: float = 40.0) -> tuple:
    trace = zipf_models(24 * scale, seed=seed, per_item_ms=PER_ITEM_MS, fixed_ms=FIXED_MS, slo_ms=SLOS_MS)
    models = tuple(SimModel(m.name, m.slo_ms, m.share, m.profile) for m in trace)
    rps = base_rps * scale
    schedule = parse_schedule(f"0:{rps},40:{5 * rps},80:{rps}")
    arrivals = scheduled_arrivals(schedule, {m.name: m.share for m in trace}, 140.0,
                                  cv={m.name: m.cv for m in trace}, seed=seed)
    high = 12 * scale
    config = SimConfig(max_backends=high, seed=seed, scheduler=SchedulerConfig(
        scale_down_cooldown_s=10.0, min_devices="t4=1", max_devices=f"t4={high}"))
    return models, arrivals, config, [(40.0, rps, 5 * rps), (80.0, 5 * rps, rps)]


def long_tail_case(scale: int, seed: int) -> tuple:
    sessions = long_tail(100 * scale, 150.0 * scale, (50.0, 200.0), seed, device_type="t4")
    models = tuple(SimModel(s.name, s.slo_ms, s.rate_rps, s.profile, expected_rate_rps=s.rate_rps) for s in sessions)
    total = sum(s.rate_rps for s in sessions)
    arrivals = scheduled_arrivals(parse_schedule(f"0:{total}"), {s.name: s.rate_rps for s in sessions}, 600.0,
                                  seed=seed)
    return models, arrivals, SimConfig(backends=20 * scale, frontends=2, seed=seed), []


def failover(scale: int, seed: int, replicas: int, spares: bool = True) -> tuple:
    sessions = long_tail(100 * scale, 300.0 * scale, (100.0, 200.0), seed, device_type="t4", exponent=0.5)
    models = tuple(SimModel(s.name, s.slo_ms, s.rate_rps, s.profile, expected_rate_rps=s.rate_rps) for s in sessions)
    total = sum(s.rate_rps for s in sessions)
    arrivals = scheduled_arrivals(parse_schedule(f"0:{total}"), {s.name: s.rate_rps for s in sessions}, 90.0,
                                  seed=seed)
    devices = 100 * scale
    config = SimConfig(backends=devices, seed=seed, faults=(Fault(FaultKind.KILL_BACKENDS, 30.0, count=max(1, devices // 100)),),
                       scheduler=SchedulerConfig(min_replicas=replicas, spare_replicas=spares))
    return models, arrivals, config, []


def with_lead(models, arrivals, config, steps, lead_s: float) -> tuple:
    """The case with ``lead_s`` of silence first: the simulated cluster starts, registers and makes its
    first plans before the trace, as the real benchmarks let theirs settle (a trace from t = 0 measures
    a cold start, which is not what these cases are about)."""
    if lead_s <= 0:
        return models, arrivals, config, steps
    shifted = Arrivals(arrivals.times_s + lead_s, arrivals.models, arrivals.names, arrivals.duration_s + lead_s)
    faults = tuple(dataclasses.replace(f, at_s=f.at_s + lead_s) for f in config.faults)
    return (models, shifted, dataclasses.replace(config, faults=faults),
            [(t + lead_s, before, after) for t, before, after in steps])


def head(models, arrivals, config, steps, seconds: float) -> tuple:
    """The case's first ``seconds`` only (all of it when ``seconds`` is 0 or the trace is shorter)."""
    if seconds <= 0 or seconds >= arrivals.duration_s:
        return models, arrivals, config, steps
    keep = arrivals.times_s < seconds
    return (models, Arrivals(arrivals.times_s[keep], arrivals.models[keep], arrivals.names, seconds), config,
            [step for step in steps if step[0] < seconds])


def run_case(name: str, models, arrivals, config, steps, out: pathlib.Path) -> dict:
    load_before = os.getloadavg()
    started = time.process_time()
    sim = Simulation(models, arrivals, config)
    sim.run()
    result = summarize(sim, steps, {"case": name, "models": len(models), "requests": arrivals.count()})
    cpu_s = time.process_time() - started
    (out / f"{name}.json").write_text(dumps(result))
    plot(result, str(out / f"{name}.png"), title=f"{name}: " + text(result).splitlines()[0])
    print(f"== {name}: {len(models)} models, {arrivals.count():,} requests over {arrivals.duration_s:g} s; "
          f"{cpu_s:.0f} CPU-seconds; load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after")
    print(text(result))
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("case", nargs="?", choices=("elastic", "long_tail", "failover"),
                   help="required, except with --smoke (which, without it, runs every case)")
    p.add_argument("--scale", type=int, default=10)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default="benchmarks/out/sim_twins")
    p.add_argument("--lead-s", type=float, default=10.0, help="silence before the trace while the cluster settles")
    p.add_argument("--max-trace-s", type=float, default=0.0,
                   help="cut every trace after this many seconds (0: each case's whole trace)")
    add_smoke(p, scale=1, max_trace_s=45.0)
    args = parse_args(p, argv)
    if args.case is None and not args.smoke:
        p.error("the following arguments are required: case")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cases = [args.case] if args.case else ["elastic", "long_tail", "failover"]
    cut = args.max_trace_s
    if "elastic" in cases:
        run_case(f"elastic.x{args.scale}", *with_lead(*head(*elastic(args.scale, args.seed), cut), args.lead_s), out)
    if "long_tail" in cases:
        run_case(f"long_tail.x{args.scale}",
                 *with_lead(*head(*long_tail_case(args.scale, args.seed), cut), args.lead_s), out)
    if "failover" in cases:
        found = {}
        for replicas, spares in ((1, False), (1, True), (2, True)):
            name = f"failover.x{args.scale}.replicas{replicas}" + ("" if spares else ".no-spares")
            r = run_case(name, *with_lead(*head(*failover(args.scale, args.seed, replicas, spares), cut),
                                          args.lead_s), out)
            found[name] = {k: r[k] for k in ("within_slo", "failed", "lost_to_faults", "seconds_below_99")}
        print(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
