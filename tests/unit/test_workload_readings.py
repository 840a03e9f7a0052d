"""The workload's readings, kept as running sums column by column (globalsched/state/rate_reports.py),
agree with the same readings worked out from scratch, session by session, from every report kept
whole: sums, shortest windows, surges, largest dispersions, as reports come, counts age out of the
window, frontends report different sessions, and a frontend leaves."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from common.pb import control
from common.surge import dispersion, dispersion_of_sums, dispersions_of_sums, is_surge, surges_of
from globalsched.state.rate_reports import PLAN_RATE_WINDOW_S, RATE_REPORT_TTL_S, RATE_SMOOTHING, Workload


class FromScratch:
    """Every report kept whole; every reading worked out from them at the instant asked."""

    def __init__(self) -> None:
        self.smoothed: dict[str, dict[str, tuple[float, float]]] = {}
        self.history: dict[str, dict[str, list]] = {}

    def report(self, r: control.WorkloadReport, now: float) -> None:
        table = self.smoothed.setdefault(r.node_id, {})
        for x in r.rates:
            rate = max(x.rate_rps, 0.0)
            old = table.get(x.model)
            if old is not None and now - old[1] <= RATE_REPORT_TTL_S:
                rate = RATE_SMOOTHING * rate + (1 - RATE_SMOOTHING) * old[0]
            table[x.model] = (rate, now)
            if x.window_ms > 0:
                self.history.setdefault(r.node_id, {}).setdefault(x.model, []).append((now, x.requests, x.window_ms / 1000))

    def forget(self, node: str) -> None:
        self.smoothed.pop(node, None)
        self.history.pop(node, None)

    def readings(self, now: float) -> dict:
        rates, windows, surging, latest, window_rates = {}, {}, {}, {}, {}
        for node, per_model in self.smoothed.items():
            for model, (smoothed, t) in per_model.items():
                if now - t > RATE_REPORT_TTL_S:
                    continue
                fresh = [(n, s) for at, n, s in self.history.get(node, {}).get(model, ())
                         if now - at <= PLAN_RATE_WINDOW_S]
                seconds = sum(s for _, s in fresh)
                rate = sum(n for n, _ in fresh) / seconds if seconds > 0 else smoothed
                if fresh:
                    n, s = fresh[-1]
                    before = seconds - s
                    if is_surge(n, (sum(c for c, _ in fresh[:-1]) / before if before > 0 else 0.0) * s):
                        rate = max(rate, n / s)
                        surging[model] = min(surging.get(model, s), s)
                    r, ls = latest.get(model, (0.0, s))
                    latest[model] = (r + n / s, min(ls, s))
                    mean = sum(c for c, _ in fresh) / seconds
                    d = dispersion(fresh)
                    if model in window_rates:
                        old = window_rates[model]
                        d = None if d is None or old[2] is None else max(d, old[2])
                        window_rates[model] = (old[0] + mean, min(old[1], seconds), d, *latest[model])
                    else:
                        window_rates[model] = (mean, seconds, d, *latest[model])
                rates[model] = rates.get(model, 0.0) + rate
                windows[model] = min(windows.get(model, seconds), seconds)
        return {"rates": rates, "windows": windows, "surging": surging, "latest": latest,
                "window_rates": window_rates}


def _incremental(w: Workload, now: float) -> dict:
    wr = w.window_rates(now)
    return {"rates": w.planning_rates(now), "windows": w.rate_windows_s(now), "surging": w.surge_windows_s(now),
            "latest": w.latest_reports(now),
            "window_rates": {m: (r.rate_rps, r.window_s, r.dispersion, r.latest_rps, r.latest_s) for m, r in wr.items()}}


def _close(a, b) -> bool:
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if a is None or b is None:
        return a is b
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_kept_up_to_date_agrees_with_from_scratch(seed):
    rng = random.Random(seed)
    w, truth = Workload(), FromScratch()
    models = [f"m{i}" for i in range(12)]
    frontends = [f"fe{i}" for i in range(4)]
    now = 0.0
    for step in range(300):
        now += rng.choice([0.05, 0.3, 0.7, 1.9, 4.0])
        node = rng.choice(frontends)
        if rng.random() < 0.03:
            w.forget(node)
            truth.forget(node)
        else:
            report = control.WorkloadReport(node_id=node)
            for m in rng.sample(models, rng.randint(1, len(models))):
                burst = rng.random() < 0.1
                n = rng.randint(20, 80) if burst else rng.choice([0, 0, 1, 2, 3, 5])
                window_ms = rng.choice([0, 2000, 2000, 2000, 1500])
                report.rates.add(model=m, requests=n, window_ms=window_ms, rate_rps=n / 2.0)
            w.report(report, now)
            truth.report(report, now)
        now += rng.choice([0.0, 0.0, 0.5, 3.0])   # read at the report, or later as counts age
        got, want = _incremental(w, now), truth.readings(now)
        for name in want:
            assert set(got[name]) == set(want[name]), (step, name)
            for model, value in want[name].items():
                assert _close(got[name][model], value), (step, name, model, got[name][model], value)


def test_the_column_rules_are_the_scalar_rules():
    rng = np.random.default_rng(3)
    counts = rng.integers(0, 60, 400).astype(float)
    expected = rng.uniform(-1, 40, 400)
    assert surges_of(counts, expected).tolist() == [is_surge(c, e) for c, e in zip(counts, expected)]
    k = rng.integers(0, 5, 400).astype(float)
    seconds = k * 2.0
    requests = np.where(rng.random(400) < 0.2, 0.0, rng.integers(0, 50, 400) * k)
    squares = requests * requests / np.maximum(seconds, 1) * rng.uniform(0.5, 3, 400)
    got = dispersions_of_sums(requests, seconds, squares, k)
    for g, args in zip(got.tolist(), zip(requests, seconds, squares, k)):
        want = dispersion_of_sums(*args)
        assert (math.isnan(g) and want is None) or math.isclose(g, want)


def test_the_planners_view_carries_each_sessions_dispersion_where_known():
    """The planner judges a drop beyond the noise of the session's own counts (rate_judgement.dropped_rates):
    the view it reads carries each session's index of dispersion, as the device scaler reads it."""
    from globalsched.state.read_view import measured
    w = Workload()
    for i, n in enumerate([0, 40, 2, 0, 35, 1, 0, 44]):          # bursty: variance far above the mean
        report = control.WorkloadReport(node_id="fe")
        report.rates.add(model="bursty", requests=n, window_ms=500, rate_rps=n * 2.0)
        if i == 7:
            report.rates.add(model="new", requests=5, window_ms=500, rate_rps=10.0)   # one count: not known
        w.report(report, 0.5 * (i + 1))
    view = measured(w, 4.0)
    assert view["rate_dispersions"] == {"bursty": w.window_rates(4.0)["bursty"].dispersion}
    assert view["rate_dispersions"]["bursty"] > 10
