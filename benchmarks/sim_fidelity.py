"""Fidelity of ``nexus simulate``, measured (issue 23 item 4): one trace on real processes and in the
simulator, side by side.

1. **The trace.** 24 models (``harness.elastic.zipf_models``: Zipf shares, Gamma arrivals of CV
   1-4, emulated-T4 profiles l(b) = 2-6 ms + 10-20 ms per item, SLOs of 300-500 ms), a total rate of
   ``--base-rps``, then 5x, then back down. The models file (``nexus simulate``'s MODELS.json) and
   the planned arrivals are written to ``--out``.
2. **The real run.** ``nexus serve --no-samples --device emulated:t4 --backends auto`` on loopback,
   the models uploaded with their profiles, the trace sent by one open-loop client
   (``harness.elastic.run_trace``). Recorded: every request's send time (the client's clock),
   status and latency; the cluster every 0.5 s (``ClusterSampler``: backend processes, desired,
   registered); the scheduler's and ``nexus serve``'s log lines at ``--log-level info`` with their
   times (``LogTail``; the components' own ``asctime`` where a line has one).
3. **The simulation.** The very send times of the real client are the simulator's trace (so both
   sides see the same requests, the client's lag included), shifted by ``LEAD_S`` of silence so that
   the simulated cluster, which starts cold, has settled as the real one had when its trace began.
   The same flags (``--min-backends``, ``--max-backends``, ``--scale-down-cooldown-s``); the
   simulator's time parameters from what the real run measured where it can (``measure_params``):
   ``backend_start_s`` (a backend added to its registration, from the logs), ``path_ms`` (a
   request's time outside the device: the fastest answers less l(1)), and the two parameters of a
   plan's way to the frontends: ``model_load_s`` and ``planning_ms`` from a line fitted to the real
   plans' delay from 'epoch E: re-planned' to the frontend's 'routing epoch E' against the most
   sessions new to one backend (:func:`fit_distribution`: the slope is the time per model loaded,
   the intercept less three control hops the fixed part, which the simulator has only
   ``planning_ms`` for). ``control_hop_ms`` and ``jitter_cv`` keep their defaults (not measurable
   from outside; see benchmarks/sim_fidelity.md). ``plan_cluster`` is timed here too, for reference.
4. **The comparison**: attainment (tolerance 0.5 points), device-seconds over the trace (10%), and
   every scaling decision (backend added, drain begun, re-plan, desired count changed) matched in
   time order between the two sides (:func:`match_decisions`; tolerance 2 s); a table (printed, and
   ``table.md`` in ``--out``) and one plot of both sides (devices, and attainment per second).

    python -m benchmarks.sim_fidelity [--base-rps 40] [--models 24] [--out benchmarks/out/sim_fidelity]
    python -m benchmarks.sim_fidelity --reuse      # the simulation again, on the saved real run

The pure parts (log parsing, decision matching, per-second series, integrals) are in
nexus/simulate/fidelity.py, tested in tests/unit/test_sim_fidelity.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time
from typing import Sequence

import numpy as np

from harness.elastic import integral
from harness.smoke import add_smoke, parse_args
from nexus.simulate.fidelity import (ADDING_LINE, EXIT, KINDS, REGISTERED_LINE, STARTED_LINE, WARMED_LINE,
                                     distribution_delays, fit_distribution, intervals_overlap_s, line_time,
                                     match_decisions, new_sessions_per_plan, per_second, real_decisions,
                                     real_distribution, sim_decisions, within_window)

LEAD_S = 20.0                   # silence before the simulated trace: the simulated cluster settles
TOL_ATTAINMENT_PTS = 0.5
TOL_DEVICE_S = 0.10
TOL_DECISION_S = 2.0
STEP = 5.0
PER_ITEM_MS, FIXED_MS, SLOS_MS = (10.0, 20.0), (2.0, 6.0), (300.0, 400.0, 500.0)


def verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


# ---- the real run -----------------------------------------------------------------------------------


def _log(message: str) -> None:
    print(f"sim_fidelity: {message}", file=sys.stderr, flush=True)


def machine() -> dict:
    model = ""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout
        model = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "")
    except Exception:  # noqa: BLE001
        pass
    return {"cpu_model": model, "cores": os.cpu_count(), "loadavg": pathlib.Path("/proc/loadavg").read_text().split()[:3]}


def top_processes(n: int = 6) -> list[str]:
    try:
        out = subprocess.run(["ps", "aux", "--sort=-%cpu"], capture_output=True, text=True, timeout=5).stdout
        return [line[:200] for line in out.splitlines()[1:n + 1]]
    except Exception:  # noqa: BLE001
        return []


def trace_models(args):
    from harness.elastic import zipf_models

    return zipf_models(args.models, zipf_s=args.zipf, seed=args.seed, per_item_ms=PER_ITEM_MS, fixed_ms=FIXED_MS,
                       slo_ms=SLOS_MS)


def models_json(models) -> dict:
    """``nexus simulate``'s MODELS.json for the trace's models."""
    return {m.name: {"slo_ms": m.slo_ms, "share": m.share, "profile": m.profile.to_json_obj()} for m in models}


def planned_trace(models, steps, seed: int):
    """The arrivals the client is asked to send (as run_trace draws them), as an Arrivals."""
    from common.arrivals import step_arrival_times
    from nexus.simulate.workload import Arrivals

    times, idx = [], []
    for i, m in enumerate(models):
        t = step_arrival_times([(d, r * m.share) for d, r in steps], seed * 1000 + i, cv=m.cv)
        times.append(t)
        idx.append(np.full(len(t), i, np.int32))
    t, k = np.concatenate(times), np.concatenate(idx)
    order = np.argsort(t, kind="stable")
    return Arrivals(t[order], k[order], tuple(m.name for m in models), sum(d for d, _ in steps))


def run_real(args, models, steps, out: pathlib.Path) -> dict:
    """The trace on ``nexus serve``; the raw record (JSON-ready)."""
    import zlib

    from common.sample_models import mlp_small, model_bytes
    from harness.cluster import ServeCluster, Upload
    from harness.elastic import ClusterSampler, LogTail, run_trace
    from harness.meters import loadavg, machine_busy, wait_quiet
    from nexus.bench.report import OK
    from nexus.scheduler_client import fetch_status

    quiet = wait_quiet(args.wait_quiet_s, args.quiet_cores)
    before = {"machine": machine(), "top": top_processes(), "external_busy_cores": quiet["busy_cores"],
              "waited_s": quiet["waited_s"]}
    _log(f"machine before the run: {before}")
    workdir = out / "real"
    workdir.mkdir(parents=True, exist_ok=True)
    flags = ["--no-samples", "--device", "emulated:t4", "--backends", "auto", "--min-backends",
             str(args.min_backends), "--max-backends", str(args.max_backends), "--scale-down-cooldown-s",
             str(args.cooldown_s), "--log-level", "info", *(["--no-measured-profiles"] if not args.measured_profiles
                                                              else [])]
    err = (workdir / "serve.log").open("w")
    cluster = ServeCluster(workdir / "data", *flags, stderr=err)
    try:
        for m in models:
            path, profile = workdir / f"{m.name}.onnx", workdir / f"{m.name}.profile.json"
            path.write_bytes(model_bytes(mlp_small(seed=zlib.crc32(m.name.encode()))))
            profile.write_text(m.profile.to_json())
            cluster.upload(Upload(path, m.name, str(profile), m.slo_ms), wait=False)
        cluster.wait_models_ready([m.name for m in models], 180)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:          # until the policy wants what is registered
            d = fetch_status(cluster.scheduler, creds=cluster.creds).decision("t4")
            if d is not None and d.desired == d.registered:
                break
            time.sleep(0.5)
        time.sleep(args.settle_s)                    # past a cool-down: no scale-down left over from start-up
        sampler = ClusterSampler(lambda: fetch_status(cluster.scheduler, 5.0, cluster.creds), cluster.pid).start()
        tail = LogTail(workdir / "serve.log").start()
        wall_minus_mono = time.time() - time.monotonic()
        busy0, load0 = machine_busy(), loadavg()
        time.sleep(1.0)
        reports = run_trace(cluster.frontend, models, steps, seed=args.seed, grace_ms=1000.0)
        busy1, load1 = machine_busy(), loadavg()
        time.sleep(2.0)
        status = fetch_status(cluster.scheduler, 10.0, cluster.creds)
        samples, lines = sampler.stop(), tail.stop()
    finally:
        cluster.stop()
        err.close()
    t0 = min(r.samples.start_s for r in reports.values())
    names = [m.name for m in models]
    sent, model, good, status_names, latency = [], [], [], [], []
    for i, name in enumerate(names):
        s = reports[name].samples
        sent.append(s.sent_at - t0)
        model.append(np.full(len(s.sent_at), i))
        good.append((s.outcome == OK) & (s.latency_ms <= s.slo_ms))
        status_names += s.statuses()
        latency.append(s.latency_ms)
    order = np.argsort(np.concatenate(sent), kind="stable")
    profiles = {p.model: {"in_use": p.in_use, "table": p.table, "measured": p.measured, "samples": p.samples}
                for p in status.profiles}
    return {
        "flags": flags, "steps": steps, "t0": t0, "wall_minus_mono_s": wall_minus_mono,
        "machine_before": before, "loadavg_start": load0, "loadavg_end": load1,
        "machine_busy_cores": (busy1[0] - busy0[0]) / max(busy1[1] - busy0[1], 1) * (os.cpu_count() or 1),
        "requests": {"sent_s": np.concatenate(sent)[order].tolist(), "model": np.concatenate(model)[order].tolist(),
                     "good": np.concatenate(good)[order].astype(int).tolist(),
                     "status": [status_names[k] for k in order.tolist()],
                     "latency_ms": [None if math.isnan(x) else round(x, 3) for x in np.concatenate(latency)[order]]},
        "client_lag_ms_p99": float(np.percentile(np.concatenate([r.samples.lag_s for r in reports.values()]), 99) * 1000),
        "samples": [{"t": s.t - t0, "processes": s.processes, "registered": s.registered, "desired": s.desired,
                     "plan_devices": s.plan_devices, "lower_bound": s.lower_bound, "cpu_s": s.cpu_s} for s in samples],
        "lines": [(t - t0, line) for t, line in lines],
        "profiles": profiles,
        "machine_after": {"machine": machine(), "top": top_processes()},
    }


# ---- measuring the simulator's parameters -----------------------------------------------------------


def measure_params(real: dict, models) -> dict:
    """The simulator's time parameters from the real run where it tells them (each with its basis)."""
    lines = [(t + real["t0"], line) for t, line in real["lines"]]
    offset = real["wall_minus_mono_s"]
    added, address, registered = {}, {}, {}
    for seen, line in lines:
        t = line_time(seen, line, offset)
        if m := ADDING_LINE.search(line):
            added[m.group(1)] = t
        elif m := STARTED_LINE.search(line):
            address[m.group(2)] = m.group(1)
        elif m := REGISTERED_LINE.search(line):
            registered.setdefault(m.group(2), t)
    starts = sorted(registered[a] - added[b] for a, b in address.items() if a in registered and b in added)
    warm = [int(m.group(2)) / 1000.0 for _, line in lines if "warmed up" in line
            for m in WARMED_LINE.finditer(line)]
    req = real["requests"]
    lat = np.array([np.nan if x is None else x for x in req["latency_ms"]])
    idx = np.array(req["model"])
    outside = []
    for i, m in enumerate(models):
        mine = lat[(idx == i) & ~np.isnan(lat)]
        if mine.size:
            outside.append(float(np.percentile(mine, 1)) - m.profile.latency_ms(1))
    trace_lines = [(t, line) for t, line in lines if t >= real["t0"]]
    per_plan = new_sessions_per_plan(trace_lines, offset)
    fit = fit_distribution(per_plan)
    ratios = []
    for p in real["profiles"].values():
        table, measured = dict(map(tuple, p["table"])), dict(map(tuple, p["measured"]))
        ratios += [measured[b] / table[b] for b in measured if b in table and table[b] > 0]
    out = {
        "backend_start_s": {"value": float(np.median(starts)) if starts else None, "n": len(starts),
                            "all": [round(x, 3) for x in starts],
                            "basis": "'adding backend-N' (nexus serve) to the scheduler's 're-plan requested: ... "
                                     "registered at ADDR' for the address that backend printed"},
        "model_load_s": {"value": fit[1] if fit else None, "n": len(per_plan),
                         "basis": "slope of a plan's way to the frontends ('epoch E: re-planned' to the frontend's "
                                  "'routing epoch E') over the most sessions new to one backend in it (fit_distribution)"},
        "distribution_fixed_s": {"value": fit[0] if fit else None,
                                 "by_new_sessions": {str(n): [len(ds), float(np.median(ds))] for n in
                                                     sorted({n for n, _ in per_plan})
                                                     for ds in [[d for k, d in per_plan if k == n]]},
                                 "basis": "intercept of that fit: the simulator's planning_ms plus three control hops"},
        "warmup_s": {"median": float(np.median(warm)) if warm else None, "n": len(warm),
                     "p90": float(np.percentile(warm, 90)) if warm else None,
                     "basis": "the backends' 'warmed up SESSION (N batches, MS ms)' lines: the warm-up batches' own "
                              "time, without the wait for the busy device or the runtime's creation"},
        "path_ms": {"value": max(0.0, float(np.median(outside))) if outside else None, "n": len(outside),
                    "basis": "per model, the 1st percentile of the client's latency less l(1); median over models"},
        "measured_over_table": {"median": float(np.median(ratios)) if ratios else None,
                                "p90": float(np.percentile(ratios, 90)) if ratios else None, "n": len(ratios),
                                "basis": "the scheduler's measured l(b) over the table's (not a simulator parameter:"
                                         " the simulated device runs l(b) with mean 1 jitter)"},
    }
    return out


# ---- the simulation ---------------------------------------------------------------------------------


def sim_config(args, params: dict):
    from common.config import SchedulerConfig
    from common.emulated_gpus import GPU_TYPES
    from nexus.simulate.config import SimConfig

    scheduler = SchedulerConfig(scale_down_cooldown_s=args.cooldown_s, min_devices=f"t4={args.min_backends}",
                                max_devices=f"t4={args.max_backends}", measured_profiles=args.measured_profiles)
    return SimConfig(device_type="t4", memory_mb=GPU_TYPES["t4"].memory_mb, backends=None,
                     min_backends=args.min_backends, max_backends=args.max_backends, seed=args.seed,
                     scheduler=scheduler, **params)


def run_sim(models, real: dict, config, duration_s: float) -> dict:
    """The simulator on the real client's send times (shifted by LEAD_S); raw record, and how long
    each plan_cluster call took here."""
    import nexus.simulate.control as control
    from nexus.simulate.models import SimModel
    from nexus.simulate.outcomes import Status
    from nexus.simulate.run import Simulation
    from nexus.simulate.workload import Arrivals

    req = real["requests"]
    times = np.array(req["sent_s"]) + LEAD_S
    sim_models = tuple(SimModel(m.name, m.slo_ms, m.share, m.profile) for m in models)
    arrivals = Arrivals(np.maximum(times, 0.0), np.array(req["model"], np.int32), tuple(m.name for m in models),
                        LEAD_S + max(duration_s, float(times.max()) - LEAD_S + 1e-3))
    plan_ms: list[float] = []             # plan_cluster calls that made a new plan (the others cost no push)
    original = control.plan_cluster
    last = [None]

    def timed(*a, **k):
        t = time.perf_counter()
        result = original(*a, **k)
        if result[0] is not last[0]:
            plan_ms.append((time.perf_counter() - t) * 1000)
        last[0] = result[0]
        return result

    import nexus.simulate.frontends as frontends

    routed: list[tuple[float, int]] = []
    set_table = frontends.SimFrontend.set_table

    def recorded(self, now, epoch, table):
        routed.append((now, epoch))
        return set_table(self, now, epoch, table)

    control.plan_cluster = timed
    frontends.SimFrontend.set_table = recorded
    try:
        sim = Simulation(sim_models, arrivals, config)
        cpu = time.process_time()
        sim.run()
        cpu = time.process_time() - cpu
    finally:
        control.plan_cluster = original
        frontends.SimFrontend.set_table = set_table
    planned = [(e["time_s"], int(m.group(1))) for e in sim.events if e["kind"] == "plan"
               and (m := re.match(r"epoch (\d+):", e["text"]))]
    delays = distribution_delays(planned, routed)
    distribution = [(t - LEAD_S, d) for (t, _), d in zip([p for p in planned if p[1] in {e for _, e in routed}],
                                                          delays)]
    status = sim.outcomes.status
    return {
        "good": (status == Status.ON_TIME).astype(int).tolist(),
        "status": {s.name.lower(): int(np.sum(status == s)) for s in Status if s is not Status.PENDING},
        "latency_ms": sim.outcomes.latency_ms,
        "backends": [(b.node_id, b.started_s - LEAD_S, None if b.ended_s is None else b.ended_s - LEAD_S)
                     for b in sim.backends.values()],
        "samples": [{"t": s.time_s - LEAD_S, "backends": s.backends, "registered": s.registered,
                     "desired": s.desired, "plan_devices": s.plan_devices} for s in sim.samples],
        "events": sim.events,
        "plan_ms": plan_ms,
        "distribution": distribution,
        "cpu_s": cpu,
    }


# ---- comparison ------------------------------------------------------------------------------------


def compare(real: dict, sim: dict, duration_s: float, models) -> dict:
    req = real["requests"]
    real_good = np.array(req["good"], bool)
    sim_good = np.array(sim["good"], bool)
    sent = np.array(req["sent_s"])
    seconds = int(math.ceil(duration_s))
    s = real["samples"]
    real_dev_s = integral([x["t"] for x in s], [x["processes"] for x in s], 0.0, duration_s)
    sim_dev_s = intervals_overlap_s([(a, b) for _, a, b in sim["backends"]], 0.0, duration_s)
    rd = within_window(real_decisions([(t + real["t0"], line) for t, line in real["lines"]], real["t0"],
                                      real["wall_minus_mono_s"]), 0.0, duration_s)
    sd = within_window(sim_decisions(sim["events"], LEAD_S), 0.0, duration_s)
    matches = match_decisions(rd, sd)
    real_dist = [d for t, d in real_distribution([(t + real["t0"], line) for t, line in real["lines"]],
                                                 real["wall_minus_mono_s"]) if 0 <= t - real["t0"] < duration_s]
    sim_dist = [d for t, d in sim["distribution"] if 0 <= t < duration_s]

    def spread(xs):
        return {"n": len(xs), "median": float(np.median(xs)) if xs else None,
                "p90": float(np.percentile(xs, 90)) if xs else None, "max": max(xs) if xs else None}

    phases = []
    steps = real["steps"]
    a = 0.0
    for k, (d, rate) in enumerate(steps):
        b = a + d if k + 1 < len(steps) else math.inf
        m = (sent >= a) & (sent < b)
        phases.append({"phase": f"{a:g}-{a + d:g} s at {rate:g} rps", "requests": int(m.sum()),
                       "real": float(real_good[m].mean()) if m.any() else None,
                       "sim": float(sim_good[m].mean()) if m.any() else None})
        a += d
    model = np.array(req["model"])
    per_model = {}
    for i, m in enumerate(models):
        mine = model == i
        if mine.any():
            per_model[m.name] = {"requests": int(mine.sum()), "real": float(real_good[mine].mean()),
                                 "sim": float(sim_good[mine].mean())}
    real_statuses: dict[str, int] = {}
    for x in req["status"]:
        real_statuses[x] = real_statuses.get(x, 0) + 1
    kinds = {}
    for kind in (*KINDS, EXIT):
        ms = [p for p in matches if p.kind == kind]
        paired = [p for p in ms if p.dt_s is not None]
        kinds[kind] = {"real": sum(1 for p in ms if p.real), "sim": sum(1 for p in ms if p.sim),
                       "paired": len(paired), "within_2s": sum(1 for p in paired if p.within(TOL_DECISION_S)),
                       "median_abs_dt_s": float(np.median([abs(p.dt_s) for p in paired])) if paired else None}
    return {
        "requests": int(len(sent)),
        "within_slo": {"real": float(real_good.mean()), "sim": float(sim_good.mean()),
                       "diff_pts": 100 * float(sim_good.mean() - real_good.mean())},
        "both_agree_per_request": float((real_good == sim_good).mean()),
        "device_s": {"real": real_dev_s, "sim": sim_dev_s, "ratio": sim_dev_s / real_dev_s if real_dev_s else None},
        "phases": phases, "per_model": per_model,
        "statuses": {"real": dict(sorted(real_statuses.items())), "sim": sim["status"]},
        "decision_kinds": kinds,
        "distribution_s": {"real": spread(real_dist), "sim": spread(sim_dist)},
        "matches": [{"kind": p.kind, "real_s": None if p.real is None else round(p.real.time_s, 2),
                     "sim_s": None if p.sim is None else round(p.sim.time_s, 2),
                     "dt_s": None if p.dt_s is None else round(p.dt_s, 2),
                     "value": (p.real or p.sim).value,
                     "real_text": None if p.real is None else p.real.text[:160],
                     "sim_text": None if p.sim is None else p.sim.text[:160]} for p in matches],
        "per_second": {"real": per_second(sent, real_good, seconds), "sim": per_second(sent, sim_good, seconds)},
        "met": {"attainment": abs(100 * (sim_good.mean() - real_good.mean())) <= TOL_ATTAINMENT_PTS,
                "device_s": bool(real_dev_s) and abs(sim_dev_s / real_dev_s - 1) <= TOL_DEVICE_S,
                "decisions": all(p.within(TOL_DECISION_S) for p in matches if p.kind in KINDS)},
    }


def table(c: dict, label: str) -> str:
    w, d = c["within_slo"], c["device_s"]
    rows = [f"### {label}", "",
            "| metric | real | simulated | difference | tolerance | |", "| --- | --- | --- | --- | --- | --- |",
            f"| within SLO, {c['requests']:,} requests | {100 * w['real']:.2f}% | {100 * w['sim']:.2f}% | "
            f"{w['diff_pts']:+.2f} pts | 0.5 pts | {verdict(c['met']['attainment'])} |"]
    for p in c["phases"]:
        rows.append(f"| ... {p['phase']} ({p['requests']:,}) | {100 * p['real']:.2f}% | {100 * p['sim']:.2f}% | "
                    f"{100 * (p['sim'] - p['real']):+.2f} pts | | |")
    rows.append(f"| device-seconds over the trace | {d['real']:.0f} | {d['sim']:.0f} | {100 * (d['ratio'] - 1):+.1f}% | "
                f"10% | {verdict(c['met']['device_s'])} |")
    for kind, k in c["decision_kinds"].items():
        dt = "" if k["median_abs_dt_s"] is None else f"median \\|dt\\| {k['median_abs_dt_s']:.1f} s"
        what = "drained backends' exits (not a decision)" if kind == EXIT else f"decisions '{kind}'"
        rows.append(f"| {what}: count; paired; within 2 s | {k['real']} | {k['sim']} | "
                    f"{k['paired']} paired, {k['within_2s']} within 2 s; {dt} | 2 s | "
                    f"{verdict(k['real'] == k['sim'] == k['within_2s'])} |")
    dr, ds = c["distribution_s"]["real"], c["distribution_s"]["sim"]
    if dr["n"] and ds["n"]:
        rows.append(f"| a plan's way to the frontends (re-planned to routing table), median / p90 / max | "
                    f"{dr['median']:.2f} / {dr['p90']:.2f} / {dr['max']:.2f} s ({dr['n']}) | "
                    f"{ds['median']:.2f} / {ds['p90']:.2f} / {ds['max']:.2f} s ({ds['n']}) | | | |")
    rows += ["", f"requests both sides called the same (within SLO or not): {100 * c['both_agree_per_request']:.2f}%",
             f"statuses, real: {c['statuses']['real']}", f"statuses, simulated: {c['statuses']['sim']}", "",
             "| kind | real (s) | simulated (s) | sim - real (s) | value | real log | simulated |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for m in c["matches"]:
        fmt = lambda x: "-" if x is None else f"{x:.1f}"   # noqa: E731
        txt = lambda x: "" if x is None else x.replace("|", "/")[:90]   # noqa: E731
        rows.append(f"| {m['kind']} | {fmt(m['real_s'])} | {fmt(m['sim_s'])} | "
                    f"{'-' if m['dt_s'] is None else format(m['dt_s'], '+.1f')} | {m['value'] if m['kind'] == 'desired' else ''} | "
                    f"{txt(m['real_text'])} | {txt(m['sim_text'])} |")
    return "\n".join(rows) + "\n"


def write_plot(path: pathlib.Path, real: dict, sims: Sequence[tuple[str, dict, dict]], duration_s: float,
               title: str) -> None:
    """Devices over time on both sides (top) and attainment per second (bottom), with the scaling
    decisions marked."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 7.5), layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[1, 1])
    s = real["samples"]
    ts = [x["t"] for x in s]
    top.step(ts, [x["processes"] for x in s], where="post", color="black", lw=1.8, label="real: backend processes")
    top.step(ts, [x["desired"] for x in s], where="post", color="black", lw=1, ls=":", label="real: desired")
    colours = ("tab:orange", "tab:blue", "tab:green")
    for (label, sim, _), colour in zip(sims, colours):
        ss = sim["samples"]
        top.step([x["t"] for x in ss], [x["backends"] for x in ss], where="post", color=colour, lw=1.4,
                 label=f"{label}: backends")
        top.step([x["t"] for x in ss], [x["desired"] for x in ss], where="post", color=colour, lw=1, ls=":",
                 label=f"{label}: desired")
    top.set_ylabel("devices")
    top.set_xlim(-2, duration_s + 2)
    top.set_ylim(bottom=0)
    top.legend(loc="upper right", fontsize=8)
    top.set_title(title, fontsize=10)
    demand = top.twinx()
    edges = np.arange(0.0, math.ceil(duration_s) + 1.0)
    counts, _ = np.histogram(real["requests"]["sent_s"], bins=edges)
    demand.plot(edges[:-1] + 0.5, counts, color="tab:gray", alpha=0.35, lw=0.8)
    demand.set_ylabel("requests sent per second", color="tab:gray")
    first = sims[0][2]
    t = np.arange(len(first["per_second"]["real"])) + 0.5
    pct = lambda xs: [np.nan if x is None else 100 * x for x in xs]   # noqa: E731
    bottom.plot(t, pct(first["per_second"]["real"]), color="black", lw=1.4, label="real")
    for (label, _, c), colour in zip(sims, colours):
        bottom.plot(t, pct(c["per_second"]["sim"]), color=colour, lw=1.1, label=label)
    for m in first["matches"]:
        if m["kind"] in ("add", "remove"):
            colour = "tab:red" if m["kind"] == "add" else "tab:purple"
            if m["real_s"] is not None:
                bottom.axvline(m["real_s"], color=colour, lw=0.8, alpha=0.8)
            if m["sim_s"] is not None:
                bottom.axvline(m["sim_s"], color=colour, lw=0.8, ls="--", alpha=0.8)
    bottom.axhline(99, color="black", lw=0.5, ls="--")
    bottom.set_ylabel("% within SLO (per second sent)")
    bottom.set_xlabel("seconds from the trace's start (vertical lines: backends added (red) and drained (purple); "
                      "solid real, dashed simulated)")
    bottom.set_ylim(0, 101)
    bottom.legend(loc="lower right", fontsize=8)
    fig.savefig(path, dpi=110)


# ---- main -------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    from nexus.simulate.config import TIME_PARAMETERS, SimConfig

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-rps", type=float, default=40.0, help="total rate before and after the 5x step")
    p.add_argument("--models", type=int, default=24)
    p.add_argument("--zipf", type=float, default=1.0)
    p.add_argument("--warm-s", type=float, default=40.0)
    p.add_argument("--high-s", type=float, default=40.0)
    p.add_argument("--low-s", type=float, default=60.0)
    p.add_argument("--cooldown-s", type=float, default=10.0, help="--scale-down-cooldown-s on both sides")
    p.add_argument("--min-backends", type=int, default=1)
    p.add_argument("--max-backends", type=int, default=12)
    p.add_argument("--measured-profiles", action="store_true",
                   help="let the real scheduler plan with measured profiles (the simulator never does)")
    p.add_argument("--settle-s", type=float, default=12.0, help="wait after start-up before the trace (> cool-down)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--wait-quiet-s", type=float, default=300.0)
    p.add_argument("--quiet-cores", type=float, default=0.5)
    p.add_argument("--reuse", action="store_true", help="reuse the saved real run; simulate again")
    p.add_argument("--out", default="benchmarks/out/sim_fidelity")
    p.add_argument("--plot", default="benchmarks/sim_fidelity.png")
    for name in TIME_PARAMETERS:
        p.add_argument("--" + name.replace("_", "-"), type=float, default=None,
                       help="override the measured (or default) simulator parameter")
    add_smoke(p, base_rps=10.0, models=3, warm_s=1.0, high_s=1.0, low_s=1.0, cooldown_s=1.0, max_backends=3,
              settle_s=1.5, wait_quiet_s=0.0)
    args = parse_args(p, argv)
    out = pathlib.Path(args.out)
    models = trace_models(args)
    base = args.base_rps
    steps = [(args.warm_s, base), (args.high_s, STEP * base), (args.low_s, base)]
    duration = sum(d for d, _ in steps)
    real_path = out / "real.json"
    if args.reuse:
        real = json.loads(real_path.read_text())
    else:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        from nexus.simulate.workload import write_trace

        (out / "models.json").write_text(json.dumps(models_json(models), indent=1, sort_keys=True))
        write_trace(planned_trace(models, steps, args.seed), out / "trace.planned.csv")
        real = run_real(args, models, steps, out)
        real_path.write_text(json.dumps(real, default=float))
    from nexus.simulate.workload import Arrivals, write_trace

    req = real["requests"]
    sent_arrivals = Arrivals(np.array(req["sent_s"]) + LEAD_S, np.array(req["model"], np.int32),
                             tuple(m.name for m in models), LEAD_S + max(duration, max(req["sent_s"]) + 1e-3))
    write_trace(sent_arrivals, out / "trace.sent.csv")
    measured = measure_params(real, models)
    defaults = SimConfig()
    base_params = {k: getattr(defaults, k) for k in TIME_PARAMETERS}
    # first a simulation with the defaults (and plan_cluster timed here), then with what was measured
    sim_default = run_sim(models, real, sim_config(args, base_params), duration)
    params = dict(base_params)
    for key in ("backend_start_s", "path_ms"):
        if measured[key]["value"] is not None:
            params[key] = round(measured[key]["value"], 4)
    # The simulated device runs the warm-up batches, so a model's load is the fitted slope less the
    # warm-up's own time; planning is plan_cluster as timed here, and a table's fixed cost the rest of
    # the fitted intercept (less three control hops).
    if sim_default["plan_ms"]:
        params["planning_ms"] = round(float(np.median(sim_default["plan_ms"])), 1)
    warmup_s = measured["warmup_s"]["median"] or 0.0
    if measured["model_load_s"]["value"] is not None:
        params["model_load_s"] = round(max(0.0, measured["model_load_s"]["value"] - warmup_s), 4)
    if measured["distribution_fixed_s"]["value"] is not None:
        params["table_update_ms"] = round(max(0.0, measured["distribution_fixed_s"]["value"] * 1000
                                              - params["planning_ms"] - 3 * params["control_hop_ms"]), 1)
    for key in base_params:
        if getattr(args, key) is not None:
            params[key] = getattr(args, key)
    sim_measured = run_sim(models, real, sim_config(args, params), duration)
    c_default = compare(real, sim_default, duration, models)
    c_measured = compare(real, sim_measured, duration, models)
    loads = (real["loadavg_start"], real["loadavg_end"])
    mach = real["machine_before"]["machine"]
    header = (f"machine: {mach['cpu_model']}, {mach['cores']} cores; load average at the trace's start and end "
              f"{loads[0]:.2f} / {loads[1]:.2f}" + (" (**above 1.5**)" if max(loads) > 1.5 else "")
              + f"; other processes' cores before: {real['machine_before']['external_busy_cores']}; whole machine "
              f"busy during the trace {real['machine_busy_cores']:.2f} cores; client lag p99 "
              f"{real['client_lag_ms_p99']:.1f} ms\n")
    text = (header + "\nsimulator parameters (measured where possible): "
            + json.dumps(params) + "\n\n" + table(c_measured, "simulated with the measured parameters")
            + "\n" + table(c_default, "simulated with the defaults of nexus/simulate/config.py"))
    print(text)
    (out / "table.md").write_text(text)
    write_plot(pathlib.Path(args.plot), real, [("simulated, measured parameters", sim_measured, c_measured),
                                               ("simulated, defaults", sim_default, c_default)], duration,
               f"{len(models)} models, {base:g} -> {STEP * base:g} -> {base:g} rps; within SLO: real "
               f"{100 * c_measured['within_slo']['real']:.2f}%, simulated {100 * c_measured['within_slo']['sim']:.2f}%"
               f"; device-s real {c_measured['device_s']['real']:.0f}, simulated {c_measured['device_s']['sim']:.0f}; "
               f"load avg {loads[0]:.2f}-{loads[1]:.2f}")
    options = {k: v for k, v in vars(args).items() if not k.startswith("_")}   # not add_smoke's own
    result = {"args": options, "params": params, "params_default": base_params, "measured": measured,
              "plan_ms_here": {"median": float(np.median(sim_default["plan_ms"])) if sim_default["plan_ms"] else None,
                               "p90": float(np.percentile(sim_default["plan_ms"], 90)) if sim_default["plan_ms"] else None,
                               "n": len(sim_default["plan_ms"])},
              "sim_cpu_s": sim_measured["cpu_s"], "machine": real["machine_before"], "machine_after": real["machine_after"],
              "loadavg": loads, "compare_measured": c_measured, "compare_default": c_default}
    (out / "result.json").write_text(json.dumps(result, indent=1, default=float))
    _log(f"wrote {out / 'table.md'}, {out / 'result.json'}, {args.plot}")
    if args.smoke and not args.reuse:    # a smoke run covers --reuse too, on the real run it just saved
        return main([*(sys.argv[1:] if argv is None else argv), "--reuse", "--out", args.out, "--plot", args.plot])
    return 0


if __name__ == "__main__":
    sys.exit(main())
