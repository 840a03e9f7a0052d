"""What the frontends report: request rates per session and fan-out counts per query edge.

Each frontend's rate is smoothed exponentially (it decides *when* to re-plan) and its request counts
are kept over a window (the window's mean is what a plan is made for). Fan-out counts per query edge
give the measured gamma of each edge. A frontend that leaves takes its reports with it (:meth:`forget`).
Pure bookkeeping: time is passed in.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass

from common.pb import control
from common.surge import dispersion_of_sums, is_surge

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


def _count(sums: list, n: float, w: float, sign: int) -> None:
    """Add (sign 1) or take away (-1) one count of ``n`` requests over ``w`` seconds to a history's sums."""
    sums[0] += sign * n
    sums[1] += sign * w
    sums[2] += sign * n * n / w
    sums[3] += sign


class Workload:
    def __init__(self) -> None:
        self.rates: dict[str, dict[str, tuple[float, float]]] = {}   # frontend -> model -> (rate, t)
        # frontend -> model -> (time, requests, window seconds) of its reports over PLAN_RATE_WINDOW_S
        self.rate_history: dict[str, dict[str, collections.deque]] = {}
        self.edges: dict[str, dict[tuple[str, str, str], tuple[int, int, float]]] = {}  # frontend -> edge -> counts
        self._memo: tuple[float, tuple] | None = None     # (now, _rates(now)) until the next report or forget
        self._window_memo: tuple[float, float, dict] | None = None  # (from, until, window_rates) likewise
        self._node_windows: dict[str, tuple[float, float, dict]] = {}   # each frontend's part of it, likewise
        # rate_history's running sums per frontend and session: [requests, seconds, sum of n*n/w, counts]
        self._history_sums: dict[str, dict[str, list]] = {}
        # frontend -> the models of its latest report, when that report counted nothing
        self.quiet: dict[str, frozenset[str]] = {}
        self.last_requested: dict[str, float] = {}   # session -> when a report last counted a request of it

    def last_requested_s(self) -> dict[str, float]:
        """When each session's requests were last reported (monotonic): residency evicts the least
        recently used (globalsched/planning/residency.py)."""
        return dict(self.last_requested)

    def report(self, request: control.WorkloadReport, now: float) -> bool:
        """Take one frontend's report (its node is known: the caller checked). Whether it is news for
        the planner: False only for a report that counts nothing (no request, no fan-out), of the
        same models as the frontend's previous report, which counted nothing either, while the
        frontend's windows hold no count and are full (:meth:`_settled`): its share of the planner's
        inputs is then the same zeros as at its previous report.

        An idle frontend sends such a report every few seconds; judging the plan on each cost the
        scheduler CPU in proportion to time, not to events. What time alone changes is judged by
        the epoch timer (globalsched/planning/control_loop.py)."""
        self._memo = self._window_memo = None
        self._node_windows.pop(request.node_id, None)
        for r in request.rates:
            if r.requests:
                self.last_requested[r.model] = now
        quiet = not any(r.requests or r.rate_rps > 0 for r in request.rates) and \
            not any(e.parent_requests or e.child_requests for e in request.edges)
        models = frozenset(r.model for r in request.rates)
        was_quiet = self.quiet.get(request.node_id) == models
        if quiet:
            self.quiet[request.node_id] = models
        else:
            self.quiet.pop(request.node_id, None)
        table = self.rates.setdefault(request.node_id, {})
        for r in request.rates:
            rate = max(r.rate_rps, 0.0)
            old = table.get(r.model)
            if old is not None and now - old[1] <= RATE_REPORT_TTL_S:   # smooth Poisson noise of short windows
                rate = RATE_SMOOTHING * rate + (1 - RATE_SMOOTHING) * old[0]
            table[r.model] = (rate, now)
            if r.window_ms > 0:
                history = self.rate_history.setdefault(request.node_id, {}).setdefault(r.model, collections.deque())
                sums = self._history_sums.setdefault(request.node_id, {}).setdefault(r.model, [0.0, 0.0, 0.0, 0])
                history.append((now, r.requests, r.window_ms / 1000))
                _count(sums, r.requests, r.window_ms / 1000, 1)
                while history and history[0][0] < now - PLAN_RATE_WINDOW_S:
                    _, n, w = history.popleft()
                    _count(sums, n, w, -1)
        edges = self.edges.setdefault(request.node_id, {})
        for e in request.edges:
            key = (e.query, e.parent, e.child)
            old = edges.get(key)
            if old is not None and now - old[2] <= RATE_REPORT_TTL_S:   # keep a window of recent counts
                edges[key] = (old[0] + e.parent_requests, old[1] + e.child_requests, old[2])
            else:
                edges[key] = (e.parent_requests, e.child_requests, now)
        return not (quiet and was_quiet and self._settled(request.node_id, now))

    def _settled(self, node: str, now: float) -> bool:
        """Whether ``node``'s reports hold no count within the windows the planner reads (rates:
        PLAN_RATE_WINDOW_S; fan-outs: :meth:`current_gammas`'s), and every rate window is full."""
        for model in self.rates.get(node, {}):
            fresh = self._fresh(node, model, now)
            if any(n for n, _ in fresh) or sum(w for _, w in fresh) < PLAN_RATE_WINDOW_S - FULL_WINDOW_SLACK_S:
                return False
        return not any((parent or child) and now - t <= 2 * RATE_REPORT_TTL_S
                       for parent, child, t in self.edges.get(node, {}).values())

    def forget(self, node_id: str) -> None:
        """A node left: its reports no longer count."""
        self._memo = self._window_memo = None
        self._node_windows.pop(node_id, None)
        self.rates.pop(node_id, None)
        self.rate_history.pop(node_id, None)
        self._history_sums.pop(node_id, None)
        self.edges.pop(node_id, None)
        self.quiet.pop(node_id, None)

    def planning_rates(self, now: float) -> dict[str, float]:
        """The rates a plan is made for: requests over time across the reports of the last
        PLAN_RATE_WINDOW_S, per frontend, summed (the smoothed rate where a frontend sent no counts);
        where a frontend's latest report is a surge (:meth:`surges`), that report's rate instead.

        The smoothed rate decides *when* to re-plan, and a re-plan starts when it is at a high (or
        low) excursion; planning on that value would keep the excursion. The window's mean is steadier,
        but lags a step up by the window's length: a surge beyond noise is planned for at once.
        """
        return dict(self._rates(now)[0])

    def rate_windows_s(self, now: float) -> dict[str, float]:
        """Per session, the seconds of counted requests behind its planning rate: the shortest window of
        any frontend reporting it (0 where a frontend sent no counts: no noise estimate). The planner
        tells noise from change with it (globalsched/planning/planner.py, :func:`settled_rates`)."""
        return dict(self._rates(now)[2])

    def surges(self, now: float) -> dict[str, float]:
        """Sessions whose latest report, on some frontend, is a surge (common/surge.py) against that
        frontend's window mean (its first report in the window: against none): their rate summed
        over frontends, with the surging frontends' latest rates. The planner keeps those that are
        surges against the rate planned too (globalsched/planning/planner.py, :func:`real_surges`)."""
        rates, surging, _ = self._rates(now)
        return {model: rates[model] for model in surging}

    def surge_windows_s(self, now: float) -> dict[str, float]:
        """Per surging session, the seconds of the latest report that surged (the shortest, when
        several frontends' did): what the planner judges a surge's noise by."""
        return dict(self._rates(now)[1])

    def latest_reports(self, now: float) -> dict[str, tuple[float, float]]:
        """Per session, its latest reports' rate summed over frontends, and the shortest of their
        windows: whether a surge's traffic goes on (globalsched/planning/planner.py, :func:`held_surges`)."""
        out: dict[str, tuple[float, float]] = {}
        for node, per_model in self.rates.items():
            for model, (_, t) in per_model.items():
                fresh = self._fresh(node, model, now)
                if now - t > RATE_REPORT_TTL_S or not fresh or fresh[-1][1] <= 0:
                    continue
                n, w = fresh[-1]
                rate, window = out.get(model, (0.0, w))
                out[model] = (rate + n / w, min(window, w))
        return out

    def window_rates(self, now: float) -> dict[str, WindowRate]:
        """Per session, its window's mean rate with the noise of its counts (common/surge.py,
        :func:`dispersion`): what the device scaling policy judges an outrun plan by. Sessions a
        frontend reported without counts are left out. The device scaler asks every tick; the answer
        changes only with a report or when one ages out of the window, so it is kept until then."""
        memo = self._window_memo
        if memo is not None and memo[0] <= now <= memo[1]:
            return dict(memo[2])
        out: dict[str, WindowRate] = {}
        until = math.inf            # the answer holds until a report counted now ages out
        for node in self.rates:
            # A frontend's part changes only with its own report or with time: worked out again then,
            # not for every other frontend's report (at 2,400 sessions, a second of the loop each time).
            part = self._node_windows.get(node)
            if part is None or not part[0] <= now <= part[1]:
                part = self._node_windows[node] = self._node_window(node, now)
            until = min(until, part[1])
            for model, mine in part[2].items():
                old = out.get(model)
                if old is not None:
                    d = None if mine.dispersion is None or old.dispersion is None else max(mine.dispersion,
                                                                                            old.dispersion)
                    mine = WindowRate(old.rate_rps + mine.rate_rps, min(mine.window_s, old.window_s), d)
                out[model] = mine
        self._window_memo = (now, until, out)
        return dict(out)

    def _node_window(self, node: str, now: float) -> tuple[float, float, dict[str, WindowRate]]:
        """``node``'s part of :meth:`window_rates`: (from, until, its rates by session)."""
        out: dict[str, WindowRate] = {}
        until = math.inf
        histories, all_sums = self.rate_history.get(node, {}), self._history_sums.get(node, {})
        for model, (_, t) in self.rates.get(node, {}).items():
            if now - t > RATE_REPORT_TTL_S or model not in histories:
                continue
            # the history's sums, less its oldest counts that aged out of the window since the report
            requests, seconds, squares, counts = all_sums[model]
            oldest = None
            for at, n, w in histories[model]:
                if now - at <= PLAN_RATE_WINDOW_S:
                    oldest = at
                    break
                requests, seconds, squares, counts = requests - n, seconds - w, squares - n * n / w, counts - 1
            if oldest is None or seconds <= 0:
                continue
            until = min(until, t + RATE_REPORT_TTL_S, oldest + PLAN_RATE_WINDOW_S)
            out[model] = WindowRate(requests / seconds, seconds,
                                    dispersion_of_sums(requests, seconds, squares, counts))
        return now, until, out

    def _fresh(self, node: str, model: str, now: float) -> list[tuple[float, float]]:
        """(requests, seconds) of ``node``'s reports of ``model`` within the rate window, oldest first."""
        return [(n, w) for at, n, w in self.rate_history.get(node, {}).get(model, ()) if now - at <= PLAN_RATE_WINDOW_S]

    def _rates(self, now: float) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
        """(rates, surge windows, rate windows) at ``now``; one view reads all three, and the planner
        reads a view every evaluation: computed once per instant and set of reports."""
        if self._memo is not None and self._memo[0] == now:
            return self._memo[1]
        result = self._compute_rates(now)
        self._memo = (now, result)
        return result

    def _compute_rates(self, now: float) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
        totals: dict[str, float] = {}
        surging: dict[str, float] = {}
        windows: dict[str, float] = {}
        for node, per_model in self.rates.items():
            for model, (smoothed, t) in per_model.items():
                if now - t > RATE_REPORT_TTL_S:
                    continue
                fresh = self._fresh(node, model, now)
                window_s = sum(w for _, w in fresh)
                rate = sum(n for n, _ in fresh) / window_s if window_s > 0 else smoothed
                if fresh:               # a frontend's first report is judged against nothing: all news
                    latest_n, latest_w = fresh[-1]
                    before_s = window_s - latest_w
                    mean = sum(n for n, _ in fresh[:-1]) / before_s if before_s > 0 else 0.0
                    expected = mean * latest_w
                    # beyond noise around the window's mean: a plan made for the mean would miss
                    # for the window's length
                    if is_surge(latest_n, expected):
                        rate = max(rate, latest_n / latest_w)
                        surging[model] = min(surging.get(model, latest_w), latest_w)
                totals[model] = totals.get(model, 0.0) + rate
                windows[model] = min(windows.get(model, window_s), window_s)
        return totals, surging, windows

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
