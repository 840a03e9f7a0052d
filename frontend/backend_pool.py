"""Connections from a frontend to its backends: one long-lived stream of requests per backend, on the
backend's framed execute channel (common/exec_frames.py) when it offers one, else on its gRPC
``Execute`` stream (a backend started with ``--exec-port -1``, or one the frontend cannot reach on
that port: logged).

Contract: :meth:`BackendConnection.execute` is called on the frontend's event loop; it returns the
backend's answer as a :class:`Reply` (the protobuf ``ExecResult`` is converted here, at the edge), or
raises :class:`BackendGone` when the stream broke before the result came
(the caller may retry elsewhere while the deadline allows). Requests are multiplexed by id; a
single writer task drains a deque into the stream so callers never block on each other.
A caller that is cancelled while it waits (its client cancelled, or its deadline passed) sends the
backend ``ExecItem.cancel`` so that the request leaves the backend's queue without running.

A stream (either kind) that ends while in use marks its backend down in the pool at once: no request is routed
there until a routing table without it arrives (the scheduler learns of the loss from its own
Attach stream) or ``DOWN_HOLD_S`` passes (a backend that comes back at the same address).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from common import grpc_util
from common.pb import control, control_grpc
from common.security import Credentials, token_metadata
from common.exec_status import ExecStatus
from frontend.framed_exec import CONNECT_TIMEOUT_S, FramedLink, FramedRefused, open_framed

log = logging.getLogger("nexus.frontend")

DOWN_HOLD_S = 3.0


class BackendGone(Exception):
    """The backend's stream failed; the request was not answered."""




@dataclass(slots=True)
class Reply:
    """A backend's answer to one request. ``outputs`` are raw tensors in the model's output order and
    ``output_shapes`` their full shapes; the times are the backend's (``backend_ns``: from receiving
    the item to encoding this answer; ``compute_input_ns``: the batch assembly part of ``compute_ns``).
    ``first_in_batch``: the first request of its model in its batch (one per model and batch)."""

    status: ExecStatus
    message: str = ""
    outputs: Sequence[bytes] | None = None
    output_shapes: list[tuple[int, ...]] | None = None
    queue_ns: int = 0
    compute_ns: int = 0
    compute_input_ns: int = 0
    backend_ns: int = 0
    batch_size: int = 0
    first_in_batch: bool = False

    @staticmethod
    def from_pb(result: control.ExecResult) -> "Reply":
        # ``outputs`` stays the message's read-only sequence: each tensor's bytes are made once, when used.
        return Reply(ExecStatus.from_wire(result.status), result.message, result.outputs,
                     [tuple(d.shape) for d in result.output_shapes], result.queue_ns, result.compute_ns,
                     result.compute_input_ns, result.backend_ns, result.batch_size, result.first_in_batch)


class BackendConnection:
    """One backend's stream of requests (module docstring). A framed connection writes each item at
    once (its writer puts one turn of the loop's items in one write); the gRPC stream is written by
    one writer task that drains a deque (gRPC allows one write in flight per call). Items sent while
    the stream opens wait in that deque. The token travels as call metadata, not through a channel
    interceptor (an intercepted stream relays every message through one more asyncio layer)."""

    def __init__(self, address: str, creds: Credentials = grpc_util.NO_CREDENTIALS, on_broken=None) -> None:
        self.address = address
        self.creds = creds
        self.on_broken = on_broken       # called with the address when the stream ends while open
        self.channel = grpc_util.aio_channel(address, creds, token_interceptor=False)
        self.metadata = token_metadata(creds.token)
        self.stub = control_grpc.BackendStub(self.channel)
        self.outstanding = 0
        self.transport = ""              # "framed" or "grpc" once a stream is open
        self._pending: dict[int, asyncio.Future] = {}
        self._outbox: collections.deque = collections.deque()
        self._wake: asyncio.Future | None = None       # set while the gRPC writer waits for the outbox
        self._link: FramedLink | None = None           # the framed connection, while open
        self._task: asyncio.Task | None = None
        self._closed = False

    def open(self) -> None:
        """Open the stream now, rather than at the first request (on the event loop)."""
        if not self._closed:
            self._ensure_stream()

    def _ensure_stream(self) -> None:
        if self._task is None or self._task.done():
            self._outbox = collections.deque()
            self._wake = None
            self._link = None
            self._task = asyncio.create_task(self._run(self._outbox))

    def _send(self, item: control.ExecItem | None) -> None:
        """Send ``item`` on the stream (None: end it)."""
        link = self._link
        if link is not None:
            if item is None:
                link.close()
            else:
                link.send(item)
            return
        self._outbox.append(item)
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    def _deliver(self, result: control.ExecResult) -> None:
        future = self._pending.pop(result.request_id, None)
        if future is not None and not future.done():
            future.set_result(Reply.from_pb(result))

    async def _write(self, call, outbox: collections.deque) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                while outbox:
                    item = outbox.popleft()
                    if item is None:
                        await call.done_writing()
                        return
                    await call.write(item)
                self._wake = loop.create_future()
                await self._wake
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            return           # the stream ended: the reader tells the pending requests

    async def _open_framed(self) -> FramedLink | None:
        """The backend's framed connection, or None where it offers none or cannot be reached on it."""
        try:
            reply = await self.stub.ExecEndpoint(control.ExecEndpointRequest(), timeout=CONNECT_TIMEOUT_S,
                                                 metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise                   # the backend is not there: the stream is broken
            return None                 # a backend from before the framed channel
        if not reply.port:
            return None
        host = self.address.rpartition(":")[0].strip("[]")
        try:
            return await open_framed(host, reply.port, self.creds, self._deliver, lambda: bool(self._pending))
        except (OSError, TimeoutError, FramedRefused) as exc:
            log.warning("framed execute channel to backend %s (port %d) failed: %s; using its gRPC stream",
                        self.address, reply.port, exc or exc.__class__.__name__)
            return None

    async def _run(self, outbox: collections.deque) -> None:
        try:
            link = await self._open_framed()
            if link is not None:
                await self._run_framed(link, outbox)
            else:
                await self._run_grpc(outbox)
        except grpc.aio.AioRpcError as exc:
            if not self._closed:
                log.warning("stream to backend %s broke: %s", self.address, exc.code().name)
        finally:
            self._link = None
            if not self._closed and self.on_broken is not None:
                self.on_broken(self.address)
            pending, self._pending = self._pending, {}
            for future in pending.values():
                if not future.done():
                    future.set_exception(BackendGone(f"backend {self.address} went away"))

    async def _run_framed(self, link: FramedLink, outbox: collections.deque) -> None:
        self.transport = "framed"
        log.info("requests to backend %s go on its framed execute channel", self.address)
        ended = False
        while outbox:               # what was sent while the connection opened
            item = outbox.popleft()
            if item is None:
                ended = True
                break
            link.send(item)
        if ended or self._closed:
            link.close()
        else:
            self._link = link
        reason = await link.closed
        if not self._closed:
            log.warning("framed stream to backend %s broke: %s", self.address, reason)

    async def _run_grpc(self, outbox: collections.deque) -> None:
        self.transport = "grpc"
        log.info("requests to backend %s go on its gRPC Execute stream", self.address)
        call = self.stub.Execute(metadata=self.metadata)
        writer = asyncio.create_task(self._write(call, outbox))
        try:
            while True:
                result = await call.read()
                if result is grpc.aio.EOF:
                    break
                self._deliver(result)
        finally:
            writer.cancel()

    async def execute(self, item: control.ExecItem, timeout_s: float | None = None) -> Reply:
        """The backend's answer to ``item``; TimeoutError after ``timeout_s`` (the request is then
        cancelled at the backend, as when the caller is cancelled)."""
        if self._closed:
            raise BackendGone(f"backend {self.address} is closed")
        self._ensure_stream()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        request_id = item.request_id
        self._pending[request_id] = future
        self.outstanding += 1
        timer = loop.call_later(timeout_s, _expire, future) if timeout_s is not None else None
        try:
            self._send(item)
            return await future
        except (asyncio.CancelledError, TimeoutError):
            if self._pending.pop(request_id, None) is not None and self._task is not None \
                    and not self._task.done():
                self._send(control.ExecItem(request_id=request_id, cancel=True))
            raise
        finally:
            if timer is not None:
                timer.cancel()
            self.outstanding -= 1
            self._pending.pop(request_id, None)

    async def execute_unary(self, item: control.ExecItem, timeout_s: float) -> Reply:
        """One RPC per request (kept for the path benchmark)."""
        self.outstanding += 1
        try:
            return Reply.from_pb(await self.stub.ExecuteOne(item, timeout=timeout_s, metadata=self.metadata))
        except grpc.aio.AioRpcError as exc:
            raise BackendGone(f"backend {self.address}: {exc.code().name}") from None
        finally:
            self.outstanding -= 1

    async def stats(self, timeout_s: float = 5.0) -> control.BackendStats:
        """The backend's ``Stats`` (a control call: it carries the cluster token)."""
        return await self.stub.Stats(control.BackendStatsRequest(), timeout=timeout_s, metadata=self.metadata)

    async def close(self) -> None:
        self._closed = True
        if self._task is not None and not self._task.done():
            self._send(None)
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout=2)
            except (asyncio.TimeoutError, Exception):
                self._task.cancel()
        await self.channel.close()


def _expire(future: asyncio.Future) -> None:
    if not future.done():
        future.set_exception(TimeoutError())


class BackendPool:
    """Connections by address, opened and closed as routing tables change."""

    def __init__(self, creds: Credentials = grpc_util.NO_CREDENTIALS) -> None:
        self.creds = creds
        self.connections: dict[str, BackendConnection] = {}
        self._ids = itertools.count(1)
        self.down: dict[str, float] = {}     # address -> when its stream broke

    def mark_down(self, address: str) -> None:
        if address not in self.down:
            log.warning("backend %s is down: not routing to it", address)
        self.down[address] = time.monotonic()

    def is_down(self, address: str) -> bool:
        since = self.down.get(address)
        if since is None:
            return False
        if time.monotonic() - since > DOWN_HOLD_S:
            del self.down[address]
            return False
        return True

    def next_id(self) -> int:
        return next(self._ids)

    def sync(self, addresses: set[str]) -> None:
        """Connections to exactly ``addresses`` (a routing table's backends). A new backend's stream
        opens at once, before a request needs it: its first requests (a model moved or paged in there)
        do not wait for the connection, the endpoint call and the hello."""
        for address in set(self.down) - addresses:   # gone from the table: a later return starts afresh
            del self.down[address]
        for address in addresses - set(self.connections):
            conn = self.connections[address] = BackendConnection(address, self.creds, self.mark_down)
            conn.open()
        for address in set(self.connections) - addresses:
            conn = self.connections.pop(address)
            asyncio.create_task(self._close_when_idle(conn))

    @staticmethod
    async def _close_when_idle(conn: BackendConnection, grace_s: float = 30.0) -> None:
        for _ in range(int(grace_s * 10)):
            if conn.outstanding == 0:
                break
            await asyncio.sleep(0.1)
        await conn.close()

    def get(self, address: str) -> BackendConnection:
        conn = self.connections.get(address)
        if conn is None:
            conn = self.connections[address] = BackendConnection(address, self.creds, self.mark_down)
        return conn

    async def close(self) -> None:
        for conn in list(self.connections.values()):
            await conn.close()
        self.connections.clear()
