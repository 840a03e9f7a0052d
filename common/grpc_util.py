"""gRPC settings shared by every process: message limits, channel options, servers and channels.

Every server and channel of the project is made here, so TLS and the cluster token
(:mod:`common.security`) apply everywhere the same way: :func:`server` guards the control
protocol with the token when the process has one; :func:`bind` serves TLS when it has a
certificate; :func:`aio_channel` and :func:`channel` dial over TLS when it has a CA or a
certificate, and send the token when it has one.
"""

from __future__ import annotations

from typing import Callable

import grpc

from common.security import Credentials, SyncTokenInterceptor, TokenGuard, channel_credentials, control_methods, \
    server_credentials, token_interceptors
from common.wire_guard import DecodeGuard

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
UPLOAD_CHUNK_BYTES = 1024 * 1024

# Keepalive: a peer whose machine vanished (no RST) or whose process hangs (SIGSTOP: its sockets
# stay open) is noticed within a few seconds on every long-lived stream, without waiting for the
# OS's TCP timeouts. ``ping_timeout_ms`` bounds every ping, not only keepalive's: without it, a
# flow-control (BDP) ping that a hung peer never acknowledges holds the keepalive timer back
# forever, and the stream stays open (tests/e2e/test_failover.py, the hung backend). A connection with
# no call in flight is not pinged (``permit_without_calls`` 0): there is no call to fail, the next
# one finds a dead peer by its deadline, and pinging every idle connection (the scheduler's channels
# to every node, used only to push tables) cost an idle scheduler about 0.5% of a core with 10
# backends (benchmarks/idle_scheduler.md).
KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 2000),
    ("grpc.keepalive_timeout_ms", 2000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.ping_timeout_ms", 2000),
]
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.enable_retries", 0),
    *KEEPALIVE_OPTIONS,
]
# A node's channel to the scheduler pings more patiently: a scheduler that stalls (a long plan, a GC
# pause, a SIGSTOP) must find its nodes' Attach streams still open when it resumes, or it removes
# every node for a stream that ended by its own pause (issue 24). Its failure detector waits up to
# 30 s before it blames others (globalsched/state/failure_detector.py); the nodes wait as long before they
# give up on it (a scheduler that died closes its sockets, which they see at once). The scheduler
# still pings its nodes every 2 s on its side of the stream: a hung node is found as quickly.
SCHEDULER_KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 10000),
    ("grpc.keepalive_timeout_ms", 20000),
    ("grpc.http2.ping_timeout_ms", 20000),
]
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
    *KEEPALIVE_OPTIONS,
    ("grpc.http2.min_ping_interval_without_data_ms", 1000),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
]

NO_CREDENTIALS = Credentials()


def server(creds: Credentials = NO_CREDENTIALS, *, guarded: Callable[[str], bool] = control_methods,
           interceptors: list | None = None, reuse_port: bool = False) -> grpc.aio.Server:
    """A grpc.aio server; with a token, the methods ``guarded`` names need it (UNAUTHENTICATED otherwise).
    Requests that do not decode are answered INVALID_ARGUMENT on every method (:mod:`common.wire_guard`).
    Its ports are its own unless ``reuse_port``: then they are bound with SO_REUSEPORT, shared with
    the other processes that bind them so (the workers of one frontend)."""
    chain = [*(interceptors or []), DecodeGuard()]     # innermost: undecodable bytes never reach a handler
    if creds.token:
        chain.insert(0, TokenGuard(creds.token, guarded))
    options = [(k, 1 if reuse_port and k == "grpc.so_reuseport" else v) for k, v in SERVER_OPTIONS]
    return grpc.aio.server(options=options, interceptors=chain)


def bind(srv: grpc.aio.Server, address: str, creds: Credentials = NO_CREDENTIALS, *,
         require_client_cert: bool = False) -> str:
    """Bind ``address`` (port 0 picks a free port), over TLS when ``creds`` has a certificate, and
    return the bound HOST:PORT. ``require_client_cert`` with a CA asks peers for a certificate that
    CA signed (mutual TLS): for ports that only components dial."""
    host = address.rpartition(":")[0]
    if creds.tls:
        port = srv.add_secure_port(address, server_credentials(creds, require_client_cert))
    else:
        port = srv.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind {address}")
    return f"{host}:{port}"


def aio_channel(address: str, creds: Credentials = NO_CREDENTIALS, *, token_interceptor: bool = True,
                to_scheduler: bool = False) -> grpc.aio.Channel:
    """An asyncio channel; with ``token_interceptor=False`` the caller sends the token itself on each call
    (``metadata=common.security.token_metadata(token)``): an intercepted stream passes every message
    through one more layer of asyncio tasks, which a per-request stream pays on its hot path.
    ``to_scheduler``: a node's channel to the scheduler (:data:`SCHEDULER_KEEPALIVE_OPTIONS`)."""
    interceptors = (token_interceptors(creds.token) or None) if token_interceptor else None
    options = CHANNEL_OPTIONS
    if to_scheduler:
        patient = dict(SCHEDULER_KEEPALIVE_OPTIONS)
        options = [(k, patient.get(k, v)) for k, v in CHANNEL_OPTIONS]
    if creds.dials_tls:
        return grpc.aio.secure_channel(address, channel_credentials(creds), options=options,
                                       interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)


def channel(address: str, creds: Credentials = NO_CREDENTIALS) -> grpc.Channel:
    """A synchronous channel (client commands)."""
    if creds.dials_tls:
        ch = grpc.secure_channel(address, channel_credentials(creds), options=CHANNEL_OPTIONS)
    else:
        ch = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    return grpc.intercept_channel(ch, SyncTokenInterceptor(creds.token)) if creds.token else ch
