"""Issue 24's targets, measured in ``nexus simulate``: the SLO while the cluster changes.

    python -m benchmarks.sim_change [--devices 100] [--cases step_auto,step_idle,ramp_auto,steady,kill,stall]
                                    [--seed N] [--floors] [--device-headroom H] [--spare-overbook F]
                                    [--burst-sigma Z] [--known-rates-ahead-s S]

``--devices`` sets the cluster's size (100 or 1,000: the models, the rates and the bounds scale with
it). Every trace starts after ``LEAD_S`` of silence while the cluster registers and plans. The cases:

* ``step_auto``: the elastic trace (benchmarks/elastic.py's models: Zipf shares, Gamma arrivals of
  CV 1-4, GPU-like profiles, SLOs of 300-500 ms; 2.4 models per device) with a 5x step up at 40 s
  and back at 80 s, ``--backends auto`` from a tenth of the devices to all of them. Targets:
  99.9% within SLO over the trace; every 1 s window at 99% or more from ``backend_start_s`` + 2 s
  after the step; device-seconds at most 1.3x the tight bound's integral; back to the bound's
  device count within a cool-down + 30 s after the step down, losing nothing to scale-down.
* ``step_idle``: the same trace with every device registered from the start: no 1 s window below 99%.
* ``ramp_auto``: the step's trace with ramps instead of steps: up from 1x to 5x over ``RAMP_S`` from
  40 s, back down over ``RAMP_S`` from 80 s, auto as ``step_auto`` (where scaling ahead of a rising
  rate would pay, if anywhere: benchmarks/elastic.md): the trace's targets, 99.9% within SLO and
  device-seconds at most 1.3x the bound, and nothing lost to scale-down.
* ``steady``: constant Poisson load (half the peak) for ``--steady-s`` (30 minutes), auto: at most
  one scale reversal (the desired count turning from rising to falling or back) per 10 minutes.
* ``kill``: every device registered, the step's peak load (Poisson), the 10% of devices carrying the
  most load killed at once 30 s in: at most 0.1% of the requests from 10 s before the kill on not
  within SLO (the trace's start, a cold start at peak, is not the kill's), and every 1 s window
  back at 99% within 5 s.
* ``stall``: the peak load (Poisson) on every device, the scheduler stalled for 10 s: no node
  evicted, and the stall's seconds as good as the ten before it.

``--known-rates-ahead-s S`` gives the planner the trace's true mean rates, known ``S`` seconds ahead,
instead of the ones it measures (nexus/simulate/known_rates.py; the trace's cases, ``step_auto``,
``step_idle`` and ``ramp_auto``): what the same planner, scaler and data plane reach when the rates
are known. With ``--device-headroom`` it draws the trade between the SLO and the devices.

Prints one line per target with the number measured and met / missed, and writes
``<out>/<case>.json`` (the simulator's result) and ``targets.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

from benchmarks.elastic import FIXED_MS, PER_ITEM_MS, SLOS_MS
from common.cli_types import non_negative_seconds
from common.config import FIXED_BURST_SIGMA, SchedulerConfig
from harness.elastic import zipf_models
from harness.smoke import add_smoke, parse_args
from nexus.simulate.config import Fault, FaultKind, SimConfig
from nexus.simulate.known_rates import KnownRates
from nexus.simulate.models import SimModel
from nexus.simulate.report import dumps, summarize
from nexus.simulate.run import Simulation
from nexus.simulate.workload import Arrivals, parse_schedule, scheduled_arrivals

LEAD_S = 10.0
STEP_UP_S, STEP_DOWN_S, END_S = 40.0, 80.0, 140.0
COOLDOWN_S = 10.0
RAMP_S = 20.0
MODELS_PER_DEVICE = 2.4
RPS_PER_DEVICE = 4.0            # the base rate per device: the step's peak (5x) needs about half the devices


def workload(devices: int, seed: int):
    trace = zipf_models(max(100, int(MODELS_PER_DEVICE * devices)), seed=seed, per_item_ms=PER_ITEM_MS,
                        fixed_ms=FIXED_MS, slo_ms=SLOS_MS)
    models = tuple(SimModel(m.name, m.slo_ms, m.share, m.profile) for m in trace)
    return trace, models


def arrivals(trace, schedule: str, duration_s: float, seed: int, cv: bool = True) -> Arrivals:
    a = scheduled_arrivals(parse_schedule(schedule), {m.name: m.share for m in trace}, duration_s,
                           cv={m.name: m.cv for m in trace} if cv else 1.0, seed=seed)
    return Arrivals(a.times_s + LEAD_S, a.models, a.names, a.duration_s + LEAD_S)


def known_rates(trace, schedule: str, ahead_s: float | None) -> KnownRates | None:
    """The trace's true mean rates, on the simulation's clock (silent for ``LEAD_S``), known ``ahead_s``
    ahead; each model's dispersion its CV squared. None: the planner measures them."""
    if ahead_s is None:
        return None
    rates = parse_schedule(schedule)

    def total_rps(t_s: float) -> float:
        return rates.rate_at(t_s - LEAD_S) if t_s >= LEAD_S else 0.0

    return KnownRates(total_rps, {m.name: m.share for m in trace}, ahead_s, {m.name: m.cv ** 2 for m in trace})


def config(devices: int, seed: int, fixed: bool, faults=(), floors: bool = False,
           device_headroom: float | None = None, spare_overbook: float | None = None,
           burst_sigma: float | None = None) -> SimConfig:
    """``floors``: the scheduler as before 2026-12-05, surges held as each session's floor and no device
    headroom (``--surge-floors --device-headroom 0``), against the defaults' spares pooled on the
    headroom; a cluster of fixed size keeps burst room on every device then, as it did (with no
    headroom, one idle device would otherwise take it away). ``device_headroom``, ``spare_overbook``,
    ``burst_sigma``: those settings, where given."""
    low = max(1, devices // 10)
    extra = {"surge_floors": True, "device_headroom": 0.0} if floors else {}
    if floors and fixed:
        extra["burst_sigma"] = FIXED_BURST_SIGMA
    if device_headroom is not None:
        extra["device_headroom"] = device_headroom
    if spare_overbook is not None:
        extra["spare_overbook"] = spare_overbook
    if burst_sigma is not None:
        extra["burst_sigma"] = burst_sigma
    scheduler = SchedulerConfig(scale_down_cooldown_s=COOLDOWN_S, min_devices=f"t4={devices if fixed else low}",
                                max_devices=f"t4={devices}", **extra)
    return SimConfig(backends=devices if fixed else None, min_backends=low, max_backends=devices, seed=seed,
                     faults=tuple(faults), scheduler=scheduler)


def run(name: str, models, arr: Arrivals, cfg: SimConfig, steps, out: pathlib.Path,
        known: KnownRates | None = None) -> tuple:
    started = time.process_time()
    sim = Simulation(models, arr, cfg, known)
    sim.run()
    result = summarize(sim, steps, {"case": name})
    (out / f"{name}.json").write_text(dumps(result))
    print(f"== {name}: {arr.count():,} requests, {len(models)} models, {time.process_time() - started:.0f} CPU-s, "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    return sim, result


def windows(result: dict, start_s: float, end_s: float) -> list[float]:
    ps = result["per_second"]
    return [a for t, a in zip(ps["time_s"], ps["within_slo"]) if start_s <= t < end_s and a is not None]


def missed_share(result: dict, start_s: float, end_s: float) -> float:
    """The share of the requests sent in [start_s, end_s) that did not finish within their SLO."""
    ps = result["per_second"]
    sent = missed = 0.0
    for t, n, a in zip(ps["time_s"], ps["arrivals"], ps["within_slo"]):
        if start_s <= t < end_s and a is not None:
            sent, missed = sent + n, missed + n * (1 - a)
    return missed / sent if sent else 0.0


def reversals(sim) -> list[float]:
    """Times at which the desired device count turned (rising to falling, or back)."""
    out, last, direction = [], None, 0
    for e in sim.events:
        if e["kind"] != "scaling" or "desired" not in e:
            continue
        d = e["desired"]
        if last is not None and d != last:
            now = 1 if d > last else -1
            if direction and now != direction:
                out.append(e["time_s"])
            direction = now
        last = d
    return out


def target(rows: list, case: str, what: str, measured, goal: str, met: bool) -> None:
    rows.append({"case": case, "target": what, "measured": measured, "goal": goal, "met": met})
    print(f"  {what}: {measured} (target {goal}): {'met' if met else 'MISSED'}", flush=True)


def trace_targets(rows: list, case: str, result: dict) -> None:
    """The whole trace's targets under auto: within SLO, and device-seconds against the bound."""
    target(rows, case, "within SLO over the trace", result["within_slo"], ">= 0.999", result["within_slo"] >= 0.999)
    ratio = result["device_seconds_over_bound"]
    target(rows, case, "device-seconds over the bound's integral", ratio, "<= 1.3", ratio <= 1.3)


def lost_targets(rows: list, case: str, result: dict) -> None:
    lost = result["lost_to_scale_down"]
    target(rows, case, "requests lost to scale-down", lost, "0", lost == 0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=100)
    p.add_argument("--cases", default="step_auto,step_idle,ramp_auto,steady,kill,stall")
    p.add_argument("--steady-s", type=float, default=1800.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default="benchmarks/out/sim_change")
    p.add_argument("--floors", action="store_true",
                   help="every case as the scheduler ran before 2026-12-05: --surge-floors --device-headroom 0 "
                        "(surges held as each session's floor, no spares pooled on a headroom)")
    p.add_argument("--device-headroom", type=float, metavar="H",
                   help="the scheduler's --device-headroom in every case (default: its own default)")
    p.add_argument("--spare-overbook", type=float, metavar="F",
                   help="the scheduler's --spare-overbook in every case (default: its own default)")
    p.add_argument("--burst-sigma", type=float, metavar="Z",
                   help="the scheduler's --burst-sigma in every case: each GPU's room for its sessions' pooled "
                        "Poisson burst (default: its own default)")
    p.add_argument("--known-rates-ahead-s", type=non_negative_seconds, metavar="S",
                   help="the trace's cases plan for the trace's true mean rates, known S seconds ahead, "
                        "instead of the measured ones (what measuring them costs)")
    add_smoke(p, devices=4, steady_s=60.0)
    args = parse_args(p, argv)
    out = pathlib.Path(args.out) / f"d{args.devices}"
    out.mkdir(parents=True, exist_ok=True)
    n = args.devices
    trace, models = workload(n, args.seed)
    base = RPS_PER_DEVICE * n
    step = f"0:{base},{STEP_UP_S}:{5 * base},{STEP_DOWN_S}:{base}"

    def cfg(fixed: bool, faults=()) -> SimConfig:
        return config(n, args.seed, fixed, faults, floors=args.floors, device_headroom=args.device_headroom,
                      spare_overbook=args.spare_overbook, burst_sigma=args.burst_sigma)

    steps = [(LEAD_S + STEP_UP_S, base, 5 * base), (LEAD_S + STEP_DOWN_S, 5 * base, base)]
    cases = args.cases.split(",")
    rows: list[dict] = []
    start_s = SimConfig().backend_start_s
    print(f"{n} devices, {len(models)} models, {base:g} -> {5 * base:g} -> {base:g} rps; "
          f"CPU {_cpu()}, load average {os.getloadavg()[0]:.2f}", flush=True)
    if "step_auto" in cases:
        sim, r = run("step_auto", models, arrivals(trace, step, END_S, args.seed),
                     cfg(False), steps, out, known_rates(trace, step, args.known_rates_ahead_s))
        trace_targets(rows, "step_auto", r)
        after = windows(r, LEAD_S + STEP_UP_S + start_s + 2, LEAD_S + STEP_DOWN_S)
        target(rows, "step_auto", f"worst 1 s window from S + 2 s after the step (S = {start_s:g} s)",
               min(after), ">= 0.99", min(after) >= 0.99)
        ps = r["per_second"]
        bound_after = max(ps["lower_bound"][int(LEAD_S + STEP_DOWN_S):] or [0])
        back = next((t for t, b in zip(ps["time_s"], ps["backends"])
                     if t >= LEAD_S + STEP_DOWN_S and b <= max(bound_after, n // 10)), None)
        took = None if back is None else back - (LEAD_S + STEP_DOWN_S)
        target(rows, "step_auto", f"seconds after the step down to the bound's {max(bound_after, n // 10)} devices",
               took, f"<= {COOLDOWN_S + 30:g}", took is not None and took <= COOLDOWN_S + 30)
        lost_targets(rows, "step_auto", r)
    if "ramp_auto" in cases:
        ramp = (f"0:{base},{STEP_UP_S}:{base},{STEP_UP_S + RAMP_S}~{5 * base},{STEP_DOWN_S}:{5 * base},"
                f"{STEP_DOWN_S + RAMP_S}~{base}")
        sim, r = run("ramp_auto", models, arrivals(trace, ramp, END_S, args.seed),
                     cfg(False), [], out, known_rates(trace, ramp, args.known_rates_ahead_s))
        trace_targets(rows, "ramp_auto", r)
        w = windows(r, LEAD_S + STEP_UP_S, LEAD_S + STEP_DOWN_S)
        target(rows, "ramp_auto", "worst 1 s window from the ramp up to the ramp down", min(w), ">= 0.99",
               min(w) >= 0.99)
        lost_targets(rows, "ramp_auto", r)
    if "step_idle" in cases:
        sim, r = run("step_idle", models, arrivals(trace, step, END_S, args.seed),
                     cfg(True), steps, out, known_rates(trace, step, args.known_rates_ahead_s))
        w = windows(r, LEAD_S, LEAD_S + END_S)
        target(rows, "step_idle", "worst 1 s window, every device registered", min(w), ">= 0.99", min(w) >= 0.99)
        target(rows, "step_idle", "within SLO over the trace", r["within_slo"], ">= 0.999", r["within_slo"] >= 0.999)
    if "steady" in cases:
        sim, r = run("steady", models, arrivals(trace, f"0:{2.5 * base}", args.steady_s, args.seed, cv=False),
                     cfg(False), [], out)
        turns = reversals(sim)
        per10 = max([sum(1 for t in turns if w <= t < w + 600) for w in range(0, int(args.steady_s), 60)] or [0])
        target(rows, "steady", "scale reversals in any 10 minutes (Poisson, constant)", per10, "<= 1", per10 <= 1)
    if "kill" in cases:
        at = LEAD_S + 30.0
        fault = Fault(FaultKind.KILL_BACKENDS, at, count=max(1, n // 10))
        sim, r = run("kill", models, arrivals(trace, f"0:{5 * base}", 60.0, args.seed, cv=False),
                     cfg(True, [fault]), [], out)
        failed = missed_share(r, at - 10, LEAD_S + 60.0)
        target(rows, "kill", "requests not within SLO from 10 s before the kill (10% of devices killed at peak)",
               round(failed, 5), "<= 0.001", failed <= 0.001)
        ps = r["per_second"]
        back = next((t for t in range(int(at), len(ps["time_s"]))
                     if all((a is None or a >= 0.99) for a in ps["within_slo"][t:t + 5])), None)
        took = None if back is None else back - int(at)
        target(rows, "kill", "seconds until every window is at 99% again", took, "<= 5", took is not None and took <= 5)
    if "stall" in cases:
        at = LEAD_S + 30.0
        fault = Fault(FaultKind.STALL_SCHEDULER, at, duration_s=10.0)
        sim, r = run("stall", models, arrivals(trace, f"0:{5 * base}", 60.0, args.seed, cv=False),
                     cfg(True, [fault]), [], out)
        # missed heartbeats, or a stream its keepalive ended at the resume (nexus/simulate/control.py)
        evicted = [e for e in sim.events if e["kind"] == "membership" and " removed: " in e["text"]]
        target(rows, "stall", "nodes evicted by a 10 s scheduler stall", len(evicted), "0", not evicted)
        before, during = windows(r, at - 10, at), windows(r, at, at + 20)
        target(rows, "stall", "worst second of the stall and the 10 s after it against the worst of the ten before",
               f"{min(during)} vs {min(before)}", ">= the ten before", min(during) >= min(before))
    (out / "targets.json").write_text(json.dumps(rows, indent=1))


def _cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
