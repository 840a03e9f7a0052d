"""KServe v2 over HTTP/REST, with Triton's binary tensor data and system shared-memory extensions, beside
the gRPC service.

Every endpoint turns its HTTP request into the KServe protobuf request and calls the same
:class:`frontend.kserve.KServeService` handler that serves gRPC, through :class:`HttpCallContext`,
a stand-in for the gRPC servicer context whose ``abort`` raises :class:`RequestError`. Validation,
routing, retries, statistics, status codes, the hold for the first routing table, the count of
requests in flight that a drain waits for, and who may load and unload models are therefore the gRPC
path's own; this module only
decodes and encodes the wire format (JSON tensors, ``binary_data_size`` sections) and maps gRPC
status codes to HTTP ones.

The server is aiohttp's: a mature asyncio HTTP server that runs in the frontend's one event loop
beside grpc.aio (no thread, no second loop), reads request bodies as streams with a size bound
(``client_max_size``, answered 413), and is already a dependency of the project.

Status codes follow Triton's HTTP server where it has the case (bad input 400, unknown model 404,
unavailable 503, internal 500, unimplemented 501) and the usual gRPC-to-HTTP mapping where it has
not (deadline 504, shed under overload 429, unauthenticated 401). Error bodies are
``{"error": "<message>"}``.
"""

from __future__ import annotations

import json
import logging
import math
import ssl
from dataclasses import dataclass, field

import grpc
import numpy as np
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage
from aiohttp.log import server_logger

from common.config import join_host_port, split_host_port
from common.pb import kserve
from common.tensors import KSERVE_TO_NUMPY
from frontend.kserve import KServeService
from frontend.requests import RequestError

log = logging.getLogger("nexus.frontend.http")

HEADER_LENGTH = "Inference-Header-Content-Length"

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
_INTEGER_KINDS = "iu"


class HttpError(Exception):
    """An error with an HTTP status that has no gRPC twin (413)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


class HttpCallContext:
    """What the KServe handlers use of ``grpc.aio.ServicerContext``, for a call that came over HTTP."""

    def __init__(self, request: web.Request) -> None:
        self._request = request

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()) -> None:
        raise RequestError(code, details)

    def time_remaining(self) -> float | None:
        return None          # HTTP carries no deadline; a request sets its own with the 'timeout' parameter

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return tuple((k.lower(), v) for k, v in self._request.headers.items())

    def peer(self) -> str:
        return f"http:{self._request.remote or ''}"


# ---- protobuf <-> JSON ------------------------------------------------------------------------------

def _value(fd, value, every_message: bool):
    if fd.enum_type is not None:
        known = fd.enum_type.values_by_number.get(value)
        return known.name if known is not None else value
    if fd.message_type is not None:
        return message_to_json(value, every_message)
    return value


def message_to_json(message, every_message: bool = True) -> dict:
    """A KServe or model-config message as Triton's HTTP server writes it: proto field names, 64-bit
    integers as JSON numbers, enums by name. Unset sub-messages are left out unless ``every_message``."""
    out: dict = {}
    for fd in message.DESCRIPTOR.fields:
        oneof = fd.containing_oneof
        if oneof is not None and message.WhichOneof(oneof.name) != fd.name:
            continue
        value = getattr(message, fd.name)
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            value_fd = fd.message_type.fields_by_name["value"]
            out[fd.name] = {k: _value(value_fd, v, every_message) for k, v in value.items()}
        elif fd.is_repeated:
            out[fd.name] = [_value(fd, v, every_message) for v in value]
        elif fd.message_type is not None:
            if every_message or message.HasField(fd.name):
                out[fd.name] = message_to_json(value, every_message)
        else:
            out[fd.name] = _value(fd, value, every_message)
    return out


def _set_parameter(target, key: str, value, where: str) -> None:
    param = target[key]
    if isinstance(value, bool):
        param.bool_param = value
    elif isinstance(value, int):
        if not -2**63 <= value < 2**64:
            raise _invalid(f"{where} parameter {key!r}: {value} does not fit in 64 bits")
        if value < 2**63:
            param.int64_param = value
        else:
            param.uint64_param = value
    elif isinstance(value, float):
        param.double_param = value
    elif isinstance(value, str):
        param.string_param = value
    else:
        raise _invalid(f"{where} parameter {key!r}: expected a boolean, number or string, got {type(value).__name__}")


def _object(value, where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _invalid(f"{where} must be a JSON object, got {type(value).__name__}")
    return value


def _load_json(data: bytes, where: str):
    try:
        return json.loads(data) if data.strip() else None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _invalid(f"malformed JSON in {where}: {exc}") from None
    except RecursionError:
        raise _invalid(f"JSON in {where} is nested too deeply") from None


def _json_tensor_bytes(name: str, datatype: str, shape: list[int], data) -> bytes:
    """The raw bytes of a tensor given as JSON ``data`` (nested or flat, row-major)."""
    dtype = KSERVE_TO_NUMPY.get(datatype)
    if dtype is None:
        raise _invalid(f"input {name!r}: datatype {datatype!r} cannot be sent as JSON data here; "
                       f"known datatypes are {sorted(KSERVE_TO_NUMPY)}")
    try:
        values = np.asarray(data)
    except ValueError as exc:
        raise _invalid(f"input {name!r}: data is not a regular array: {exc}") from None
    kind = values.dtype.kind
    if values.size and not (kind == "b" if dtype.kind == "b" else
                            kind in _INTEGER_KINDS if dtype.kind in _INTEGER_KINDS else kind in "iuf"):
        wanted = "true/false" if dtype.kind == "b" else "integers" if dtype.kind in _INTEGER_KINDS else "numbers"
        raise _invalid(f"input {name!r}: data of a {datatype} tensor must be {wanted}")
    count = math.prod(shape)
    if values.size != count:
        raise _invalid(f"input {name!r}: shape {shape} needs {count} values, data has {values.size}")
    cast = values.astype(dtype)
    if dtype.kind in _INTEGER_KINDS and values.size and not np.array_equal(cast, values):
        raise _invalid(f"input {name!r}: a value is out of range for {datatype}")
    return cast.tobytes()


@dataclass(frozen=True)
class OutputFormat:
    """Which outputs of an infer response go back as binary sections rather than JSON ``data``."""

    binary_default: bool = False               # the request's binary_data_output parameter
    binary: dict[str, bool] = field(default_factory=dict)   # per requested output: its binary_data parameter

    def is_binary(self, name: str) -> bool:
        return self.binary.get(name, self.binary_default)


def decode_infer_request(model: str, version: str, body: bytes, header_length: str | None
                         ) -> tuple[kserve.ModelInferRequest, OutputFormat]:
    """An HTTP infer body (JSON, optionally followed by binary tensor data) as a ModelInferRequest, and
    the form its outputs go back in. Raises RequestError (INVALID_ARGUMENT) naming what is wrong."""
    if header_length is None:
        header, binary = body, b""
    else:
        try:
            length = int(header_length)
        except ValueError:
            raise _invalid(f"{HEADER_LENGTH} must be an integer, got {header_length!r}") from None
        if not 0 <= length <= len(body):
            raise _invalid(f"{HEADER_LENGTH} {length} is outside the body of {len(body)} bytes")
        header, binary = body[:length], body[length:]
    doc = _load_json(header, "the inference request")
    if not isinstance(doc, dict):
        raise _invalid("the inference request must be a JSON object")
    request = kserve.ModelInferRequest(model_name=model, model_version=version)
    request_id = doc.get("id", "")
    if not isinstance(request_id, str):
        raise _invalid(f"'id' must be a string, got {type(request_id).__name__}")
    request.id = request_id
    parameters = dict(_object(doc.get("parameters"), "'parameters'"))
    binary_output = parameters.pop("binary_data_output", False)
    if not isinstance(binary_output, bool):
        raise _invalid("parameter 'binary_data_output' must be true or false")
    for key, value in parameters.items():
        _set_parameter(request.parameters, key, value, "request")
    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise _invalid("'inputs' must be a non-empty list of tensors")
    offset = 0
    for i, tensor in enumerate(inputs):
        tensor = _object(tensor, f"inputs[{i}]")
        name, datatype, shape = tensor.get("name"), tensor.get("datatype"), tensor.get("shape")
        if not isinstance(name, str) or not isinstance(datatype, str):
            raise _invalid(f"inputs[{i}] needs a string 'name' and 'datatype'")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
            raise _invalid(f"input {name!r}: 'shape' must be a list of integers")
        if any(d < 0 for d in shape):
            raise _invalid(f"input {name!r}: shape {shape} has a negative dimension")
        if any(d >= 2**63 for d in shape):
            raise _invalid(f"input {name!r}: shape {shape} has a dimension past 64 bits")
        params = dict(_object(tensor.get("parameters"), f"input {name!r} 'parameters'"))
        size = params.pop("binary_data_size", None)
        request.inputs.add(name=name, datatype=datatype, shape=shape)
        for key, value in params.items():
            _set_parameter(request.inputs[-1].parameters, key, value, f"input {name!r}")
        if "shared_memory_region" in params:       # read from the region (frontend/requests.py): no data here
            if size is not None or "data" in tensor:
                raise _invalid(f"input {name!r} has both a shared_memory_region and "
                               f"{'data' if 'data' in tensor else 'a binary_data_size parameter'}")
        elif size is not None:
            if "data" in tensor:
                raise _invalid(f"input {name!r} has both 'data' and a binary_data_size parameter")
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise _invalid(f"input {name!r}: binary_data_size must be a non-negative integer, got {size!r}")
            if header_length is None:
                raise _invalid(f"input {name!r} has a binary_data_size parameter but the request has no "
                               f"{HEADER_LENGTH} header")
            if offset + size > len(binary):
                raise _invalid(f"input {name!r}: binary_data_size {size} runs past the end of the body "
                               f"({len(binary) - offset} bytes of binary data left)")
            request.raw_input_contents.append(binary[offset:offset + size])
            offset += size
        elif "data" in tensor:
            request.raw_input_contents.append(_json_tensor_bytes(name, datatype, shape, tensor["data"]))
        else:
            raise _invalid(f"input {name!r} has neither 'data' nor a binary_data_size parameter")
    if offset != len(binary):
        raise _invalid(f"the body has {len(binary) - offset} bytes of binary data beyond the inputs' "
                       f"binary_data_size total of {offset}")
    binary_outputs: dict[str, bool] = {}
    outputs = doc.get("outputs")
    if outputs is not None:
        if not isinstance(outputs, list):
            raise _invalid("'outputs' must be a list")
        for i, out in enumerate(outputs):
            out = _object(out, f"outputs[{i}]")
            name = out.get("name")
            if not isinstance(name, str):
                raise _invalid(f"outputs[{i}] needs a string 'name'")
            params = dict(_object(out.get("parameters"), f"output {name!r} 'parameters'"))
            if params.pop("classification", 0):
                raise _invalid(f"output {name!r}: the classification extension is not supported")
            as_binary = params.pop("binary_data", binary_output)
            if not isinstance(as_binary, bool):
                raise _invalid(f"output {name!r}: binary_data must be true or false")
            binary_outputs[name] = as_binary
            request.outputs.add(name=name)
            for key, value in params.items():
                _set_parameter(request.outputs[-1].parameters, key, value, f"output {name!r}")
    return request, OutputFormat(binary_output, binary_outputs)


def encode_infer_response(response: kserve.ModelInferResponse, form: OutputFormat) -> tuple[bytes, list[bytes]]:
    """The JSON header of an infer response and the binary sections that follow it, in output order."""
    outputs, sections = [], []
    for out, raw in zip(response.outputs, response.raw_output_contents):
        entry = {"name": out.name, "datatype": out.datatype, "shape": list(out.shape)}
        if "shared_memory_region" in out.parameters:      # written to the region: only where it went
            entry["parameters"] = {k: getattr(p, p.WhichOneof("parameter_choice")) for k, p in out.parameters.items()}
        elif form.is_binary(out.name):
            entry["parameters"] = {"binary_data_size": len(raw)}
            sections.append(raw)
        else:
            entry["data"] = np.frombuffer(raw, KSERVE_TO_NUMPY[out.datatype]).tolist()
        outputs.append(entry)
    doc = {"model_name": response.model_name, "model_version": response.model_version}
    if response.id:
        doc["id"] = response.id
    if response.parameters:
        doc["parameters"] = {k: getattr(p, p.WhichOneof("parameter_choice")) for k, p in response.parameters.items()
                             if p.WhichOneof("parameter_choice")}
    doc["outputs"] = outputs
    return json.dumps(doc).encode(), sections


# ---- the server -------------------------------------------------------------------------------------

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
    def __init__(self, service: KServeService, max_body_bytes: int) -> None:
        self.service = service
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
        return _object(_load_json(await self._body(request), "the request body"), "the request body")

    async def _call(self, method: str, message, request: web.Request):
        return await getattr(self.service, method)(message, HttpCallContext(request))

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
        reply = await self._call("ModelInfer", message, request)
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
            raise _invalid("'ready' must be true or false")
        reply = await self._call("RepositoryIndex", kserve.RepositoryIndexRequest(ready=ready), request)
        return web.json_response([message_to_json(m) for m in reply.models])

    async def _repository_call(self, request, method: str, message):
        params = _object((await self._json_body(request)).get("parameters"), "'parameters'")
        for key, value in params.items():
            if key == "file" or key.startswith("file:"):
                raise _invalid("loading a model from files in the request is not supported; "
                               "upload it with `nexus models upload`")
            if key == "config":
                raise _invalid("an override 'config' is not supported on load")
            _set_parameter(message.parameters, key, value, "repository")
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
            raise _invalid("'key' must be a string: the shared-memory object's key")
        for field_name, value in (("offset", offset), ("byte_size", byte_size)):
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**64:
                raise _invalid(f"'{field_name}' must be a non-negative integer")
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


def build_app(service: KServeService, max_body_bytes: int) -> web.Application:
    """The KServe v2 REST routes (with Triton's repository, statistics and shared-memory extensions) over
    ``service``."""
    api = _Api(service, max_body_bytes)
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


async def start(service: KServeService, listen: str, max_body_bytes: int,
                ssl_context: ssl.SSLContext | None = None, drain_s: float = 20.0) -> tuple[web.AppRunner, str]:
    """Serve HTTP/REST (HTTPS with ``ssl_context``) on ``listen`` (port 0: any free port) in the running
    event loop; return the runner and the bound HOST:PORT. ``await runner.cleanup()`` stops accepting
    and waits at most ``drain_s`` for the requests in flight."""
    host, port = split_host_port(listen)
    runner = web.AppRunner(build_app(service, max_body_bytes), access_log=None, shutdown_timeout=drain_s,
                           logger=_ServerLog(server_logger, {}))
    await runner.setup()
    try:
        await web.TCPSite(runner, host or None, port, ssl_context=ssl_context).start()
    except OSError as exc:
        await runner.cleanup()
        raise OSError(f"could not bind HTTP {listen}: {exc.strerror or exc}") from exc
    return runner, join_host_port(host, runner.addresses[0][1])
