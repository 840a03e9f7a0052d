"""The KServe v2 ``inference.GRPCInferenceService`` over gRPC: each unary call goes to the transport-free
:class:`frontend.kserve_api.KServeApi` with the caller's metadata and deadline, and a
:class:`RequestError` it raises aborts the call with its status. ``ModelStreamInfer``, which only gRPC
has, answers each request of the stream as it completes, an error as a message of the stream.
"""

from __future__ import annotations

import asyncio

from common.pb import kserve
from common.security import ProtocolAccess
from frontend.frontend_state import FrontendState
from frontend.inference import infer
from frontend.kserve_api import Call, KServeApi
from frontend.requests import RequestError

# Every unary call but ModelInfer, which has a handler of its own (the hot path copies no metadata).
UNARY_CALLS = (
    "ServerLive",
    "ServerReady",
    "ModelReady",
    "ServerMetadata",
    "ModelMetadata",
    "ModelConfig",
    "ModelStatistics",
    "RepositoryIndex",
    "RepositoryModelLoad",
    "RepositoryModelUnload",
    "SystemSharedMemoryStatus",
    "SystemSharedMemoryRegister",
    "SystemSharedMemoryUnregister",
    "CudaSharedMemoryStatus",
    "CudaSharedMemoryRegister",
    "CudaSharedMemoryUnregister",
)


def _unary(name: str):
    async def handler(self, request, context):
        try:
            return await getattr(self.api, name)(request, Call(tuple(context.invocation_metadata() or ()),
                                                                context.time_remaining()))
        except RequestError as exc:
            await context.abort(exc.code, str(exc))
    handler.__name__ = handler.__qualname__ = name
    return handler


class KServeService:
    """Handlers registered under ``inference.GRPCInferenceService``; ``api`` is the transport-free core,
    which HTTP/REST serves too."""

    def __init__(self, state: FrontendState, scheduler_stub=None,
                 repository_access: ProtocolAccess = ProtocolAccess(),
                 shared_memory_access: ProtocolAccess = ProtocolAccess(), siblings=None) -> None:
        self.api = KServeApi(state, scheduler_stub, repository_access, shared_memory_access, siblings)
        self.state = state

    async def ModelInfer(self, request, context):
        """The hot path: inference reads no metadata, so none is copied."""
        try:
            return await self.api.ModelInfer(request, Call(time_left_s=context.time_remaining()))
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



for _name in UNARY_CALLS:
    setattr(KServeService, _name, _unary(_name))
