"""Undecodable request bytes on any gRPC port: INVALID_ARGUMENT, one short rate-limited log line.

grpc.aio deserialises a request before the handler runs; a deserialiser that raises makes the
server answer UNKNOWN and log a traceback per request. :class:`DecodeGuard`, installed on every
server by :func:`common.grpc_util.server`, wraps each method's request deserialiser so that a
message protobuf cannot parse becomes a marker instead of an exception, and wraps the handler so
that the marker is answered INVALID_ARGUMENT ("undecodable <Message>: ...") before any servicer
code sees it. For streaming requests the marker ends the call at the message where it appears.
Servicers therefore only ever receive well-formed messages (through their request argument or
iterator; none of this project's servicers reads with ``context.read()``, which is not covered).
"""

from __future__ import annotations

import inspect
import logging
import threading
import time

import grpc
from google.protobuf.message import DecodeError

log = logging.getLogger("nexus.wire")

LOG_INTERVAL_S = 10.0


class _Undecodable:
    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


class _RateLimitedLog:
    """At most one line per ``interval_s``, counting what it held back."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._last = -float("inf")
        self._held = 0
        self._lock = threading.Lock()

    def __call__(self, method: str, reason: str) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last < self.interval_s:
                self._held += 1
                return
            held, self._held, self._last = self._held, 0, now
        more = f" (+{held} more since the last report)" if held else ""
        log.warning("refused undecodable request to %s: %s%s", method, reason[:120], more)


_report = _RateLimitedLog()


def _guard_deserializer(deserializer):
    if deserializer is None:
        return None
    name = getattr(getattr(deserializer, "__self__", None), "__name__", "message")

    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except (DecodeError, ValueError, TypeError, RuntimeError) as exc:   # protobuf's parse failures
            return _Undecodable(f"undecodable {name}: {exc or type(exc).__name__}")

    return deserialize


def _reason(method: str, marker: _Undecodable) -> str:
    _report(method, marker.reason)
    return marker.reason


async def _responses(result):
    """The messages of a streaming handler's result: an async or plain generator, or a coroutine that
    writes with ``context.write``."""
    if hasattr(result, "__aiter__"):
        async for item in result:
            yield item
    elif inspect.isawaitable(result):
        await result
    elif result is not None:
        for item in result:
            yield item


def _guard_unary_request(behavior, method: str):
    is_coroutine = inspect.iscoroutinefunction(behavior)   # known once: not asked per request

    async def unary(request, context):
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _reason(method, request))
        if is_coroutine:
            return await behavior(request, context)
        result = behavior(request, context)
        return await result if inspect.isawaitable(result) else result

    async def unary_stream(request, context):
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _reason(method, request))
        async for item in _responses(behavior(request, context)):
            yield item

    return unary, unary_stream


class _Refused(Exception):
    """An undecodable message in a request stream: it ends the servicer's reading, and the call is
    aborted from the handler's own flow (:func:`_guard_stream_request`)."""


def _guard_stream_request(behavior, method: str, streaming_response: bool):
    """The call is aborted where the handler itself runs, never from the iterator: a servicer that reads
    its requests in a task of its own while it writes responses (frontend/kserve.py, backend/server.py)
    would otherwise abort during a write, which gRPC refuses (GRPC_CALL_ERROR_TOO_MANY_OPERATIONS) and
    logs with a traceback, leaving the client to wait for its deadline."""
    def checked(request_iterator, refused: list[str]):
        async def messages():
            async for message in request_iterator:
                if isinstance(message, _Undecodable):
                    refused.append(_reason(method, message))
                    raise _Refused(refused[0])
                yield message
        return messages()

    async def stream_unary(request_iterator, context):
        refused: list[str] = []
        try:
            result = behavior(checked(request_iterator, refused), context)
            reply = await result if inspect.isawaitable(result) else result
        except _Refused:
            reply = None
        if refused:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refused[0])
        return reply

    async def stream_stream(request_iterator, context):
        refused: list[str] = []
        try:
            async for item in _responses(behavior(checked(request_iterator, refused), context)):
                if refused:
                    break
                yield item
        except _Refused:
            pass
        if refused:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refused[0])

    return stream_stream if streaming_response else stream_unary


def guard_handler(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """``handler`` with undecodable requests answered INVALID_ARGUMENT (module docstring)."""
    kw = dict(request_deserializer=_guard_deserializer(handler.request_deserializer),
              response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(_guard_unary_request(handler.unary_unary, method)[0], **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(_guard_unary_request(handler.unary_stream, method)[1], **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(_guard_stream_request(handler.stream_unary, method, False), **kw)
    return grpc.stream_stream_rpc_method_handler(_guard_stream_request(handler.stream_stream, method, True), **kw)


class DecodeGuard(grpc.aio.ServerInterceptor):
    """Installs :func:`guard_handler` on every method of the server (module docstring)."""

    def __init__(self) -> None:
        self._guarded: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        cached = self._guarded.get(method)      # registered methods only: a bounded cache
        if cached is None or cached[0] is not handler:
            cached = self._guarded[method] = (handler, guard_handler(handler, method))
        return cached[1]
