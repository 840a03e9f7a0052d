"""The standard ``grpc.health.v1.Health`` service of every component (grpcio-health-checking).

Service names a probe may ask for (docs/deployment.md; Kubernetes gRPC probes name them in
``grpc.service``):
- ``""`` (the server as a whole) and every name given in ``ready_services``: readiness. NOT_SERVING
  until the component says it is ready (a frontend: it holds a routing table and reaches the
  backends in it; a backend: its model table is loaded; the scheduler: it listens with its
  database open), and again from the moment it starts draining.
- ``"liveness"``: SERVING for as long as the process's event loop answers; it never depends on
  another component, and stays SERVING while the component drains.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

LIVENESS = "liveness"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Health:
    """Readiness and liveness of one component, served on its gRPC server."""

    def __init__(self, server: grpc.aio.Server, ready_services: tuple[str, ...] = ()) -> None:
        """Use :meth:`attach`: the statuses must be set before the server starts."""
        self.servicer = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)
        self._ready_services = ("", *ready_services)
        self.ready = False
        self.draining = False

    @classmethod
    async def attach(cls, server: grpc.aio.Server, ready_services: tuple[str, ...] = ()) -> "Health":
        """Add the service to ``server`` (before it starts): readiness NOT_SERVING, liveness SERVING."""
        health = cls(server, ready_services)
        for name in health._ready_services:
            await health.servicer.set(name, NOT_SERVING)
        await health.servicer.set(LIVENESS, SERVING)
        return health

    async def set_ready(self, ready: bool) -> None:
        """Readiness follows ``ready`` until the component drains; then it stays NOT_SERVING."""
        if self.draining or ready == self.ready:
            return
        self.ready = ready
        for name in self._ready_services:
            await self.servicer.set(name, SERVING if ready else NOT_SERVING)

    async def start_draining(self) -> None:
        """NOT_SERVING for readiness from now on; liveness stays SERVING."""
        await self.set_ready(False)
        self.draining = True
