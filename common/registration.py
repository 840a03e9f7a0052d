"""The registration loop every node runs against the scheduler."""

from __future__ import annotations

import asyncio
import logging

import grpc

from common.pb import control

log = logging.getLogger("nexus.registration")

REFUSED_RETRY_MAX_S = 10.0


async def _attached(scheduler, node_id: str) -> str:
    """Hold the scheduler's Attach stream open until it ends; return why it ended.

    "unsupported": the scheduler predates Attach (heartbeats alone then); anything else means the
    scheduler is gone or no longer knows this node, so the node registers again.
    """
    try:
        async for _ in scheduler.Attach(control.AttachRequest(node_id=node_id)):
            pass
        return "the scheduler closed the Attach stream"
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
            return "unsupported"
        return f"Attach stream broke ({exc.code().name})"


async def keep_registered(scheduler, register: control.RegisterRequest, node) -> None:
    """Register, hold the Attach stream open and heartbeat forever; register again when the
    scheduler forgets this node, restarts, or its Attach stream ends.

    The Attach stream is how the scheduler learns at once that this node is gone (its end); the
    heartbeats are the backstop for a connection that hangs without breaking.
    ``node.node_id`` is set after each successful registration; a re-registration asks for the
    same id so the scheduler's tables stay meaningful across its restarts. A node the scheduler
    cannot dial back at its address (FAILED_PRECONDITION) logs the scheduler's reason as an error
    and tries again, more slowly.

    A node with a ``fill_heartbeat(request)`` method adds what it reports to each heartbeat (a
    backend: its latency samples, backend/latency_samples.py); a heartbeat that fails loses it.

    A node that sets ``node.leaving`` (it drains: its Leave is in flight or answered) never
    registers again: the loop keeps the Attach stream it holds until the scheduler ends it, then
    waits to be cancelled, so a node being moved out of the plan is not put back into it.
    Cancelled (the node stops), it leaves the Attach stream open too: a node that leaves the plan
    after this loop ends still leaves it first, and its channel's close ends the stream.
    """
    interval = 1.0
    refused = 0
    while True:
        if getattr(node, "leaving", False):
            await asyncio.Event().wait()        # until cancelled
        attach: asyncio.Task | None = None
        try:
            reply = await scheduler.Register(register, timeout=10)
            node.node_id = reply.node_id
            register.node_id = reply.node_id
            interval = max(reply.heartbeat_interval_ms / 1000, 0.05)
            refused = 0
            log.info("registered as %s; peers reach it at %s", reply.node_id, reply.address or register.address)
            attach = asyncio.create_task(_attached(scheduler, reply.node_id))
            while True:
                if attach is not None:
                    await asyncio.wait({attach}, timeout=interval)
                    if attach.done():
                        why = attach.result()
                        attach = None
                        if why != "unsupported":
                            if not getattr(node, "leaving", False):
                                log.warning("%s; registering again", why)
                            await asyncio.sleep(min(interval, 0.2))
                            break
                        continue
                else:
                    await asyncio.sleep(interval)
                request = control.HeartbeatRequest(node_id=node.node_id)
                fill = getattr(node, "fill_heartbeat", None)
                if fill is not None:
                    fill(request)
                try:
                    beat = await scheduler.Heartbeat(request, timeout=5)
                except grpc.aio.AioRpcError as exc:
                    # A scheduler that stalls (a long plan, a pause) answers nothing for a while, but
                    # its Attach stream stays open: dropping the stream now would have it remove this
                    # node for its own pause when it resumes (issue 24). Only a broken stream, or a
                    # scheduler that forgot this node, makes the node register again.
                    if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and attach is not None and not attach.done():
                        # With standby schedulers, one of them may lead now: follow it then.
                        probe = getattr(scheduler, "probe_leader", None)
                        if probe is not None and await probe():
                            break
                        log.warning("heartbeat timed out (%s); the Attach stream is open: keeping it",
                                    exc.details() or exc.code().name)
                        continue
                    raise
                if not beat.known:
                    if not getattr(node, "leaving", False):
                        log.warning("scheduler forgot %s; registering again", node.node_id)
                    break
                if beat.heartbeat_interval_ms:      # the period grows and shrinks with the cluster
                    interval = max(beat.heartbeat_interval_ms / 1000, 0.05)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                log.error("the scheduler refused this node: %s", exc.details())
                await asyncio.sleep(5.0)
                continue
            if exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT):
                refused += 1
                log.error("registration refused: %s (retrying)", exc.details())
                await asyncio.sleep(min(2.0 * refused, REFUSED_RETRY_MAX_S))
                continue
            log.warning("scheduler unreachable (%s); retrying", exc.code().name)
            await asyncio.sleep(min(interval, 1.0))
        except asyncio.CancelledError:
            # The node is stopping. Its Attach stream stays open until the node has left the plan
            # (its drain calls Leave) or closed its channel: the scheduler then sees a node that
            # left, not one whose stream ended (which it reports as a failure and repairs later).
            if attach is not None:
                attach.add_done_callback(lambda task: task.cancelled() or task.exception())
                attach = None
            raise
        finally:
            if attach is not None:
                attach.cancel()
