"""When a frontend sends its workload report: every ``interval_s``, and at once when a session's
demand surges.

A session surges when its count in the current window already exceeds what its planned rate would
bring over the window by a wide statistical margin (:func:`common.surge.is_surge`, the scheduler's
own rule). Waiting for the period's end would leave it on the capacity planned for the old rate for
up to ``interval_s`` more, and the scheduler plans for a surge at once (cold start: a model just
uploaded is planned for the default 1 request/s; a step up of a model's traffic). The early report
is bounded: a session triggers at most one every ``EARLY_REPORT_GAP_S``, and no report of any kind
covers less than ``MIN_WINDOW_S`` (a window that short says little).

A surge usually starts inside the window, and the requests before it would dilute the rate the
report gives. So a surging session's window is reported in two consecutive parts, oldest first:
before and since the moment from which its count stands furthest above its planned rate (in
standard deviations of a Poisson count; the report loop marks the counts every ``CHECK_S``). The
scheduler judges the latest part against the earlier ones, as it judges consecutive reports.

A request for a cold session (resident on no device) is reported at once in a report of its own
that carries only the cold sessions asked for (:meth:`ReportClock.page_in_counts`): the scheduler
pages them in, and the other sessions' window goes on. With thousands of models whose tail is cold,
a full report per page-in would send every session's count many times a second, and the
scheduler's rate history would fragment into as many slivers. A session so reported starts its own
window then, until the next full report.

The rule compares a frontend's own count with the session's planned rate, which covers every
frontend: with several frontends sharing a session's traffic, each one reports early only when its
own share alone outruns the plan, and otherwise at its period.

Pure bookkeeping: time is passed in.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping, Sequence

from common.pb import control
from common.surge import is_surge

EARLY_REPORT_GAP_S = 1.0      # a session triggers at most one early report this often
MIN_WINDOW_S = 0.2            # no report, nor the recent part of a surging session's window, covers less
CHECK_S = 0.1                 # how often the report loop looks


class ReportClock:
    def __init__(self, interval_s: float, now: float) -> None:
        self.interval_s = interval_s
        self.window_start = now
        self.last_early: dict[str, float] = {}
        self.marks: list[tuple[float, dict[str, int]]] = [(now, {})]   # (time, counts then) within the window
        self.session_start: dict[str, float] = {}    # sessions reported on their own since window_start

    def start(self, name: str) -> float:
        """Where session ``name``'s window began: the window's, or its own page-in report."""
        return self.session_start.get(name, self.window_start)

    def surging(self, counts: Mapping[str, int], planned_rps: Mapping[str, float], now: float) -> list[str]:
        """The sessions whose count in the window so far is a surge against their planned rate and may
        trigger an early report now."""
        if now - self.window_start < MIN_WINDOW_S:
            return []
        out = []
        for name, count in counts.items():
            planned = planned_rps.get(name)
            if planned is None or now - self.last_early.get(name, -math.inf) < EARLY_REPORT_GAP_S:
                continue
            if is_surge(count, planned * (now - self.start(name))):
                out.append(name)
        return out

    def due(self, counts: Mapping[str, int], planned_rps: Mapping[str, float], now: float) -> list[str] | None:
        """None: no report now (the counts are marked); else report now, for these surging sessions
        (empty: the period is over)."""
        if now - self.window_start >= self.interval_s:
            return []
        surging = self.surging(counts, planned_rps, now)
        if not surging:
            self.marks.append((now, dict(counts)))
        return surging or None

    def parts(self, name: str, count: int, planned_rps: float, now: float) -> list[tuple[int, float]]:
        """``(requests, seconds)`` of the window for session ``name`` (``count`` so far), oldest first:
        before and since the mark from which the count stands furthest above the planned rate (at
        least ``MIN_WINDOW_S`` before now) when that part is a surge, else the whole window."""
        start = self.start(name)
        best_at, best_z = start, -math.inf
        for at, then in self.marks:
            span = now - at
            if span < MIN_WINDOW_S:
                break
            if at < start:
                continue
            expected = planned_rps * span
            z = (count - then.get(name, 0) - expected) / math.sqrt(expected + 1.0)
            if z > best_z:
                best_at, best_z = at, z
        whole = [(count, now - start)]
        if best_at <= start:
            return whole
        before = next(then.get(name, 0) for at, then in self.marks if at == best_at)
        if not is_surge(count - before, planned_rps * (now - best_at)):
            return whole
        return [(before, best_at - start), (count - before, now - best_at)]

    def report_counts(self, window: Mapping[str, int], served: Sequence[str], planned_rps: Mapping[str, float],
                      surging: Sequence[str], now: float) -> list[tuple[str, int, float]]:
        """The report's ``(session, requests, seconds)`` counts for every ``served`` session (0 where
        ``window`` counted none), a surging one's in its two parts (:meth:`parts`), oldest first."""
        surging = set(surging)
        out = []
        for name in served:
            count = window.get(name, 0)
            parts = (self.parts(name, count, planned_rps[name], now) if name in surging
                     else [(count, max(now - self.start(name), 1e-6))])
            out.extend((name, requests, window_s) for requests, window_s in parts)
        return out

    def page_in_counts(self, window: dict[str, int], names: Sequence[str], now: float) -> list[tuple[str, int, float]]:
        """The ``(session, requests, seconds)`` counts of a page-in report (module docstring): the cold
        sessions ``names``, each over its window so far (at least MIN_WINDOW_S, so that a request
        just after a report does not read as a burst). Their counts leave ``window``, and each starts
        its own window now."""
        out = []
        for name in names:
            out.append((name, window.pop(name, 0), max(now - self.start(name), MIN_WINDOW_S)))
            self.session_start[name] = now
        return out

    def reported(self, now: float, surging: list[str]) -> None:
        """A report covering the window up to ``now`` went out, early for ``surging``."""
        self.window_start = now
        self.session_start = {}
        self.marks = [(now, {})]
        for name in surging:
            self.last_early[name] = now


def workload_report(node_id: str, counts: Iterable[tuple[str, int, float]]) -> control.WorkloadReport:
    """The report of ``(session, requests, seconds)`` counts (:meth:`ReportClock.report_counts`,
    :meth:`ReportClock.page_in_counts`), as the frontend and the simulated frontends send it."""
    report = control.WorkloadReport(node_id=node_id)
    for name, requests, window_s in counts:
        report.rates.add(model=name, rate_rps=requests / max(window_s, 1e-6), requests=requests,
                         window_ms=int(window_s * 1000))
    return report
