"""The backend process: registers with the scheduler, loads its model table, executes requests.

Requests arrive from frontends on a long-lived bidirectional ``Execute`` stream (one per frontend),
or one per call on ``ExecuteOne``; see benchmarks/frontend_path.py for why the stream is the
default. Raw tensors are decoded with ``np.frombuffer`` (no copy) on the loop thread, queued in the
:class:`~backend.engine.Engine`, and results are serialised back on the loop thread.

Prefix batching: sessions of the table whose models carry the same ``prefix_group`` (assigned by
the scheduler at upload, globalsched/prefix_groups.py), at least two distinct ONNX models, on a CPU
or CUDA device, are split at the group's prefix (each model on its own with ``split_at``, cached
per model; ``find_shared_prefix`` when the id is not a cut of them all). The prefix runtime is
loaded once, a suffix runtime per model, and the engine batches them as one
:class:`~backend.engine.SharedPrefix`. Anything that fails there (no shared prefix, a load error)
falls back to running the models whole; ``--no-prefix-batching`` turns it off; emulated devices run
models whole (their profile is the whole model's). The split runs under the profiling lock so it
never disturbs a measurement.

Warm-up (backend/warmup.py, common/warmup.py): a model table is answered only once the sessions
it brings (or whose runtime it renews) are loaded and have run their warm-up batches, on the
executor between the serving batches of the sessions already here, which keep serving from the old
table meanwhile; only then does the new table replace the old one. The scheduler routes frontends
to a backend only after its answer, so traffic reaches warm sessions only; readiness turns SERVING
once the first table is applied, so it waits for warm-up too. A session whose model's own warm-up
fails is reported failed, like a load error. The warm-up of one table has ``WARMUP_BUDGET_S``
(half the scheduler's wait for the answer); batches left then are skipped, with a warning.
``--no-warmup`` turns it off.

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
import hashlib
import logging
import os
import sys
import time

import grpc
import numpy as np

from backend.engine import Engine, ExecError, Outcome, Session, SharedPrefix, WarmupResult, Work
from backend.latency_samples import SampleRecorder
from backend.warmup import Warmer
from common import grpc_util
from common.config import BackendConfig, BatchStart, scheduler_addresses
from common.emulated_gpus import OUT_OF_MEMORY
from common.health import Health
from common.host_load import ContentionMonitor
from common.pb import control, control_grpc
from common.profile import Profile
from common.registration import keep_registered
from common.scheduler_connection import SchedulerConnection
from common.security import Credentials
from common.tensors import TensorSpec
from common.versions import version_key
from common.warmup import WarmupError, from_pb as warmup_from_pb

log = logging.getLogger("nexus.backend")

RESPONSE_MARGIN_S = 0.002

_STATUS = {name: control.ExecStatus.Value(name) for name in control.ExecStatus.keys()}
_BYTES_PER_MB = 1024 * 1024
UTILIZATION_WINDOW_S = 10.0
# A shared prefix is batched only when it carries at least this many bytes of weights (the scheduler
# groups models on larger prefixes still, see globalsched/prefix_groups.py).
MIN_SHARED_PREFIX_BYTES = 64 * 1024
SMALL_HEAD_RATIO = 4
WARMUP_BUDGET_S = 60.0   # per model table; the scheduler waits 120 s for the answer (globalsched/distribution.py)


def _spec(desc: control.TensorDesc) -> TensorSpec:
    return TensorSpec(desc.name, desc.datatype, tuple(desc.shape))


def model_key(model: control.ModelDesc) -> str:
    """What a backend loads a runtime for: one version of a model (its version key, common/versions.py),
    shared by every session that runs it (the version's own and query stages')."""
    return version_key(model.name, model.version or 1)


def _io_json(model: control.ModelDesc) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    return tuple(_spec(t) for t in model.inputs), tuple(_spec(t) for t in model.outputs)


def item_nbytes(session: Session) -> tuple[int | None, ...]:
    """Bytes of one batch row of each of the session's inputs (None where a dimension is variable)."""
    return tuple(spec.item_nbytes() for spec in session.inputs)


def decode_inputs(session: Session, item: control.ExecItem,
                  row_nbytes: tuple[int | None, ...] | None = None) -> list[np.ndarray]:
    """Raw input bytes -> arrays of shape (rows, *spec.shape); ExecError(EXEC_INVALID) if they do not fit.

    The frontend validated the request against the model's description already; this only checks
    that each tensor's length fits its shape (``row_nbytes``: :func:`item_nbytes`, computed once per
    session by the caller) before ``np.frombuffer`` (which copies nothing)."""
    if len(item.inputs) != len(session.inputs):
        raise ExecError("EXEC_INVALID", f"expected {len(session.inputs)} inputs, got {len(item.inputs)}")
    rows = item.rows or 1
    if row_nbytes is None:
        row_nbytes = item_nbytes(session)
    if not item.input_shapes and None not in row_nbytes:      # the common case: fixed item shapes
        arrays = []
        for spec, raw, size in zip(session.inputs, item.inputs, row_nbytes):
            if len(raw) != rows * size:
                raise ExecError("EXEC_INVALID", f"input {spec.name!r}: expected {rows * size} bytes for shape "
                                                f"{[rows, *spec.shape]}, got {len(raw)}")
            arrays.append(np.frombuffer(raw, dtype=spec.dtype).reshape(rows, *spec.shape))
        return arrays
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


def encode_result(request_id: int, outcome: Outcome, received_ns: int = 0) -> control.ExecResult:
    """The reply to a request; ``received_ns`` (``time.monotonic_ns`` when the item arrived) gives its
    ``backend_ns``."""
    result = control.ExecResult(request_id=request_id, status=_STATUS[outcome.status], message=outcome.message,
                                queue_ns=outcome.queue_ns, compute_ns=outcome.compute_ns,
                                batch_size=outcome.batch_size, compute_input_ns=outcome.input_ns,
                                first_in_batch=outcome.first_in_batch,
                                backend_ns=time.monotonic_ns() - received_ns if received_ns else 0)
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
        self._loaded: dict[str, tuple[str, object]] = {}   # model_key -> (sha256+runtime, runtime)
        # prefix group -> (prefix id, prefix runtime, its output tensor)
        self._prefixes: dict[str, tuple[str, object, str]] = {}
        self._scheduler_stub = None
        self.health = None                   # common.health.Health, set by serve()
        self.in_flight = 0                   # requests accepted and not answered yet (drain waits for 0)
        self.leaving = False                 # draining: never register again (common/registration.py)
        self._table_lock = asyncio.Lock()
        self._newest_epoch = 0        # of the tables received, applied or waiting for the lock
        # one measurement at a time, and no load or warm-up beside one, or they disturb each other
        self._profile_lock = asyncio.Lock()
        self._row_nbytes: dict[str, tuple[Session, tuple[int | None, ...]]] = {}   # per session, see _work
        self.warmer = Warmer()
        self.warming: set[str] = set()        # sessions whose warm-up runs now (Stats)
        # An emulated GPU holds what a real one would: a model table beyond its memory fails the
        # loads that do not fit, as CUDA's out-of-memory does (a real GPU enforces it itself).
        self.memory_limit_mb = ((config.memory_mb or detect_memory_mb(config.device))
                                if config.device.startswith("emulated:") else 0.0)

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

    async def _runtime_for(self, entry: control.SessionEntry):
        from common.runtimes import load_runtime

        model = entry.model
        runtime_kind = "emulated" if self.config.device.startswith("emulated:") else model.runtime
        key = f"{model.sha256}/{runtime_kind}"
        cached = self._loaded.get(model_key(model))
        if cached and cached[0] == key:
            return cached[1]
        profile_json = entry.profile_json
        if runtime_kind == "emulated":     # the device waits its table's latencies, never a measured profile's
            profile_json = entry.emulated_profile_json or entry.profile_json
            key += f"/{hashlib.sha256(profile_json.encode()).hexdigest()[:16]}"
            cached = self._loaded.get(model.name)
            if cached and cached[0] == key:
                return cached[1]
        data = await self._fetch(model.sha256)
        profile = Profile.from_json(profile_json) if profile_json else None
        if profile is not None and runtime_kind == "emulated" and self.config.emulated_latency_factor != 1.0:
            profile = profile.scaled(self.config.emulated_latency_factor)
        async with self._profile_lock:      # loading is CPU-heavy: never while a profile is measured
            runtime = await asyncio.to_thread(
                load_runtime, runtime_kind, data, self.config.device, profile=profile,
                intra_op_threads=self._threads(), io=_io_json(model))
        self._loaded[model_key(model)] = (key, runtime)
        return runtime

    # ---- prefix batching ------------------------------------------------------------------------

    def _prefix_candidates(self, entries) -> dict[str, list]:
        """Prefix group -> its entries, for groups of >= 2 distinct ONNX models this backend can split."""
        if self.config.device.startswith("emulated:") or not self.config.prefix_batching:
            return {}
        groups: dict[str, list] = {}
        for entry in entries:
            if entry.model.prefix_group and entry.model.runtime == "onnxruntime":
                groups.setdefault(entry.model.prefix_group, []).append(entry)
        return {g: es for g, es in groups.items() if len({model_key(e.model) for e in es}) >= 2}

    async def _split_parts(self, group: str, models: dict[str, control.ModelDesc]):
        """(prefix id, prefix runtime, its output, {model: suffix runtime}) for ``models``.

        The group id is a prefix id that is a cut point of every member (globalsched/prefix_groups.py),
        so each model is split on its own with ``split_at`` and its suffix runtime is kept: a member
        joining later costs one split, not the group's. When the id is not a cut of some model (a
        group formed elsewhere), ``find_shared_prefix`` finds the longest prefix the models share.
        Raises LookupError when they share none.
        """
        from common.runtimes import load_runtime
        from common.onnx_prefix import find_shared_prefix, split_at

        threads = self._threads()

        def load(data: bytes, prefix_weights: int = 0, suffix_weights: int = 0):
            return load_runtime("onnxruntime", data, self.config.device,
                                intra_op_threads=suffix_threads(threads, prefix_weights, suffix_weights))

        cached = self._prefixes.get(group)
        if cached and all((self._loaded.get(n) or ("",))[0] == f"{m.sha256}/suffix/{cached[0]}"
                          for n, m in models.items()):     # nothing new: every member is split already
            return cached[0], cached[1], cached[2], {n: self._loaded[n][1] for n in models}
        suffixes = {}
        prefix = (cached[0], cached[1], cached[2]) if cached and cached[0] == group else None
        try:
            for name, model in models.items():
                loaded = self._loaded.get(name)
                if loaded and loaded[0] == f"{model.sha256}/suffix/{group}" and prefix is not None:
                    suffixes[name] = loaded[1]
                    continue
                part = await asyncio.to_thread(split_at, await self._fetch(model.sha256), group)
                if prefix is None:
                    prefix = (group, await asyncio.to_thread(load, part.prefix), part.cut_tensor)
                suffixes[name] = await asyncio.to_thread(load, part.suffix, part.prefix_weight_bytes,
                                                         part.suffix_weight_bytes)
            return prefix[0], prefix[1], prefix[2], suffixes
        except ValueError as exc:
            log.info("prefix group %s: %s; looking for the longest shared prefix instead", group[:12], exc)
        data = {name: await self._fetch(m.sha256) for name, m in models.items()}
        split = await asyncio.to_thread(find_shared_prefix, data, min_prefix_weight_bytes=MIN_SHARED_PREFIX_BYTES)
        if split is None:
            raise LookupError("the models on this backend share no prefix")
        prefix_rt = await asyncio.to_thread(load, split.prefix)
        suffixes = {name: await asyncio.to_thread(load, split.suffixes[name], split.prefix_weight_bytes,
                                                  split.suffix_weight_bytes[name]) for name in models}
        return split.prefix_id, prefix_rt, split.cut_tensor, suffixes

    async def _shared_prefix(self, group: str, entries) -> tuple[dict[str, Session], SharedPrefix] | None:
        """Split the group's models at their shared prefix and load the prefix once and one suffix per
        model; None (the members then run whole) when they share no prefix or anything fails."""
        models = {model_key(e.model): e.model for e in entries}
        try:
            # Splitting and loading are CPU-heavy: never while a profile is being measured here.
            async with self._profile_lock:
                prefix_id, prefix_rt, cut, suffixes = await self._split_parts(group, models)
            sessions = {}
            for entry in entries:
                model = entry.model
                inputs, outputs = _io_json(model)
                suffix = suffixes[model_key(model)]
                if (len(prefix_rt.inputs) != len(inputs)
                        or any(a.dtype != b.dtype for a, b in zip(prefix_rt.inputs, inputs))
                        or [o.name for o in prefix_rt.outputs] != [cut] or len(suffix.inputs) != 1
                        or not {o.name for o in outputs} <= {o.name for o in suffix.outputs}):
                    raise ValueError(f"{model.name}: the split's inputs/outputs do not match the model's")
                name = entry.session or model.name
                profile = Profile.from_json(entry.profile_json) if entry.profile_json else None
                sessions[name] = Session(name, suffix, entry.slo_ms, entry.batch, profile, model.sha256,
                                         self.config.max_queue, inputs=inputs, outputs=outputs,
                                         model=model_key(model))
        except LookupError as exc:
            log.info("prefix group %s: %s; running its models whole", group[:12], exc)
            return None
        except Exception as exc:
            log.warning("prefix group %s: cannot batch its prefix (%s: %s); running its models whole",
                        group[:12], exc.__class__.__name__, exc)
            return None
        self._prefixes[group] = (prefix_id, prefix_rt, cut)
        for name, model in models.items():
            self._loaded[name] = (f"{model.sha256}/suffix/{prefix_id}", suffixes[name])
        return sessions, SharedPrefix(group, prefix_rt, cut, list(sessions.values()), prefix_id)

    async def UpdateModelTable(self, request, context):
        self._newest_epoch = max(self._newest_epoch, request.epoch)
        async with self._table_lock:
            # Older than the table applied, or than one waiting behind it (a plan's release step
            # queued behind the next plan's tables, which drop what it would drop): no effect.
            if request.epoch and request.epoch < max(self.epoch, self._newest_epoch):
                return control.ModelTableReply(loaded=list(self.engine.sessions))
            self.epoch = request.epoch
            sessions: dict[str, Session] = {}
            groups: list[SharedPrefix] = []
            failed = []
            grouped: set[str] = set()
            for group, entries in self._prefix_candidates(request.sessions).items():
                built = await self._shared_prefix(group, entries)
                if built is not None:
                    members, shared = built
                    sessions.update(members)
                    groups.append(shared)
                    grouped.update(members)
            for entry in request.sessions:
                name = entry.session or entry.model.name   # a query stage runs under its own name
                if name in grouped:
                    continue
                try:
                    runtime = await self._runtime_for(entry)
                except Exception as exc:
                    log.warning("cannot load %s: %s", name, exc)
                    failed.append(f"{name}: {exc.__class__.__name__}: {exc}")
                    continue
                if self.memory_limit_mb:
                    held = {id(s.runtime): s.runtime.memory_mb() for s in sessions.values()}
                    need, used = runtime.memory_mb(), sum(held.values())
                    if id(runtime) not in held and used + need > self.memory_limit_mb:
                        log.warning("cannot load %s: out of memory (%.0f MB needed, %.0f of %.0f MB in use)",
                                    name, need, used, self.memory_limit_mb)
                        failed.append(f"{name}: {OUT_OF_MEMORY} CUDA out of memory: {need:,.0f} MB needed, {used:,.0f} "
                                      f"of {self.memory_limit_mb:,.0f} MB in use by the table's other models")
                        continue
                profile = Profile.from_json(entry.profile_json) if entry.profile_json else None
                sessions[name] = Session(name, runtime, entry.slo_ms, entry.batch, profile, entry.model.sha256,
                                         self.config.max_queue)
            warmed = await self._warm_up(request.sessions, sessions, failed)
            groups = _without_failed(groups, sessions)
            # Eager by default: measured against duty-cycle waiting in benchmarks/query_split.md.
            eager = self.config.batch_start is BatchStart.EAGER
            self.engine.duty_cycle_s = 0.0 if eager else request.duty_cycle_ms / 1000
            removed = self.engine.set_sessions(sessions, groups)
            with self.engine.stats_lock:
                for name, result in warmed.items():
                    sessions[name].stats.warmup_count += result.batches
                    sessions[name].stats.warmup_ns += result.ns
            for s in removed:
                if s.name not in sessions:
                    self._fail_queue(s, "model unloaded from this backend")
            # Runtimes no longer used are closed; a batch still running on one keeps its own reference.
            in_use = {s.runtime for s in sessions.values()}
            for name in list(self._loaded):
                if self._loaded[name][1] not in in_use:
                    _, runtime = self._loaded.pop(name)
                    runtime.close()
                    self.warmer.forget(runtime)
            prefixes_in_use = {g.runtime for g in groups}
            for group in list(self._prefixes):
                if self._prefixes[group][1] not in prefixes_in_use:
                    self._prefixes.pop(group)[1].close()
            log.info("epoch %d: serving %s", request.epoch, ", ".join(f"{n}(b={s.planned_batch}/{s.max_batch})"
                                                                     for n, s in sessions.items()) or "nothing")
            for g in groups:
                log.info("prefix group %s: %s share prefix %s (max batch %d)", g.name[:12],
                         ", ".join(m.name for m in g.members), g.prefix_id[:12], g.max_batch)
            if self.health is not None:
                await self.health.set_ready(True)
            return control.ModelTableReply(loaded=list(sessions), failed=failed)

    async def _warm_up(self, entries, sessions: dict[str, Session], failed: list[str]) -> dict[str, WarmupResult]:
        """Run the warm-up of every session in ``sessions`` that needs it (module docstring); those
        whose model's own warm-up fails leave ``sessions`` for ``failed``. Returns the results by session."""
        if not self.config.warmup:
            return {}
        own = {}
        for entry in entries:
            name = entry.session or entry.model.name
            try:
                own[name] = warmup_from_pb(entry.model.warmup)
            except WarmupError as exc:
                own[name] = exc
        plans = []
        for name, session in sessions.items():
            samples = own.get(name, ())
            if isinstance(samples, WarmupError):
                failed.append(f"{name}: warm-up: {samples}")
                continue
            plan = self.warmer.plan(session, samples)
            if plan is not None:
                plans.append(plan)
        for entry in failed:
            sessions.pop(entry.partition(": ")[0], None)
        self.warming = {p.session for p in plans}
        try:
            # warm-up batches and a profile's batches would time each other: one at a time
            async with self._profile_lock:
                results = await asyncio.gather(*[asyncio.wrap_future(
                    self.engine.warm_up(list(plan.batches), WARMUP_BUDGET_S)) for plan in plans])
        finally:
            self.warming = set()
        out = {}
        for plan, result in zip(plans, results):
            if result.error and plan.configured:
                log.warning("cannot serve %s: its warm-up failed: %s", plan.session, result.error)
                failed.append(f"{plan.session}: warm-up failed: {result.error}")
                sessions.pop(plan.session, None)
                continue
            if result.error:
                log.warning("default warm-up of %s stopped: %s", plan.session, result.error)
            elif not result.skipped:
                self.warmer.done(plan)
            out[plan.session] = result
        if plans:
            log.info("warmed up %s", ", ".join(f"{p.session} ({r.batches} batches, {r.ns / 1e6:.0f} ms)"
                                               for p, r in zip(plans, results)))
        return out

    def _fail_queue(self, session: Session, why: str) -> None:
        self.engine.fail_queued(session, Outcome("EXEC_NOT_FOUND", why))

    # ---- execution -----------------------------------------------------------------------------

    def _work(self, item: control.ExecItem, now: float, done) -> Work:
        session = self.engine.sessions.get(item.model)
        if session is None:
            raise ExecError("EXEC_NOT_FOUND", f"model {item.model!r} is not loaded on this backend")
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
        clock = self.engine.clock

        queued: dict[int, object] = {}      # this stream's request id -> its queue entry, until answered

        def finished(entry) -> None:
            self.in_flight -= 1
            results.put_nowait(entry)

        def completer(request_id: int, received_ns: int):
            def done(outcome: Outcome) -> None:     # on the loop: the engine delivers a batch at a time
                finished((request_id, outcome, received_ns))
            return done

        async def reader() -> None:
            try:
                async for item in request_iterator:
                    received_ns = time.monotonic_ns()
                    if item.cancel:     # the client gave up: a request still queued never runs
                        entry = queued.pop(item.request_id, None)
                        if entry is not None and self.engine.cancel(entry):
                            finished((item.request_id, Outcome("EXEC_CANCELLED", "cancelled by the frontend"),
                                      received_ns))
                        continue
                    try:
                        queued[item.request_id] = self.engine.submit(
                            self._work(item, clock(), completer(item.request_id, received_ns)))
                        self.in_flight += 1
                    except ExecError as exc:
                        results.put_nowait((item.request_id, Outcome(exc.status, str(exc)), received_ns))
            finally:
                results.put_nowait(None)

        task = asyncio.create_task(reader())
        try:
            while True:
                entry = await results.get()
                if entry is None:
                    break
                queued.pop(entry[0], None)
                yield encode_result(*entry)
        finally:
            task.cancel()
            for entry in queued.values():   # the frontend is gone: nobody waits for these any more
                if self.engine.cancel(entry):
                    self.in_flight -= 1

    async def ExecuteOne(self, request, context):
        received_ns = time.monotonic_ns()
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def done(outcome: Outcome) -> None:     # on the loop: the engine delivers a batch at a time
            future.done() or future.set_result(outcome)

        try:
            self.engine.submit(self._work(request, self.engine.clock(), done))
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
        reply.warming.extend(sorted(self.warming))
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
        from backend.profiling import measure_profile
        from common.emulated_gpus import NoDatasheet

        model = request.model
        runtime_kind = "emulated" if self.config.device.startswith("emulated:") else model.runtime
        try:
            data = await self._fetch(model.sha256)
            async with self._profile_lock:
                profile = await asyncio.to_thread(
                    measure_profile, data, runtime_kind, self.config.device, self.config.resolved_device_type,
                    _io_json(model), list(request.batch_sizes), request.budget_s or 20.0,
                    self._threads())
        except NoDatasheet as exc:
            return control.MeasuredProfile(error=str(exc), unmeasurable=True)
        except Exception as exc:
            log.warning("profiling %s failed: %s", model.name, exc)
            return control.MeasuredProfile(error=f"{exc.__class__.__name__}: {exc}")
        return control.MeasuredProfile(profile_json=profile.to_json())


def _without_failed(groups: list[SharedPrefix], sessions: dict[str, Session]) -> list[SharedPrefix]:
    """The prefix groups without members that left ``sessions`` (a failed warm-up); a group left with
    none goes."""
    out = []
    for g in groups:
        kept = [m for m in g.members if sessions.get(m.name) is m]
        if len(kept) == len(g.members):
            out.append(g)
        elif kept:
            out.append(SharedPrefix(g.name, g.runtime, g.cut_tensor, kept, g.prefix_id))
    return out


def suffix_threads(threads: int | None, prefix_weight_bytes: int, suffix_weight_bytes: int) -> int | None:
    """Intra-op threads of a suffix runtime: one for a small head (its weights under a quarter of the
    prefix's), else the backend's setting. A merged batch runs the prefix and then every member's suffix
    back to back: a thread pool per tiny head would only spin and steal the cores from the next run
    (measured: 2-3x slower merged batches on 2 cores, benchmarks/prefix_batching.md)."""
    if suffix_weight_bytes * SMALL_HEAD_RATIO < prefix_weight_bytes:
        return 1
    return threads


def backend_stats(engine: Engine, node_id: str = "") -> control.BackendStats:
    reply = control.BackendStats(node_id=node_id, utilization=engine.utilization(UTILIZATION_WINDOW_S),
                                 utilization_total=engine.utilization())
    total = 0
    sessions, groups = list(engine.sessions.items()), list(engine.groups)
    memory = {name: int(s.memory_mb * _BYTES_PER_MB) for name, s in sessions}
    with engine.stats_lock:     # one consistent snapshot: no batch half counted
        for name, s in sessions:
            st = s.stats
            group = s.group if s.group in groups else None
            total += memory[name]
            reply.sessions.append(control.SessionStats(
                model=name, inference_count=st.inference_count, execution_count=st.execution_count,
                success_count=st.success_count, success_ns=st.success_ns, fail_count=st.fail_count,
                queue_ns=st.queue_ns, compute_ns=st.compute_ns, dropped=st.dropped, queue_length=s.depth.queued,
                batch_histogram=dict(st.batch_histogram), batch_compute_ns=dict(st.batch_compute_ns),
                memory_bytes=memory[name], last_inference_ms=st.last_inference_ms,
                prefix_group=group.name if group else "",
                shared_memory_bytes=int(group.memory_mb * _BYTES_PER_MB) if group else 0,
                request_compute_input_ns=st.request_compute_input_ns,
                request_compute_infer_ns=st.request_compute_infer_ns,
                request_compute_output_ns=st.request_compute_output_ns,
                batch_compute_input_ns=dict(st.batch_compute_input_ns),
                batch_compute_output_ns=dict(st.batch_compute_output_ns),
                warmup_count=st.warmup_count, warmup_ns=st.warmup_ns))
        for g in groups:
            gs = g.stats
            reply.prefix_groups.append(control.PrefixGroupStats(
                group=g.name, prefix_id=g.prefix_id, sessions=[m.name for m in g.members],
                execution_count=gs.execution_count, inference_count=gs.inference_count, compute_ns=gs.compute_ns,
                prefix_compute_ns=gs.prefix_ns, batch_histogram=dict(gs.batch_histogram),
                memory_bytes=int(g.memory_mb * _BYTES_PER_MB), max_batch=g.max_batch))
    reply.memory_bytes = total
    return reply


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


def device_problem(device: str) -> str | None:
    """Why this backend cannot use ``device`` (a clear message for the operator), or None when it can.

    CPU and emulated devices always work. A CUDA device works when onnxruntime's CUDA execution
    provider actually starts on it (probed with a one-node model) or torch sees it.
    """
    from common.runtimes import DeviceSpec

    try:
        spec = DeviceSpec.parse(device)
    except ValueError as exc:
        return str(exc)
    if not spec.is_cuda:
        return None
    reasons = []
    try:
        import onnxruntime as ort

        providers = ort.get_available_providers()
        if "CUDAExecutionProvider" in providers:
            if _ort_cuda_works(ort, spec.index):
                return None
            reasons.append(f"onnxruntime's CUDAExecutionProvider could not start on {spec} "
                           f"(no such GPU, or CUDA/cuDNN libraries missing)")
        else:
            reasons.append(f"onnxruntime has no CUDAExecutionProvider (available: {', '.join(providers)}; "
                           f"install onnxruntime-gpu)")
    except ImportError:
        reasons.append("onnxruntime is not installed")
    try:
        import torch

        if torch.cuda.is_available():
            count = torch.cuda.device_count()
            if spec.index < count:
                return None
            reasons.append(f"torch sees {count} CUDA device(s), so no {spec}")
        else:
            reasons.append("torch sees no CUDA device")
    except ImportError:
        reasons.append("torch is not installed")
    return f"device {spec} is not available: {'; '.join(reasons)}. Use --device cpu or emulated:<gpu-name>"


def _ort_cuda_works(ort, index: int) -> bool:
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    options = ort.SessionOptions()
    options.log_severity_level = 4
    try:
        session = ort.InferenceSession(model.SerializeToString(), sess_options=options,
                                       providers=[("CUDAExecutionProvider", {"device_id": index})])
    except Exception:
        return False
    return "CUDAExecutionProvider" in session.get_providers()


def detect_memory_mb(device: str) -> float:
    if device == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1024 * 1024)
        except (ValueError, OSError):
            return 0.0
    if device.startswith("emulated:"):
        from common.emulated_gpus import GPU_TYPES

        gpu = GPU_TYPES.get(device.split(":", 1)[1])
        return gpu.memory_mb if gpu else 0.0
    return 0.0


async def serve(config: BackendConfig, ready=None) -> None:
    """Run a backend until cancelled: serve, register, heartbeat (re-registering if forgotten)."""
    from common.batching import POLICIES

    if config.policy not in POLICIES:
        raise SystemExit(f"nexus backend: error: unknown --policy {config.policy!r}; "
                         f"expected one of {', '.join(POLICIES)}")
    problem = await asyncio.to_thread(device_problem, config.device)
    if problem:
        raise SystemExit(f"nexus backend: error: {problem}")
    # The executor thread must get the interpreter back quickly after a batch (default: 5 ms).
    sys.setswitchinterval(0.0005)
    engine = Engine(POLICIES[config.policy]())
    engine.samples = SampleRecorder()
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
    await server.start()
    metrics_server = None
    if config.metrics_port:
        from backend.metrics import registry
        from common.metrics_http import start_metrics_server

        host = config.listen.rpartition(":")[0].strip("[]") or "127.0.0.1"
        try:
            metrics_server = await start_metrics_server(host, config.metrics_port,
                                                        registry(service.stats, config.device))
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
        engine.stop()
        if monitor is not None:
            monitor.stop()
        if metrics_server is not None:
            await metrics_server.close()
        await server.stop(grace=1)
        await scheduler.close()
