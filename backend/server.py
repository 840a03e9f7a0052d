"""The backend process: registers with the scheduler, loads its model table, executes requests.

Requests arrive from frontends on a long-lived bidirectional ``Execute`` stream (one per frontend),
or one per call on ``ExecuteOne``; see benchmarks/frontend_path.py for why the stream is the
default. Raw tensors are decoded with ``np.frombuffer`` (no copy) on the loop thread, queued in the
:class:`~backend.engine.Engine`, and results are serialised back on the loop thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys

import grpc
import numpy as np

from backend.engine import Engine, ExecError, Outcome, Session, Work
from common import grpc_util
from common.config import BackendConfig
from common.pb import control, control_grpc
from common.profile import Profile
from common.registration import keep_registered
from common.tensors import TensorSpec

log = logging.getLogger("nexus.backend")

_STATUS = {name: control.ExecStatus.Value(name) for name in control.ExecStatus.keys()}


def _spec(desc: control.TensorDesc) -> TensorSpec:
    return TensorSpec(desc.name, desc.datatype, tuple(desc.shape))


def _io_json(model: control.ModelDesc) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    return tuple(_spec(t) for t in model.inputs), tuple(_spec(t) for t in model.outputs)


def decode_inputs(session: Session, item: control.ExecItem) -> list[np.ndarray]:
    """Raw input bytes -> arrays of shape (rows, *spec.shape); ExecError(EXEC_INVALID) if they do not fit."""
    if len(item.inputs) != len(session.inputs):
        raise ExecError("EXEC_INVALID", f"expected {len(session.inputs)} inputs, got {len(item.inputs)}")
    rows = item.rows or 1
    shapes = {d.name: tuple(d.shape) for d in item.input_shapes}
    arrays = []
    for spec, raw in zip(session.inputs, item.inputs):
        shape = shapes.get(spec.name) or (rows, *spec.shape)
        if any(d < 0 for d in shape):
            raise ExecError("EXEC_INVALID", f"input {spec.name!r}: variable dimensions need an explicit shape")
        expected = int(np.prod(shape, dtype=np.int64)) * spec.dtype.itemsize
        if len(raw) != expected:
            raise ExecError("EXEC_INVALID", f"input {spec.name!r}: expected {expected} bytes for shape "
                                            f"{list(shape)}, got {len(raw)}")
        arrays.append(np.frombuffer(raw, dtype=spec.dtype).reshape(shape))
    return arrays


def encode_result(request_id: int, outcome: Outcome) -> control.ExecResult:
    result = control.ExecResult(request_id=request_id, status=_STATUS[outcome.status], message=outcome.message,
                                queue_ns=outcome.queue_ns, compute_ns=outcome.compute_ns,
                                batch_size=outcome.batch_size)
    if outcome.outputs is not None:
        for arr in outcome.outputs:
            result.outputs.append(np.ascontiguousarray(arr).tobytes())
            result.output_shapes.append(control.TensorDesc(shape=list(arr.shape)))
    return result


class BackendService(control_grpc.BackendServicer):
    def __init__(self, config: BackendConfig, engine: Engine) -> None:
        self.config = config
        self.engine = engine
        self.node_id = ""
        self.epoch = 0
        self._loaded: dict[str, tuple[str, object]] = {}   # model -> (sha256+runtime, runtime)
        self._scheduler_stub = None
        self._table_lock = asyncio.Lock()
        self._profile_lock = asyncio.Lock()   # one measurement at a time, or they disturb each other

    def attach_scheduler(self, stub) -> None:
        self._scheduler_stub = stub

    # ---- model table ---------------------------------------------------------------------------

    async def _fetch(self, sha256: str) -> bytes:
        parts = []
        async for chunk in self._scheduler_stub.DownloadModel(control.DownloadRequest(sha256=sha256), timeout=300):
            parts.append(chunk.data)
        return b"".join(parts)

    async def _runtime_for(self, entry: control.SessionEntry):
        from backend.runtimes import load_runtime

        model = entry.model
        runtime_kind = "emulated" if self.config.device.startswith("emulated:") else model.runtime
        key = f"{model.sha256}/{runtime_kind}"
        cached = self._loaded.get(model.name)
        if cached and cached[0] == key:
            return cached[1]
        data = await self._fetch(model.sha256)
        profile = Profile.from_json(entry.profile_json) if entry.profile_json else None
        runtime = await asyncio.to_thread(
            load_runtime, runtime_kind, data, self.config.device, profile=profile,
            intra_op_threads=self.config.threads or None, io=_io_json(model))
        self._loaded[model.name] = (key, runtime)
        return runtime

    async def UpdateModelTable(self, request, context):
        async with self._table_lock:
            if request.epoch and request.epoch < self.epoch:
                return control.ModelTableReply(loaded=list(self.engine.sessions))
            self.epoch = request.epoch
            sessions: dict[str, Session] = {}
            failed = []
            for entry in request.sessions:
                name = entry.model.name
                try:
                    runtime = await self._runtime_for(entry)
                except Exception as exc:
                    log.warning("cannot load %s: %s", name, exc)
                    failed.append(f"{name}: {exc.__class__.__name__}: {exc}")
                    continue
                profile = Profile.from_json(entry.profile_json) if entry.profile_json else None
                sessions[name] = Session(name, runtime, entry.slo_ms, entry.batch, profile, entry.model.sha256,
                                         self.config.max_queue)
            removed = self.engine.set_sessions(sessions)
            for s in removed:
                if s.name not in sessions:
                    self._fail_queue(s, "model unloaded from this backend")
            for name in list(self._loaded):
                if name not in sessions:
                    _, runtime = self._loaded.pop(name)
                    runtime.close()
            log.info("epoch %d: serving %s", request.epoch, ", ".join(f"{n}(b={s.planned_batch}/{s.max_batch})"
                                                                     for n, s in sessions.items()) or "nothing")
            return control.ModelTableReply(loaded=list(sessions), failed=failed)

    def _fail_queue(self, session: Session, why: str) -> None:
        queue, session.queue = session.queue, []
        for p in queue:
            p.payload.done(Outcome("EXEC_NOT_FOUND", why))

    # ---- execution -----------------------------------------------------------------------------

    def _work(self, item: control.ExecItem, now: float, done) -> Work:
        session = self.engine.sessions.get(item.model)
        if session is None:
            raise ExecError("EXEC_NOT_FOUND", f"model {item.model!r} is not loaded on this backend")
        arrays = decode_inputs(session, item)
        budget_s = item.budget_us / 1e6 if item.budget_us else session.slo_ms / 1000
        return Work(item.model, arrays, arrays[0].shape[0], now + budget_s, now, done)

    async def Execute(self, request_iterator, context):
        loop = asyncio.get_running_loop()
        results: asyncio.Queue = asyncio.Queue()
        clock = self.engine.clock

        def completer(request_id: int):
            def done(outcome: Outcome) -> None:
                loop.call_soon_threadsafe(results.put_nowait, (request_id, outcome))
            return done

        async def reader() -> None:
            try:
                async for item in request_iterator:
                    try:
                        self.engine.submit(self._work(item, clock(), completer(item.request_id)))
                    except ExecError as exc:
                        results.put_nowait((item.request_id, Outcome(exc.status, str(exc))))
            finally:
                results.put_nowait(None)

        task = asyncio.create_task(reader())
        try:
            while True:
                entry = await results.get()
                if entry is None:
                    break
                yield encode_result(entry[0], entry[1])
        finally:
            task.cancel()

    async def ExecuteOne(self, request, context):
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def done(outcome: Outcome) -> None:
            loop.call_soon_threadsafe(lambda: future.done() or future.set_result(outcome))

        try:
            self.engine.submit(self._work(request, self.engine.clock(), done))
        except ExecError as exc:
            return encode_result(request.request_id, Outcome(exc.status, str(exc)))
        return encode_result(request.request_id, await future)

    async def Stats(self, request, context):
        reply = control.BackendStats(node_id=self.node_id, utilization=self.engine.utilization())
        for name, s in list(self.engine.sessions.items()):
            st = s.stats
            reply.sessions.append(control.SessionStats(
                model=name, inference_count=st.inference_count, execution_count=st.execution_count,
                success_count=st.success_count, success_ns=st.success_ns, fail_count=st.fail_count,
                queue_ns=st.queue_ns, compute_ns=st.compute_ns, dropped=st.dropped, queue_length=len(s.queue),
                batch_histogram=dict(st.batch_histogram), batch_compute_ns=dict(st.batch_compute_ns),
                memory_bytes=int(s.memory_mb * 1024 * 1024), last_inference_ms=st.last_inference_ms))
        return reply

    # ---- profiling -----------------------------------------------------------------------------

    async def ProfileModel(self, request, context):
        from backend.profiling import measure_profile

        model = request.model
        runtime_kind = "emulated" if self.config.device.startswith("emulated:") else model.runtime
        try:
            data = await self._fetch(model.sha256)
            async with self._profile_lock:
                profile = await asyncio.to_thread(
                    measure_profile, data, runtime_kind, self.config.device, self.config.resolved_device_type,
                    _io_json(model), list(request.batch_sizes), request.budget_s or 20.0,
                    self.config.threads or None)
        except Exception as exc:
            log.warning("profiling %s failed: %s", model.name, exc)
            return control.MeasuredProfile(error=f"{exc.__class__.__name__}: {exc}")
        return control.MeasuredProfile(profile_json=profile.to_json())


def detect_memory_mb(device: str) -> float:
    if device == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1024 * 1024)
        except (ValueError, OSError):
            return 0.0
    return 0.0


async def serve(config: BackendConfig, ready=None) -> None:
    """Run a backend until cancelled: serve, register, heartbeat (re-registering if forgotten)."""
    from backend.policies import POLICIES

    if config.policy not in POLICIES:
        raise SystemExit(f"nexus backend: error: unknown --policy {config.policy!r}; "
                         f"expected one of {', '.join(POLICIES)}")
    # The executor thread must get the interpreter back quickly after a batch (default: 5 ms).
    sys.setswitchinterval(0.0005)
    engine = Engine(POLICIES[config.policy]())
    service = BackendService(config, engine)
    server = grpc.aio.server(options=grpc_util.SERVER_OPTIONS)
    control_grpc.add_BackendServicer_to_server(service, server)
    address = grpc_util.bind(server, config.listen)
    await server.start()
    channel = grpc_util.aio_channel(config.scheduler)
    scheduler = control_grpc.SchedulerStub(channel)
    service.attach_scheduler(scheduler)
    memory = config.memory_mb or detect_memory_mb(config.device)
    register = control.RegisterRequest(kind=control.NODE_KIND_BACKEND, address=address, device=config.device,
                                       device_type=config.resolved_device_type, memory_mb=memory)
    if ready:
        ready(address)
    try:
        await keep_registered(scheduler, register, service)
    finally:
        engine.stop()
        await server.stop(grace=1)
        await channel.close()
