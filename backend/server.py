"""The backend process: registers with the scheduler, loads its model table, executes requests.

Requests arrive from frontends on a long-lived bidirectional ``Execute`` stream (one per frontend),
or one per call on ``ExecuteOne``; see benchmarks/frontend_path.py for why the stream is the
default. Raw tensors are decoded with ``np.frombuffer`` (no copy) on the loop thread, queued in the
:class:`~backend.engine.Engine`, and results are serialised back on the loop thread.

The model table (loads, prefix batching, warm-up, tables superseded while they wait) is
backend/model_table.py; the wire codec (requests' tensors, replies, stats) backend/wire.py; which
device this backend can use, backend/device_probe.py. Readiness turns SERVING once the first table
is applied, so it waits for that table's warm-up too.

Measured profiles: the engine records every serving batch's latency (backend/latency_samples.py,
which says when a batch counts as contended; on a CPU device a :class:`common.host_load.ContentionMonitor`
watches the host's other work) and each heartbeat carries them to the scheduler. An emulated device
waits the latencies of the table the scheduler sends for it (``emulated_profile_json``: the uploaded,
profiled or datasheet table, or a prediction, never the measured profile the plan may use, which the
emulation would then feed on), times ``--emulated-latency-factor``: a device faster or slower than
its table says, whose serving measurements then correct the table.

Metrics: ``Stats`` (also behind the frontend's ModelStatistics) and, with ``--metrics-port``, a
Prometheus text endpoint (backend/metrics.py).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import sys
import time

import grpc

from backend.device_probe import detect_memory_mb, device_problem
from backend.engine import Engine
from backend.exec_channel import ExecChannel
from backend.framed_exec import start_framed_exec
from backend.sessions import Session
from backend.work import ExecError, Outcome, Work
from backend.latency_samples import SampleRecorder
from backend.model_table import ModelTables
from backend.profile_requests import background_executor, measure_profile
from backend.wire import backend_stats, decode_inputs, encode_result, io_specs, item_nbytes
from common import grpc_util
from common.batch_decision import POLICIES
from common.config import BackendConfig, scheduler_addresses
from common.emulated_gpus import NoDatasheet
from common.health import Health
from common.host_load import ContentionMonitor
from common.pb import control, control_grpc
from common.registration import keep_registered
from common.scheduler_connection import SchedulerConnection
from common.security import Credentials
from common.exec_status import ExecStatus

log = logging.getLogger("nexus.backend")

RESPONSE_MARGIN_S = 0.002


class BackendService(control_grpc.BackendServicer):
    def __init__(self, config: BackendConfig, engine: Engine) -> None:
        self.config = config
        self.engine = engine
        self.node_id = ""
        self._scheduler_stub = None
        self.health = None                   # common.health.Health, set by serve()
        self.in_flight = 0                   # requests accepted and not answered yet (drain waits for 0)
        self.leaving = False                 # draining: never register again (common/registration.py)
        # one measurement at a time, and no load or warm-up beside one, or they disturb each other
        self._profile_lock = asyncio.Lock()
        self._background = None              # the background measurements' thread (made at the first one)
        self._row_nbytes: dict[str, tuple[Session, tuple[int | None, ...]]] = {}   # per session, see work
        self.exec_port = 0                   # the framed execute channel's port (0: not served)
        self.tables = ModelTables(config, engine, self._profile_lock, self._fetch, self._threads())

    @property
    def epoch(self) -> int:
        """The epoch of the model table applied."""
        return self.tables.epoch

    def _threads(self) -> int | None:
        """Intra-op threads per model: as configured, else the runtime's default (one per core), the
        same as ``nexus profile`` measures with, so that served batches take what their profile says.
        Intra-op spinning is off, so idle pool threads leave the cores to the RPC path
        (benchmarks/vs_triton.md: 1.3x the goodput of one thread on 2 cores)."""
        return self.config.threads or None

    def attach_scheduler(self, stub) -> None:
        self._scheduler_stub = stub

    # ---- model table ---------------------------------------------------------------------------

    async def _fetch(self, sha256: str) -> bytes:
        parts = []
        async for chunk in self._scheduler_stub.DownloadModel(control.DownloadRequest(sha256=sha256), timeout=300):
            parts.append(chunk.data)
        return b"".join(parts)

    async def UpdateModelTable(self, request, context):
        reply, applied = await self.tables.update(request)
        if applied and self.health is not None:
            await self.health.set_ready(True)
        return reply

    # ---- execution -----------------------------------------------------------------------------

    def work(self, item: control.ExecItem, now: float, done) -> Work:
        """``item`` as the engine's work (ExecError when it cannot run here)."""
        session = self.engine.sessions.get(item.model)
        if session is None:
            raise ExecError(ExecStatus.NOT_FOUND, f"model {item.model!r} is not loaded on this backend")
        cached = self._row_nbytes.get(item.model)
        if cached is None or cached[0] is not session:      # computed once per loaded session
            cached = self._row_nbytes[item.model] = (session, item_nbytes(session))
        arrays = decode_inputs(session, item, cached[1])
        budget_s = item.budget_us / 1e6 if item.budget_us else session.slo_ms / 1000
        # The reply still has to travel back: a batch must end this much before the deadline.
        return Work(item.model, arrays, arrays[0].shape[0], now + budget_s - RESPONSE_MARGIN_S, now, done,
                    asyncio.get_running_loop().call_soon_threadsafe)    # one hand-over per batch

    async def Execute(self, request_iterator, context):
        results: asyncio.Queue = asyncio.Queue()
        channel = ExecChannel(self, results.put_nowait)

        async def reader() -> None:
            try:
                async for item in request_iterator:
                    channel.receive(item)
            finally:
                results.put_nowait(None)

        task = asyncio.create_task(reader())
        try:
            while True:
                result = await results.get()
                if result is None:
                    break
                yield result
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()      # what ended the reading (an undecodable message: refused)
        finally:
            task.cancel()
            channel.close()     # the frontend is gone: nobody waits for what is still queued

    async def ExecEndpoint(self, request, context):
        return control.ExecEndpointReply(port=self.exec_port)

    async def ExecuteOne(self, request, context):
        received_ns = time.monotonic_ns()
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def done(outcome: Outcome) -> None:     # on the loop: the engine delivers a batch at a time
            future.done() or future.set_result(outcome)

        try:
            self.engine.submit(self.work(request, self.engine.clock(), done))
        except ExecError as exc:
            return encode_result(request.request_id, Outcome(exc.status, str(exc)), received_ns)
        self.in_flight += 1
        try:
            return encode_result(request.request_id, await future, received_ns)
        finally:
            self.in_flight -= 1

    def stats(self) -> control.BackendStats:
        """A snapshot of every session's and prefix group's counters (``Stats`` and ``/metrics``)."""
        reply = backend_stats(self.engine, self.node_id)
        reply.warming.extend(sorted(self.tables.warming))
        return reply

    async def Stats(self, request, context):
        return self.stats()

    def fill_heartbeat(self, request: control.HeartbeatRequest) -> None:
        """The latency samples of the batches served since the last heartbeat (backend/latency_samples.py)."""
        if self.engine.samples is None:
            return
        for taken in self.engine.samples.take():
            request.batch_samples.add(model=taken.model, lost=taken.lost, samples=[
                control.LatencySample(batch=s.batch, latency_ms=s.latency_ms, contended=s.contended)
                for s in taken.samples])

    # ---- profiling -----------------------------------------------------------------------------

    async def ProfileModel(self, request, context):
        model = request.model
        runtime_kind = "emulated" if self.config.device.startswith("emulated:") else model.runtime
        if request.threads and self.config.device != "cpu":
            return control.MeasuredProfile(error=f"threads={request.threads}: only a CPU backend measures with "
                                                 f"other intra-op threads than its own (this one runs "
                                                 f"{self.config.device})")
        try:
            data = await self._fetch(model.sha256)
            measure = functools.partial(
                measure_profile, data, runtime_kind, self.config.device, self.config.resolved_device_type,
                io_specs(model), list(request.batch_sizes), request.budget_s or 20.0,
                request.threads or self._threads(), request.extend_to_batch)
            async with self._profile_lock:
                if request.background:
                    if self._background is None:
                        self._background = background_executor()
                    profile = await asyncio.get_running_loop().run_in_executor(self._background, measure)
                else:
                    profile = await asyncio.to_thread(measure)
        except NoDatasheet as exc:
            return control.MeasuredProfile(error=str(exc), unmeasurable=True)
        except Exception as exc:
            log.warning("profiling %s failed: %s", model.name, exc)
            return control.MeasuredProfile(error=f"{exc.__class__.__name__}: {exc}")
        return control.MeasuredProfile(profile_json=profile.to_json())


async def drain(service: BackendService, scheduler, grace_s: float) -> None:
    """On SIGTERM: readiness NOT_SERVING; ask the scheduler to move this backend's sessions (its
    Leave replies once every frontend's routing table leaves this backend out); then answer every
    request still queued or running here. All within ``grace_s``; a second signal cuts it short."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    if service.health is not None:
        await service.health.start_draining()
    service.leaving = True          # the registration loop must not register this backend again
    if service.node_id:
        try:
            reply = await scheduler.Leave(control.LeaveRequest(node_id=service.node_id), timeout=grace_s)
            log.info("left the plan; %d sessions moved", reply.sessions_moved)
        except grpc.aio.AioRpcError as exc:
            log.warning("could not leave the plan (%s: %s); draining anyway", exc.code().name, exc.details())
    while service.in_flight and loop.time() < deadline:
        await asyncio.sleep(0.02)
    if service.in_flight:
        log.warning("%d requests still in flight after the %.0f s drain grace", service.in_flight, grace_s)


async def serve(config: BackendConfig, ready=None) -> None:
    """Run a backend until cancelled: serve, register, heartbeat (re-registering if forgotten)."""
    if config.policy not in POLICIES:
        raise SystemExit(f"nexus backend: error: unknown --policy {config.policy!r}; "
                         f"expected one of {', '.join(POLICIES)}")
    problem = await asyncio.to_thread(device_problem, config.device)
    if problem:
        raise SystemExit(f"nexus backend: error: {problem}")
    # The executor thread must get the interpreter back quickly after a batch (default: 5 ms).
    sys.setswitchinterval(0.0005)
    engine = Engine(POLICIES[config.policy](), executor_cpus=config.executor_cpu_set())
    engine.samples = SampleRecorder()
    if config.device == "cpu" and not config.executor_cpu_set():
        engine.run_inline_on(asyncio.get_running_loop(), config.inline_max_ms)
    monitor = None
    if config.device == "cpu":      # batches run on the host's cores: other work there contends them
        monitor = ContentionMonitor(config.threads or len(os.sched_getaffinity(0))).start()
        engine.host_contended = monitor.contended
    creds = Credentials.load(config.security)
    service = BackendService(config, engine)
    server = grpc_util.server(creds)
    control_grpc.add_BackendServicer_to_server(service, server)
    service.health = await Health.attach(server)
    # Only components dial a backend: with a CA, they must present a certificate it signed.
    address = grpc_util.bind(server, config.listen, creds, require_client_cert=True)
    framed = None
    if config.exec_port >= 0:
        host = config.listen.rpartition(":")[0].strip("[]")
        try:
            framed = await start_framed_exec(service, host, config.exec_port, creds)
        except OSError as exc:
            await server.stop(grace=0)
            raise SystemExit(f"nexus backend: error: cannot serve --exec-port {config.exec_port} on "
                             f"{host or 'every address'}: {exc.strerror or exc}") from None
        service.exec_port = framed.port
    await server.start()
    metrics_server = None
    if config.metrics_port:
        # lazy: prometheus_client and aiohttp (~150 ms at start-up) are needed only with --metrics-port
        from backend.metrics import registry
        from common.metrics_http import start_metrics_server  # lazy: aiohttp, as above

        host = config.listen.rpartition(":")[0].strip("[]") or "127.0.0.1"
        try:
            metrics_server = await start_metrics_server(host, config.metrics_port,
                                                        registry(service.stats, config.device),
                                                        loop_lag="nexus_backend_loop_lag_seconds")
        except OSError as exc:
            await server.stop(grace=0)
            raise SystemExit(f"nexus backend: error: cannot serve --metrics-port {config.metrics_port} on "
                             f"{host}: {exc.strerror or exc}") from None
        log.info("Prometheus metrics on http://%s:%d/metrics", host, config.metrics_port)
    scheduler = SchedulerConnection(scheduler_addresses(config.scheduler), creds)
    service.attach_scheduler(scheduler)
    memory = config.memory_mb or detect_memory_mb(config.device)
    register = control.RegisterRequest(kind=control.NODE_KIND_BACKEND, address=config.advertise or address,
                                       device=config.device, device_type=config.resolved_device_type,
                                       memory_mb=memory)
    if ready:
        ready(address)
    # The registration runs on: the Leave of the drain must come while the Attach stream is still open,
    # or the stream's end removes this backend at once and Leave replies before its sessions moved.
    registration = asyncio.create_task(keep_registered(scheduler, register, service))
    try:
        await asyncio.shield(registration)
    finally:
        try:
            await drain(service, scheduler, config.drain_grace_s)
        finally:
            registration.cancel()
        if framed is not None:
            framed.close()
        engine.stop()
        if monitor is not None:
            monitor.stop()
        if metrics_server is not None:
            await metrics_server.close()
        await server.stop(grace=1)
        await scheduler.close()
