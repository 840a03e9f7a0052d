"""The KServe v2 calls, free of any transport: gRPC (frontend/kserve.py) and HTTP/REST
(frontend/rest.py) both call :class:`KServeApi` with the request message and a :class:`Call` (the
caller's metadata, the time it left), and turn the :class:`RequestError` it raises into their own
status. Validation, routing, retries, statistics, the hold for the first routing table, the count of
requests in flight that a drain waits for, and who may load and unload models are therefore the same
on both.

Inference goes to
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
from dataclasses import dataclass

import grpc

from common.pb import control, kserve, model_config
from common.security import ProtocolAccess
from common.version_policy import to_pb as policy_to_pb
from frontend.frontend_state import FrontendState
from frontend.inference import infer
from frontend.requests import RequestError
from frontend.routing import ModelEntry, QueryEntry
from frontend.statistics import StatsBook, reported_executions
from frontend.worker_statistics import SiblingCounts, asks_worker_scope

log = logging.getLogger("nexus.frontend")

SERVER_NAME = "nexus"
LOAD_WAIT_S = 120.0     # a repository load answers once the model is ready, or after this
TABLE_WAIT_S = 10.0     # and once this frontend's own routing table routes it (normally at once)
SERVER_VERSION = "0.1.0"
EXTENSIONS = ["binary_tensor_data", "model_repository", "model_repository(unload_dependents)", "statistics",
              "schedule_policy", "system_shared_memory"]

_DTYPE_ENUM = {name: model_config.DataType.Value(f"TYPE_{name}") for name in
               ("BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32", "FP64")}

@dataclass(frozen=True)
class Call:
    """What a call carries beside its message: the caller's metadata (lower-case keys; gRPC metadata or
    HTTP headers) and the time the caller left it (None: no deadline; HTTP carries none, a request sets
    its own with the 'timeout' parameter)."""
    metadata: tuple[tuple[str, str], ...] = ()
    time_left_s: float | None = None


class KServeApi:
    """The KServe v2 calls, by their gRPC names: ``await api.ModelInfer(request, call)`` answers the
    response message or raises :class:`RequestError`."""

    def __init__(self, state: FrontendState, scheduler_stub=None,
                 repository_access: ProtocolAccess = ProtocolAccess(),
                 shared_memory_access: ProtocolAccess = ProtocolAccess(),
                 siblings: SiblingCounts | None = None) -> None:
        self.state = state
        self.siblings = siblings            # a worker's: the other workers' counts (frontend/worker_statistics.py)
        self.scheduler = scheduler_stub
        self.repository_access = repository_access
        self.shared_memory_access = shared_memory_access
        self.stats_book = StatsBook()       # backends' statistics, kept cumulative across their changes
        self._reported: dict[str, tuple[int, int]] = {}    # session -> (executions, rows) reported last

    async def ServerLive(self, request, call: Call):
        return kserve.ServerLiveResponse(live=True)

    async def ServerReady(self, request, call: Call):
        return kserve.ServerReadyResponse(ready=self.state.ready)

    async def ModelReady(self, request, call: Call):
        try:      # as Triton: an unknown model or version is not ready (no error)
            model = self.state.entry(request.name, request.version)
        except RequestError:
            model = None
        return kserve.ModelReadyResponse(ready=bool(model and model.servable))

    async def ServerMetadata(self, request, call: Call):
        return kserve.ServerMetadataResponse(name=SERVER_NAME, version=SERVER_VERSION, extensions=EXTENSIONS)

    def _model(self, name: str, version: str) -> ModelEntry:
        return self.state.entry(name, version)

    def _versions_of(self, model: ModelEntry | QueryEntry) -> list[ModelEntry | QueryEntry]:
        """The versions of ``model``'s model that are served (none served: ``model`` itself)."""
        if isinstance(model, QueryEntry):
            return [model]
        return self.state.table.served_versions(model.name) or [model]

    async def ModelMetadata(self, request, call: Call):
        model = self._model(request.name, request.version)
        versions = [str(v.version) for v in self._versions_of(model)]
        meta = kserve.ModelMetadataResponse(name=model.name, versions=versions, platform=model.platform)
        for spec in model.inputs:
            meta.inputs.add(name=spec.name, datatype=spec.datatype, shape=[-1, *spec.shape])
        for spec in model.outputs:
            meta.outputs.add(name=spec.name, datatype=spec.datatype, shape=[-1, *spec.shape])
        return meta

    async def ModelConfig(self, request, call: Call):
        model = self._model(request.name, request.version)
        config = model_config.ModelConfig(name=model.name, platform=model.platform, max_batch_size=model.max_batch,
                                          backend=model.runtime)
        if isinstance(model, ModelEntry):       # a query has one version, and its stages always drop
            config.version_policy.CopyFrom(policy_to_pb(model.version_policy))
            config.parameters["late_requests"].string_value = "serve" if model.serve_late else "drop"
        for spec in model.inputs:
            config.input.add(name=spec.name, data_type=_DTYPE_ENUM[spec.datatype], dims=list(spec.shape))
        for spec in model.outputs:
            config.output.add(name=spec.name, data_type=_DTYPE_ENUM[spec.datatype], dims=list(spec.shape))
        config.dynamic_batching.max_queue_delay_microseconds = 0
        config.instance_group.add(name=model.name, count=max(len(model.backends), 1),
                                  kind=model_config.ModelInstanceGroup.KIND_AUTO)
        config.parameters["slo_ms"].string_value = f"{model.slo_ms:g}"
        return kserve.ModelConfigResponse(config=config)

    async def ModelInfer(self, request, call: Call):
        return await infer(self.state, request, call.time_left_s)

    async def ModelStatistics(self, request, call: Call):
        with self.state.counted():
            return await self._statistics(request, call)

    async def _statistics(self, request, call: Call):
        table = self.state.table
        if request.name:
            model = self._model(request.name, request.version)
            entries = [model] if request.version else self._versions_of(model)
        else:      # every model: its served versions (its newest stored one when none is served), every query
            entries = [*(table.served_versions(name) or [table.newest(name)] for name in sorted(table.versions)),
                       *([q] for _, q in sorted(table.queries.items()))]
            entries = [e for group in entries for e in group]
        reply = kserve.ModelStatisticsResponse()
        if asks_worker_scope(call.metadata):        # a sibling worker's question: this one's counts only
            for entry in entries:
                self._add_counts(reply, entry, self.state.counters.get(entry.session, {}))
            return reply
        # This worker's rows are read before the backends are asked: a backend counts a batch before it
        # answers its rows, so every row read here is in the batches its stats give. Read after them,
        # a reply that came in meanwhile showed a row without its batch, and the execution count
        # (never more executions than rows between two reports) then lagged one behind for good.
        local = {entry.session: dict(self.state.counters.get(entry.session, {})) for entry in entries}
        siblings = await self.siblings.read(request) if self.siblings is not None else {}
        backend_stats = await self._backend_stats()
        for entry in entries:
            session = entry.session
            c = local[session]
            for name, value in siblings.get((entry.name, str(entry.version)), {}).items():
                c[name] = c.get(name, 0) + value
            stats = self._add_counts(reply, entry, c)
            inf = stats.inference_stats
            totals = self.stats_book.totals(session)
            previous = self._reported.get(session, (0, 0))
            stats.execution_count = reported_executions(totals.sums["execution_count"], stats.inference_count,
                                                        previous)
            self._reported[session] = (stats.execution_count, max(stats.inference_count, previous[1]))
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

    @staticmethod
    def _add_counts(reply: kserve.ModelStatisticsResponse, entry, counters: dict[str, int]):
        """A new entry of ``reply`` for ``entry`` with the frontend's own counts (COUNTERS) filled in."""
        stats = reply.model_stats.add(name=entry.name, version=str(entry.version))
        stats.inference_count = counters.get("rows", 0)
        inf = stats.inference_stats
        inf.success.count = counters.get("success", 0)
        inf.success.ns = counters.get("success_ns", 0)
        inf.fail.count = counters.get("fail", 0)
        return stats

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

    async def RepositoryIndex(self, request, call: Call):
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

    async def _admit_repository_call(self, call: Call) -> None:
        refused = self.repository_access.problem(call.metadata)
        if refused is not None:
            raise RequestError(*refused)
        if self.scheduler is None:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "no scheduler connected")

    async def RepositoryModelLoad(self, request, call: Call):
        await self._admit_repository_call(call)
        with self.state.counted():
            return await self._load(request, call)

    async def _load(self, request, call: Call):
        """Load, and answer once the model is ready (as Triton's load does), or with why it cannot be
        (the scheduler's serving state, globalsched/state/readiness.py) as soon as that is known."""
        name = request.model_name
        try:
            await self.scheduler.LoadModel(control.LoadRequest(name=name), timeout=10)
            desc = await self.scheduler.WaitModelReady(control.WaitReadyRequest(name=name, timeout_s=LOAD_WAIT_S),
                                                       timeout=LOAD_WAIT_S + 10)
        except grpc.aio.AioRpcError as exc:
            raise RequestError(exc.code(), exc.details()) from None
        if desc.serving_state not in (control.READY, control.COLD):     # a cold one is paged in by a request
            raise RequestError(grpc.StatusCode.UNAVAILABLE,
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
        raise RequestError(grpc.StatusCode.UNAVAILABLE,
                            f"model {request.model_name!r} did not become ready: {model.reason if model else 'unknown'}")

    async def RepositoryModelUnload(self, request, call: Call):
        await self._admit_repository_call(call)
        with self.state.counted():
            try:
                await self.scheduler.UnloadModel(control.UnloadRequest(name=request.model_name), timeout=10)
            except grpc.aio.AioRpcError as exc:
                raise RequestError(exc.code(), exc.details()) from None
        return kserve.RepositoryModelUnloadResponse()

    # ---- system shared memory ------------------------------------------------------------------------

    async def _admit_shared_memory_call(self, call: Call) -> None:
        refused = self.shared_memory_access.problem(call.metadata)
        if refused is not None:
            raise RequestError(*refused)

    async def SystemSharedMemoryStatus(self, request, call: Call):
        await self._admit_shared_memory_call(call)
        regions = self.state.shared_memory.status(request.name)
        reply = kserve.SystemSharedMemoryStatusResponse()
        for r in regions:
            reply.regions[r.name].CopyFrom(kserve.SystemSharedMemoryStatusResponse.RegionStatus(
                name=r.name, key=r.key, offset=r.offset, byte_size=r.byte_size))
        return reply

    async def SystemSharedMemoryRegister(self, request, call: Call):
        await self._admit_shared_memory_call(call)
        self.state.shared_memory.register(request.name, request.key, request.offset, request.byte_size)
        return kserve.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(self, request, call: Call):
        await self._admit_shared_memory_call(call)
        self.state.shared_memory.unregister(request.name)
        return kserve.SystemSharedMemoryUnregisterResponse()

    # CUDA shared memory is not offered: no region is ever registered. Status and Unregister answer as
    # Triton's do with no regions (tritonclient's shm examples clear both kinds first); Register is
    # refused, saying what is offered instead.

    async def CudaSharedMemoryStatus(self, request, call: Call):
        await self._admit_shared_memory_call(call)
        if request.name:
            raise RequestError(grpc.StatusCode.NOT_FOUND, f"no CUDA shared memory region {request.name!r} is "
                                                           f"registered (this frontend offers none)")
        return kserve.CudaSharedMemoryStatusResponse()

    async def CudaSharedMemoryRegister(self, request, call: Call):
        await self._admit_shared_memory_call(call)
        raise RequestError(grpc.StatusCode.UNIMPLEMENTED,
                            f"CUDA shared memory region {request.name!r}: this frontend does not offer CUDA shared "
                            f"memory; register system shared memory (SystemSharedMemoryRegister) instead")

    async def CudaSharedMemoryUnregister(self, request, call: Call):
        await self._admit_shared_memory_call(call)
        return kserve.CudaSharedMemoryUnregisterResponse()
