"""The framed execute channel between a frontend and a backend: the same requests as the gRPC
``Execute`` stream, for a fraction of its CPU per request (benchmarks/transport_micro.py).

Contract (version ``nexus-exec/1``):
- One TCP connection per frontend and backend, to the port the backend's ``ExecEndpoint`` call names
  on the host of its gRPC address; TLS when the backend serves TLS, with the same certificates as its
  gRPC port (a client certificate when the cluster has a CA).
- Every frame is a 5-byte header, the payload's length (4 bytes, little-endian) and its
  :class:`FrameKind` (1 byte), then the payload. A frame over :data:`MAX_FRAME_BYTES`, an unknown
  kind or a payload that does not decode is a protocol error: the receiver closes the connection.
  Before the hello is accepted, the backend takes frames of :data:`MAX_HELLO_BYTES` at most.
- The frontend's first frame is ``HELLO`` (:data:`PROTOCOL`, a newline, the cluster token or
  nothing). The backend answers ``ACCEPTED``, or ``DENIED`` with the reason and closes.
- Then the frontend sends ``ITEM`` frames (a serialised ``control.ExecItem``, cancels included) and
  the backend ``RESULT`` frames (a serialised ``control.ExecResult``), in any order; one write may
  carry many frames (every frame queued in one turn of the event loop goes in one write: a batch's
  replies travel together).
- Liveness: a frontend waiting for replies that has heard nothing for :data:`PING_AFTER_S` sends
  ``PING``; the backend answers ``PONG`` at once. A backend silent :data:`PING_TIMEOUT_S` after a
  ping is hung (a stopped process keeps its sockets open): the frontend drops the connection, as
  gRPC's keepalive does for the stream.
"""

from __future__ import annotations

import asyncio
import enum
import hmac
import os
import ssl
import struct
import tempfile
from collections.abc import Iterator

from common.grpc_util import MAX_MESSAGE_BYTES
from common.security import Credentials

PROTOCOL = b"nexus-exec/1"
HEADER = struct.Struct("<IB")
MAX_FRAME_BYTES = MAX_MESSAGE_BYTES
MAX_HELLO_BYTES = 4096          # what a backend buffers from a peer it has not accepted yet
PING_AFTER_S = 2.0
PING_TIMEOUT_S = 2.0


class FrameKind(enum.IntEnum):
    HELLO = 1
    ACCEPTED = 2
    DENIED = 3
    ITEM = 4
    RESULT = 5
    PING = 6
    PONG = 7


class FrameError(Exception):
    """The peer broke the protocol; the message says how."""


class FrameReader:
    """Bytes as they arrive -> whole frames of at most ``max_bytes`` (the caller may change it)."""

    def __init__(self, max_bytes: int = MAX_FRAME_BYTES) -> None:
        self._buf = bytearray()
        self.max_bytes = max_bytes

    def feed(self, data: bytes) -> Iterator[tuple[FrameKind, bytes]]:
        """The frames ``data`` completes, in order, one at a time (a limit changed between two applies
        to the next); a partial frame waits for the next call once these are consumed. Raises
        :class:`FrameError` for an oversized frame or an unknown kind."""
        if self._buf:
            self._buf += data
            data = bytes(self._buf)
            self._buf.clear()
        offset, size = 0, len(data)
        while size - offset >= HEADER.size:
            length, kind = HEADER.unpack_from(data, offset)
            try:
                kind = FrameKind(kind)
            except ValueError:
                raise FrameError(f"unknown frame kind {kind}") from None
            if length > self.max_bytes:
                raise FrameError(f"{kind.name} frame of {length} bytes is over the limit of {self.max_bytes}")
            end = offset + HEADER.size + length
            if end > size:
                break
            yield kind, data[offset + HEADER.size:end]
            offset = end
        if offset < size:
            self._buf += data[offset:]


class FrameWriter:
    """Frames out of one transport: every frame sent in one turn of the event loop goes in one write."""

    def __init__(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self._out: list[bytes] = []
        self._loop = asyncio.get_running_loop()

    def send(self, kind: FrameKind, payload: bytes = b"") -> None:
        """Queue a frame; frames sent after the transport closed are dropped (nobody reads them)."""
        if self.transport.is_closing():
            return
        if not self._out:
            self._loop.call_soon(self.flush)
        self._out += (HEADER.pack(len(payload), kind), payload)

    def flush(self) -> None:
        out, self._out = self._out, []
        if out and not self.transport.is_closing():
            self.transport.writelines(out)

    def close(self) -> None:
        """Write what is queued, then close."""
        self.flush()
        self.transport.close()


def hello(token: str | None) -> bytes:
    return PROTOCOL + b"\n" + (token or "").encode()


def check_hello(payload: bytes, token: str | None) -> str | None:
    """Why a ``HELLO`` is refused (None: accepted): another protocol, or the wrong cluster token."""
    protocol, _, given = payload.partition(b"\n")
    if protocol != PROTOCOL:
        return f"expected protocol {PROTOCOL.decode()}, got {protocol[:40]!r}"
    if token and not hmac.compare_digest(given, token.encode()):
        return "missing cluster token" if not given else "wrong cluster token"
    return None


# ---- TLS: the same material as the gRPC port ----------------------------------------------------------


def _load_chain(context: ssl.SSLContext, cert: bytes, key: bytes) -> None:
    # ssl loads a certificate chain only from files: written to a private directory, read, removed.
    with tempfile.TemporaryDirectory(prefix="nexus-tls-") as tmp:
        cert_path, key_path = os.path.join(tmp, "cert.pem"), os.path.join(tmp, "key.pem")
        for path, data in ((cert_path, cert), (key_path, key)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        context.load_cert_chain(cert_path, key_path)


def server_ssl_context(creds: Credentials) -> ssl.SSLContext | None:
    """The backend's side: its certificate; with a CA, peers must present a certificate it signed."""
    if not creds.tls:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _load_chain(context, creds.cert, creds.key)
    if creds.ca is not None:
        context.load_verify_locations(cadata=creds.ca.decode())
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_ssl_context(creds: Credentials) -> ssl.SSLContext | None:
    """The frontend's side: the backend verified against the CA (the system roots without one), and
    this process's certificate as its client certificate when it has one."""
    if not creds.dials_tls:
        return None
    context = ssl.create_default_context(cadata=creds.ca.decode() if creds.ca else None)
    if creds.cert is not None and creds.key is not None:
        _load_chain(context, creds.cert, creds.key)
    return context
