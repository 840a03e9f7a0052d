"""Leader and standby: which of the schedulers sharing one PostgreSQL model database acts.

A scheduler started with ``--database`` begins as a standby. It listens, keeps its database connection
and its cache of model files warm, and refuses every Scheduler RPC with UNAVAILABLE and a message (and
the trailing metadata ``nexus-leader``) naming the leader, so that nodes and admin commands given
several addresses go there. It polls the lease (globalsched/state/database/lease.py) every ``poll_s``; once it
holds the lease it becomes the leader: ``on_elected(lease_epoch)`` starts the scheduler's parts, whose
plan epochs begin above every earlier leader's.

The leader renews every ``ttl_s / 4``. When a renew fails (another scheduler took over) or the local
deadline passes before a renew succeeds (this process was paused, or the database was out of reach for
a whole TTL), the leader stops acting at once (:meth:`Leadership.may_act` is False from that instant,
and the planner checks it before every table push) and the process exits with status 3, to start
again as a standby: a scheduler never returns from leader to standby in place, so no stale state
survives a lost term. On a clean stop the leader releases the lease, and a standby takes over within
one poll.

Without ``--database`` (SQLite) there is one scheduler: it leads from the start, lease epoch 0.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import secrets
import time
from typing import Awaitable, Callable

import grpc

from common.scheduler_connection import LEADER_METADATA
from globalsched.state.database.lease import LeaderLease

log = logging.getLogger("nexus.scheduler")

EXIT_LOST_LEADERSHIP = 3


class Role(enum.Enum):
    LEADER = "leader"
    STANDBY = "standby"


class LostLeadership(Exception):
    """The leader lost its lease; the process must exit (status :data:`EXIT_LOST_LEADERSHIP`)."""

    code = EXIT_LOST_LEADERSHIP

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class Leadership:
    """The role of this scheduler, and the task that keeps it (see the module's contract)."""

    def __init__(self, lease: LeaderLease | None, *, shared: bool = False, poll_s: float = 0.2,
                 warm: Callable[[], None] | None = None, warm_every_s: float = 5.0, clock=time.monotonic) -> None:
        """``shared``: several schedulers share the database, and this one leads only while it holds
        ``lease`` (which may be set after construction, once the listening address is known)."""
        self.lease = lease
        self.shared = shared or lease is not None
        self.poll_s = poll_s
        self.warm = warm
        self.warm_every_s = warm_every_s
        self.clock = clock
        self.role = Role.STANDBY if self.shared else Role.LEADER
        self.lease_epoch = 0
        self.leader_address = ""          # the leader's, as the lease row says ("": unknown)
        self.lost = False
        self.decided = asyncio.Event()    # set once the first try for the lease has been answered

    @classmethod
    def single(cls) -> "Leadership":
        return cls(None)

    @staticmethod
    def identity() -> str:
        return f"{os.uname().nodename}/{os.getpid()}/{secrets.token_hex(4)}"

    def may_act(self) -> bool:
        """True while this scheduler may change the cluster (push tables, scale)."""
        if not self.shared:
            return True
        return self.lease is not None and self.role is Role.LEADER and not self.lost and self.lease.holds()

    async def run(self, on_elected: Callable[[int], Awaitable[None]]) -> None:
        """Stand by until elected, call ``on_elected``, then keep the lease; raise :class:`LostLeadership`
        when it is lost."""
        if not self.shared:
            await on_elected(0)
            self.decided.set()
            return
        lease = self.lease
        assert lease is not None, "a shared database needs the lease before run()"
        last_warm = -self.warm_every_s
        announced = None
        while True:
            try:
                epoch = await asyncio.to_thread(lease.try_acquire)
            except Exception as exc:       # the database is out of reach: stay a standby and retry
                log.warning("standby: cannot read the lease: %s", exc)
                epoch = None
            if epoch is not None:
                break
            self.decided.set()
            try:
                holder = await asyncio.to_thread(lease.current)
            except Exception:
                holder = None
            if holder is not None:
                self.leader_address = holder.address
                if announced != (holder.address, holder.epoch):
                    announced = (holder.address, holder.epoch)
                    log.info("standby: the leader is %s (lease epoch %d)", holder.address, holder.epoch)
            if self.warm is not None and self.clock() - last_warm >= self.warm_every_s:
                last_warm = self.clock()
                try:
                    await asyncio.to_thread(self.warm)
                except Exception as exc:
                    log.warning("standby: warming the model-file cache failed: %s", exc)
            await asyncio.sleep(self.poll_s)
        self.role, self.lease_epoch, self.leader_address = Role.LEADER, epoch, lease.address
        log.warning("leader: this scheduler (%s) leads, lease epoch %d", lease.address, epoch)
        await on_elected(epoch)
        self.decided.set()
        await self._keep(lease)

    async def _keep(self, lease: LeaderLease) -> None:
        period = lease.ttl_s / 4
        while True:
            await asyncio.sleep(period)
            if not lease.holds():
                self._lose("the lease ran out before it could be renewed (this process was paused, or the "
                           "database was out of reach)")
            try:
                renewed = await asyncio.to_thread(lease.renew)
            except Exception as exc:
                log.warning("leader: renewing the lease failed: %s", exc)
                continue                   # retried until the local deadline passes
            if not renewed:
                self._lose("another scheduler holds the lease")

    def _lose(self, why: str) -> None:
        self.lost = True
        log.error("leader: lost the leadership (lease epoch %d): %s; exiting to start again as a standby",
                  self.lease_epoch, why)
        raise LostLeadership(why)

    def release(self) -> None:
        """Give the lease up (a clean stop), so that a standby takes over at once. Blocking."""
        if self.lease is not None and self.role is Role.LEADER and not self.lost:
            try:
                self.lease.release()
                log.info("leader: released the lease")
            except Exception as exc:
                log.warning("leader: could not release the lease (a standby takes over when it expires): %s", exc)

    def refusal(self) -> str:
        where = self.leader_address or "not known yet"
        return f"this scheduler is a standby; the leader is {where}"


class StandbyGate(grpc.aio.ServerInterceptor):
    """Refuses every Scheduler RPC while this scheduler does not lead: UNAVAILABLE, with the leader's
    address in the message and in the ``nexus-leader`` trailing metadata."""

    def __init__(self, leadership: Leadership, service_prefix: str = "/nexus.control.Scheduler/") -> None:
        self.leadership = leadership
        self.prefix = service_prefix

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self.prefix) or self.leadership.may_act():
            return handler
        leadership = self.leadership

        async def refuse(request, context):
            if leadership.leader_address:
                context.set_trailing_metadata(((LEADER_METADATA, leadership.leader_address),))
            await context.abort(grpc.StatusCode.UNAVAILABLE, leadership.refusal())

        async def refuse_stream(request, context):
            await refuse(request, context)
            yield  # pragma: no cover  (abort raises)

        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(refuse_stream, handler.request_deserializer,
                                                         handler.response_serializer)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(refuse, handler.request_deserializer,
                                                        handler.response_serializer)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(refuse_stream, handler.request_deserializer,
                                                        handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(refuse, handler.request_deserializer, handler.response_serializer)
