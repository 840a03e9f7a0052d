"""The backend's side of the framed execute channel (the protocol: common/exec_frames.py).

Each connection is one :class:`~backend.exec_channel.ExecChannel`; a connection that breaks the
protocol (a bad hello, an oversized or unknown frame, an item that does not decode) is logged and
closed, and its queued requests leave the engine as when a frontend goes away; so is one that says
no hello within :data:`HELLO_TIMEOUT_S`. Nothing else is disturbed.
"""

from __future__ import annotations

import asyncio
import logging

from google.protobuf.message import DecodeError

from backend.exec_channel import ExecChannel, Executor
from common.exec_frames import MAX_FRAME_BYTES, MAX_HELLO_BYTES, FrameError, FrameKind, FrameReader, FrameWriter, \
    check_hello, server_ssl_context
from common.pb import control
from common.security import Credentials

log = logging.getLogger("nexus.backend")

HELLO_TIMEOUT_S = 10.0      # a connection that has not said hello by then is closed (it holds a socket)


class FramedExecProtocol(asyncio.Protocol):
    def __init__(self, executor: Executor, token: str | None, open_transports: set,
                 hello_timeout_s: float = HELLO_TIMEOUT_S) -> None:
        self._executor = executor
        self._hello_timeout_s = hello_timeout_s
        self._hello_timer: asyncio.TimerHandle | None = None
        self._open = open_transports
        self._token = token
        self._reader = FrameReader(MAX_HELLO_BYTES)     # a stranger is not buffered much
        self._writer: FrameWriter | None = None
        self._channel: ExecChannel | None = None       # set once the hello is accepted
        self._peer = "?"

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._writer = FrameWriter(transport)
        self._open.add(transport)
        peer = transport.get_extra_info("peername")
        self._peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self._hello_timer = asyncio.get_running_loop().call_later(self._hello_timeout_s, self._no_hello)

    def _no_hello(self) -> None:
        if self._channel is None:
            log.warning("framed execute connection from %s closed: no hello in %.0f s", self._peer,
                        self._hello_timeout_s)
            self._writer.send(FrameKind.DENIED, b"no hello in time")
            self._writer.close()

    def _send_result(self, result: control.ExecResult) -> None:
        self._writer.send(FrameKind.RESULT, result.SerializeToString())

    def data_received(self, data: bytes) -> None:
        try:
            for kind, payload in self._reader.feed(data):
                channel = self._channel
                if kind is FrameKind.ITEM and channel is not None:
                    channel.receive(control.ExecItem.FromString(payload))
                elif kind is FrameKind.PING and channel is not None:
                    self._writer.send(FrameKind.PONG)
                elif kind is FrameKind.HELLO and channel is None:
                    refused = check_hello(payload, self._token)
                    if refused:
                        log.warning("framed execute connection from %s refused: %s", self._peer, refused)
                        self._writer.send(FrameKind.DENIED, refused.encode())
                        self._writer.close()
                        return
                    self._channel = ExecChannel(self._executor, self._send_result)
                    self._reader.max_bytes = MAX_FRAME_BYTES
                    self._hello_timer.cancel()
                    self._writer.send(FrameKind.ACCEPTED)
                else:
                    raise FrameError(f"unexpected {kind.name} frame" + ("" if channel else " before the hello"))
        except (FrameError, DecodeError) as exc:
            log.warning("framed execute connection from %s closed: %s", self._peer, exc or "undecodable item")
            self._writer.send(FrameKind.DENIED, str(exc).encode())
            self._writer.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._hello_timer.cancel()
        self._open.discard(self._writer.transport)
        if self._channel is not None:
            self._channel.close()
            self._channel = None


class FramedExecServer:
    """The listening socket and the connections it accepted."""

    def __init__(self, server: asyncio.Server, open_transports: set) -> None:
        self.server = server
        self._open = open_transports

    @property
    def port(self) -> int:
        return self.server.sockets[0].getsockname()[1]

    def close(self) -> None:
        """Stop listening and close every connection (their queued requests leave the engine)."""
        self.server.close()
        for transport in list(self._open):
            transport.close()


async def start_framed_exec(executor: Executor, host: str, port: int, creds: Credentials,
                            hello_timeout_s: float = HELLO_TIMEOUT_S) -> FramedExecServer:
    """Serve the framed execute channel on ``host``:``port`` (0: any free port; an empty host: every
    address); OSError when it cannot bind."""
    loop = asyncio.get_running_loop()
    open_transports: set = set()
    server = await loop.create_server(lambda: FramedExecProtocol(executor, creds.token, open_transports,
                                                                 hello_timeout_s),
                                      host or None, port, ssl=server_ssl_context(creds), reuse_address=True)
    return FramedExecServer(server, open_transports)
