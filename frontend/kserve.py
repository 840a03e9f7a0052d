"""The KServe v2 ``inference.GRPCInferenceService`` served by the frontend.

Each inference request is validated against the routing table's model description, sent to a
backend chosen by load (outstanding requests per unit of planned share), and retried on another
backend if the first one disappears while the request's deadline still allows.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time

import grpc

from common import grpc_util
from common.pb import control, kserve, model_config
from common.security import Credentials
from frontend.backend_pool import BackendGone, BackendPool, Reply, ReplyStatus
from frontend.metrics import FrontendMetrics
from frontend.requests import RequestError, parse_infer_request
from frontend.routing import ModelEntry, RoutingTable
from frontend.statistics import StatsBook
from frontend.trace import Marks, Tracer

log = logging.getLogger("nexus.frontend")

SERVER_NAME = "nexus"
SERVER_VERSION = "0.1.0"
EXTENSIONS = ["binary_tensor_data", "model_repository", "model_repository(unload_dependents)", "statistics", "schedule_policy"]

_EXEC_TO_GRPC = {
    ReplyStatus.NOT_FOUND: grpc.StatusCode.UNAVAILABLE,
    ReplyStatus.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    ReplyStatus.DEADLINE: grpc.StatusCode.DEADLINE_EXCEEDED,
    ReplyStatus.OVERLOADED: grpc.StatusCode.UNAVAILABLE,      # a full queue, as Triton answers it
    ReplyStatus.INTERNAL: grpc.StatusCode.INTERNAL,
    ReplyStatus.CANCELLED: grpc.StatusCode.CANCELLED,
    ReplyStatus.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
}
# A request whose backend has not answered this long after its deadline is cancelled there and
# answered DEADLINE_EXCEEDED (the backend drops expired requests itself; this covers a backend
# busy with a long batch or hung).
DEADLINE_GRACE_S = 0.02
PATH_SMOOTHING = 0.05
CLIENT_PATH_SHARE = 0.05
RETURN_ALLOWANCE_MAX_S = 0.1
_DTYPE_ENUM = {name: model_config.DataType.Value(f"TYPE_{name}") for name in
               ("BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32", "FP64")}


class FrontendState:
    """What the frontend knows: the routing table, backend connections, counters and rates."""

    def __init__(self, use_stream: bool = True, creds: Credentials = grpc_util.NO_CREDENTIALS,
                 tracer: Tracer | None = None) -> None:
        self.table = RoutingTable.empty()
        self.tracer = tracer                             # --trace: per-request timelines (frontend/trace.py)
        self.pool = BackendPool(creds)
        self.health = None                               # common.health.Health, set by the server
        self.use_stream = use_stream
        self.ready = False
        # Rows per model and query since the last report: a request of n rows counts n, as batches
        # are sized in rows and query stages count their rows (the scheduler plans in rows/s).
        self.requests_window: dict[str, int] = {}
        self.counters: dict[str, dict[str, int]] = {}   # per model: success/fail counts, ns, rows
        self.edge_window: dict[tuple[str, str, str], list[int]] = {}  # (query, parent, child) -> [parent, child] rows
        self.table_changed = asyncio.Event()
        self.metrics = FrontendMetrics(lambda: self.table)   # Prometheus, served by frontend/server.py
        self.path_overhead_s = 0.0                      # smoothed frontend-backend-frontend overhead
        self.path_deviation_s = 0.0                     # and its smoothed mean deviation

    def set_table(self, table: RoutingTable) -> None:
        self.table = table
        self.pool.sync(table.addresses())     # readiness follows in frontend/readiness.py
        self.table_changed.set()
        self.table_changed = asyncio.Event()

    def return_allowance_s(self) -> float:
        """Time kept off a request's budget at the backend for the way there and back: the smoothed
        overhead of the frontend-backend path plus four smoothed deviations (at most RETURN_ALLOWANCE_MAX_S)."""
        return min(self.path_overhead_s + 4 * self.path_deviation_s, RETURN_ALLOWANCE_MAX_S)

    def observe_path(self, sent_s: float, result: Reply) -> None:
        """Smooth the path's overhead (a request's time at the frontend less its queue and compute)
        and its deviation, as TCP smooths round-trip times."""
        overhead = max(time.monotonic() - sent_s - (result.queue_ns + result.compute_ns) / 1e9, 0.0)
        self.path_deviation_s += PATH_SMOOTHING * (abs(overhead - self.path_overhead_s) - self.path_deviation_s)
        self.path_overhead_s += PATH_SMOOTHING * (overhead - self.path_overhead_s)

    def count(self, model: str, key: str, value: int = 1) -> None:
        c = self.counters.setdefault(model, {})
        c[key] = c.get(key, 0) + value


def _model(state: FrontendState, name: str) -> ModelEntry:
    model = state.table.models.get(name) or state.table.queries.get(name)
    if model is None:
        raise RequestError(grpc.StatusCode.NOT_FOUND, f"unknown model {name!r}")
    return model


def _pick(state: FrontendState, model: ModelEntry, exclude: set[str]):
    """Least outstanding work per unit of planned share, ties broken at random."""
    choices = [r for r in model.backends if r.address not in exclude and not state.pool.is_down(r.address)]
    if not choices:
        return None
    return min(choices, key=lambda r: ((state.pool.get(r.address).outstanding + 1) / max(r.weight, 1e-6),
                                       random.random()))


async def dispatch(state: FrontendState, model: ModelEntry, inputs: list[bytes], rows: int,
                   end_s: float, marks: Marks | None = None) -> Reply:
    """Run one request of ``rows`` rows on a backend of ``model`` before ``end_s`` (monotonic).

    Retries on another backend when one disappears or no longer has the model, while time is
    left; when every backend of a served model is gone, waits (within the deadline) for the routing
    table the scheduler sends after repairing the plan. Raises RequestError with the gRPC status
    otherwise. A request still waiting on its backend past the deadline is cancelled there.
    ``inputs`` are the raw tensors in the model's input order. ``marks``, when the
    request is traced, get the clock readings of the last attempt's send and reply.
    """
    tried: set[str] = set()
    last_reason = model.reason or "no backend serves it"
    while True:
        route = _pick(state, model, tried)
        left = end_s - time.monotonic()
        if left <= 0:
            raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED, f"model {model.name!r}: deadline passed")
        if route is None:
            if not model.backends:
                raise RequestError(grpc.StatusCode.UNAVAILABLE, f"model {model.name!r} is not available: {last_reason}")
            changed = state.table_changed   # its backends are lost: the repaired table comes soon
            try:
                await asyncio.wait_for(changed.wait(), timeout=left)
            except asyncio.TimeoutError:
                raise RequestError(grpc.StatusCode.UNAVAILABLE,
                                   f"model {model.name!r} is not available: {last_reason}") from None
            model = state.table.models.get(model.name) or model
            tried = set()
            continue
        # The backend must finish early enough for the answer to travel back to the client: the
        # measured overhead of the path to the backend, and at least a share of the budget for the
        # way in and out of this frontend (it grows when the machine is loaded, as under overload,
        # where a batch that only just meets its oldest request's deadline would answer it late).
        budget_s = max(left - max(state.return_allowance_s(), CLIENT_PATH_SHARE * left), left / 2)
        item = control.ExecItem(request_id=state.pool.next_id(), model=model.name, budget_us=int(budget_s * 1e6),
                                inputs=inputs, rows=rows)
        conn = state.pool.get(route.address)
        if marks is not None:
            marks.sent = time.monotonic_ns()
        try:
            if state.use_stream:
                async with asyncio.timeout(left + DEADLINE_GRACE_S):
                    result = await conn.execute(item)
            else:
                result = await conn.execute_unary(item, left + 1.0)
        except BackendGone as exc:
            tried.add(route.address)
            last_reason = str(exc)
            continue
        except asyncio.TimeoutError:
            raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"model {model.name!r}: deadline passed while queued") from None
        if marks is not None:
            marks.replied = time.monotonic_ns()
        if result.status is ReplyStatus.OK:
            state.observe_path(end_s - left, result)
        if result.status in (ReplyStatus.NOT_FOUND, ReplyStatus.UNAVAILABLE):  # stale route, or draining
            tried.add(route.address)
            last_reason = result.message
            continue
        if result.status is not ReplyStatus.OK:
            raise RequestError(_EXEC_TO_GRPC.get(result.status, grpc.StatusCode.INTERNAL), result.message)
        return result


def request_budget_s(slo_ms: float, timeout_us: int, deadline_s: float | None) -> float:
    """The request's time budget: its own 'timeout' parameter or the SLO, capped by the gRPC deadline."""
    budget_s = timeout_us / 1e6 if timeout_us else slo_ms / 1000
    return min(budget_s, deadline_s) if deadline_s is not None else budget_s


async def infer(state: FrontendState, request, deadline_s: float | None) -> kserve.ModelInferResponse:
    """Serve one ModelInferRequest (a model or a query); raise RequestError with the gRPC status on failure."""
    start = time.monotonic()
    marks = state.tracer.start() if state.tracer is not None else None
    name = request.model_name
    query = state.table.queries.get(name)
    if query is not None:
        from frontend.queries import run_query
        try:
            response = await run_query(state, query, request, deadline_s)
        except RequestError as exc:
            state.metrics.failure(name, exc.code)
            raise
        timeout_us = request.parameters["timeout"].int64_param if "timeout" in request.parameters else 0
        state.metrics.success(name, request.inputs[0].shape[0], time.monotonic() - start,
                              request_budget_s(query.slo_ms, max(timeout_us, 0), deadline_s))
        return response
    model = _model(state, name)
    if request.model_version and request.model_version != "1":
        raise RequestError(grpc.StatusCode.NOT_FOUND, f"model {model.name!r} has no version {request.model_version!r}")
    try:
        parsed = parse_infer_request(request, model)
    except RequestError as exc:
        state.metrics.failure(model.name, exc.code)
        raise
    state.requests_window[model.name] = state.requests_window.get(model.name, 0) + parsed.rows
    end = start + request_budget_s(model.slo_ms, parsed.timeout_us, deadline_s)
    if marks is not None:
        marks.validated = time.monotonic_ns()
    try:
        result = await dispatch(state, model, parsed.inputs, parsed.rows, end, marks)
    except RequestError as exc:
        state.count(model.name, "fail")
        state.metrics.failure(model.name, exc.code)
        raise
    except asyncio.CancelledError:      # its client gave up: a failure, as in Triton's statistics
        state.count(model.name, "fail")
        state.metrics.failure(model.name, grpc.StatusCode.CANCELLED)
        raise
    response = kserve.ModelInferResponse(model_name=model.name, model_version="1", id=request.id)
    for i in parsed.output_indices:
        spec = model.outputs[i]
        response.outputs.add(name=spec.name, datatype=spec.datatype, shape=result.output_shapes[i])
        response.raw_output_contents.append(result.outputs[i])
    state.count(model.name, "success")
    state.count(model.name, "rows", parsed.rows)
    state.count(model.name, "success_ns", int((time.monotonic() - start) * 1e9))
    state.metrics.success(model.name, parsed.rows, time.monotonic() - start, end - start, result)
    if marks is not None:
        state.tracer.record(model.name, parsed.rows, marks, result)
    return response


class KServeService:
    """Handlers registered under ``inference.GRPCInferenceService``."""

    def __init__(self, state: FrontendState, scheduler_stub=None) -> None:
        self.state = state
        self.scheduler = scheduler_stub
        self.stats_book = StatsBook()       # backends' statistics, kept cumulative across their changes

    async def ServerLive(self, request, context):
        return kserve.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return kserve.ServerReadyResponse(ready=self.state.ready)

    async def ModelReady(self, request, context):
        model = self.state.table.models.get(request.name) or self.state.table.queries.get(request.name)
        return kserve.ModelReadyResponse(ready=bool(model and model.ready))

    async def ServerMetadata(self, request, context):
        return kserve.ServerMetadataResponse(name=SERVER_NAME, version=SERVER_VERSION, extensions=EXTENSIONS)

    async def _model_or_abort(self, name: str, context) -> ModelEntry:
        try:
            return _model(self.state, name)
        except RequestError as exc:
            await context.abort(exc.code, str(exc))

    async def ModelMetadata(self, request, context):
        model = await self._model_or_abort(request.name, context)
        meta = kserve.ModelMetadataResponse(name=model.name, versions=["1"], platform=model.platform)
        for spec in model.inputs:
            meta.inputs.add(name=spec.name, datatype=spec.datatype, shape=[-1, *spec.shape])
        for spec in model.outputs:
            meta.outputs.add(name=spec.name, datatype=spec.datatype, shape=[-1, *spec.shape])
        return meta

    async def ModelConfig(self, request, context):
        model = await self._model_or_abort(request.name, context)
        config = model_config.ModelConfig(name=model.name, platform=model.platform, max_batch_size=model.max_batch,
                                          backend=model.runtime)
        for spec in model.inputs:
            config.input.add(name=spec.name, data_type=_DTYPE_ENUM[spec.datatype], dims=list(spec.shape))
        for spec in model.outputs:
            config.output.add(name=spec.name, data_type=_DTYPE_ENUM[spec.datatype], dims=list(spec.shape))
        config.dynamic_batching.max_queue_delay_microseconds = 0
        config.instance_group.add(name=model.name, count=max(len(model.backends), 1),
                                  kind=model_config.ModelInstanceGroup.KIND_AUTO)
        config.parameters["slo_ms"].string_value = f"{model.slo_ms:g}"
        return kserve.ModelConfigResponse(config=config)

    async def ModelInfer(self, request, context):
        try:
            return await infer(self.state, request, context.time_remaining())
        except RequestError as exc:
            await context.abort(exc.code, str(exc))

    async def ModelStreamInfer(self, request_iterator, context):
        out: asyncio.Queue = asyncio.Queue()
        tasks: set[asyncio.Task] = set()

        async def one(request) -> None:
            try:
                response = await infer(self.state, request, None)
                out.put_nowait(kserve.ModelStreamInferResponse(infer_response=response))
            except RequestError as exc:
                out.put_nowait(kserve.ModelStreamInferResponse(
                    error_message=f"{exc.code.name}: {exc}",
                    infer_response=kserve.ModelInferResponse(model_name=request.model_name, id=request.id)))

        async def reader() -> None:
            async for request in request_iterator:
                task = asyncio.create_task(one(request))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            while tasks:
                await asyncio.gather(*list(tasks), return_exceptions=True)
            out.put_nowait(None)

        read = asyncio.create_task(reader())
        try:
            while True:
                item = await out.get()
                if item is None:
                    break
                yield item
        finally:
            read.cancel()
            for t in list(tasks):
                t.cancel()

    async def ModelStatistics(self, request, context):
        names = [request.name] if request.name else sorted(
            n for n in {**self.state.table.models, **self.state.table.queries} if "/" not in n)
        if request.name:
            await self._model_or_abort(request.name, context)
        backend_stats = await self._backend_stats()
        reply = kserve.ModelStatisticsResponse()
        for name in names:
            stats = reply.model_stats.add(name=name, version="1")
            c = self.state.counters.get(name, {})
            stats.inference_count = c.get("rows", 0)
            inf = stats.inference_stats
            inf.success.count = c.get("success", 0)
            inf.success.ns = c.get("success_ns", 0)
            inf.fail.count = c.get("fail", 0)
            totals = self.stats_book.totals(name)
            stats.execution_count = totals.sums["execution_count"]
            # Triton's per-request phases: one sample per successful request in each, so that queue
            # and compute counts always agree (perf_analyzer checks they do).
            for phase, key in ((inf.queue, "queue_ns"), (inf.compute_input, "request_compute_input_ns"),
                               (inf.compute_infer, "request_compute_infer_ns"),
                               (inf.compute_output, "request_compute_output_ns")):
                phase.count = totals.sums["success_count"]
                phase.ns = totals.sums[key]
            stats.last_inference = totals.last_inference_ms
            for size in sorted(totals.batches):
                count, input_ns, infer_ns, output_ns = totals.batches[size]
                b = stats.batch_stats.add(batch_size=size)
                b.compute_input.count, b.compute_input.ns = count, input_ns
                b.compute_infer.count, b.compute_infer.ns = count, infer_ns
                b.compute_output.count, b.compute_output.ns = count, output_ns
            for bs in backend_stats:
                for s in bs.sessions:
                    if s.model == name:
                        stats.memory_usage.add(type="CPU" if "cpu" in bs.node_id else "DEVICE",
                                               byte_size=s.memory_bytes)
        return reply

    async def _backend_stats(self) -> list:
        """Every reachable backend's stats now; each also goes into the stats book (which keeps the
        figures of backends that fail to answer, or are gone, at their last values)."""
        issued_at = time.monotonic()
        conns = list(self.state.pool.connections.items())
        calls = [conn.stub.Stats(control.BackendStatsRequest(), timeout=5) for _, conn in conns]
        results = await asyncio.gather(*calls, return_exceptions=True)
        replies = []
        for (address, _), result in zip(conns, results):
            if not isinstance(result, BaseException):
                self.stats_book.record(address, result, issued_at)
                replies.append(result)
        return replies

    async def RepositoryIndex(self, request, context):
        reply = kserve.RepositoryIndexResponse()
        entries = {**self.state.table.models, **self.state.table.queries}
        for name, model in sorted(entries.items()):
            if "/" in name:        # a query's stage session: internal
                continue
            if request.ready and not model.ready:
                continue
            state = "READY" if model.ready else "UNAVAILABLE"
            reply.models.add(name=name, version="1", state=state, reason="" if model.ready else model.reason)
        return reply

    async def RepositoryModelLoad(self, request, context):
        if self.scheduler is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no scheduler connected")
        try:
            await self.scheduler.LoadModel(control.LoadRequest(name=request.model_name), timeout=10)
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), exc.details())
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            model = self.state.table.models.get(request.model_name)
            if model is not None and model.ready:
                return kserve.RepositoryModelLoadResponse()
            try:
                await asyncio.wait_for(self.state.table_changed.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                pass
        model = self.state.table.models.get(request.model_name)
        await context.abort(grpc.StatusCode.UNAVAILABLE,
                            f"model {request.model_name!r} did not become ready: {model.reason if model else 'unknown'}")

    async def RepositoryModelUnload(self, request, context):
        if self.scheduler is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no scheduler connected")
        try:
            await self.scheduler.UnloadModel(control.UnloadRequest(name=request.model_name), timeout=10)
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), exc.details())
        return kserve.RepositoryModelUnloadResponse()
