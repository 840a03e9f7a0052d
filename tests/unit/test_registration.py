"""The node's registration loop (common/registration.py) against a scripted scheduler: a heartbeat
that times out while the Attach stream is open keeps the stream (a stalled scheduler must not find
its nodes gone for its own pause), and a broken stream makes the node register again."""

from __future__ import annotations

import asyncio

import grpc

from common.pb import control
from common.registration import keep_registered


def _error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=code.name)


class Scheduler:
    """Register and Heartbeat as scripted; Attach streams stay open until ``break_stream``."""

    def __init__(self, heartbeats: list) -> None:
        self.heartbeats = list(heartbeats)      # each: an exception to raise, or True/False for known
        self.registered = 0
        self.attached = 0
        self.streams_ended = 0
        self.beats = 0
        self.broken = asyncio.Event()

    async def Register(self, request, timeout=None):
        self.registered += 1
        return control.RegisterReply(node_id="be-1", heartbeat_interval_ms=10)

    async def Attach(self, request):
        self.attached += 1
        try:
            await self.broken.wait()
            raise _error(grpc.StatusCode.UNAVAILABLE)
            yield                                # an async generator
        finally:
            self.streams_ended += 1

    async def Heartbeat(self, request, timeout=None):
        self.beats += 1
        if self.heartbeats:
            step = self.heartbeats.pop(0)
            if isinstance(step, Exception):
                raise step
            if isinstance(step, control.HeartbeatReply):
                return step
            return control.HeartbeatReply(known=step)
        return control.HeartbeatReply(known=True)


class Node:
    node_id = ""


async def _run(scheduler: Scheduler, seconds: float, then=None, until=None) -> int:
    """Run the loop for ``seconds`` (and ``then()``, and as long again); the streams ended meanwhile.

    With ``until``, the last wait goes on until ``until()`` holds (30 s at most): a loaded machine
    may run the loop's 50 ms beats late, and the tests ask what the loop did, not when.
    """
    task = asyncio.create_task(keep_registered(scheduler, control.RegisterRequest(), Node()))
    await asyncio.sleep(seconds)
    if then is not None:
        then()
        await asyncio.sleep(seconds)
    if until is not None:
        for _ in range(3000):
            if until():
                break
            await asyncio.sleep(0.01)
    ended = scheduler.streams_ended
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return ended


def test_heartbeats_that_time_out_keep_the_open_attach_stream():
    timeouts = [_error(grpc.StatusCode.DEADLINE_EXCEEDED) for _ in range(5)]
    scheduler = Scheduler(timeouts)
    ended = asyncio.run(_run(scheduler, 0.1, until=lambda: not scheduler.heartbeats))
    assert not scheduler.heartbeats                      # every timeout was tried through
    assert scheduler.registered == 1 and scheduler.attached == 1 and ended == 0


def test_a_broken_stream_or_a_forgetful_scheduler_makes_the_node_register_again():
    scheduler = Scheduler([])
    ended = asyncio.run(_run(scheduler, 0.2, then=scheduler.broken.set, until=lambda: scheduler.registered >= 2))
    assert scheduler.registered >= 2 and ended >= 1
    forgetful = Scheduler([False])
    asyncio.run(_run(forgetful, 0.1, until=lambda: forgetful.registered >= 2))
    assert forgetful.registered >= 2


def test_a_heartbeat_refused_otherwise_still_registers_again():
    scheduler = Scheduler([_error(grpc.StatusCode.UNAVAILABLE)])
    asyncio.run(_run(scheduler, 0.1, until=lambda: scheduler.registered >= 2))
    assert scheduler.registered >= 2


def test_the_node_beats_at_the_period_the_scheduler_asks_for_from_then_on():
    """A growing cluster's scheduler asks for a longer period in its heartbeat reply (50 ms at
    registration here, then 1 s): the node follows it."""
    steady = Scheduler([])
    asyncio.run(_run(steady, 0.4, until=lambda: steady.beats >= 5))
    slowed = Scheduler([control.HeartbeatReply(known=True, heartbeat_interval_ms=1000)])
    asyncio.run(_run(slowed, 0.4))
    assert steady.beats >= 5 and slowed.beats == 1, (steady.beats, slowed.beats)     # 50 ms at the least
    assert slowed.registered == 1
