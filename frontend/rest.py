"""KServe v2 over HTTP/REST, with Triton's binary tensor data and system shared-memory extensions, beside
the gRPC service.

Every endpoint turns its HTTP request into the KServe protobuf request (frontend/rest_codec.py) and
calls the transport-free :class:`frontend.kserve_api.KServeApi`, which serves gRPC too, with the
request's headers as the call's metadata. Validation, routing, retries, statistics, the hold for the
first routing table, the count of requests in flight that a drain waits for, and who may load and
unload models are therefore the same as on gRPC; this module only routes, maps the
:class:`RequestError` the core raises to an HTTP status, and bounds request bodies.

The server is aiohttp's: a mature asyncio HTTP server that runs in the frontend's one event loop
beside grpc.aio (no thread, no second loop), reads request bodies as streams with a size bound
(``client_max_size``, answered 413), and is already a dependency of the project.

Status codes follow Triton's HTTP server where it has the case (bad input 400, unknown model 404,
unavailable 503, internal 500, unimplemented 501) and the usual gRPC-to-HTTP mapping where it has
not (deadline 504, shed under overload 429, unauthenticated 401). Error bodies are
``{"error": "<message>"}``.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from dataclasses import dataclass

import grpc
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage
from aiohttp.log import server_logger

from common.config import join_host_port, split_host_port
from common.pb import kserve
from frontend.kserve_api import Call, KServeApi
from frontend.requests import RequestError
from frontend.rest_codec import (HEADER_LENGTH, HttpError, invalid, load_json, json_object, set_parameter,
                                 decode_infer_request, encode_infer_response, message_to_json)

log = logging.getLogger("nexus.frontend.http")

# How long a drain keeps idle keep-alive connections open, answering what comes on them with
# ``Connection: close``, before it closes those still open.
KEEP_ALIVE_CLOSE_GRACE_S = 2.0

HTTP_STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.ALREADY_EXISTS: 400,
    grpc.StatusCode.CANCELLED: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNKNOWN: 500,
    grpc.StatusCode.DATA_LOSS: 500,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


class _ServerLog(logging.LoggerAdapter):
    """aiohttp's server log, where bytes that are not an HTTP/1 request (a gRPC client dialling this
    port speaks HTTP/2) make one line instead of a traceback; aiohttp answers them 400 itself."""

    def exception(self, msg, *args, exc_info=True, **kwargs) -> None:
        if not isinstance(exc_info, BadHttpMessage):
            self.logger.exception(msg, *args, exc_info=exc_info, **kwargs)
            return
        peer = args[0] if args else "a client"
        if "PRI" in exc_info.message:        # HTTP/2's connection preface, "PRI * HTTP/2.0"
            log.warning("HTTP/REST port: %s spoke HTTP/2 (a gRPC client? KServe gRPC is on the --listen "
                        "port); answered 400", peer)
        else:
            reason = exc_info.message.strip().splitlines()[0].rstrip(":") if exc_info.message.strip() else "bad request"
            log.warning("HTTP/REST port: %s sent no valid HTTP/1 request (%s); answered 400", peer, reason)


def error_response(status: int, message: str, headers=None) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


@web.middleware
async def _errors(request: web.Request, handler):
    try:
        return await handler(request)
    except RequestError as exc:
        return error_response(HTTP_STATUS.get(exc.code, 500), str(exc))
    except HttpError as exc:
        return error_response(exc.status, str(exc))
    except web.HTTPException as exc:       # no such path (404), wrong method (405), ...
        if exc.status < 400:
            raise
        allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        message = {404: f"no endpoint {request.path}",
                   405: f"{request.method} is not allowed on {request.path}"}.get(exc.status, exc.reason)
        return error_response(exc.status, message, allow)
    except Exception as exc:               # a bug: answer 500 and keep serving
        log.exception("HTTP %s %s failed", request.method, request.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")


class _Api:
    def __init__(self, api: KServeApi, max_body_bytes: int) -> None:
        self.api = api
        self.max_body_bytes = max_body_bytes

    async def _body(self, request: web.Request) -> bytes:
        too_large = HttpError(413, f"request body is larger than the limit of {self.max_body_bytes} bytes "
                                   f"(--http-max-body-mb)")
        if request.content_length is not None and request.content_length > self.max_body_bytes:
            raise too_large
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise too_large from None

    async def _json_body(self, request: web.Request) -> dict:
        return json_object(load_json(await self._body(request), "the request body"), "the request body")

    async def _call(self, method: str, message, request: web.Request):
        call = Call(metadata=tuple((k.lower(), v) for k, v in request.headers.items()))
        return await getattr(self.api, method)(message, call)

    @staticmethod
    def _model(request: web.Request) -> tuple[str, str]:
        return request.match_info["name"], request.match_info.get("version", "")

    async def live(self, request):
        reply = await self._call("ServerLive", kserve.ServerLiveRequest(), request)
        return web.Response(status=200 if reply.live else 400)

    async def ready(self, request):
        reply = await self._call("ServerReady", kserve.ServerReadyRequest(), request)
        return web.Response(status=200 if reply.ready else 400)

    async def server_metadata(self, request):
        reply = await self._call("ServerMetadata", kserve.ServerMetadataRequest(), request)
        return web.json_response(message_to_json(reply))

    async def model_ready(self, request):
        name, version = self._model(request)
        reply = await self._call("ModelReady", kserve.ModelReadyRequest(name=name, version=version), request)
        return web.Response(status=200 if reply.ready else 400)

    async def model_metadata(self, request):
        name, version = self._model(request)
        reply = await self._call("ModelMetadata", kserve.ModelMetadataRequest(name=name, version=version), request)
        return web.json_response(message_to_json(reply))

    async def model_config(self, request):
        name, version = self._model(request)
        reply = await self._call("ModelConfig", kserve.ModelConfigRequest(name=name, version=version), request)
        return web.json_response(message_to_json(reply.config, every_message=False))

    async def model_stats(self, request):
        name = request.match_info.get("name", "")
        version = request.match_info.get("version", "")
        reply = await self._call("ModelStatistics", kserve.ModelStatisticsRequest(name=name, version=version),
                                 request)
        return web.json_response(message_to_json(reply))

    async def infer(self, request):
        name, version = self._model(request)
        body = await self._body(request)
        message, form = decode_infer_request(name, version, body, request.headers.get(HEADER_LENGTH))
        reply = await self.api.ModelInfer(message, Call())     # inference reads no headers
        header, sections = encode_infer_response(reply, form)
        if not sections:
            response = web.Response(body=header, content_type="application/json")
        else:
            response = web.Response(body=b"".join([header, *sections]), content_type="application/octet-stream",
                                    headers={HEADER_LENGTH: str(len(header))})
        response.enable_compression()      # gzip or deflate when the client's Accept-Encoding asks for it
        return response

    async def repository_index(self, request):
        doc = await self._json_body(request)
        ready = doc.get("ready", False)
        if not isinstance(ready, bool):
            raise invalid("'ready' must be true or false")
        reply = await self._call("RepositoryIndex", kserve.RepositoryIndexRequest(ready=ready), request)
        return web.json_response([message_to_json(m) for m in reply.models])

    async def _repository_call(self, request, method: str, message):
        params = json_object((await self._json_body(request)).get("parameters"), "'parameters'")
        for key, value in params.items():
            if key == "file" or key.startswith("file:"):
                raise invalid("loading a model from files in the request is not supported; "
                               "upload it with `nexus models upload`")
            if key == "config":
                raise invalid("an override 'config' is not supported on load")
            set_parameter(message.parameters, key, value, "repository")
        await self._call(method, message, request)
        return web.Response(status=200)

    async def load(self, request):
        return await self._repository_call(request, "RepositoryModelLoad",
                                           kserve.RepositoryModelLoadRequest(model_name=request.match_info["name"]))

    async def unload(self, request):
        return await self._repository_call(request, "RepositoryModelUnload",
                                           kserve.RepositoryModelUnloadRequest(model_name=request.match_info["name"]))


    # ---- system shared memory (Triton's extension) -------------------------------------------------

    async def shm_status(self, request):
        name = request.match_info.get("name", "")
        reply = await self._call("SystemSharedMemoryStatus", kserve.SystemSharedMemoryStatusRequest(name=name),
                                 request)
        return web.json_response([message_to_json(r) for _, r in sorted(reply.regions.items())])

    async def shm_register(self, request):
        doc = await self._json_body(request)
        key, offset, byte_size = doc.get("key"), doc.get("offset", 0), doc.get("byte_size")
        if not isinstance(key, str):
            raise invalid("'key' must be a string: the shared-memory object's key")
        for field_name, value in (("offset", offset), ("byte_size", byte_size)):
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**64:
                raise invalid(f"'{field_name}' must be a non-negative integer")
        message = kserve.SystemSharedMemoryRegisterRequest(name=request.match_info["name"], key=key, offset=offset,
                                                           byte_size=byte_size)
        await self._call("SystemSharedMemoryRegister", message, request)
        return web.Response(status=200)

    async def shm_unregister(self, request):
        name = request.match_info.get("name", "")
        await self._call("SystemSharedMemoryUnregister", kserve.SystemSharedMemoryUnregisterRequest(name=name),
                         request)
        return web.Response(status=200)

    async def cuda_shm_status(self, request):
        name = request.match_info.get("name", "")
        await self._call("CudaSharedMemoryStatus", kserve.CudaSharedMemoryStatusRequest(name=name), request)
        return web.json_response([])

    async def cuda_shm_register(self, request):
        await self._json_body(request)
        await self._call("CudaSharedMemoryRegister", kserve.CudaSharedMemoryRegisterRequest(
            name=request.match_info["name"]), request)
        return web.Response(status=200)

    async def cuda_shm_unregister(self, request):
        name = request.match_info.get("name", "")
        await self._call("CudaSharedMemoryUnregister", kserve.CudaSharedMemoryUnregisterRequest(name=name), request)
        return web.Response(status=200)


def build_app(core: KServeApi, max_body_bytes: int) -> web.Application:
    """The KServe v2 REST routes (with Triton's repository, statistics and shared-memory extensions) over
    ``core``."""
    api = _Api(core, max_body_bytes)
    app = web.Application(client_max_size=max_body_bytes, middlewares=[_errors])
    r = app.router
    r.add_get("/v2/health/live", api.live)
    r.add_get("/v2/health/ready", api.ready)
    r.add_get("/v2", api.server_metadata)
    r.add_get("/v2/", api.server_metadata)
    r.add_get("/v2/models/stats", api.model_stats)     # before /v2/models/{name}, which would take it
    r.add_post("/v2/repository/index", api.repository_index)
    r.add_post("/v2/repository/models/{name}/load", api.load)
    r.add_post("/v2/repository/models/{name}/unload", api.unload)
    for prefix, status, register, unregister in (
            ("/v2/systemsharedmemory", api.shm_status, api.shm_register, api.shm_unregister),
            ("/v2/cudasharedmemory", api.cuda_shm_status, api.cuda_shm_register, api.cuda_shm_unregister)):
        r.add_get(prefix + "/status", status)
        r.add_get(prefix + "/region/{name}/status", status)
        r.add_post(prefix + "/region/{name}/register", register)
        r.add_post(prefix + "/unregister", unregister)
        r.add_post(prefix + "/region/{name}/unregister", unregister)
    for model in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
        r.add_get(model, api.model_metadata)
        r.add_get(model + "/ready", api.model_ready)
        r.add_get(model + "/config", api.model_config)
        r.add_get(model + "/stats", api.model_stats)
        r.add_post(model + "/infer", api.infer)
    return app


def tls_context(cert_path: str, key_path: str) -> ssl.SSLContext:
    """HTTPS with the component's certificate; like the KServe gRPC port, clients present none."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_path, key_path)
    return context


class _Draining:
    """Once set, every response closes its connection after it (``Connection: close``)."""

    def __init__(self) -> None:
        self.is_set = False

    async def on_response_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        if self.is_set:                   # the headers are made: say it, and close after the response
            response.headers["Connection"] = "close"
            response.force_close()


@dataclass
class HttpServer:
    """A started HTTP/REST server; :meth:`stop` drains it."""
    runner: web.AppRunner
    site: web.TCPSite
    address: str                  # the bound HOST:PORT
    close_grace_s: float
    draining: _Draining

    async def stop(self) -> None:
        """Stop accepting connections, then give the open keep-alive connections ``close_grace_s`` to
        close by themselves: each answers what comes on it with ``Connection: close`` and closes (an
        idle connection closed under a client that is sending on it would lose that request, since
        HTTP/1.1 has no way to say it was not taken). Then close what is still open, and wait for the
        requests in flight (at most the drain's time)."""
        await self.site.stop()
        self.draining.is_set = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.close_grace_s
        while self.runner.server is not None and self.runner.server.connections and loop.time() < deadline:
            await asyncio.sleep(0.02)
        await self.runner.cleanup()


async def start(core: KServeApi, listen: str, max_body_bytes: int,
                ssl_context: ssl.SSLContext | None = None, drain_s: float = 20.0,
                reuse_port: bool = False) -> HttpServer:
    """Serve HTTP/REST (HTTPS with ``ssl_context``) on ``listen`` (port 0: any free port) in the running
    event loop. ``HttpServer.stop()`` drains it: it waits at most ``drain_s`` for the requests in
    flight. ``reuse_port``: the port is shared with the other workers of the frontend (SO_REUSEPORT)."""
    host, port = split_host_port(listen)
    app = build_app(core, max_body_bytes)
    draining = _Draining()
    app.on_response_prepare.append(draining.on_response_prepare)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=drain_s,
                           logger=_ServerLog(server_logger, {}))
    await runner.setup()
    site = web.TCPSite(runner, host or None, port, ssl_context=ssl_context, reuse_port=reuse_port or None)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise OSError(f"could not bind HTTP {listen}: {exc.strerror or exc}") from exc
    return HttpServer(runner, site, join_host_port(host, runner.addresses[0][1]),
                      min(drain_s, KEEP_ALIVE_CLOSE_GRACE_S), draining)
