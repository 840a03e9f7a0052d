"""The frontend process: KServe v2 on one port, plus the control service the scheduler pushes to;
KServe v2 HTTP/REST (``frontend.rest``) on a second port, in the same event loop.

It registers with the scheduler, heartbeats, and reports per-model request rates every
``report_interval_s``. Routing tables arrive by push (``Frontend.UpdateRoutingTable``).
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from common import grpc_util
from common.config import FrontendConfig, split_host_port
from common.health import Health
from common.pb import control, control_grpc, kserve_grpc
from common.registration import keep_registered
from common.security import (REPOSITORY_METHODS, Credentials, HeaderGuard, RepositoryAccess, control_methods,
                             parse_restricted_header)
from frontend import rest
from frontend.kserve import FrontendState, KServeService
from frontend.routing import RoutingTable

log = logging.getLogger("nexus.frontend")

KSERVE_SERVICE = "inference.GRPCInferenceService"


class FrontendControl(control_grpc.FrontendServicer):
    def __init__(self, state: FrontendState) -> None:
        self.state = state

    async def UpdateRoutingTable(self, request, context):
        if request.epoch < self.state.table.epoch:
            return control.RoutingTableReply()
        self.state.set_table(RoutingTable.from_proto(request))
        if self.state.health is not None:
            await self.state.health.set_ready(True)
        log.info("routing epoch %d: %s", request.epoch,
                 ", ".join(f"{m.name}->{len(m.backends)}" for m in self.state.table.models.values()) or "empty")
        return control.RoutingTableReply()


async def _report_loop(state: FrontendState, scheduler, node, interval_s: float) -> None:
    last = time.monotonic()
    while True:
        await asyncio.sleep(interval_s)
        if state.tracer is not None:
            state.tracer.flush()
        now = time.monotonic()
        window, state.requests_window = state.requests_window, {}
        elapsed = max(now - last, 1e-6)
        last = now
        if not node.node_id:
            continue
        edges, state.edge_window = state.edge_window, {}
        report = control.WorkloadReport(node_id=node.node_id)
        served = [m.name for m in state.table.models.values() if m.served] + list(state.table.queries)
        for name in served:
            count = window.get(name, 0)
            report.rates.add(model=name, rate_rps=count / elapsed, requests=count, window_ms=int(elapsed * 1000))
        for (query, parent, child), (parent_rows, child_rows) in edges.items():
            report.edges.add(query=query, parent=parent, child=child, parent_requests=parent_rows,
                             child_requests=child_rows)
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
        from frontend.trace import Tracer
        try:
            tracer = Tracer(config.trace, config.trace_every)
        except OSError as exc:
            raise SystemExit(f"nexus frontend: error: cannot write --trace {config.trace}: "
                             f"{exc.strerror or exc}") from None
    state = FrontendState(use_stream=config.exec_path == "stream", creds=creds, tracer=tracer)
    channel = grpc_util.aio_channel(config.scheduler, creds)
    scheduler = control_grpc.SchedulerStub(channel)
    # Repository load/unload are admin calls: the restricted header when configured (as Triton's
    # restricted protocol), else the cluster token like the rest of the control plane.
    if config.restricted_repository_header:
        guards, guarded = [HeaderGuard(*parse_restricted_header(config.restricted_repository_header))], control_methods
    else:
        guards, guarded = [], lambda method: control_methods(method) or method in REPOSITORY_METHODS
    server = grpc_util.server(creds, guarded=guarded, interceptors=guards)
    kserve_service = KServeService(state, scheduler)
    kserve_grpc.add_GRPCInferenceServiceServicer_to_server(kserve_service, server)
    control_grpc.add_FrontendServicer_to_server(FrontendControl(state), server)
    state.health = await Health.attach(server, (KSERVE_SERVICE,))
    # KServe clients present no certificate: the control service on this port is guarded by the token.
    address = grpc_util.bind(server, config.listen, creds)
    await server.start()
    http_runner, http_address = None, ""
    if config.resolved_http_listen:
        tls = rest.tls_context(config.security.tls_cert, config.security.tls_key) if creds.tls else None
        try:
            restricted = (parse_restricted_header(config.restricted_repository_header)
                          if config.restricted_repository_header else None)
            http_runner, http_address = await rest.start(kserve_service, config.resolved_http_listen,
                                                         int(config.http_max_body_mb * 2**20), tls,
                                                         config.drain_grace_s,
                                                         RepositoryAccess(restricted, creds.token))
        except OSError:
            await server.stop(None)
            await channel.close()
            raise
    metrics = await _start_metrics(config, state, server)
    node = _Node()
    register = control.RegisterRequest(kind=control.NODE_KIND_FRONTEND, address=address)
    reporter = asyncio.create_task(_report_loop(state, scheduler, node, config.report_interval_s))
    if ready:
        extra = {"http": http_address} if http_address else {}
        if metrics:
            extra["metrics"] = metrics.url
        ready(address, **extra)
    try:
        await keep_registered(scheduler, register, node)
    finally:
        reporter.cancel()
        if state.tracer is not None:
            state.tracer.flush()
        if metrics is not None:
            await metrics.close()
        if http_runner is not None:
            await http_runner.cleanup()
        await state.pool.close()
        await server.stop(grace=1)
        await channel.close()


async def _start_metrics(config: FrontendConfig, state: FrontendState, server):
    """The Prometheus endpoint on ``--metrics-listen`` (None when off); exits with a message when it cannot bind."""
    if not config.resolved_metrics_listen:
        return None
    from common.metrics_http import start_metrics_server

    host, port = split_host_port(config.resolved_metrics_listen)
    try:
        metrics = await start_metrics_server(host, port, state.metrics.registry)
    except OSError as exc:
        await server.stop(grace=0)
        raise SystemExit(f"nexus frontend: error: cannot serve --metrics-listen {config.metrics_listen}: "
                         f"{exc.strerror or exc}") from None
    log.info("Prometheus metrics on %s", metrics.url)
    return metrics
