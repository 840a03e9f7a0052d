"""The frontend's dispatch core, below every transport.

KServe gRPC (``frontend/kserve.py``), HTTP/REST (``frontend/rest.py``, through the KServe handlers),
and multi-model queries (``frontend/queries.py``) sit above this module and reach backends only
through it; it imports none of them.

Contracts:
- :class:`FrontendState` is what one frontend knows: the routing table, the backend connections,
  the demand windows it reports, the Triton statistics and the Prometheus recorder.
- :meth:`FrontendState.admit` takes in every inference request, whatever its transport (KServe gRPC
  unary or streaming, HTTP/REST): it is counted in flight until it ends, which the drain on SIGTERM
  waits for, and one that arrives before the first routing table waits for it. A frontend listens
  before the scheduler has pushed it a table (the scheduler reaches it on that port), so a client
  that dials it at once, as a round-robin client does when a restarted frontend comes back, would
  get NOT_FOUND for every model; the wait is at most ``FIRST_TABLE_WAIT_S`` and never past the
  request's own deadline.
- :func:`dispatch` runs one request on a backend of a model, chosen by load (outstanding requests
  per unit of planned share), and retries on another backend when the first one disappears, while
  the request's deadline allows.
- :func:`request_budget_s` is a request's time budget.
- :class:`RequestRecord` is the one place where a request of a known model or query becomes
  counters: demand, Triton statistics and Prometheus metrics, for success and failure alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Iterator

import grpc

from common import grpc_util
from common.late_requests import SERVE_LATE_LIMIT_S
from common.pb import control
from common.security import Credentials
from common.exec_status import ExecStatus
from frontend.backend_pool import BackendGone, BackendPool, Reply
from frontend.metrics import FrontendMetrics
from frontend.requests import RequestError
from frontend.routing import ModelEntry, RoutingTable, choose_route
from frontend.shared_memory import SharedMemoryRegistry
from frontend.trace import Marks, Tracer

_EXEC_TO_GRPC = {
    ExecStatus.NOT_FOUND: grpc.StatusCode.UNAVAILABLE,
    ExecStatus.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    ExecStatus.DEADLINE: grpc.StatusCode.DEADLINE_EXCEEDED,
    ExecStatus.OVERLOADED: grpc.StatusCode.UNAVAILABLE,      # a full queue, as Triton answers it
    ExecStatus.INTERNAL: grpc.StatusCode.INTERNAL,
    ExecStatus.CANCELLED: grpc.StatusCode.CANCELLED,
    ExecStatus.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
}
# How long a request for a cold session may wait beyond its own budget for the session to be paged
# in: the placement, the load and warm-up of its model, and the routing table (benchmarks/ready.md:
# 0.1-0.4 s from plan to route for the sample models on a CPU).
COLD_START_ALLOWANCE_S = 5.0
# A request whose backend has not answered this long after its deadline is cancelled there and
# answered DEADLINE_EXCEEDED (the backend drops expired requests itself; this covers a backend
# busy with a long batch or hung).
DEADLINE_GRACE_S = 0.02
PATH_SMOOTHING = 0.05
CLIENT_PATH_SHARE = 0.05
RETURN_ALLOWANCE_MAX_S = 0.1
FIRST_TABLE_WAIT_S = 5.0
ANSWER_MARGIN_S = 0.1     # a request held for the first table stops waiting this long before its deadline


class FrontendState:
    """What the frontend knows: the routing table, backend connections, counters and rates."""

    def __init__(self, use_stream: bool = True, creds: Credentials = grpc_util.NO_CREDENTIALS,
                 tracer: Tracer | None = None) -> None:
        self.table = RoutingTable.empty()
        self.tracer = tracer                             # --trace: per-request timelines (frontend/trace.py)
        self.shared_memory = SharedMemoryRegistry()      # clients' registered system shared memory
        self.pool = BackendPool(creds)
        self.health = None                               # common.health.Health, set by the server
        self.use_stream = use_stream
        self.ready = False
        self.in_flight = 0                               # requests and calls being served now (see admit)
        self.calls_started = 0                           # ... and since the start (a drain waits for them to stop)
        # Rows per model and query since the last report: a request of n rows counts n, as batches
        # are sized in rows and query stages count their rows (the scheduler plans in rows/s).
        self.requests_window: dict[str, int] = {}
        self.counters: dict[str, dict[str, int]] = {}   # per model: success/fail counts, ns, rows
        self.edge_window: dict[tuple[str, str, str], list[int]] = {}  # (query, parent, child) -> [parent, child] rows
        self.table_changed = asyncio.Event()
        # cold sessions a request asked for since the last workload report: the report goes at once
        # (frontend/server.py), and the scheduler pages them in (globalsched/planning/residency.py)
        self.page_in: set[str] = set()
        self.page_in_asked = asyncio.Event()
        # cold sessions asked for since the routing table changed: asked once per table, not per request
        # (a table that leaves one cold clears it, and its next request asks again)
        self.asked_cold: set[str] = set()
        self.metrics = FrontendMetrics(lambda: self.table, lambda: self.in_flight)   # served by frontend/server.py
        self.path_overhead_s = 0.0                      # smoothed frontend-backend-frontend overhead
        self.path_deviation_s = 0.0                     # and its smoothed mean deviation

    def set_table(self, table: RoutingTable) -> None:
        self.table = table
        self.pool.sync(table.addresses())     # readiness follows in frontend/readiness.py
        self.asked_cold = set()
        self.table_changed.set()
        self.table_changed = asyncio.Event()

    def ask_page_in(self, session: str) -> None:
        """A request waits for cold ``session``: report it at once, unless asked since the last table."""
        if session not in self.asked_cold:
            self.asked_cold.add(session)
            self.page_in.add(session)
            self.page_in_asked.set()

    @contextlib.contextmanager
    def counted(self) -> Iterator[None]:
        """Count a call in flight while in the block (the drain on SIGTERM waits for it to end)."""
        self.in_flight += 1
        self.calls_started += 1
        try:
            yield
        finally:
            self.in_flight -= 1

    @contextlib.asynccontextmanager
    async def admit(self, deadline_s: float | None) -> AsyncIterator[float | None]:
        """Take in an inference request with ``deadline_s`` left (None: no deadline): counted in flight
        while in the block, and held until the first routing table (module doc); yields the deadline
        left after the hold."""
        with self.counted():
            if self.table.epoch == 0:
                deadline_s = await self._first_table(deadline_s)
            yield deadline_s

    async def _first_table(self, deadline_s: float | None) -> float | None:
        start = time.monotonic()
        wait_s = FIRST_TABLE_WAIT_S if deadline_s is None else min(FIRST_TABLE_WAIT_S, deadline_s - ANSWER_MARGIN_S)
        while self.table.epoch == 0 and (left_s := start + wait_s - time.monotonic()) > 0:
            try:
                await asyncio.wait_for(self.table_changed.wait(), left_s)
            except asyncio.TimeoutError:
                break
        return None if deadline_s is None else deadline_s - (time.monotonic() - start)

    def entry(self, name: str, version: str = "") -> ModelEntry:
        """The routing table's query ``name``, or version ``version`` of model ``name`` (empty: the
        newest ready one, :meth:`RoutingTable.newest`); RequestError NOT_FOUND naming what it lacks."""
        table = self.table
        query = table.queries.get(name)
        if query is not None:
            if version not in ("", "1"):
                raise RequestError(grpc.StatusCode.NOT_FOUND, f"query {name!r} has no version {version!r} "
                                                              f"(a query has version 1 only)")
            return query
        versions = table.versions.get(name)
        if versions:
            if not version:
                return table.newest(name)
            model = versions.get(int(version)) if version.isdigit() else None
            if model is None:
                raise RequestError(grpc.StatusCode.NOT_FOUND,
                                   f"model {name!r} has no version {version!r} (its versions: "
                                   f"{', '.join(str(v) for v in versions)})")
            return model
        model = table.models.get(name)          # a query's stage session, "<query>/<stage>"
        if model is None or model.session != model.name:
            raise RequestError(grpc.StatusCode.NOT_FOUND, f"unknown model {name!r}")
        return model

    def return_allowance_s(self) -> float:
        """Time kept off a request's budget at the backend for the way there and back: the smoothed
        overhead of the frontend-backend path plus four smoothed deviations (at most RETURN_ALLOWANCE_MAX_S)."""
        return min(self.path_overhead_s + 4 * self.path_deviation_s, RETURN_ALLOWANCE_MAX_S)

    def observe_path(self, sent_s: float, result: Reply) -> None:
        """Smooth the path's overhead (a request's time at the frontend less its queue and compute)
        and its deviation, as TCP smooths round-trip times."""
        overhead = max(time.monotonic() - sent_s - (result.queue_ns + result.compute_ns) / 1e9, 0.0)
        self.path_deviation_s += PATH_SMOOTHING * (abs(overhead - self.path_overhead_s) - self.path_deviation_s)
        self.path_overhead_s += PATH_SMOOTHING * (overhead - self.path_overhead_s)

    def count(self, model: str, key: str, value: int = 1) -> None:
        c = self.counters.setdefault(model, {})
        c[key] = c.get(key, 0) + value

    def count_demand(self, name: str, rows: int) -> None:
        """``rows`` rows asked of model, query or stage session ``name`` (reported as its rate)."""
        self.requests_window[name] = self.requests_window.get(name, 0) + rows

    @contextlib.contextmanager
    def record(self, name: str, start_s: float) -> Iterator["RequestRecord"]:
        """Record the outcome of one request of model or query ``name``, started at ``start_s``
        (monotonic): a RequestError or a cancellation leaving the block is counted as a failure and
        goes on; success is what :meth:`RequestRecord.succeeded` says."""
        record = RequestRecord(self, name, start_s)
        try:
            yield record
        except RequestError as exc:
            record.failed(exc.code)
            raise
        except asyncio.CancelledError:      # its client gave up: a failure, as in Triton's statistics
            record.failed(grpc.StatusCode.CANCELLED)
            raise


class RequestRecord:
    """One request of a known model or query, from its arrival to its outcome: the only place where
    requests become demand, Triton statistics and Prometheus metrics (see :meth:`FrontendState.record`).

    A request counts as demand, and a later failure in the statistics' failures, only once it was
    :meth:`accepted` (valid); a malformed request is a failure in the metrics alone."""

    def __init__(self, state: FrontendState, name: str, start_s: float) -> None:
        self.state, self.name, self.start_s = state, name, start_s
        self.accepted_rows: int | None = None

    def accepted(self, rows: int) -> None:
        """The request is valid and asks for ``rows`` rows."""
        self.accepted_rows = rows
        self.state.count_demand(self.name, rows)

    def succeeded(self, rows: int, budget_s: float, reply: Reply | None = None) -> None:
        """Answered, ``budget_s`` its time budget; ``reply`` is the backend's answer (None for a
        query, whose stages ran on several backends)."""
        elapsed_s = time.monotonic() - self.start_s
        state = self.state
        state.count(self.name, "success")
        state.count(self.name, "rows", rows)
        state.count(self.name, "success_ns", int(elapsed_s * 1e9))
        state.metrics.success(self.name, rows, elapsed_s, budget_s, reply)

    def failed(self, code: grpc.StatusCode) -> None:
        if self.accepted_rows is not None:
            self.state.count(self.name, "fail")
        self.state.metrics.failure(self.name, code)


def _pick(state: FrontendState, model: ModelEntry, exclude: set[str]):
    pool = state.pool
    return choose_route(model.backends, lambda address: pool.get(address).outstanding, pool.is_down, exclude,
                        random.random)


def backend_budget_s(left_s: float, return_allowance_s: float) -> float:
    """How long a backend may take for a request with ``left_s`` of its budget left: the backend must
    finish early enough for the answer to travel back to the client, so the measured overhead of the
    path to the backend (``return_allowance_s``) and at least a share of the budget for the way in and
    out of the frontend are kept off it (that share grows when the machine is loaded, as under
    overload, where a batch that only just meets its oldest request's deadline would answer it late);
    never less than half of what is left."""
    return max(left_s - max(return_allowance_s, CLIENT_PATH_SHARE * left_s), left_s / 2)


async def dispatch(state: FrontendState, model: ModelEntry, inputs: list[bytes], rows: int,
                   end_s: float, marks: Marks | None = None, serve_by_s: float | None = None) -> Reply:
    """Run one request of ``rows`` rows on a backend of ``model`` before ``end_s`` (monotonic).
    ``serve_by_s`` (a model that serves late requests): the deadline the backend orders and batches
    it by, before ``end_s``, when the request fails (None: ``end_s``).

    Retries on another backend when one disappears or no longer has the model, while time is
    left; when every backend of a served model is gone, waits (within the deadline) for the routing
    table the scheduler sends after repairing the plan. Raises RequestError with the gRPC status
    otherwise. A request still waiting on its backend past the deadline is cancelled there.
    ``inputs`` are the raw tensors in the model's input order. ``marks``, when the
    request is traced, get the clock readings of the last attempt's send and reply.
    """
    tried: set[str] = set()
    last_reason = model.reason or "no backend serves it"
    while True:
        route = _pick(state, model, tried)
        left = end_s - time.monotonic()
        if left <= 0:
            raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED, f"model {model.name!r}: deadline passed")
        if route is None:
            if model.cold:
                # also a model evicted while this request was on its way: it gets the page-in's time too
                end_s = max(end_s, time.monotonic() + COLD_START_ALLOWANCE_S)
                model = await _paged_in(state, model, end_s)
                tried = set()
                continue
            if not model.backends:
                raise RequestError(grpc.StatusCode.UNAVAILABLE, f"model {model.name!r} is not available: {last_reason}")
            changed = state.table_changed   # its backends are lost: the repaired table comes soon
            try:
                await asyncio.wait_for(changed.wait(), timeout=left)
            except asyncio.TimeoutError:
                raise RequestError(grpc.StatusCode.UNAVAILABLE,
                                   f"model {model.name!r} is not available: {last_reason}") from None
            model = state.table.models.get(model.session) or model
            tried = set()
            continue
        serve_left = left if serve_by_s is None else serve_by_s - time.monotonic()
        budget_s = backend_budget_s(serve_left, state.return_allowance_s())
        # At least 1 us: a late request's deadline has passed, and 0 would mean "the SLO" to the backend.
        item = control.ExecItem(request_id=state.pool.next_id(), model=model.session,
                                budget_us=max(int(budget_s * 1e6), 1), inputs=inputs, rows=rows)
        conn = state.pool.get(route.address)
        if marks is not None:
            marks.sent = time.monotonic_ns()
        try:
            if state.use_stream:
                result = await conn.execute(item, left + DEADLINE_GRACE_S)
            else:
                result = await conn.execute_unary(item, left + 1.0)
        except BackendGone as exc:
            tried.add(route.address)
            last_reason = str(exc)
            continue
        except asyncio.TimeoutError:
            raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"model {model.name!r}: deadline passed while queued") from None
        if marks is not None:
            marks.replied = time.monotonic_ns()
        if result.status is ExecStatus.OK:
            state.observe_path(end_s - left, result)
        if result.status in (ExecStatus.NOT_FOUND, ExecStatus.UNAVAILABLE):  # stale route, or draining
            tried.add(route.address)
            last_reason = result.message
            continue
        if result.status is not ExecStatus.OK:
            raise RequestError(_EXEC_TO_GRPC.get(result.status, grpc.StatusCode.INTERNAL), result.message)
        return result


async def _paged_in(state: FrontendState, model: ModelEntry, end_s: float) -> ModelEntry:
    """Ask for a cold session to be paged in, and wait (until ``end_s``) for the routing table that
    routes it; its entry then, or RequestError UNAVAILABLE with the reason when none came in time."""
    state.ask_page_in(model.session)
    state.metrics.cold_start(model.session)
    began = time.monotonic()
    while True:
        left = end_s - time.monotonic()
        if left <= 0:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, f"model {model.name!r} was not paged in within "
                                                            f"{time.monotonic() - began:.1f} s: {model.reason}")
        changed = state.table_changed
        try:
            await asyncio.wait_for(changed.wait(), timeout=left)
        except asyncio.TimeoutError:
            continue
        now = state.table.models.get(model.session)
        if now is None or not now.served:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, f"model {model.name!r} is no longer served")
        if now.backends:
            state.metrics.paged_in(model.session, time.monotonic() - began)
            return now
        if not now.cold:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, f"model {model.name!r} is not available: {now.reason}")
        model = now
        state.ask_page_in(model.session)     # a plan made meanwhile left it cold: ask again


def cold_budget_s(budget_s: float, deadline_s: float | None) -> float:
    """The time budget of a request for a cold session: its own, plus the time the page-in may take
    (COLD_START_ALLOWANCE_S), within the client's gRPC deadline when it has one."""
    extended = budget_s + COLD_START_ALLOWANCE_S
    return min(extended, deadline_s) if deadline_s is not None else extended


def late_limit_s(deadline_s: float | None) -> float:
    """How long a request of a model that serves late requests may take: the client's gRPC deadline,
    else SERVE_LATE_LIMIT_S. (Its 'timeout' parameter is its SLO, as for any request: the budget it
    is ordered, batched and counted late by.)"""
    return SERVE_LATE_LIMIT_S if deadline_s is None else deadline_s


def request_budget_s(slo_ms: float, timeout_us: int, deadline_s: float | None) -> float:
    """The request's time budget: its own 'timeout' parameter or the SLO, capped by the gRPC deadline."""
    budget_s = timeout_us / 1e6 if timeout_us else slo_ms / 1000
    return min(budget_s, deadline_s) if deadline_s is not None else budget_s
