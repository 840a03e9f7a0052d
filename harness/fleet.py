"""Stand-in nodes for a real scheduler at fleet scale: many backends and frontends in one process.

Each stand-in registers, holds its Attach stream and heartbeats through the production registration
loop (:func:`common.registration.keep_registered`), so the scheduler sees what it sees from real nodes.
What a stand-in does not do is serve: every stand-in shares one gRPC server that answers the
scheduler's dial-back health check, accepts every model table (each of its sessions "loaded") and
every routing table, and counts them. The frontends report workload as real ones do: per session,
the requests counted over the report period (Poisson counts of the rate they are given).

The driver is :mod:`benchmarks.scheduler_fleet`; the stand-ins are not a device model (the simulator
is, :mod:`nexus.simulate`): they measure the scheduler's own process, its event loop and CPU, with as
many nodes as the real one would have.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Mapping

import grpc
import numpy as np
from prometheus_client import CollectorRegistry

from common.health import Health
from common.loop_lag import LoopLagMonitor
from common.pb import control, control_grpc
from common.registration import keep_registered
from frontend.early_report import workload_report

NODES_PER_CHANNEL = 50       # stand-ins sharing one channel to the scheduler (one HTTP/2 connection)


@dataclass
class Received:
    """What the scheduler pushed to the stand-ins."""

    model_tables: int = 0
    routing_tables: int = 0


class _Backends(control_grpc.BackendServicer):
    def __init__(self, received: Received) -> None:
        self.received = received

    async def UpdateModelTable(self, request, context):
        self.received.model_tables += 1
        return control.ModelTableReply(loaded=[s.session or s.model.name for s in request.sessions])


class _Frontends(control_grpc.FrontendServicer):
    def __init__(self, received: Received) -> None:
        self.received = received

    async def UpdateRoutingTable(self, request, context):
        self.received.routing_tables += 1
        return control.RoutingTableReply()


class _Node:
    def __init__(self) -> None:
        self.node_id = ""


class Fleet:
    """``backends`` stand-in backends of ``device_type`` and ``frontends`` stand-in frontends, registered
    with the scheduler at ``scheduler``. Use inside a running event loop: ``await start()``, then
    :meth:`set_rates` as the workload changes, then ``await stop()``."""

    def __init__(self, scheduler: str, backends: int, frontends: int, *, device_type: str = "t4",
                 device: str = "emulated:t4", memory_mb: float = 16000.0, report_interval_s: float = 2.0,
                 seed: int = 0) -> None:
        self.scheduler = scheduler
        self.backends, self.frontends = backends, frontends
        self.device_type, self.device, self.memory_mb = device_type, device, memory_mb
        self.report_interval_s = report_interval_s
        self.received = Received()
        self.loop_lag = LoopLagMonitor("fleet_loop_lag_seconds")
        self.registry = CollectorRegistry()           # the stand-ins' own loop lag, read like a scrape
        self.registry.register(self.loop_lag.histogram)
        self.reports_failed = 0
        self._rates: dict[str, float] = {}
        self._rng = np.random.default_rng(seed)
        self._server: grpc.aio.Server | None = None
        self._channels: list[grpc.aio.Channel] = []
        self._tasks: list[asyncio.Task] = []
        self.backend_nodes: list[_Node] = []
        self.frontend_nodes: list[_Node] = []

    async def start(self) -> None:
        self._server = grpc.aio.server()
        control_grpc.add_BackendServicer_to_server(_Backends(self.received), self._server)
        control_grpc.add_FrontendServicer_to_server(_Frontends(self.received), self._server)
        health = await Health.attach(self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        await health.set_ready(True)
        address = f"127.0.0.1:{port}"
        stub = None
        for i in range(self.backends + self.frontends):
            if i % NODES_PER_CHANNEL == 0:
                # distinct channel args: a connection of its own, not one shared through grpc's pool
                channel = grpc.aio.insecure_channel(self.scheduler, options=[("nexus.fleet.channel", i)])
                self._channels.append(channel)
                stub = control_grpc.SchedulerStub(channel)
            node = _Node()
            if i < self.backends:
                request = control.RegisterRequest(kind=control.NODE_KIND_BACKEND, address=address, device=self.device,
                                                  device_type=self.device_type, memory_mb=self.memory_mb)
                self.backend_nodes.append(node)
            else:
                request = control.RegisterRequest(kind=control.NODE_KIND_FRONTEND, address=address)
                self.frontend_nodes.append(node)
                self._tasks.append(asyncio.create_task(self._report(stub, node)))
            self._tasks.append(asyncio.create_task(keep_registered(stub, request, node)))
        self._tasks.append(asyncio.create_task(self.loop_lag.run()))

    def registered(self) -> int:
        return sum(1 for n in (*self.backend_nodes, *self.frontend_nodes) if n.node_id)

    def set_rates(self, rates: Mapping[str, float]) -> None:
        """The total arrival rate of each model (rps), split evenly over the frontends from now on."""
        self._rates = dict(rates)

    async def _report(self, stub, node: _Node) -> None:
        while True:
            await asyncio.sleep(self.report_interval_s)
            if not node.node_id or not self._rates:
                continue
            names = list(self._rates)
            mean = np.array([self._rates[n] for n in names]) * self.report_interval_s / self.frontends
            counts = self._rng.poisson(mean)
            # every session, its zero counts too, as a frontend reports them: a report that left out
            # the windows without a request would read a tail session's rate several times too high
            report = workload_report(node.node_id, [(name, int(count), self.report_interval_s)
                                                    for name, count in zip(names, counts)])
            try:
                await stub.ReportWorkload(report, timeout=10)
            except grpc.aio.AioRpcError:
                self.reports_failed += 1

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for channel in self._channels:
            await channel.close()
        if self._server is not None:
            await self._server.stop(0)


