"""When a frontend is ready (grpc.health.v1 readiness and KServe ServerReady agree).

Ready: it holds a routing table (one the scheduler pushed), and it reaches the backends in it:
every served model that the table routes to backends has at least one backend that answers a
health check. A frontend that loses the scheduler keeps its last table and so stays ready while
its backends answer; liveness never depends on another component (common/health.py). From the
moment it drains it is not ready.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.health import LIVENESS

log = logging.getLogger("nexus.frontend")

CHECK_INTERVAL_S = 1.0
CHECK_TIMEOUT_S = 1.0


async def _answers(pool, address: str) -> bool:
    conn = pool.get(address)
    try:
        await health_pb2_grpc.HealthStub(conn.channel).Check(health_pb2.HealthCheckRequest(service=LIVENESS),
                                                             timeout=CHECK_TIMEOUT_S)
        return True
    except grpc.aio.AioRpcError:
        return False


async def evaluate(state) -> bool:
    """Whether ``state`` (a FrontendState) is ready now; sets ``state.ready`` and the health status."""
    table = state.table
    ready = table.epoch > 0
    if ready:
        groups = [{r.address for r in m.backends} for m in table.models.values() if m.served and m.backends]
        addresses = sorted(set().union(*groups)) if groups else []
        answers = dict(zip(addresses, await asyncio.gather(*(_answers(state.pool, a) for a in addresses))))
        ready = all(any(answers[a] for a in group) for group in groups)
        if not ready:
            log.info("not ready: no backend answers for %s",
                     ", ".join(m.name for m in table.models.values()
                               if m.served and m.backends and not any(answers[r.address] for r in m.backends)))
    if state.health is not None and state.health.draining:
        ready = False
    state.ready = ready
    if state.health is not None:
        await state.health.set_ready(ready)
    return ready


async def keep_evaluating(state, interval_s: float = CHECK_INTERVAL_S) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            await evaluate(state)
        except Exception:    # never let a probe error end the loop
            log.exception("readiness check failed")
