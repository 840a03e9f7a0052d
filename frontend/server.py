"""The frontend process: KServe v2 on one port, plus the control service the scheduler pushes to.

It registers with the scheduler, heartbeats, and reports per-model request rates every
``report_interval_s``. Routing tables arrive by push (``Frontend.UpdateRoutingTable``).
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from common import grpc_util
from common.config import FrontendConfig
from common.health import Health
from common.pb import control, control_grpc, kserve_grpc
from common.registration import keep_registered
from common.security import REPOSITORY_METHODS, Credentials, HeaderGuard, control_methods, parse_restricted_header
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
    """Run a frontend until cancelled; ``ready(address)`` is called once it listens."""
    creds = Credentials.load(config.security)
    state = FrontendState(use_stream=config.exec_path == "stream", creds=creds)
    channel = grpc_util.aio_channel(config.scheduler, creds)
    scheduler = control_grpc.SchedulerStub(channel)
    # Repository load/unload are admin calls: the restricted header when configured (as Triton's
    # restricted protocol), else the cluster token like the rest of the control plane.
    if config.restricted_repository_header:
        guards, guarded = [HeaderGuard(*parse_restricted_header(config.restricted_repository_header))], control_methods
    else:
        guards, guarded = [], lambda method: control_methods(method) or method in REPOSITORY_METHODS
    server = grpc_util.server(creds, guarded=guarded, interceptors=guards)
    kserve_grpc.add_GRPCInferenceServiceServicer_to_server(KServeService(state, scheduler), server)
    control_grpc.add_FrontendServicer_to_server(FrontendControl(state), server)
    state.health = await Health.attach(server, (KSERVE_SERVICE,))
    # KServe clients present no certificate: the control service on this port is guarded by the token.
    address = grpc_util.bind(server, config.listen, creds)
    await server.start()
    node = _Node()
    register = control.RegisterRequest(kind=control.NODE_KIND_FRONTEND, address=address)
    reporter = asyncio.create_task(_report_loop(state, scheduler, node, config.report_interval_s))
    if ready:
        ready(address)
    try:
        await keep_registered(scheduler, register, node)
    finally:
        reporter.cancel()
        await state.pool.close()
        await server.stop(grace=1)
        await channel.close()
