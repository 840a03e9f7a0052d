"""What the frontends report: request rates per session and fan-out counts per query edge.

Each frontend's rate is smoothed exponentially (it decides *when* to re-plan) and its request counts
are kept over a window (the window's mean is what a plan is made for). Fan-out counts per query edge
give the measured gamma of each edge. A frontend that leaves takes its reports with it (:meth:`forget`).
Pure bookkeeping: time is passed in, and it only moves forward.

A fleet's frontends each report thousands of sessions every few seconds, and the scheduler reads
the sums at every report and every tick of the device scaler. Worked out session by session, that
held its event loop for a quarter of a second at every report. So each frontend's counts are kept
as running sums in columns, one per session (numpy arrays), its readings are worked out column-wise
when its report comes or one of its counts ages out of the window, and the sums over frontends are
column-wise too.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass

import numpy as np

from common.pb import control
from common.surge import dispersions_of_sums, surges_of

RATE_REPORT_TTL_S = 10.0        # a frontend's report counts this long
RATE_SMOOTHING = 0.3            # weight of the newest report in the exponentially smoothed rate
PLAN_RATE_WINDOW_S = 10.0       # plans use the mean rate of the reports of this window
MIN_EDGE_SAMPLES = 20           # parent rows before a measured gamma is trusted
FULL_WINDOW_SLACK_S = 0.5       # a rate window this close to PLAN_RATE_WINDOW_S is full (report timing jitter)


@dataclass(frozen=True)
class WindowRate:
    """A session's counted requests over the rate window, summed over frontends."""

    rate_rps: float             # the window's mean (no surge substituted)
    window_s: float             # the shortest window of any frontend reporting it
    dispersion: float | None    # the largest index of dispersion of a frontend's counts; None: not known
    latest_rps: float = 0.0     # the latest reports' rates, summed over frontends
    latest_s: float = 0.0       # the shortest of their windows (0: not known)


class _Readings:
    """One frontend's readings at an instant, column by column (a session per column): where it
    reports the session (``present``) and has counts in the window (``counted``), the rate to plan
    for (the window's mean, a surging latest report's rate, or the smoothed rate without counts), the
    seconds of counts behind it (0 without), the surging latest report's seconds (inf: no surge), the
    window's mean and its dispersion (NaN: not known), and the latest report's rate and seconds."""

    __slots__ = ("present", "counted", "rate", "seconds", "surge_s", "mean", "dispersion", "latest", "latest_s")


class _Frontend:
    """One frontend's reports, as running sums over the window in session columns."""

    ARRAYS = ("requests", "seconds", "squares", "counts", "latest_n", "latest_w", "smoothed", "reported_at")

    def __init__(self, width: int) -> None:
        self.history: collections.deque = collections.deque()   # (time, columns, requests, seconds) per report
        for name in self.ARRAYS:
            setattr(self, name, np.zeros(width))
        self.reported_at[:] = -np.inf           # when it last reported each session
        self.readings: _Readings | None = None  # true until a report, an ageing, or ``earliest`` expires
        self.earliest = math.inf                # the earliest report of a session the readings hold
        self.read_at, self.read_aged = -math.inf, 0     # when they were read, less how many reports

    def grow(self, width: int) -> None:
        for name in self.ARRAYS:
            old = getattr(self, name)
            new = np.full(width, -np.inf if name == "reported_at" else 0.0)
            new[:len(old)] = old
            setattr(self, name, new)

    def prune(self, now: float) -> None:
        """Drop the reports that left the window by ``now`` (a report of its own came: time is past them)."""
        while self.history and now - self.history[0][0] > PLAN_RATE_WINDOW_S:
            _count((self.requests, self.seconds, self.squares, self.counts), *self.history.popleft()[1:], sign=-1)
        self.readings = None

    def read(self, now: float) -> _Readings:
        """Its readings at ``now``: the running sums less the reports that left the window since its
        last report (kept until a report, a count's ageing, or a session's expiry changes them)."""
        aged = 0
        for at, *_ in self.history:
            if now - at <= PLAN_RATE_WINDOW_S:
                break
            aged += 1
        if self.readings is not None and self.read_at <= now and aged == self.read_aged and \
                now - self.earliest <= RATE_REPORT_TTL_S:
            return self.readings
        requests, seconds, squares, counts = self.requests, self.seconds, self.squares, self.counts
        if aged:
            requests, seconds, squares, counts = (a.copy() for a in (requests, seconds, squares, counts))
            for i in range(aged):
                _count((requests, seconds, squares, counts), *self.history[i][1:], sign=-1)
        r = _Readings()
        r.present = now - self.reported_at <= RATE_REPORT_TTL_S
        r.counted = r.present & (counts > 0)
        with np.errstate(divide="ignore", invalid="ignore"):
            r.mean = np.where(r.counted, requests / seconds, 0.0)
            r.latest = np.where(r.counted, self.latest_n / self.latest_w, 0.0)
            before_s = seconds - self.latest_w
            before = np.where(before_s > 0, (requests - self.latest_n) / before_s, 0.0)
        # beyond noise around the window's mean: a plan made for the mean would miss for the window's
        # length (a frontend's first report is judged against nothing: all news)
        surging = r.counted & surges_of(self.latest_n, before * self.latest_w)
        r.rate = np.where(r.counted, np.where(surging, np.maximum(r.mean, r.latest), r.mean),
                          np.where(r.present, self.smoothed, 0.0))
        r.seconds = np.where(r.counted, seconds, 0.0)
        r.surge_s = np.where(surging, self.latest_w, np.inf)
        r.dispersion = dispersions_of_sums(requests, seconds, squares, counts)
        r.latest_s = np.where(r.counted, self.latest_w, np.inf)
        reported = self.reported_at[r.present]
        self.readings, self.earliest = r, float(reported.min()) if reported.size else math.inf
        self.read_at, self.read_aged = now, aged
        return r


def _count(sums: tuple, cols: np.ndarray, n: np.ndarray, w: np.ndarray, sign: int = 1) -> None:
    """Add (``sign`` 1) or take out (-1) one report's counts (``n`` requests over ``w`` seconds in
    columns ``cols``) to running ``sums`` (requests, seconds, sum of n * n / w, reports)."""
    for total, values in zip(sums, (n, w, n * n / w, 1)):
        np.add.at(total, cols, sign * values)


class _Sums:
    """The readings of every frontend summed by session, as the accessors answer them."""

    def __init__(self, names: list[str], frontends: list[_Readings]) -> None:
        width = len(names)
        present = np.zeros(width, bool)
        counted = np.zeros(width, bool)
        rates, means, latest = np.zeros(width), np.zeros(width), np.zeros(width)
        windows, surge_s, counted_s, latest_s = (np.full(width, np.inf) for _ in range(4))
        dispersion, unknown = np.ones(width), np.zeros(width, bool)
        for r in frontends:
            n = min(len(r.present), width)      # a frontend's arrays grow ahead of the sessions
            p, c = r.present[:n], r.counted[:n]
            present[:n] |= p
            counted[:n] |= c
            rates[:n] += r.rate[:n]
            means[:n] += r.mean[:n]
            latest[:n] += r.latest[:n]
            np.minimum(windows[:n], np.where(p, r.seconds[:n], np.inf), out=windows[:n])
            np.minimum(surge_s[:n], r.surge_s[:n], out=surge_s[:n])
            np.minimum(counted_s[:n], np.where(c, r.seconds[:n], np.inf), out=counted_s[:n])
            np.minimum(latest_s[:n], r.latest_s[:n], out=latest_s[:n])
            unknown[:n] |= c & np.isnan(r.dispersion[:n])
            np.fmax(dispersion[:n], np.where(c, r.dispersion[:n], 1.0), out=dispersion[:n])
        cols = np.flatnonzero(present)
        keys = [names[i] for i in cols]
        self.rates = dict(zip(keys, rates[cols].tolist()))
        self.windows = dict(zip(keys, windows[cols].tolist()))
        cols = np.flatnonzero(surge_s < np.inf)
        self.surging = dict(zip([names[i] for i in cols], surge_s[cols].tolist()))
        cols = np.flatnonzero(counted)
        keys = [names[i] for i in cols]
        self.latest = dict(zip(keys, zip(latest[cols].tolist(), latest_s[cols].tolist())))
        known_s = np.where(np.isfinite(latest_s[cols]), latest_s[cols], 0.0)
        self.window_rates = {k: WindowRate(m, s, None if u else d, lr, ls) for k, m, s, u, d, lr, ls in
                             zip(keys, means[cols].tolist(), counted_s[cols].tolist(), unknown[cols].tolist(),
                                 dispersion[cols].tolist(), latest[cols].tolist(), known_s.tolist())}
        self.dispersions = {k: r.dispersion for k, r in self.window_rates.items() if r.dispersion is not None}


class Workload:
    def __init__(self) -> None:
        self.rates: dict[str, dict[str, tuple[float, float]]] = {}   # frontend -> model -> (rate, t)
        self.edges: dict[str, dict[tuple[str, str, str], tuple[int, int, float]]] = {}  # frontend -> edge -> counts
        self.columns: dict[str, int] = {}       # session -> its column in every frontend's arrays
        self._names: list[str] = []             # column -> session
        self._frontends: dict[str, _Frontend] = {}
        self._sums: tuple[list, _Sums] | None = None    # (the readings summed, their sums) until one changes
        # frontend -> the models of its latest report, when that report counted nothing
        self.quiet: dict[str, frozenset[str]] = {}
        self.last_requested: dict[str, float] = {}   # session -> when a report last counted a request of it

    def last_requested_s(self) -> dict[str, float]:
        """When each session's requests were last reported (monotonic): residency evicts the least
        recently used (globalsched/planning/residency.py)."""
        return dict(self.last_requested)

    def _column(self, model: str) -> int:
        col = self.columns.get(model)
        if col is None:
            col = self.columns[model] = len(self._names)
            self._names.append(model)
        return col

    def report(self, request: control.WorkloadReport, now: float) -> bool:
        """Take one frontend's report (its node is known: the caller checked). Whether it is news for
        the planner: False only for a report that counts nothing (no request, no fan-out), of the
        same models as the frontend's previous report, which counted nothing either, while the
        frontend's windows hold no count and are full (:meth:`_settled`): its share of the planner's
        inputs is then the same zeros as at its previous report.

        An idle frontend sends such a report every few seconds; judging the plan on each cost the
        scheduler CPU in proportion to time, not to events. What time alone changes is judged by
        the epoch timer (globalsched/planning/control_loop.py)."""
        node = request.node_id
        rows = [(r.model, r.requests, r.window_ms, r.rate_rps) for r in request.rates]   # one pass: thousands
        models = [row[0] for row in rows]
        numbers = np.array([row[1:] for row in rows], dtype=float).reshape(len(rows), 3)
        requests, window_s, reported = numbers[:, 0], numbers[:, 1] / 1000, np.maximum(numbers[:, 2], 0.0)
        for i in np.flatnonzero(requests):
            self.last_requested[models[i]] = now
        quiet = not (requests.any() or reported.any()) and \
            not any(e.parent_requests or e.child_requests for e in request.edges)
        names = frozenset(models)
        was_quiet = self.quiet.get(node) == names
        if quiet:
            self.quiet[node] = names
        else:
            self.quiet.pop(node, None)
        cols = np.array([self._column(m) for m in models], dtype=np.intp)
        fe = self._frontends.get(node)
        if fe is None:
            fe = self._frontends[node] = _Frontend(len(self._names))
        if len(fe.requests) < len(self._names):
            fe.grow(max(len(self._names), 2 * len(fe.requests)))
        fe.prune(now)
        # smooth Poisson noise of short windows with the previous report, where it still counts
        recent = now - fe.reported_at[cols] <= RATE_REPORT_TTL_S
        smoothed = np.where(recent, RATE_SMOOTHING * reported + (1 - RATE_SMOOTHING) * fe.smoothed[cols], reported)
        fe.smoothed[cols] = smoothed
        fe.reported_at[cols] = now
        table = self.rates.setdefault(node, {})
        table.update(zip(models, zip(smoothed.tolist(), [now] * len(models))))
        counted = window_s > 0
        if counted.any():
            c, n, w = cols[counted], requests[counted], window_s[counted]
            fe.history.append((now, c, n, w))
            _count((fe.requests, fe.seconds, fe.squares, fe.counts), c, n, w)
            fe.latest_n[c] = n
            fe.latest_w[c] = w
        edges = self.edges.setdefault(node, {})
        for e in request.edges:
            key = (e.query, e.parent, e.child)
            old = edges.get(key)
            if old is not None and now - old[2] <= RATE_REPORT_TTL_S:   # keep a window of recent counts
                edges[key] = (old[0] + e.parent_requests, old[1] + e.child_requests, old[2])
            else:
                edges[key] = (e.parent_requests, e.child_requests, now)
        return not (quiet and was_quiet and self._settled(node, now))

    def _settled(self, node: str, now: float) -> bool:
        """Whether ``node``'s reports hold no count within the windows the planner reads (rates:
        PLAN_RATE_WINDOW_S; fan-outs: :meth:`current_gammas`'s), and every rate window is full."""
        fe = self._frontends.get(node)
        if fe is not None:
            fe.prune(now)
            ever = fe.reported_at > -np.inf
            if fe.requests[ever].any() or (fe.seconds[ever] < PLAN_RATE_WINDOW_S - FULL_WINDOW_SLACK_S).any():
                return False
        return not any((parent or child) and now - t <= 2 * RATE_REPORT_TTL_S
                       for parent, child, t in self.edges.get(node, {}).values())

    def forget(self, node_id: str) -> None:
        """A node left: its reports no longer count."""
        self._frontends.pop(node_id, None)
        self.rates.pop(node_id, None)
        self.edges.pop(node_id, None)
        self.quiet.pop(node_id, None)

    def _summed(self, now: float) -> _Sums:
        """Every frontend's readings at ``now``, summed by session (kept while none of them changes)."""
        readings = [fe.read(now) for fe in self._frontends.values()]
        if self._sums is None or len(readings) != len(self._sums[0]) or \
                any(a is not b for a, b in zip(readings, self._sums[0])):
            self._sums = (readings, _Sums(self._names, readings))
        return self._sums[1]

    def planning_rates(self, now: float) -> dict[str, float]:
        """The rates a plan is made for: requests over time across the reports of the last
        PLAN_RATE_WINDOW_S, per frontend, summed (the smoothed rate where a frontend sent no counts);
        where a frontend's latest report is a surge (:meth:`surges`), that report's rate instead.

        The smoothed rate decides *when* to re-plan, and a re-plan starts when it is at a high (or
        low) excursion; planning on that value would keep the excursion. The window's mean is steadier,
        but lags a step up by the window's length: a surge beyond noise is planned for at once.
        """
        return dict(self._summed(now).rates)

    def rate_windows_s(self, now: float) -> dict[str, float]:
        """Per session, the seconds of counted requests behind its planning rate: the shortest window of
        any frontend reporting it (0 where a frontend sent no counts: no noise estimate). The planner
        tells noise from change with it (globalsched/planning/rate_judgement.py, :func:`settled_rates`)."""
        return dict(self._summed(now).windows)

    def surges(self, now: float) -> dict[str, float]:
        """Sessions whose latest report, on some frontend, is a surge (common/surge.py) against that
        frontend's window mean (its first report in the window: against none): their rate summed
        over frontends, with the surging frontends' latest rates. The planner keeps those that are
        surges against the rate planned too (globalsched/planning/rate_judgement.py, :func:`real_surges`)."""
        sums = self._summed(now)
        return {model: sums.rates[model] for model in sums.surging}

    def surge_windows_s(self, now: float) -> dict[str, float]:
        """Per surging session, the seconds of the latest report that surged (the shortest, when
        several frontends' did): what the planner judges a surge's noise by."""
        return dict(self._summed(now).surging)

    def latest_reports(self, now: float) -> dict[str, tuple[float, float]]:
        """Per session, its latest reports' rate summed over frontends, and the shortest of their
        windows: whether a surge's traffic goes on (globalsched/planning/rate_judgement.py, :func:`held_surges`)."""
        return dict(self._summed(now).latest)

    def window_rates(self, now: float) -> dict[str, WindowRate]:
        """Per session, its window's mean rate with the noise of its counts (common/surge.py,
        :func:`dispersion`): what the device scaling policy judges an outrun plan by. Sessions a
        frontend reported without counts are left out."""
        return dict(self._summed(now).window_rates)

    def rate_dispersions(self, now: float) -> dict[str, float]:
        """Per session, the index of dispersion of its counts (:meth:`window_rates`), where known: the
        noise the planner judges a drop beyond (globalsched/planning/rate_judgement.py, :func:`dropped_rates`)."""
        return dict(self._summed(now).dispersions)

    def current_rates(self, now: float) -> dict[str, float]:
        """The smoothed rate per session, summed over frontends."""
        totals: dict[str, float] = {}
        for per_model in self.rates.values():
            for model, (rate, t) in per_model.items():
                if now - t <= RATE_REPORT_TTL_S:
                    totals[model] = totals.get(model, 0.0) + rate
        return totals

    def current_gammas(self, now: float) -> dict[tuple[str, str, str], float]:
        """Measured fan-out per query edge: child rows per parent row over the recent window."""
        totals: dict[tuple[str, str, str], list[int]] = {}
        for per_edge in self.edges.values():
            for key, (parent, child, t) in per_edge.items():
                if now - t <= 2 * RATE_REPORT_TTL_S:
                    acc = totals.setdefault(key, [0, 0])
                    acc[0] += parent
                    acc[1] += child
        return {k: c / p for k, (p, c) in totals.items() if p >= MIN_EDGE_SAMPLES}
