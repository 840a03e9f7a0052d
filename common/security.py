"""TLS material and the cluster token of one process, and the gRPC interceptors that carry and check it.

Contracts (docs/security.md):
- :class:`Credentials` is loaded once per process from its :class:`~common.config.SecurityConfig`:
  PEM files read, the token taken from ``--token-file`` or ``$NEXUS_TOKEN``. A process without a
  certificate serves plaintext; one without a token neither sends nor checks one.
- The token travels as gRPC metadata ``authorization: Bearer <token>`` on every call a component
  or a client command makes on the control protocol (:func:`token_interceptors`).
- A server guards the methods its ``guarded(method)`` predicate names (:class:`TokenGuard`): a
  missing or wrong token is answered UNAUTHENTICATED, saying which, and the handler never runs.
  KServe inference and ``grpc.health.v1`` are never guarded: clients and probes carry no cluster
  token. KServe's repository load/unload are admin calls: the frontend's KServe handlers admit them
  by :class:`ProtocolAccess` (Triton's restricted-protocol header when one is configured, else
  the token), for gRPC and HTTP alike. System shared memory is, as in Triton, open unless a
  restricted-protocol header is configured for it.
"""

from __future__ import annotations

import hmac
import os
import pathlib
import secrets
from dataclasses import dataclass
from typing import Callable

import grpc

TOKEN_ENV = "NEXUS_TOKEN"
TOKEN_METADATA_KEY = "authorization"
_BEARER = "Bearer "
CONTROL_SERVICE_PREFIX = "/nexus.control."


class SecurityError(ValueError):
    """Unusable TLS material or token; the message names the file."""


@dataclass(frozen=True, repr=False)
class Credentials:
    cert: bytes | None = None
    key: bytes | None = None
    ca: bytes | None = None
    token: str | None = None

    @property
    def tls(self) -> bool:
        """This process serves TLS (it has a certificate)."""
        return self.cert is not None

    @property
    def dials_tls(self) -> bool:
        """This process dials its peers over TLS (it has a CA to verify them, or serves TLS itself)."""
        return self.ca is not None or self.cert is not None

    def __repr__(self) -> str:   # never print key material or the token
        return (f"Credentials(tls={self.tls}, ca={self.ca is not None}, "
                f"token={'set' if self.token else 'none'})")

    @staticmethod
    def load(config, environ=None) -> "Credentials":
        """Read the files a :class:`~common.config.SecurityConfig` names; the token falls back to
        ``$NEXUS_TOKEN``. Raises :class:`SecurityError` naming an unreadable or empty file."""
        environ = os.environ if environ is None else environ
        token = read_token(config.token_file) if config.token_file else (environ.get(TOKEN_ENV, "").strip() or None)
        return Credentials(cert=_read(config.tls_cert, "--tls-cert"), key=_read(config.tls_key, "--tls-key"),
                           ca=_read(config.tls_ca, "--tls-ca"), token=token)


def _read(path: str, flag: str) -> bytes | None:
    if not path:
        return None
    try:
        data = pathlib.Path(path).read_bytes()
    except OSError as exc:
        raise SecurityError(f"{flag} {path}: {exc.strerror or exc}") from None
    if not data.strip():
        raise SecurityError(f"{flag} {path}: the file is empty")
    return data


def read_token(path: str | os.PathLike) -> str:
    """The token in ``path`` (surrounding whitespace removed); SecurityError when unreadable or empty."""
    try:
        token = pathlib.Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise SecurityError(f"--token-file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if not token:
        raise SecurityError(f"--token-file {path}: the file is empty")
    return token


def ensure_token_file(path: pathlib.Path) -> str:
    """The token in ``path``, created (random, mode 0600) when the file does not exist yet."""
    path = pathlib.Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
    return read_token(path)


# ---- TLS credentials ---------------------------------------------------------------------------------


def server_credentials(creds: Credentials, require_client_cert: bool) -> grpc.ServerCredentials:
    """TLS with this process's certificate; with a CA and ``require_client_cert``, mutual TLS."""
    assert creds.cert is not None and creds.key is not None
    mutual = require_client_cert and creds.ca is not None
    return grpc.ssl_server_credentials([(creds.key, creds.cert)], root_certificates=creds.ca if mutual else None,
                                       require_client_auth=mutual)


def channel_credentials(creds: Credentials) -> grpc.ChannelCredentials:
    """TLS to a peer: verified against the CA (the system roots without one); this process's own
    certificate goes along as its client certificate when it has one."""
    return grpc.ssl_channel_credentials(root_certificates=creds.ca, private_key=creds.key,
                                        certificate_chain=creds.cert)


# ---- the token on the wire ---------------------------------------------------------------------------


def token_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return ((TOKEN_METADATA_KEY, _BEARER + token),) if token else ()


def _with_token(details, token: str):
    metadata = list(details.metadata or ()) + [(TOKEN_METADATA_KEY, _BEARER + token)]
    return details._replace(metadata=metadata) if hasattr(details, "_replace") else type(details)(
        details.method, details.timeout, metadata, details.credentials, details.wait_for_ready)


class _AioUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_with_token(details, self.token), request)


class _AioUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_with_token(details, self.token), request)


class _AioStreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(_with_token(details, self.token), request_iterator)


class _AioStreamStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(_with_token(details, self.token), request_iterator)


def token_interceptors(token: str | None) -> list:
    """grpc.aio client interceptors that add the token to every call (none without a token)."""
    if not token:
        return []
    return [_AioUnaryUnary(token), _AioUnaryStream(token), _AioStreamUnary(token), _AioStreamStream(token)]


class SyncTokenInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                           grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """The same for a synchronous channel (``grpc.intercept_channel``), used by client commands."""

    def __init__(self, token: str) -> None:
        self.token = token

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(_with_token(details, self.token), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(_with_token(details, self.token), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(_with_token(details, self.token), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(_with_token(details, self.token), request_iterator)


# ---- the token at the server -------------------------------------------------------------------------


def control_methods(method: str) -> bool:
    """The default guard: every method of the project's control protocol (``nexus.control.*``)."""
    return method.startswith(CONTROL_SERVICE_PREFIX)


def token_problem(metadata, token: str) -> str | None:
    """Why ``metadata`` does not carry ``token`` (None when it does)."""
    presented = None
    for key, value in metadata or ():
        if key == TOKEN_METADATA_KEY:
            presented = value
            break
    if presented is None:
        return ("missing cluster token: this call needs the cluster token (--token-file PATH or $NEXUS_TOKEN, "
                "sent as 'authorization: Bearer <token>')")
    if not (isinstance(presented, str) and presented.startswith(_BEARER)
            and hmac.compare_digest(presented[len(_BEARER):].encode(), token.encode())):
        return "wrong cluster token: the token sent does not match this cluster's"
    return None


def _refusal(handler, message: str):
    """A handler of ``handler``'s kind that answers UNAUTHENTICATED with ``message``."""

    async def unary(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - an async generator that never yields a message

    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(streaming, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    return grpc.stream_stream_rpc_method_handler(streaming, **kw)


class TokenGuard(grpc.aio.ServerInterceptor):
    """Refuses guarded methods whose call does not carry the cluster token (module docstring)."""

    def __init__(self, token: str, guarded: Callable[[str], bool] = control_methods) -> None:
        self.token = token
        self.guarded = guarded

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not self.guarded(handler_call_details.method):
            return handler
        problem = token_problem(handler_call_details.invocation_metadata, self.token)
        return handler if problem is None else _refusal(handler, problem)


# ---- Triton's restricted protocol on the KServe port -----------------------------------------------

RESTRICTED_HEADER_PREFIX = "triton-grpc-protocol-"


def parse_restricted_header(value: str) -> tuple[str, str]:
    """``KEY=VALUE`` -> (header name ``triton-grpc-protocol-KEY``, VALUE), as Triton's
    ``--grpc-restricted-protocol=model-repository:KEY=VALUE`` names it; ValueError when malformed."""
    key, sep, expected = value.partition("=")
    key = key.strip().lower()
    if not sep or not key or not expected:
        raise ValueError(f"expected KEY=VALUE, got {value!r}")
    if not all(c.isascii() and (c.isalnum() or c in "-_.") for c in key):
        raise ValueError(f"header key {key!r}: only letters, digits, '-', '_' and '.'")
    return RESTRICTED_HEADER_PREFIX + key, expected


def restricted_header_problem(metadata, key: str, value: str) -> str | None:
    """Why ``metadata`` does not carry the restricted protocol's header ``key: value`` (None when it does)."""
    presented = dict(metadata or ()).get(key)
    if isinstance(presented, str) and hmac.compare_digest(presented.encode(), value.encode()):
        return None
    return f"this protocol is restricted: expecting header {key!r} with the value the server was started with"


@dataclass(frozen=True, repr=False)
class ProtocolAccess:
    """Who may call a category of KServe calls (Triton's restricted protocols: the repository load and
    unload, system shared memory), the same rule on gRPC and on HTTP: with a restricted header
    (``--restricted-repository-header``, ``--restricted-shared-memory-header``) the callers presenting
    it, else with a cluster token the callers presenting that, else everyone."""

    restricted: tuple[str, str] | None = None      # (header name, value)
    token: str | None = None

    def problem(self, metadata) -> tuple[grpc.StatusCode, str] | None:
        """(status, message) refusing a call with ``metadata`` (lower-case keys), or None to serve it."""
        if self.restricted is not None:
            why = restricted_header_problem(metadata, *self.restricted)
            return None if why is None else (grpc.StatusCode.UNAVAILABLE, why)
        if self.token:
            why = token_problem(metadata, self.token)
            return None if why is None else (grpc.StatusCode.UNAUTHENTICATED, why)
        return None
