"""A simulated frontend: its routing table, the production choice of backend
(:func:`frontend.routing.choose_route`) and time budget (:func:`frontend.frontend_state.backend_budget_s`),
retries, and its workload reports with the production report clock
(:class:`frontend.early_report.ReportClock`: every period, and at once on a surge).

As the frontend's dispatch does: a request whose backend goes away (killed: a broken stream; or it
no longer has the model) is retried on another backend of the model while its deadline allows;
when every backend of a served model is gone it waits for the next routing table, until its
deadline; a model with no backend is answered UNAVAILABLE at once. A request for a cold model (on
no device, globalsched/planning/residency.py) is held, its deadline extended by the page-in's allowance
(``COLD_START_ALLOWANCE_S``), and reported at once, as the frontend's report loop reports a page-in:
the scheduler re-plans with the model resident, and the routing table that routes it releases the
request.
"""

from __future__ import annotations

from dataclasses import dataclass

from frontend.frontend_state import COLD_START_ALLOWANCE_S, RETURN_ALLOWANCE_MAX_S, backend_budget_s
from frontend.early_report import CHECK_S, ReportClock, workload_report
from frontend.routing import Route, choose_route
from nexus.simulate.outcomes import Status

NO_TRIES: frozenset[str] = frozenset()


@dataclass(frozen=True)
class SimRoute:
    """One model in a simulated routing table."""

    routes: tuple[Route, ...]
    planned_rate_rps: float
    cold: bool = False           # resident on no device: a request pages it in


class SimFrontend:
    def __init__(self, sim, node_id: str) -> None:
        self.sim = sim
        self.node_id = node_id
        self.epoch = 0
        self.table: dict[str, SimRoute] = {}
        self.outstanding: dict[str, int] = {}
        self.down: set[str] = set()
        self.window: dict[str, int] = {}
        self.tried: dict[int, set[str]] = {}
        # requests waiting for a routing table (with a backend), and their status should none come in time
        # with the deadline the wait was armed for (a wait re-armed with a later one outlives the first):
        # the first table's hold ends in DEADLINE_EXCEEDED, a lost route's wait in UNAVAILABLE
        # (frontend/frontend_state.py, FrontendState.admit and call_backend)
        self.waiting: dict[int, tuple[Status, float]] = {}
        self.page_in: set[str] = set()      # cold models requested since the last report
        self.asked_cold: set[str] = set()   # cold models asked for since the last routing table (once each)
        self.clock = ReportClock(sim.config.report_interval_s, 0.0)
        self.return_allowance_s = min(sim.config.path_ms / 2000.0, RETURN_ALLOWANCE_MAX_S)

    # ---- requests --------------------------------------------------------------------------------

    def accept(self, request: int, model: str, now: float) -> None:
        """A client's request reaches this frontend: counted as demand, then dispatched."""
        self.window[model] = self.window.get(model, 0) + 1
        self.dispatch(now, request)

    def dispatch(self, now: float, request: int) -> None:
        sim = self.sim
        model = sim.model_of(request)
        left_s = sim.deadline_s(request) - now
        if left_s <= 0:
            self._finish(request, Status.EXPIRED, now)
            return
        if self.epoch == 0:           # held until the first routing table (FrontendState.admit)
            self._wait(request)
            return
        entry = self.table.get(model)
        if entry is not None and entry.cold and not entry.routes:
            self._page_in(now, request, model)
            return
        if entry is None or not entry.routes:
            self._finish(request, Status.UNAVAILABLE, now)
            return
        outstanding = self.outstanding
        while True:
            route = choose_route(entry.routes, lambda a: outstanding.get(a, 0), self.down.__contains__,
                                 self.tried.get(request, NO_TRIES), sim.rng.random)
            if route is None:         # every backend of a served model is gone: wait for the next table
                self._wait(request)
                return
            backend = sim.backends[route.node_id]
            outstanding[route.address] = outstanding.get(route.address, 0) + 1    # the backend may answer at once
            why = backend.enqueue(request, model, now + backend_budget_s(left_s, self.return_allowance_s), now)
            if not why:
                return
            outstanding[route.address] -= 1
            if why == "overloaded":
                self._finish(request, Status.OVERLOADED, now)
                return
            self.tried.setdefault(request, set()).add(route.address)    # not loaded there: try another

    def returned(self, request: int, backend_id: str) -> None:
        """``backend_id`` answered (or dropped) the request: it no longer counts as outstanding there."""
        self.outstanding[backend_id] -= 1
        self.tried.pop(request, None)

    def let_go(self, request: int, backend_id: str, broken: bool, now: float) -> None:
        """The backend let the request go (``broken``: its connection broke, and so it is down):
        retried on another backend one hop later."""
        self.outstanding[backend_id] -= 1
        if broken:
            self.down.add(backend_id)
        self.tried.setdefault(request, set()).add(backend_id)
        self.sim.at(now + self.sim.config.path_ms / 1000.0, self.dispatch, request)

    def _page_in(self, now: float, request: int, model: str) -> None:
        """Hold a request for a cold model until a routing table routes it (frontend/frontend_state.py's
        ``_paged_in``), asking for the page-in with a report now."""
        sim = self.sim
        sim.outcomes.found_cold(request)
        sim.extend_deadline(request, now + COLD_START_ALLOWANCE_S)
        if model not in self.asked_cold:        # FrontendState.ask_page_in
            self.asked_cold.add(model)
            if not self.page_in:
                sim.at(now, self._report)
            self.page_in.add(model)
        self._wait(request)

    def _wait(self, request: int) -> None:
        deadline_s = self.sim.deadline_s(request)
        self.waiting[request] = (Status.EXPIRED if self.epoch == 0 else Status.UNAVAILABLE, deadline_s)
        self.sim.at(deadline_s, self._give_up, request, deadline_s)

    def _give_up(self, now: float, request: int, deadline_s: float) -> None:
        waiting = self.waiting.get(request)
        if waiting is not None and waiting[1] == deadline_s:
            del self.waiting[request]
            self._finish(request, waiting[0], now)

    def _finish(self, request: int, status: Status, now: float) -> None:
        self.tried.pop(request, None)
        self.sim.ended(request, status, now)

    # ---- tables and reports ----------------------------------------------------------------------

    def set_table(self, now: float, epoch: int, table: dict[str, SimRoute]) -> None:
        if epoch < self.epoch:
            return
        self.epoch = epoch
        self.table = table
        self.asked_cold = set()
        live = {r.address for e in table.values() for r in e.routes}
        self.down &= live
        waiting, self.waiting = self.waiting, {}
        for request in waiting:
            self.tried.pop(request, None)
            self.dispatch(now, request)

    def check_report(self, now: float) -> None:
        """The report loop's turn (every CHECK_S): a report when the period is over or a session surged."""
        sim = self.sim
        sim.at(now + min(CHECK_S, sim.config.report_interval_s), self.check_report)
        self._report(now)

    def _report(self, now: float) -> None:
        """A workload report when one is due, a session surged or a cold model was requested."""
        sim = self.sim
        planned = {name: e.planned_rate_rps for name in self.window if (e := self.table.get(name)) is not None}
        surging = self.clock.due(self.window, planned, now)
        paging_in, self.page_in = sorted(self.page_in), set()
        if surging is None:
            if paging_in:         # a report of their own, as the frontend's report loop sends
                report = workload_report(self.node_id, self.clock.page_in_counts(self.window, paging_in, now))
                sim.log(now, "page-in", f"{self.node_id}: {', '.join(paging_in)} requested while cold")
                sim.at(now + sim.config.control_hop_ms / 1000.0, sim.scheduler.report, report)
            return
        window, self.window = self.window, {}
        report = workload_report(self.node_id, self.clock.report_counts(window, list(self.table), planned, surging, now))
        self.clock.reported(now, surging)
        if surging:
            sim.log(now, "report", f"{self.node_id}: early workload report, {', '.join(surging)} surged")
        if paging_in:
            sim.log(now, "page-in", f"{self.node_id}: {', '.join(paging_in)} requested while cold")
        sim.at(now + sim.config.control_hop_ms / 1000.0, sim.scheduler.report, report)
