"""The frontend's end of a framed execute connection to one backend (the protocol:
common/exec_frames.py). frontend/backend_pool.py matches its results to requests.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Callable

from google.protobuf.message import DecodeError

from common.exec_frames import PING_AFTER_S, PING_TIMEOUT_S, FrameError, FrameKind, FrameReader, FrameWriter, \
    client_ssl_context, hello
from common.pb import control
from common.security import Credentials

log = logging.getLogger("nexus.frontend")

CONNECT_TIMEOUT_S = 5.0


class FramedRefused(Exception):
    """The backend refused the connection or broke the protocol during the hello."""


class FramedLink(asyncio.Protocol):
    """One connection. ``on_result`` gets each ``ExecResult`` on the loop; ``waiting()`` says whether
    requests wait for replies (only then is a silent backend pinged). ``closed`` resolves, with the
    reason, when the connection ends."""

    def __init__(self, token: str | None, on_result: Callable[[control.ExecResult], None],
                 waiting: Callable[[], bool]) -> None:
        loop = asyncio.get_running_loop()
        self._token = token
        self._on_result = on_result
        self._waiting = waiting
        self._reader = FrameReader()
        self._writer: FrameWriter | None = None
        self.accepted: asyncio.Future = loop.create_future()
        self.closed: asyncio.Future = loop.create_future()
        self._heard_s = time.monotonic()
        self._ping_sent_s: float | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._writer = FrameWriter(transport)
        self._writer.send(FrameKind.HELLO, hello(self._token))

    def send(self, item: control.ExecItem) -> None:
        self._writer.send(FrameKind.ITEM, item.SerializeToString())

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()

    def _fail(self, reason: str) -> None:
        if not self.closed.done():
            self.closed.set_result(reason)
        if not self.accepted.done():
            self.accepted.set_exception(FramedRefused(reason))
        self._writer.transport.abort()

    def data_received(self, data: bytes) -> None:
        self._heard_s = time.monotonic()
        self._ping_sent_s = None
        try:
            for kind, payload in self._reader.feed(data):
                if kind is FrameKind.RESULT:
                    self._on_result(control.ExecResult.FromString(payload))
                elif kind is FrameKind.PONG:
                    pass
                elif kind is FrameKind.ACCEPTED and not self.accepted.done():
                    self.accepted.set_result(None)
                    self._timer = asyncio.get_running_loop().call_later(PING_AFTER_S / 4, self._keepalive)
                elif kind is FrameKind.DENIED:
                    self._fail(f"refused: {payload.decode(errors='replace')}")
                    return
                else:
                    raise FrameError(f"unexpected {kind.name} frame")
        except (FrameError, DecodeError) as exc:
            self._fail(f"protocol error: {exc or 'undecodable result'}")

    def _keepalive(self) -> None:
        if self.closed.done():
            return
        now = time.monotonic()
        if self._ping_sent_s is not None and now - self._ping_sent_s > PING_TIMEOUT_S:
            self._fail(f"no answer to a ping in {PING_TIMEOUT_S:.0f} s")
            return
        if self._ping_sent_s is None and now - self._heard_s > PING_AFTER_S and self._waiting():
            self._ping_sent_s = now
            self._writer.send(FrameKind.PING)
        self._timer = asyncio.get_running_loop().call_later(PING_AFTER_S / 4, self._keepalive)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        reason = f"connection lost: {exc}" if exc else "connection closed"
        if not self.closed.done():
            self.closed.set_result(reason)
        if not self.accepted.done():
            self.accepted.set_exception(FramedRefused(reason))


@functools.lru_cache(maxsize=4)
def _ssl_context(creds: Credentials):
    return client_ssl_context(creds)


async def open_framed(host: str, port: int, creds: Credentials, on_result: Callable[[control.ExecResult], None],
                      waiting: Callable[[], bool]) -> FramedLink:
    """A connection whose hello the backend accepted; OSError or TimeoutError when it cannot be
    reached, :class:`FramedRefused` when it refuses."""
    loop = asyncio.get_running_loop()
    context = _ssl_context(creds)
    _, link = await asyncio.wait_for(
        loop.create_connection(lambda: FramedLink(creds.token, on_result, waiting), host, port, ssl=context,
                               server_hostname=host if context is not None else None),
        CONNECT_TIMEOUT_S)
    try:
        await asyncio.wait_for(asyncio.shield(link.accepted), CONNECT_TIMEOUT_S)
    except BaseException:
        link.close()
        raise
    return link
