"""The KServe v2 ``inference.GRPCInferenceService`` served by the frontend.

The handlers serve gRPC, and HTTP/REST through ``frontend/rest.py``. Inference goes to
:func:`frontend.inference.infer`, which runs it through the dispatch core (``frontend/frontend_state.py``);
the other calls answer from the routing table, the backends' statistics and the scheduler.
Repository load and unload are served only to callers that ``repository_access`` admits (Triton's
restricted-protocol header, else the cluster token): the one check, for gRPC and HTTP alike.

Versions, as Triton's: a request names a model and maybe a version; no version means the newest
ready one (``FrontendState.entry``), an unknown one is NOT_FOUND naming it. ModelMetadata lists the
versions served; ModelReady, ModelConfig, ModelStatistics and RepositoryIndex answer per version
(statistics and the index list every version when none is named). A query has version 1.

System shared memory (frontend/shared_memory.py): the SystemSharedMemory* calls manage the
frontend's registered regions. As in Triton they need no token; ``shared_memory_access`` (Triton's
restricted protocol, category ``shared-memory``) can require a header of them, and of the
CudaSharedMemory* calls, which answer as a server with no CUDA regions (registering one is refused).
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from common.pb import control, kserve, model_config
from common.security import ProtocolAccess
from common.version_policy import to_pb as policy_to_pb
from frontend.frontend_state import FrontendState
from frontend.inference import infer
from frontend.requests import RequestError
from frontend.routing import ModelEntry, QueryEntry
from frontend.statistics import StatsBook, reported_executions

log = logging.getLogger("nexus.frontend")

SERVER_NAME = "nexus"
LOAD_WAIT_S = 120.0     # a repository load answers once the model is ready, or after this
TABLE_WAIT_S = 10.0     # and once this frontend's own routing table routes it (normally at once)
SERVER_VERSION = "0.1.0"
EXTENSIONS = ["binary_tensor_data", "model_repository", "model_repository(unload_dependents)", "statistics",
              "schedule_policy", "system_shared_memory"]

_DTYPE_ENUM = {name: model_config.DataType.Value(f"TYPE_{name}") for name in
               ("BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32", "FP64")}


class KServeService:
    """Handlers registered under ``inference.GRPCInferenceService``."""

    def __init__(self, state: FrontendState, scheduler_stub=None,
                 repository_access: ProtocolAccess = ProtocolAccess(),
                 shared_memory_access: ProtocolAccess = ProtocolAccess()) -> None:
        self.state = state
        self.scheduler = scheduler_stub
        self.repository_access = repository_access
        self.shared_memory_access = shared_memory_access
        self.stats_book = StatsBook()       # backends' statistics, kept cumulative across their changes

    async def ServerLive(self, request, context):
        return kserve.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return kserve.ServerReadyResponse(ready=self.state.ready)

    async def ModelReady(self, request, context):
        try:      # as Triton: an unknown model or version is not ready (no error)
            model = self.state.entry(request.name, request.version)
        except RequestError:
            model = None
        return kserve.ModelReadyResponse(ready=bool(model and model.servable))

    async def ServerMetadata(self, request, context):
        return kserve.ServerMetadataResponse(name=SERVER_NAME, version=SERVER_VERSION, extensions=EXTENSIONS)

    async def _model_or_abort(self, name: str, version: str, context) -> ModelEntry:
        try:
            return self.state.entry(name, version)
        except RequestError as exc:
            await context.abort(exc.code, str(exc))

    def _versions_of(self, model: ModelEntry | QueryEntry) -> list[ModelEntry | QueryEntry]:
        """The versions of ``model``'s model that are served (none served: ``model`` itself)."""
        if isinstance(model, QueryEntry):
            return [model]
        return self.state.table.served_versions(model.name) or [model]

    async def ModelMetadata(self, request, context):
        model = await self._model_or_abort(request.name, request.version, context)
        versions = [str(v.version) for v in self._versions_of(model)]
        meta = kserve.ModelMetadataResponse(name=model.name, versions=versions, platform=model.platform)
        for spec in model.inputs:
            meta.inputs.add(name=spec.name, datatype=spec.datatype, shape=[-1, *spec.shape])
        for spec in model.outputs:
            meta.outputs.add(name=spec.name, datatype=spec.datatype, shape=[-1, *spec.shape])
        return meta

    async def ModelConfig(self, request, context):
        model = await self._model_or_abort(request.name, request.version, context)
        config = model_config.ModelConfig(name=model.name, platform=model.platform, max_batch_size=model.max_batch,
                                          backend=model.runtime)
        if isinstance(model, ModelEntry):
            config.version_policy.CopyFrom(policy_to_pb(model.version_policy))
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
            # The end is always marked, also when reading fails: an undecodable message aborts the call
            # inside this task (common/wire_guard.py), and the responses below must not wait for more.
            try:
                async for request in request_iterator:
                    task = asyncio.create_task(one(request))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                while tasks:
                    await asyncio.gather(*list(tasks), return_exceptions=True)
            finally:
                out.put_nowait(None)

        read = asyncio.create_task(reader())
        try:
            while True:
                item = await out.get()
                if item is None:
                    break
                yield item
            if read.done() and not read.cancelled() and read.exception() is not None:
                raise read.exception()        # the abort (or failure) that ended the reading
        finally:
            read.cancel()
            for t in list(tasks):
                t.cancel()

    async def ModelStatistics(self, request, context):
        with self.state.counted():
            return await self._statistics(request, context)

    async def _statistics(self, request, context):
        table = self.state.table
        if request.name:
            model = await self._model_or_abort(request.name, request.version, context)
            entries = [model] if request.version else self._versions_of(model)
        else:      # every model: its served versions (its newest stored one when none is served), every query
            entries = [*(table.served_versions(name) or [table.newest(name)] for name in sorted(table.versions)),
                       *([q] for _, q in sorted(table.queries.items()))]
            entries = [e for group in entries for e in group]
        backend_stats = await self._backend_stats()
        reply = kserve.ModelStatisticsResponse()
        for entry in entries:
            session = entry.session
            stats = reply.model_stats.add(name=entry.name, version=str(entry.version))
            c = self.state.counters.get(session, {})
            stats.inference_count = c.get("rows", 0)
            inf = stats.inference_stats
            inf.success.count = c.get("success", 0)
            inf.success.ns = c.get("success_ns", 0)
            inf.fail.count = c.get("fail", 0)
            totals = self.stats_book.totals(session)
            stats.execution_count = reported_executions(totals.sums["execution_count"], stats.inference_count)
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
                    if s.model == session:
                        stats.memory_usage.add(type="CPU" if "cpu" in bs.node_id else "DEVICE",
                                               byte_size=s.memory_bytes)
        return reply

    async def _backend_stats(self) -> list:
        """Every reachable backend's stats now; each also goes into the stats book (which keeps the
        figures of backends that fail to answer, or are gone, at their last values)."""
        issued_at = time.monotonic()
        conns = list(self.state.pool.connections.items())
        calls = [conn.stats(timeout_s=5) for _, conn in conns]
        results = await asyncio.gather(*calls, return_exceptions=True)
        replies = []
        for (address, _), result in zip(conns, results):
            if not isinstance(result, BaseException):
                self.stats_book.record(address, result, issued_at)
                replies.append(result)
        return replies

    async def RepositoryIndex(self, request, context):
        """Every version of every model the scheduler knows, and every query (version 1); stage
        sessions are internal."""
        table = self.state.table
        entries = [(name, str(v), e) for name, versions in table.versions.items() for v, e in versions.items()]
        entries += [(name, "1", q) for name, q in table.queries.items()]
        reply = kserve.RepositoryIndexResponse()
        for name, version, model in sorted(entries, key=lambda e: (e[0], int(e[1]))):
            if request.ready and not model.servable:
                continue
            state = "READY" if model.servable else "UNAVAILABLE"
            reply.models.add(name=name, version=version, state=state, reason="" if model.ready else model.reason)
        return reply

    async def _admit_repository_call(self, context) -> None:
        refused = self.repository_access.problem(context.invocation_metadata())
        if refused is not None:
            await context.abort(*refused)
        if self.scheduler is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no scheduler connected")

    async def RepositoryModelLoad(self, request, context):
        await self._admit_repository_call(context)
        with self.state.counted():
            return await self._load(request, context)

    async def _load(self, request, context):
        """Load, and answer once the model is ready (as Triton's load does), or with why it cannot be
        (the scheduler's serving state, globalsched/state/readiness.py) as soon as that is known."""
        name = request.model_name
        try:
            await self.scheduler.LoadModel(control.LoadRequest(name=name), timeout=10)
            desc = await self.scheduler.WaitModelReady(control.WaitReadyRequest(name=name, timeout_s=LOAD_WAIT_S),
                                                       timeout=LOAD_WAIT_S + 10)
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), exc.details())
        if desc.serving_state not in (control.READY, control.COLD):     # a cold one is paged in by a request
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"model {name!r} cannot be served: {desc.state_reason}"
                                if desc.serving_state == control.FAILED else
                                f"model {name!r} is not ready: {desc.state_reason}")
        # routed: the scheduler counts it so once every frontend took the table; this one has it
        deadline = time.monotonic() + TABLE_WAIT_S
        while time.monotonic() < deadline:
            model = self.state.table.newest(request.model_name)
            if model is not None and model.servable:
                return kserve.RepositoryModelLoadResponse()
            try:
                await asyncio.wait_for(self.state.table_changed.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                pass
        model = self.state.table.newest(request.model_name)
        await context.abort(grpc.StatusCode.UNAVAILABLE,
                            f"model {request.model_name!r} did not become ready: {model.reason if model else 'unknown'}")

    async def RepositoryModelUnload(self, request, context):
        await self._admit_repository_call(context)
        with self.state.counted():
            try:
                await self.scheduler.UnloadModel(control.UnloadRequest(name=request.model_name), timeout=10)
            except grpc.aio.AioRpcError as exc:
                await context.abort(exc.code(), exc.details())
        return kserve.RepositoryModelUnloadResponse()

    # ---- system shared memory ------------------------------------------------------------------------

    async def _admit_shared_memory_call(self, context) -> None:
        refused = self.shared_memory_access.problem(context.invocation_metadata())
        if refused is not None:
            await context.abort(*refused)

    async def SystemSharedMemoryStatus(self, request, context):
        await self._admit_shared_memory_call(context)
        try:
            regions = self.state.shared_memory.status(request.name)
        except RequestError as exc:
            await context.abort(exc.code, str(exc))
        reply = kserve.SystemSharedMemoryStatusResponse()
        for r in regions:
            reply.regions[r.name].CopyFrom(kserve.SystemSharedMemoryStatusResponse.RegionStatus(
                name=r.name, key=r.key, offset=r.offset, byte_size=r.byte_size))
        return reply

    async def SystemSharedMemoryRegister(self, request, context):
        await self._admit_shared_memory_call(context)
        try:
            self.state.shared_memory.register(request.name, request.key, request.offset, request.byte_size)
        except RequestError as exc:
            await context.abort(exc.code, str(exc))
        return kserve.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(self, request, context):
        await self._admit_shared_memory_call(context)
        self.state.shared_memory.unregister(request.name)
        return kserve.SystemSharedMemoryUnregisterResponse()

    # CUDA shared memory is not offered: no region is ever registered. Status and Unregister answer as
    # Triton's do with no regions (tritonclient's shm examples clear both kinds first); Register is
    # refused, saying what is offered instead.

    async def CudaSharedMemoryStatus(self, request, context):
        await self._admit_shared_memory_call(context)
        if request.name:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no CUDA shared memory region {request.name!r} is "
                                                           f"registered (this frontend offers none)")
        return kserve.CudaSharedMemoryStatusResponse()

    async def CudaSharedMemoryRegister(self, request, context):
        await self._admit_shared_memory_call(context)
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            f"CUDA shared memory region {request.name!r}: this frontend does not offer CUDA shared "
                            f"memory; register system shared memory (SystemSharedMemoryRegister) instead")

    async def CudaSharedMemoryUnregister(self, request, context):
        await self._admit_shared_memory_call(context)
        return kserve.CudaSharedMemoryUnregisterResponse()
