"""A backend's model table: the sessions it serves, loaded, split and warmed up before they serve.

A table (``UpdateModelTable``) is applied one at a time, under :attr:`ModelTables.lock`. A table older
than the one applied, or than one already waiting behind it (a plan's release step queued behind the
next plan's tables, which drop what it would drop: globalsched/actuators/handover.py), is answered without
effect. The models it brings are fetched from the scheduler and loaded (a runtime per model version,
kept while any session runs it); on an emulated device a load beyond the device's memory fails as
CUDA's out-of-memory does.

Prefix batching: sessions of the table whose models carry the same ``prefix_group`` (assigned by
the scheduler at upload, globalsched/planning/prefix_groups.py), at least two distinct ONNX models, on a CPU
or CUDA device, are split at the group's prefix (each model on its own with ``split_at``, cached
per model; ``find_shared_prefix`` when the id is not a cut of them all). The prefix runtime is
loaded once, a suffix runtime per model, and the engine batches them as one
:class:`~backend.sessions.SharedPrefix`. Anything that fails there (no shared prefix, a load error)
falls back to running the models whole; ``--no-prefix-batching`` turns it off; emulated devices run
models whole (their profile is the whole model's). The split runs under the profiling lock so it
never disturbs a measurement.

Warm-up (backend/warmup_runner.py, common/warmup_spec.py): a model table is answered only once the sessions
it brings (or whose runtime it renews) are loaded and have run the warm-up batches that hold the
answer (the model's own samples, or the default's planned batch), on the executor between the
serving batches of the sessions already here, which keep serving from the old table meanwhile; only
then does the new table replace the old one. The scheduler routes frontends to a backend only after
its answer, so traffic reaches warm sessions only. The deferred rest (the default's batch 1, and
the new planned batch of a session already serving here) runs after the table took effect, on an
idle device; its batches count in the session's warm-up statistics when they finish. A session whose model's
own warm-up fails is reported failed, like a load error. The warm-up of one table has
``WARMUP_BUDGET_S`` (half the scheduler's wait for the answer); batches left then are skipped, with
a warning. ``--no-warmup`` turns it off.

The table's loads and warm-ups overlap: the models' bytes are fetched from the scheduler ahead of
the loads (at most ``FETCHES_AHEAD`` models' bytes held and not loaded yet), the runtimes load one
after another in the table's order, and each session's warm-up starts on the executor as soon as its
runtime is loaded, while the next one loads. A backend given many models at once (a new one at a
load step) answers after about its loads plus the last warm-up, not its loads plus every warm-up
(benchmarks/warmup.md). Loads, splits and warm-ups take the profile lock the backend measures
profiles under: they would disturb each other's timings.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from typing import Awaitable, Callable

from backend.device_probe import detect_memory_mb
from backend.engine import Engine, WarmupResult
from backend.sessions import Session, SharedPrefix
from backend.work import Outcome
from backend.warmup_runner import Warmer, WarmupPlan
from backend.wire import io_specs, model_key
from common.config import BackendConfig, BatchStart
from common.emulated_gpus import OUT_OF_MEMORY
from common.late_requests import LateRequests
from common.pb import control
from common.profile import Profile
from common.runtimes import load_runtime
from common.warmup_spec import WarmupError, WarmupSample, from_pb as warmup_from_pb
from common.exec_status import ExecStatus

log = logging.getLogger("nexus.backend")

MIN_SHARED_PREFIX_BYTES = 64 * 1024
SMALL_HEAD_RATIO = 4
WARMUP_BUDGET_S = 60.0   # per model table; the scheduler waits 120 s for the answer (globalsched/actuators/distribution.py)
FETCHES_AHEAD = 4        # a table's models fetched from the scheduler and not yet loaded, at most


class ModelTables:
    def __init__(self, config: BackendConfig, engine: Engine, profile_lock: asyncio.Lock,
                 fetch: Callable[[str], Awaitable[bytes]], threads: int | None) -> None:
        """``fetch(sha256)``: a model's bytes from the scheduler; ``threads``: intra-op threads per
        model (None: the runtime's default)."""
        self.config = config
        self.engine = engine
        self._profile_lock = profile_lock
        self._fetch = fetch
        self.threads = threads
        self.epoch = 0
        self.lock = asyncio.Lock()
        self._newest_epoch = 0        # of the tables received, applied or waiting for the lock
        self._loaded: dict[str, tuple[str, object]] = {}   # model_key -> (sha256+runtime, runtime)
        # prefix group -> (prefix id, prefix runtime, its output tensor)
        self.prefixes: dict[str, tuple[str, object, str]] = {}
        self.warmer = Warmer()
        self.warming: set[str] = set()        # sessions whose warm-up runs now (Stats)
        # An emulated GPU holds what a real one would: a model table beyond its memory fails the
        # loads that do not fit, as CUDA's out-of-memory does (a real GPU enforces it itself).
        self.memory_limit_mb = ((config.memory_mb or detect_memory_mb(config.device))
                                if config.device.startswith("emulated:") else 0.0)

    def _runtime_key(self, entry: control.SessionEntry) -> tuple[str, str, object | None]:
        """``(runtime kind, key, the runtime loaded under that key or None)`` for ``entry``'s model."""
        model = entry.model
        runtime_kind = "emulated" if self.config.device.startswith("emulated:") else model.runtime
        key = f"{model.sha256}/{runtime_kind}"
        cached = self._loaded.get(model_key(model))
        if cached and cached[0] == key:
            return runtime_kind, key, cached[1]
        if runtime_kind == "emulated":     # the device waits its table's latencies, never a measured profile's
            profile_json = entry.emulated_profile_json or entry.profile_json
            key += f"/{hashlib.sha256(profile_json.encode()).hexdigest()[:16]}"
            cached = self._loaded.get(model.name)
            if cached and cached[0] == key:
                return runtime_kind, key, cached[1]
        return runtime_kind, key, None

    def _start_fetches(self, entries) -> "_Fetches":
        """The bytes of every model in ``entries`` that needs a load, fetched from the scheduler ahead of
        the loads (module docstring)."""
        fetches = _Fetches(self._fetch, FETCHES_AHEAD)
        for entry in entries:
            if self._runtime_key(entry)[2] is None:
                fetches.start(entry.model.sha256)
        return fetches

    async def _runtime_for(self, entry: control.SessionEntry, fetches: "_Fetches") -> object:
        """``entry``'s runtime: the one loaded, else a new one from the bytes its fetch brings. The
        caller holds the profile lock (loading is CPU-heavy: never while a profile is measured)."""
        model = entry.model
        runtime_kind, key, cached = self._runtime_key(entry)
        if cached is not None:
            return cached
        profile_json = entry.profile_json
        if runtime_kind == "emulated":
            profile_json = entry.emulated_profile_json or entry.profile_json
        data = await fetches.take(model.sha256)
        profile = Profile.from_json(profile_json) if profile_json else None
        if profile is not None and runtime_kind == "emulated" and self.config.emulated_latency_factor != 1.0:
            profile = profile.scaled(self.config.emulated_latency_factor)
        runtime = await asyncio.to_thread(
            load_runtime, runtime_kind, data, self.config.device, profile=profile,
            intra_op_threads=self.threads, io=io_specs(model))
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

        The group id is a prefix id that is a cut point of every member (globalsched/planning/prefix_groups.py),
        so each model is split on its own with ``split_at`` and its suffix runtime is kept: a member
        joining later costs one split, not the group's. When the id is not a cut of some model (a
        group formed elsewhere), ``find_shared_prefix`` finds the longest prefix the models share.
        Raises LookupError when they share none.
        """
        # lazy: common.onnx_prefix imports onnx (~30 ms at start-up); only prefix-sharing groups need it
        from common.onnx_prefix import find_shared_prefix, split_at

        threads = self.threads

        def load(data: bytes, prefix_weights: int = 0, suffix_weights: int = 0):
            return load_runtime("onnxruntime", data, self.config.device,
                                intra_op_threads=suffix_threads(threads, prefix_weights, suffix_weights))

        cached = self.prefixes.get(group)
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
                inputs, outputs = io_specs(model)
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
                                         model=model_key(model), serve_late=_serves_late(model))
        except LookupError as exc:
            log.info("prefix group %s: %s; running its models whole", group[:12], exc)
            return None
        except Exception as exc:
            log.warning("prefix group %s: cannot batch its prefix (%s: %s); running its models whole",
                        group[:12], exc.__class__.__name__, exc)
            return None
        self.prefixes[group] = (prefix_id, prefix_rt, cut)
        for name, model in models.items():
            self._loaded[name] = (f"{model.sha256}/suffix/{prefix_id}", suffixes[name])
        return sessions, SharedPrefix(group, prefix_rt, cut, list(sessions.values()), prefix_id)

    async def update(self, request: control.ModelTable) -> tuple[control.ModelTableReply, bool]:
        """Apply ``request`` (module docstring): its reply, and whether it took effect."""
        self._newest_epoch = max(self._newest_epoch, request.epoch)
        async with self.lock:
            # Older than the table applied, or than one waiting behind it (a plan's release step
            # queued behind the next plan's tables, which drop what it would drop): no effect.
            if request.epoch and request.epoch < max(self.epoch, self._newest_epoch):
                return control.ModelTableReply(loaded=list(self.engine.sessions)), False
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
            own = self._warmup_samples(request.sessions)
            serving = {s.runtime for s in self.engine.sessions.values()}
            warming: list[tuple[WarmupPlan, asyncio.Future]] = []
            deferred: list[WarmupPlan] = []
            fetches = self._start_fetches(e for e in request.sessions if (e.session or e.model.name) not in grouped)
            try:
                # Loads and warm-ups are CPU-heavy, and warm-up batches would time a profile's: never
                # while a profile is measured here. A session's warm-up starts once it is loaded, while
                # the next one loads.
                async with self._profile_lock:
                    for name, session in list(sessions.items()):      # the prefix groups' members
                        if not self._start_warm_up(name, session, own, serving, failed, warming, deferred):
                            sessions.pop(name)
                    for entry in request.sessions:
                        name = entry.session or entry.model.name   # a query stage runs under its own name
                        if name in grouped:
                            continue
                        session = await self._session_for(entry, name, sessions, failed, fetches)
                        if session is not None and self._start_warm_up(name, session, own, serving, failed,
                                                                       warming, deferred):
                            sessions[name] = session
                    warmed = await self._warmed(warming, sessions, failed)
            finally:
                self.warming = set()
                fetches.cancel()
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
            for plan in deferred:
                if plan.session in sessions:
                    self._start_deferred(plan)
            # Runtimes no longer used are closed; a batch still running on one keeps its own reference.
            in_use = {s.runtime for s in sessions.values()}
            for name in list(self._loaded):
                if self._loaded[name][1] not in in_use:
                    _, runtime = self._loaded.pop(name)
                    runtime.close()
                    self.warmer.forget(runtime)
            prefixes_in_use = {g.runtime for g in groups}
            for group in list(self.prefixes):
                if self.prefixes[group][1] not in prefixes_in_use:
                    self.prefixes.pop(group)[1].close()
            log.info("epoch %d: serving %s", request.epoch, ", ".join(f"{n}(b={s.planned_batch}/{s.max_batch})"
                                                                     for n, s in sessions.items()) or "nothing")
            for g in groups:
                log.info("prefix group %s: %s share prefix %s (max batch %d)", g.name[:12],
                         ", ".join(m.name for m in g.members), g.prefix_id[:12], g.max_batch)
            return control.ModelTableReply(loaded=list(sessions), failed=failed), True

    async def _session_for(self, entry: control.SessionEntry, name: str, sessions: dict[str, Session],
                           failed: list[str], fetches: "_Fetches") -> Session | None:
        """The session ``entry`` brings, its runtime loaded; None, with the reason in ``failed``, when
        it cannot load or does not fit beside ``sessions`` on an emulated device's memory."""
        try:
            runtime = await self._runtime_for(entry, fetches)
        except Exception as exc:
            log.warning("cannot load %s: %s", name, exc)
            failed.append(f"{name}: {exc.__class__.__name__}: {exc}")
            return None
        if self.memory_limit_mb:
            held = {id(s.runtime): s.runtime.memory_mb() for s in sessions.values()}
            need, used = runtime.memory_mb(), sum(held.values())
            if id(runtime) not in held and used + need > self.memory_limit_mb:
                log.warning("cannot load %s: out of memory (%.0f MB needed, %.0f of %.0f MB in use)",
                            name, need, used, self.memory_limit_mb)
                failed.append(f"{name}: {OUT_OF_MEMORY} CUDA out of memory: {need:,.0f} MB needed, {used:,.0f} "
                              f"of {self.memory_limit_mb:,.0f} MB in use by the table's other models")
                return None
        profile = Profile.from_json(entry.profile_json) if entry.profile_json else None
        return Session(name, runtime, entry.slo_ms, entry.batch, profile, entry.model.sha256,
                       self.config.max_queue, serve_late=_serves_late(entry.model))

    @staticmethod
    def _warmup_samples(entries) -> dict[str, tuple[WarmupSample, ...] | WarmupError]:
        """Each session's own warm-up samples (none: the default), or why they cannot run."""
        own: dict[str, tuple[WarmupSample, ...] | WarmupError] = {}
        for entry in entries:
            try:
                own[entry.session or entry.model.name] = warmup_from_pb(entry.model.warmup)
            except WarmupError as exc:
                own[entry.session or entry.model.name] = exc
        return own

    def _start_warm_up(self, name: str, session: Session, own, serving: set, failed: list[str],
                       warming: list[tuple[WarmupPlan, asyncio.Future]], deferred: list[WarmupPlan]) -> bool:
        """Start the warm-up that holds the answer for ``session`` on the engine (module docstring),
        into ``warming``, and note its deferred rest in ``deferred``; False, with the reason in
        ``failed``, when its model's own samples cannot run."""
        if not self.config.warmup:
            return True
        samples = own.get(name, ())
        if isinstance(samples, WarmupError):
            failed.append(f"{name}: warm-up: {samples}")
            return False
        for plan in self.warmer.plan(session, samples, serving=session.runtime in serving):
            if plan.deferred:
                deferred.append(plan)
                continue
            self.warming.add(plan.session)
            warming.append((plan, asyncio.wrap_future(self.engine.warm_up(list(plan.batches), WARMUP_BUDGET_S))))
        return True

    async def _warmed(self, warming: list[tuple[WarmupPlan, asyncio.Future]], sessions: dict[str, Session],
                      failed: list[str]) -> dict[str, WarmupResult]:
        """Wait for the warm-ups started; those whose model's own warm-up failed leave ``sessions`` for
        ``failed``. Returns the results by session."""
        results = await asyncio.gather(*[job for _, job in warming])
        out = {}
        for (plan, _), result in zip(warming, results):
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
        if warming:
            log.info("warmed up %s", ", ".join(f"{p.session} ({r.batches} batches, {r.ns / 1e6:.0f} ms)"
                                               for (p, _), r in zip(warming, results)))
        return out

    def _start_deferred(self, plan: WarmupPlan) -> None:
        """Run a deferred warm-up on the engine (module docstring); when it ends, its sizes are warm
        and its batches count in the session's statistics."""
        self.warmer.started(plan)
        job = asyncio.wrap_future(self.engine.warm_up(list(plan.batches), WARMUP_BUDGET_S, deferred=True))

        def ended(job: asyncio.Future) -> None:
            if job.cancelled():
                return
            result = job.result()
            closed = getattr(plan.runtime, "closed", False)
            if result.error and not closed:
                log.warning("deferred warm-up of %s stopped: %s", plan.session, result.error)
            self.warmer.done(plan, ok=not result.error and not result.skipped)
            session = self.engine.sessions.get(plan.session)
            if session is not None and session.runtime is plan.runtime:
                with self.engine.stats_lock:
                    session.stats.warmup_count += result.batches
                    session.stats.warmup_ns += result.ns
        job.add_done_callback(ended)

    def _fail_queue(self, session: Session, why: str) -> None:
        self.engine.fail_queued(session, Outcome(ExecStatus.NOT_FOUND, why))


class _Fetches:
    """A table's model downloads from the scheduler, ahead of its loads: at most ``ahead`` models' bytes
    fetched and not taken yet, so a table of many large models never holds them all at once."""

    def __init__(self, fetch: Callable[[str], Awaitable[bytes]], ahead: int) -> None:
        self._fetch = fetch
        self._gate = asyncio.Semaphore(ahead)
        self._tasks: dict[str, asyncio.Task] = {}

    def start(self, sha256: str) -> None:
        if sha256 not in self._tasks:
            task = self._tasks[sha256] = asyncio.ensure_future(self._one(sha256))
            # a failure is raised to the load that takes it; one that no load took is let go
            task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _one(self, sha256: str) -> bytes:
        await self._gate.acquire()          # released when the bytes are taken
        return await self._fetch(sha256)

    async def take(self, sha256: str) -> bytes:
        """The model's bytes: from its fetch under way, else fetched now."""
        task = self._tasks.pop(sha256, None)
        if task is None:
            return await self._fetch(sha256)
        try:
            return await task
        finally:
            if task.done() and not task.cancelled():
                self._gate.release()

    def cancel(self) -> None:
        """Let go the fetches that no load took (the table failed or ended)."""
        for task in self._tasks.values():
            task.cancel()
        self._tasks.clear()


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


def _serves_late(model: control.ModelDesc) -> bool:
    return LateRequests.from_pb(model.late_requests) is LateRequests.SERVE
