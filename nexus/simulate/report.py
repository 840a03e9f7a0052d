"""What a simulation found, as one JSON-ready value (:func:`summarize`) and a text summary (:func:`text`).

The JSON holds at least the contract's ``requests``, ``within_slo`` (a fraction), ``failed``,
``device_seconds`` and ``lower_bound_device_seconds``, and beside them: the outcome counts, latency
percentiles, per-model results, requests lost to faults and to scale-down, the recovery after each
rate step, every plan, scaling decision, actuator action, membership change and fault with its time
and reason, and the per-second series (arrivals, attainment, devices, the plan's, the bound's).
Floats are rounded to 6 decimals and keys sorted, so the same run gives the same bytes.

The lower bound is the planner's certified bound (globalsched/planning/algorithms/lower_bound.py) on the
demand each ``BOUND_WINDOW_S`` window of arrivals brings (its counts over the window's length),
integrated over time: no plan of any scaling policy serves that demand with fewer device-seconds,
whatever its reaction time.
"""

from __future__ import annotations

import json
import math
from typing import Sequence

import numpy as np

from globalsched.planning.plan import GpuSpec, SessionSpec
from globalsched.planning.algorithms.lower_bound import lower_bound
from globalsched.planning.cluster_values import UNBOUNDED_MEMORY_MB
from globalsched.planning.planner import PlannerSettings
from nexus.simulate.outcomes import FAILED, Loss, Status
from nexus.simulate.run import Simulation

BOUND_WINDOW_S = 10.0
RECOVERED_ATTAINMENT = 0.99      # a second at or above this is recovered...
RECOVERED_FOR_S = 5              # ...when this many seconds in a row are


def _r(x: float) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else round(float(x), 6)


def _percentile(values: np.ndarray, q: float) -> float | None:
    return _r(float(np.percentile(values, q))) if values.size else None


def lower_bound_series(sim: Simulation) -> list[tuple[float, int]]:
    """(window start, devices) of the bound on each window's demand (module docstring)."""
    config = sim.config
    planner = PlannerSettings.from_config(config.scheduler).planner
    gpu = GpuSpec(config.device_type, config.memory_mb or UNBOUNDED_MEMORY_MB)
    by_name = {m.name: m for m in sim.models}
    times, models = sim.arrivals.times_s, sim.arrivals.models
    windows = max(1, math.ceil(sim.arrivals.duration_s / BOUND_WINDOW_S))
    index = np.minimum((times // BOUND_WINDOW_S).astype(np.int64), windows - 1)
    counts = np.zeros((windows, len(sim.arrivals.names)), dtype=np.int64)
    np.add.at(counts, (index, models), 1)
    out = []
    for w in range(windows):
        length = min(BOUND_WINDOW_S, sim.arrivals.duration_s - w * BOUND_WINDOW_S) or BOUND_WINDOW_S
        specs = [SessionSpec(name, name, by_name[name].slo_ms, counts[w, j] / length, by_name[name].profile)
                 for j, name in enumerate(sim.arrivals.names) if counts[w, j] > 0]
        # without the memory term: a fleet that pages models in need not hold every model requested
        # in the window at once (globalsched/planning/residency.py)
        out.append((w * BOUND_WINDOW_S, lower_bound(specs, gpu, planner, memory_term=False) if specs else 0))
    return out


def recovery(per_second: Sequence[float | None], step_s: float) -> float | None:
    """Seconds from ``step_s`` until attainment stays at or above RECOVERED_ATTAINMENT for
    RECOVERED_FOR_S seconds in a row (0 when it never fell below); None when it never does."""
    start = int(step_s)
    run = 0
    for s in range(start, len(per_second)):
        a = per_second[s]
        if a is None or a >= RECOVERED_ATTAINMENT:
            run += 1
            if run >= RECOVERED_FOR_S:
                return float(max(0, s - RECOVERED_FOR_S + 1 - start))
        else:
            run = 0
    return None


def summarize(sim: Simulation, steps: Sequence[tuple[float, float, float]] = (), inputs: dict | None = None) -> dict:
    """The run's results (module docstring); ``steps``: (time, rate before, rate after) of the
    schedule's changes, whose recovery is reported."""
    status, latency = sim.outcomes.status, sim.outcomes.latency_ms
    n = int(status.size)
    counts = {s: int(np.sum(status == s)) for s in Status if s is not Status.PENDING}
    failed = sum(counts[s] for s in FAILED)
    answered = (status == Status.ON_TIME) | (status == Status.LATE)
    lost = sim.outcomes.loss
    failed_mask = np.isin(status, [int(s) for s in FAILED])
    duration = sim.arrivals.duration_s
    seconds = max(1, math.ceil(duration))
    second = np.minimum(sim.arrivals.times_s.astype(np.int64), seconds - 1) if n else np.zeros(0, np.int64)
    arrivals_ps = np.bincount(second, minlength=seconds)
    on_time_ps = np.bincount(second[status == Status.ON_TIME], minlength=seconds)
    attainment = [(_r(o / a) if a else None) for o, a in zip(on_time_ps.tolist(), arrivals_ps.tolist())]
    bounds = lower_bound_series(sim) if n else []
    bound_ps = [0] * seconds
    for start, devices in bounds:
        for s in range(int(start), min(seconds, int(start + BOUND_WINDOW_S))):
            bound_ps[s] = devices
    device_seconds = sum(b.device_seconds(duration) for b in sim.backends.values())
    bound_seconds = sum(d * min(BOUND_WINDOW_S, duration - start) for start, d in bounds)
    samples = [s for s in sim.samples if s.time_s < seconds]
    per_model = _per_model(sim, status, latency, answered)
    return {
        "inputs": inputs or {},
        "requests": n,
        "within_slo": _r(counts[Status.ON_TIME] / n) if n else None,
        "failed": failed,
        "outcomes": {s.name.lower(): c for s, c in counts.items()},
        "latency_ms": {"p50": _percentile(latency[answered], 50), "p99": _percentile(latency[answered], 99)},
        "lost_to_faults": int(np.sum(failed_mask & (lost == Loss.FAULT))),
        "lost_to_scale_down": int(np.sum(failed_mask & (lost == Loss.SCALE_DOWN))),
        "lost_to_eviction": int(np.sum(failed_mask & (lost == Loss.EVICTED))),
        "cold": _cold(sim, status, latency, answered, failed_mask),
        "device_seconds": _r(device_seconds),
        "lower_bound_device_seconds": _r(bound_seconds),
        "device_seconds_over_bound": _r(device_seconds / bound_seconds) if bound_seconds else None,
        "duration_s": _r(duration),
        "backends_started": len(sim.backends),
        "plans": sum(1 for e in sim.events if e["kind"] == "plan"),
        "recovery": [{"at_s": _r(t), "from_rps": _r(a), "to_rps": _r(b),
                      "recovered_after_s": recovery(attainment, t)} for t, a, b in steps],
        "worst_second": min(((a, s) for s, a in enumerate(attainment) if a is not None), default=(None, None))[0],
        "seconds_below_99": sum(1 for a in attainment if a is not None and a < RECOVERED_ATTAINMENT),
        "per_model": per_model,
        "decisions": sim.events,
        "per_second": {
            "time_s": list(range(seconds)),
            "arrivals": arrivals_ps.tolist(),
            "within_slo": attainment,
            "backends": [s.backends for s in samples],
            "registered": [s.registered for s in samples],
            "desired": [s.desired for s in samples],
            "plan_devices": [s.plan_devices for s in samples],
            "lower_bound": bound_ps,
        },
    }


def _per_model(sim: Simulation, status: np.ndarray, latency: np.ndarray, answered: np.ndarray) -> dict:
    """Each model's requests, attainment, failures and latency percentiles (one pass over the
    requests sorted by model, so 2,000 models cost what 20 do)."""
    models = sim.arrivals.models
    order = np.argsort(models, kind="stable")
    bounds = np.searchsorted(models[order], np.arange(len(sim.arrivals.names) + 1))
    failed_codes = [int(s) for s in FAILED]
    out = {}
    for j, name in enumerate(sim.arrivals.names):
        mine = order[bounds[j]:bounds[j + 1]]
        m_status = status[mine]
        total = int(m_status.size)
        m_answered = latency[mine[answered[mine]]]
        out[name] = {
            "requests": total,
            "within_slo": _r(np.sum(m_status == Status.ON_TIME) / total) if total else None,
            "failed": int(np.sum(np.isin(m_status, failed_codes))),
            "late": int(np.sum(m_status == Status.LATE)),
            "p50_ms": _percentile(m_answered, 50), "p99_ms": _percentile(m_answered, 99),
        }
    return out


def _cold(sim: Simulation, status: np.ndarray, latency: np.ndarray, answered: np.ndarray,
          failed_mask: np.ndarray) -> dict:
    """Requests that found their model resident against those that waited for a page-in; of the
    latter, the first of each wait (unless the model's previous request was cold too and still
    open when it came), and by how much their latency exceeded the model's SLO."""
    cold = sim.outcomes.cold
    resident = ~cold
    n_resident, n_cold = int(resident.sum()), int(cold.sum())
    models = sim.arrivals.models
    order = np.argsort(models, kind="stable")
    sorted_cold = cold[order]
    same_model = np.r_[False, models[order][1:] == models[order][:-1]]
    times = sim.arrivals.times_s[order]
    ended_s = times + np.nan_to_num(latency[order], nan=0.0) / 1000.0
    # the same wait: the model's previous request was cold too, and had not ended when this one came
    same_wait = same_model & np.r_[False, sorted_cold[:-1]] & np.r_[False, ended_s[:-1] > times[1:]]
    first_sorted = sorted_cold & ~same_wait
    first = np.zeros_like(cold)
    first[order] = first_sorted
    slo_by_name = {m.name: m.slo_ms for m in sim.models}
    slo_ms = np.array([slo_by_name[n] for n in sim.arrivals.names], dtype=np.float64)[models]
    over_ms = latency - slo_ms

    def over(mask: np.ndarray) -> dict:
        sel = mask & answered
        return {"requests": int(mask.sum()), "answered": int(sel.sum()), "failed": int(np.sum(mask & failed_mask)),
                "latency_p99_ms": _percentile(latency[sel], 99), "over_slo_p50_ms": _percentile(over_ms[sel], 50),
                "over_slo_p99_ms": _percentile(over_ms[sel], 99), "over_slo_max_ms": _r(over_ms[sel].max())
                if sel.any() else None}

    return {
        "resident_requests": n_resident,
        "resident_within_slo": _r(np.sum(resident & (status == Status.ON_TIME)) / n_resident) if n_resident else None,
        "resident_failed": int(np.sum(resident & failed_mask)),
        "cold_requests": n_cold,
        "cold": over(cold),
        "first_of_wait": over(first),
        "page_ins": sum(1 for e in sim.events if e["kind"] == "page-in"),
    }


def dumps(result: dict) -> str:
    return json.dumps(result, sort_keys=True, indent=1, allow_nan=False) + "\n"


def text(result: dict) -> str:
    """A few lines a person reads first."""
    o = result["outcomes"]
    lines = [
        f"requests {result['requests']:,}: {100 * (result['within_slo'] or 0):.3f}% within SLO; failed "
        f"{result['failed']:,} (dropped {o['dropped']:,}, unavailable {o['unavailable']:,}, overloaded "
        f"{o['overloaded']:,}, expired {o['expired']:,}), late {o['late']:,}",
        f"latency p50 {result['latency_ms']['p50']} ms, p99 {result['latency_ms']['p99']} ms",
        f"device-seconds {result['device_seconds']:,.0f} against the lower bound's {result['lower_bound_device_seconds']:,.0f}"
        + (f" ({result['device_seconds_over_bound']:.2f}x)" if result["device_seconds_over_bound"] else ""),
        f"lost to faults {result['lost_to_faults']:,}, to scale-down {result['lost_to_scale_down']:,}; "
        f"{result['seconds_below_99']} seconds below 99% within SLO (worst {result['worst_second']})",
        f"{result['plans']} plans, {result['backends_started']} backends started",
    ]
    cold = result.get("cold")
    if cold and cold["cold_requests"]:
        first = cold["first_of_wait"]
        lines.append(f"cold models: {cold['cold_requests']:,} requests found theirs cold ({first['requests']:,} first of a "
                     f"wait; {cold['cold']['failed']:,} failed); their latency over the SLO p99 "
                     f"{cold['cold']['over_slo_p99_ms']} ms (first of a wait {first['over_slo_p99_ms']} ms); "
                     f"resident models {100 * (cold['resident_within_slo'] or 0):.3f}% within SLO; "
                     f"lost to eviction {result['lost_to_eviction']:,}")
    for r in result["recovery"]:
        rec = "never" if r["recovered_after_s"] is None else f"{r['recovered_after_s']:g} s"
        lines.append(f"step at {r['at_s']:g} s ({r['from_rps']:g} -> {r['to_rps']:g} rps): recovered after {rec}")
    return "\n".join(lines) + "\n"
