"""The frontend process: KServe v2 on one port, plus the control service the scheduler pushes to;
KServe v2 HTTP/REST (``frontend.rest``) on a second port, in the same event loop.

It registers with the scheduler, heartbeats, and reports per-model demand in rows per second every
``report_interval_s``, and at once when a session's demand surges beyond its planned rate
(``frontend.early_report``). Routing tables arrive by push (``Frontend.UpdateRoutingTable``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import grpc

from common import grpc_util
from common.config import FrontendConfig, scheduler_addresses
from common.health import Health
from common.metrics_http import serve_metrics
from common.pb import control, control_grpc, kserve_grpc
from common.registration import keep_registered
from common.scheduler_connection import SchedulerConnection
from common.security import Credentials, ProtocolAccess, parse_restricted_header
from frontend import readiness, rest
from frontend.frontend_state import FrontendState
from frontend.early_report import CHECK_S, ReportClock, workload_report
from frontend.kserve import KServeService
from frontend.routing import RoutingTable
from frontend.trace import Tracer
from frontend.worker_statistics import SiblingCounts

log = logging.getLogger("nexus.frontend")

KSERVE_SERVICE = "inference.GRPCInferenceService"
DRAIN_SETTLE_S = 0.2            # a drain's waits end after a lull this long, seen by this many checks in a row
DRAIN_SETTLE_CHECKS = 5         # (a starved loop checks late: time alone would call its backlog a lull)
DRAIN_CHECK_S = 0.02
DRAIN_SENDERS_MAX_S = 2.0       # the longest a drain serves on while new calls keep coming


class FrontendControl(control_grpc.FrontendServicer):
    def __init__(self, state: FrontendState) -> None:
        self.state = state

    async def UpdateRoutingTable(self, request, context):
        if request.epoch < self.state.table.epoch:
            return control.RoutingTableReply()
        self.state.set_table(RoutingTable.from_proto(request))
        await readiness.evaluate(self.state)
        log.info("routing epoch %d: %s", request.epoch,
                 ", ".join(f"{m.name}->{len(m.backends)}" for m in self.state.table.models.values()) or "empty")
        return control.RoutingTableReply()


async def _report_loop(state: FrontendState, scheduler, node, interval_s: float) -> None:
    """Report the demand every ``interval_s``, and at once when a session surges (frontend/early_report.py)."""
    clock = ReportClock(interval_s, time.monotonic())
    while True:
        try:      # a request for a cold session is reported at once: the scheduler pages it in
            await asyncio.wait_for(state.page_in_asked.wait(), min(CHECK_S, interval_s))
        except asyncio.TimeoutError:
            pass
        now = time.monotonic()
        models = state.table.models
        planned = {name: m.planned_rate_rps for name in state.requests_window
                   if (m := models.get(name)) is not None and m.served}
        paging_in, state.page_in = sorted(state.page_in), set()
        state.page_in_asked.clear()
        surging = clock.due(state.requests_window, planned, now)
        if surging is None:
            if paging_in and node.node_id:      # a report of their own: the scheduler pages them in
                log.info("page-in report: %s requested while cold", ", ".join(paging_in))
                await _send_report(scheduler, workload_report(
                    node.node_id, clock.page_in_counts(state.requests_window, paging_in, now)))
            continue
        if surging:
            log.info("early workload report: demand of %s surged beyond its planned rate", ", ".join(surging))
        if paging_in:
            log.info("workload report: %s requested while cold", ", ".join(paging_in))
        if state.tracer is not None:
            state.tracer.flush()
        window, state.requests_window = state.requests_window, {}
        if not node.node_id:
            clock.reported(now, surging)
            continue
        edges, state.edge_window = state.edge_window, {}
        served = [session for session, m in state.table.models.items() if m.served] + list(state.table.queries)
        report = workload_report(node.node_id, clock.report_counts(window, served, planned, surging, now))
        clock.reported(now, surging)
        for (query, parent, child), (parent_rows, child_rows) in edges.items():
            report.edges.add(query=query, parent=parent, child=child, parent_requests=parent_rows,
                             child_requests=child_rows)
        await _send_report(scheduler, report)


async def _send_report(scheduler, report: control.WorkloadReport) -> None:
    try:
        await scheduler.ReportWorkload(report, timeout=5)
    except grpc.aio.AioRpcError as exc:
        log.debug("workload report failed: %s", exc.code().name)


class _Node:
    node_id = ""


async def serve(config: FrontendConfig, ready=None) -> None:
    """Run a frontend until cancelled; ``ready(address, http=HTTP_ADDRESS)`` is called once it listens."""
    creds = Credentials.load(config.security)
    tracer = None
    if config.trace:
        try:
            tracer = Tracer(config.trace, config.trace_every)
        except OSError as exc:
            raise SystemExit(f"nexus frontend: error: cannot write --trace {config.trace}: "
                             f"{exc.strerror or exc}") from None
    state = FrontendState(use_stream=config.exec_path == "stream", creds=creds, tracer=tracer)
    scheduler = SchedulerConnection(scheduler_addresses(config.scheduler), creds)
    # Repository load/unload are admin calls: the restricted header when configured (as Triton's
    # restricted protocol), else the cluster token like the rest of the control plane. The KServe
    # handlers check it, for gRPC and HTTP alike.
    header = config.restricted_repository_header
    access = ProtocolAccess(parse_restricted_header(header) if header else None, creds.token)
    # System shared memory: open, as in Triton, unless its own restricted header is configured.
    shm_header = config.restricted_shared_memory_header
    shm_access = ProtocolAccess(parse_restricted_header(shm_header) if shm_header else None)
    server = grpc_util.server(creds, reuse_port=config.is_worker)
    siblings = SiblingCounts(config.sibling_addresses, creds) if config.sibling_addresses else None
    kserve_service = KServeService(state, scheduler, access, shm_access, siblings)
    kserve_grpc.add_GRPCInferenceServiceServicer_to_server(kserve_service, server)
    control_grpc.add_FrontendServicer_to_server(FrontendControl(state), server)
    state.health = await Health.attach(server, (KSERVE_SERVICE,))
    # KServe clients present no certificate: the control service on this port is guarded by the token.
    address = grpc_util.bind(server, config.listen, creds)
    # A worker of several shares --listen; the scheduler pushes its routing tables to its own port.
    own_address = grpc_util.bind(server, config.worker_control_listen, creds) if config.is_worker else address
    await server.start()
    http_server = None
    if config.resolved_http_listen:
        tls = rest.tls_context(config.security.tls_cert, config.security.tls_key) if creds.tls else None
        try:
            http_server = await rest.start(kserve_service.api, config.resolved_http_listen,
                                           int(config.http_max_body_mb * 2**20), tls,
                                           config.drain_grace_s, reuse_port=config.is_worker)
        except OSError:
            await server.stop(None)
            await scheduler.close()
            raise
    metrics = await _start_metrics(config, state, server)
    node = _Node()
    register = control.RegisterRequest(kind=control.NODE_KIND_FRONTEND, address=config.advertise or own_address)
    reporter = asyncio.create_task(_report_loop(state, scheduler, node, config.report_interval_s))
    checker = asyncio.create_task(readiness.keep_evaluating(state))
    if ready:
        extra = {"http": http_server.address} if http_server is not None else {}
        if metrics:
            extra["metrics"] = metrics.url
        if config.is_worker:
            extra["own"] = own_address
        ready(address, **extra)
    try:
        await keep_registered(scheduler, register, node)
    finally:
        reporter.cancel()
        if state.tracer is not None:
            state.tracer.flush()
        checker.cancel()
        await drain(state, server, scheduler, node, config.drain_grace_s,
                    http_server.stop if http_server is not None else None)
        if metrics is not None:
            await metrics.close()
        await state.pool.close()
        if siblings is not None:
            await siblings.close()
        state.shared_memory.close()
        await scheduler.close()


async def drain(state: FrontendState, server, scheduler, node, grace_s: float, stop_http=None) -> None:
    """On SIGTERM: readiness NOT_SERVING first (load balancers stop sending), leave the scheduler's
    tables, serve on while calls keep coming (DRAIN_SENDERS_MAX_S at most), then refuse new requests
    and finish those in flight, all within ``grace_s`` (gRPC here; HTTP in ``stop_http()``, which
    stops its own way from the Leave on); then exit."""
    state.ready = False
    if state.health is not None:
        await state.health.start_draining()
    if node.node_id:
        try:
            await scheduler.Leave(control.LeaveRequest(node_id=node.node_id), timeout=2)
        except grpc.aio.AioRpcError as exc:
            log.info("could not leave the scheduler's tables (%s); draining anyway", exc.code().name)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    # HTTP stops its own way from now on: a request on an open keep-alive connection is still answered
    # for a while (frontend/rest.py), and its in-flight requests get the whole grace.
    http_stopping = asyncio.create_task(stop_http()) if stop_http is not None else None
    # gRPC serves on until the senders have gone: clients that balance on health have seen NOT_SERVING,
    # and the tables no longer name this frontend, so a call that still arrives is served, not refused.
    # Stopping at once would also race the calls on their way: gRPC's own stop cancels a call that
    # reaches it at that instant.
    seen = state.calls_started

    def new_calls() -> bool:
        nonlocal seen
        started, seen = seen != state.calls_started, state.calls_started
        return started

    await _wait_for_lull(new_calls, min(deadline, loop.time() + min(DRAIN_SENDERS_MAX_S, grace_s / 2)))
    # Refuse new calls from now on; wait for the requests in flight, over every transport (long-lived
    # streams such as health watches never end by themselves, so waiting for every call would take
    # the whole grace).
    stopping = asyncio.create_task(server.stop(grace=max(0.0, deadline - loop.time())))
    await _wait_for_lull(lambda: bool(state.in_flight or any(c.outstanding for c in state.pool.connections.values())),
                         deadline)
    await server.stop(grace=0)
    await stopping
    if http_stopping is not None:
        await http_stopping


async def _wait_for_lull(busy: Callable[[], bool], until: float) -> None:
    """Return once ``busy()`` has answered no for DRAIN_SETTLE_S and DRAIN_SETTLE_CHECKS checks in a
    row, or at loop time ``until``."""
    loop = asyncio.get_running_loop()
    quiet_since, quiet_checks = None, 0
    while loop.time() < until:
        if busy():
            quiet_since, quiet_checks = None, 0
        elif quiet_since is None:
            quiet_since, quiet_checks = loop.time(), 1
        else:
            quiet_checks += 1
            if loop.time() - quiet_since >= DRAIN_SETTLE_S and quiet_checks >= DRAIN_SETTLE_CHECKS:
                return
        await asyncio.sleep(DRAIN_CHECK_S)


async def _start_metrics(config: FrontendConfig, state: FrontendState, server):
    """The Prometheus endpoint on ``--metrics-listen`` (None when off); exits with a message when it cannot bind."""
    if not config.resolved_metrics_listen:
        return None
    try:
        metrics = await serve_metrics("frontend", config.metrics_listen, config.resolved_metrics_listen,
                                      state.metrics.registry, loop_lag="nexus_frontend_loop_lag_seconds")
    except SystemExit:
        await server.stop(grace=0)
        raise
    log.info("Prometheus metrics on %s", metrics.url)
    return metrics
