"""Multi-tenant measurement: dedicated peaks, the co-located frontier, cost and slowdown.

For models M_1..M_N (N >= 2) on one device, all with the same SLO:

1. each model is profiled (unless a profile is given) with batch latencies capped at SLO/2;
2. *dedicated peak* R_i: the harness (:mod:`profiler.harness`) serves M_i alone and an open-loop ramp
   (:mod:`common.rate_search`) finds the largest Poisson rate at which the latency percentile stays within
   the SLO and at most 1% of requests are dropped or late;
3. *co-located frontier*: every model is loaded on the same device; for each fraction f the models
   M_1..M_{N-1} are held at f * R_j / (N-1) and M_N's rate is ramped until any model breaks. With two
   models this traces M_2's sustainable rate against M_1's, to compare with the straight line
   r_2 = R_2 * (1 - r_1 / R_1) between the dedicated peaks (what time-slicing would give);
4. cost per million inferences and shared-vs-dedicated cost change per frontier point
   (:mod:`profiler.cost`);
5. per model, the co-location slowdown of its batch execution time (:mod:`profiler.slowdown`), saved
   in the report so the scheduler can inflate l(b) for sessions that share a device.

The result is a JSON-ready dict (format in ``profiler/README.md``).
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from common.profile import Profile
from common.rate_search import max_passing_rate
from profiler.cost import compare_point, cost_per_million
from profiler.environment import device_type_of, environment_meta, parse_device, resolve_threads
from profiler.errors import ProfilerError
from profiler.harness import Harness, ModelStepStats, TenantModel
from profiler.model_file import model_sha256
from profiler.profiling import profile_model
from profiler.runtime import open_runtime
from profiler.slowdown import measured_slowdown, merge_exec

REPORT_KIND = "nexus-multitenant-report"
REPORT_VERSION = 1
DEFAULT_FRACTIONS = (0.25, 0.5, 0.75)
# A ramp whose first rate fails halves it down to this fraction of the first rate before it gives up.
MIN_FRACTION = 1.0 / 64


def _ramp(passes: Callable[[float], bool], start: float, growth: float, refine: int, max_rate: float) -> float:
    """The largest passing rate: from ``start`` times ``growth`` while passing (or divided while failing),
    then ``refine`` bisections."""
    return max_passing_rate(passes, start, growth=growth, refine=refine, max_rate=max_rate,
                            floor=start * MIN_FRACTION)


@dataclass(frozen=True)
class TenantSpec:
    """A model to co-locate: its bytes, runtime kind and (optionally) an existing profile."""

    name: str
    model_bytes: bytes
    runtime: str = "onnxruntime"
    profile: Profile | None = None
    path: str | None = None
    io: Any = None  # (inputs, outputs) TensorSpecs, for TorchScript files


def _check_options(tenants: Sequence[TenantSpec], slo_ms: float, price_per_hour: float,
                   fractions: Sequence[float], duration_s: float) -> None:
    if len(tenants) < 2:
        raise ProfilerError(f"multi-tenant measurement needs at least two models, got {len(tenants)}")
    names = [t.name for t in tenants]
    if len(set(names)) != len(names):
        raise ProfilerError(f"model names must be distinct, got {names}")
    if not slo_ms > 0:
        raise ProfilerError(f"SLO must be positive, got {slo_ms}")
    if not price_per_hour > 0:
        raise ProfilerError(f"price per hour must be positive, got {price_per_hour}")
    if not fractions or any(not 0 < f < 1 for f in fractions):
        raise ProfilerError(f"fractions must lie strictly between 0 and 1, got {list(fractions)}")
    if not duration_s > 0:
        raise ProfilerError(f"step duration must be positive, got {duration_s}")


def measure_multitenant(tenants: Sequence[TenantSpec], device: str = "cpu", slo_ms: float = 100.0, *,
                        price_per_hour: float = 1.0, fractions: Sequence[float] = DEFAULT_FRACTIONS,
                        duration_s: float = 2.0, refine: int = 3, growth: float = 2.0, threads: int | None = None,
                        seed: int = 0, percentile: float = 99.0, max_bad_rate: float = 0.01,
                        profile_options: dict[str, Any] | None = None, device_type: str | None = None,
                        progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the whole measurement (see the module docstring) and return the report."""
    _check_options(tenants, slo_ms, price_per_hour, fractions, duration_s)
    device = parse_device(device)
    dev_type = device_type or device_type_of(device)
    threads = resolve_threads(threads, device)
    say = progress or (lambda _msg: None)

    profiles: dict[str, Profile] = {}
    for t in tenants:
        if t.profile is not None:
            if t.profile.device_type and t.profile.device_type != dev_type:
                raise ProfilerError(f"{t.name}: profile is for device type {t.profile.device_type!r}, "
                                    f"not {dev_type!r}")
            profiles[t.name] = t.profile
        else:
            say(f"profiling {t.name}")
            opts = dict(iters=20, time_budget_s=1.0)
            opts.update(profile_options or {})
            profiles[t.name] = profile_model(t.model_bytes, device, t.runtime, opts.pop("batch_sizes", "auto"),
                                             threads=threads, seed=seed, max_latency_ms=slo_ms / 2.0,
                                             device_type=dev_type, model_name=t.name, io=t.io,
                                             runtime_profile=t.profile, **opts)

    runtimes = []
    try:
        models = []
        for t in tenants:
            rt = open_runtime(t.runtime, t.model_bytes, device, threads=threads, profile=profiles[t.name], io=t.io,
                              where=t.name)
            runtimes.append(rt)
            models.append(TenantModel(t.name, rt, profiles[t.name], slo_ms,
                                      input_shapes=(profile_options or {}).get("input_shapes")))
        harness = Harness(models, percentile=percentile, max_bad_rate=max_bad_rate)
        return _measure(harness, models, tenants, profiles, device, dev_type, threads, slo_ms, price_per_hour,
                        fractions, duration_s, refine, growth, seed, percentile, max_bad_rate, say)
    finally:
        for rt in runtimes:
            try:
                rt.close()
            except Exception:
                pass


MAX_REQUESTS_PER_STEP = 2_000_000


def _rate_cap(model: TenantModel, duration_s: float) -> float:
    """No ramp goes past 16x the profile's mean-latency throughput (or 2M requests in one step)."""
    return min(16.0 * max(model.mean_peak_rps, model.predicted_peak_rps), MAX_REQUESTS_PER_STEP / duration_s)


def _measure(harness: Harness, models: list[TenantModel], tenants: Sequence[TenantSpec],
             profiles: dict[str, Profile], device: str, dev_type: str, threads: int | None, slo_ms: float,
             price: float, fractions: Sequence[float], duration_s: float, refine: int, growth: float, seed: int,
             percentile: float, max_bad_rate: float, say: Callable[[str], None]) -> dict[str, Any]:
    names = [m.name for m in models]
    trials: list[dict] = []
    exec_alone: dict[str, dict] = {n: {} for n in names}
    exec_shared: dict[str, dict] = {n: {} for n in names}
    passing: dict[tuple, dict[str, ModelStepStats]] = {}

    def step(kind: str, rates: dict[str, float]) -> dict[str, ModelStepStats]:
        stats = harness.run_step(rates, duration_s, seed=seed * 1_000_003 + len(trials))
        ok = all(s.ok for s in stats.values())
        loaded = [n for n in names if rates.get(n, 0) > 0]
        for n in loaded:
            merge_exec(exec_alone[n] if len(loaded) == 1 else exec_shared[n], stats[n].exec_ms)
        trials.append({"kind": kind, "rates_rps": {n: round(rates.get(n, 0.0), 3) for n in names}, "ok": ok,
                       "stats": {n: stats[n].to_json_obj() for n in loaded}})
        say(f"{kind}: " + ", ".join(f"{n} {rates.get(n, 0):.0f}/s" for n in loaded) + (" ok" if ok else " FAIL"))
        if ok:
            passing[(kind, tuple(round(rates.get(n, 0.0), 6) for n in names))] = stats
        return stats

    # Warm-up (not recorded): caches, thread pools and allocator arenas of every model.
    harness.run_step({m.name: 0.1 * m.predicted_peak_rps for m in models}, min(duration_s, 0.5), seed=seed + 999_983)

    def dedicated_peak(m: TenantModel, start: float) -> float:
        def alone(rate: float) -> bool:
            return all(s.ok for s in step(f"dedicated {m.name}", {m.name: rate}).values())

        return _ramp(alone, start, growth, refine, _rate_cap(m, duration_s))

    first: dict[str, float] = {}
    for m in models:
        first[m.name] = dedicated_peak(m, 0.5 * m.predicted_peak_rps)
        if first[m.name] <= 0:
            raise ProfilerError(f"{m.name}: no load passes the {slo_ms:g} ms SLO even on a dedicated device")

    fixed_models, ramped = models[:-1], models[-1]
    measured_points: list[tuple[float, dict[str, float], float, str]] = []
    for f in sorted(fractions):
        fixed = {m.name: f * first[m.name] / len(fixed_models) for m in fixed_models}
        kind = f"co-located f={f:g}"

        def shared(rate: float) -> bool:
            return all(s.ok for s in step(kind, {**fixed, ramped.name: rate}).values())

        line = first[ramped.name] * (1.0 - f)
        rate = _ramp(shared, max(0.5 * line, 0.01 * first[ramped.name]), growth, refine,
                     min(4.0 * first[ramped.name], _rate_cap(ramped, duration_s)))
        rates = {**fixed, ramped.name: rate}
        if rate <= 0 and not all(s.ok for s in step(kind + " (fixed load alone)", fixed).values()):
            rates = {n: 0.0 for n in rates}  # even the fixed load fails when co-located
        measured_points.append((f, {n: rates.get(n, 0.0) for n in names}, rate, kind))

    # Dedicated peaks again, after the co-located steps: a machine whose speed drifts (other load,
    # clocks, heat) would otherwise bias the comparison. The peaks used are the mean of both runs.
    second = {m.name: dedicated_peak(m, first[m.name]) for m in models}
    peaks = {n: (first[n] + second[n]) / 2.0 for n in names}
    drift = {n: second[n] / first[n] - 1.0 for n in names}
    warnings = [f"{n}: dedicated peak moved {d * 100:+.0f}% between the first and second measurement; the "
                f"device's speed drifted (other load?), treat the comparison with care"
                for n, d in drift.items() if abs(d) > 0.2]

    frontier: list[dict] = []
    for f, rates, rate, kind in measured_points:
        line = peaks[ramped.name] * (1.0 - sum(rates[m.name] / peaks[m.name] for m in fixed_models))
        point = {"fraction": f, "fixed": sorted(m.name for m in fixed_models), "ramped": ramped.name,
                 "rates_rps": rates, "line_rps": max(0.0, line), "vs_line": rate / line if line > 0 else None}
        point.update(compare_point(price, rates, peaks))
        key = (kind, tuple(round(rates[n], 6) for n in names))
        if key in passing:
            point["stats"] = {n: s.to_json_obj() for n, s in passing[key].items() if rates[n] > 0}
        frontier.append(point)

    report_models = []
    for t, m in zip(tenants, models):
        raw = measured_slowdown(exec_alone[m.name], exec_shared[m.name], profiles[m.name])
        report_models.append({
            "name": m.name,
            "path": t.path,
            "model_sha256": model_sha256(t.model_bytes),
            "runtime": t.runtime,
            "max_batch": m.max_batch,
            "predicted_peak_rps": m.predicted_peak_rps,
            "dedicated_peak_rps": peaks[m.name],
            "dedicated_peak_runs_rps": [first[m.name], second[m.name]],
            "peak_drift": drift[m.name],
            "peak_vs_predicted": peaks[m.name] / m.predicted_peak_rps,
            "peak_at_rate_cap": max(first[m.name], second[m.name]) >= _rate_cap(m, duration_s),
            "cost_per_million_dedicated": cost_per_million(price, peaks[m.name]),
            "slowdown": max(1.0, raw) if raw is not None else 1.0,
            "slowdown_measured": raw,
            "profile": profiles[m.name].to_json_obj(),
        })

    interior = [p for p in frontier if p["efficiency"] > 0]
    best = max(interior, key=lambda p: p["efficiency"]) if interior else None
    balanced = min(frontier, key=lambda p: abs(p["fraction"] - 0.5))
    costs = {
        "price_per_hour": price,
        "dedicated_cost_per_million": {m["name"]: m["cost_per_million_dedicated"] for m in report_models},
        "best_fraction": best["fraction"] if best else None,
        "best_efficiency": best["efficiency"] if best else None,
        "best_cost_per_million_shared": best["cost_per_million_shared"] if best else None,
        "best_change_vs_dedicated": best["cost_change_vs_dedicated"] if best else None,
        "balanced_change_vs_dedicated": balanced["cost_change_vs_dedicated"],
        "mean_efficiency": sum(p["efficiency"] for p in frontier) / len(frontier),
    }
    meta = environment_meta(device, tenants[0].runtime, threads, seed)
    meta["created"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    meta["warnings"] = warnings
    return {
        "kind": REPORT_KIND,
        "version": REPORT_VERSION,
        "device": device,
        "device_type": dev_type,
        "slo_ms": slo_ms,
        "percentile": percentile,
        "max_bad_rate": max_bad_rate,
        "duration_s": duration_s,
        "price_per_hour": price,
        "models": report_models,
        "frontier": frontier,
        "costs": costs,
        "trials": trials,
        "meta": meta,
    }
