"""The registration loop every node runs against the scheduler."""

from __future__ import annotations

import asyncio
import logging

import grpc

from common.pb import control

log = logging.getLogger("nexus.registration")

REFUSED_RETRY_MAX_S = 10.0


async def keep_registered(scheduler, register: control.RegisterRequest, node) -> None:
    """Register, then heartbeat forever; register again when the scheduler forgets or restarts.

    ``node.node_id`` is set after each successful registration; a re-registration asks for the
    same id so the scheduler's tables stay meaningful across its restarts. A node the scheduler
    cannot dial back at its address (FAILED_PRECONDITION) logs the scheduler's reason as an error
    and tries again, more slowly.
    """
    interval = 1.0
    refused = 0
    while True:
        try:
            reply = await scheduler.Register(register, timeout=10)
            node.node_id = reply.node_id
            register.node_id = reply.node_id
            interval = max(reply.heartbeat_interval_ms / 1000, 0.05)
            refused = 0
            log.info("registered as %s; peers reach it at %s", reply.node_id, reply.address or register.address)
            while True:
                await asyncio.sleep(interval)
                beat = await scheduler.Heartbeat(control.HeartbeatRequest(node_id=node.node_id), timeout=5)
                if not beat.known:
                    log.warning("scheduler forgot %s; registering again", node.node_id)
                    break
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT):
                refused += 1
                log.error("registration refused: %s (retrying)", exc.details())
                await asyncio.sleep(min(2.0 * refused, REFUSED_RETRY_MAX_S))
                continue
            log.warning("scheduler unreachable (%s); retrying", exc.code().name)
            await asyncio.sleep(min(interval, 1.0))
