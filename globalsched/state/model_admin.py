"""Model administration: the model database behind the admin RPCs, queries, serving states and load
failures.

Uploads are validated and stored in a thread (globalsched/state/modeldb.py); loads, unloads, profiles and
query registrations change what the plan must serve and so ask for a re-plan. Two rooms beside it hold
the rest of a model's way to serving: globalsched/state/profiles_in_service.py (what each version
plans with, corrected while serving) and globalsched/actuators/profiling.py (profiling runs on
backends). A model file that a backend cannot load (while profiling it or from a model table) is
recorded in :class:`globalsched.state.load_failures.LoadFailures`: retried on another backend a
bounded number of times, then routed UNAVAILABLE with the reason. Every refusal raises :class:`Refused`.

Serving states (globalsched/state/readiness.py): every description carries where its version is on the
way to serving (stored, loading and what it waits for, ready and how long that took, or failed and
why); :meth:`ModelAdmin.wait_ready` answers when it is ready or cannot be.

Versions: what belongs to one version of a model (its file, profiles, load failures, description)
is keyed by its version key (common/version_policy.py); loads, unloads and settings are by model name.
:attr:`ModelAdmin.rollout` (globalsched/planning/version_rollout.py) keeps an old version served until its
successor is routed.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import AbstractSet, Iterable, Mapping

import grpc

from common import grpc_util
from common.config import SchedulerConfig
from common.pb import control
from common.emulated_gpus import OUT_OF_MEMORY
from common.profile import Profile, ProfileError
from common.late_requests import LateRequests
from common.loop_slices import Steps, drain
from common.query_def import ModelIO, QueryError, parse_query, validate_query
from common.version_policy import VersionError, from_pb as policy_from_pb, to_pb as policy_to_pb, version_key
from common.warmup_spec import WarmupError, from_pb as warmup_from_pb
from globalsched.state.catalog import Catalog, UnplannedRoute
from globalsched.planning.cluster_values import ClusterPlan
from globalsched.rpc.convert import model_desc
from globalsched.state.load_failures import LoadFailures
from globalsched.state.membership import Node
from globalsched.state.modeldb import ModelDatabase, ServingSettings, UploadError
from globalsched.state.profile_book import MEASURED, PREDICTED, Choice
from globalsched.state.profiles_in_service import ProfilesInService
from globalsched.state.querydb import QueryStore
from globalsched.state.readiness import Readiness, serving_state
from globalsched.refusal import Refused
from globalsched.planning.replan_trigger import ReplanTrigger
from globalsched.planning.version_rollout import VersionRollout
from globalsched.actuators.profiling import ProfilingActuator

log = logging.getLogger("nexus.scheduler")

READY_RECHECK_S = 1.0           # a wait for readiness looks again at least this often


class ModelAdmin:
    """Every change to what must be served (uploads, loads, unloads, profiles, queries) asks ``trigger``
    for a plan."""

    def __init__(self, config: SchedulerConfig, db: ModelDatabase, nodes: Mapping[str, Node], trigger: ReplanTrigger,
                 prefix_fn=None) -> None:
        self.config = config
        self.db = db
        self.nodes = nodes
        self.prefix_fn = prefix_fn
        self.query_store = QueryStore.beside(db.sql, config.data_dir)
        self.load_failures = LoadFailures()     # models a backend could not load: bounded retries
        self.trigger = trigger
        self.rollout = VersionRollout(trigger.request)
        self.readiness = Readiness()
        self._uploading: dict[str, tuple[str, asyncio.Future]] = {}    # upload id -> its model, its store
        self.in_service = ProfilesInService(config, db, nodes, trigger)
        self.book = self.in_service.book
        self.profiling = ProfilingActuator(nodes, db, self.book, self.load_failures, self.readiness, trigger,
                                           desc_of=self.desc, present_types=self.in_service.present_types)

    def close(self) -> None:
        self.query_store.close()

    # ---- the model database ------------------------------------------------------------------------

    async def upload(self, request_iterator) -> control.UploadReply:
        """Receive an upload and store it. Once received, the store and what follows it (readiness,
        the re-plan) complete even when the client has gone, so a stored version is always planned.
        An upload with the id of one in progress waits for that one and gets its answer; with the id
        of one stored, it gets the version stored (globalsched/state/modeldb.py)."""
        began = time.monotonic()
        header, parts = await self._receive(request_iterator)
        upload_id = header.upload_id
        first = self._uploading.get(upload_id) if upload_id else None
        if first is not None and first[0] != header.name:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"upload of {header.name!r} refused: upload id "
                                                            f"{upload_id!r} is in use by an upload of {first[0]!r}")
        if first is None:
            first = (header.name, asyncio.ensure_future(self._store(header, parts, began)))
            first[1].add_done_callback(lambda task: self._uploaded(upload_id, task))
            if upload_id:
                self._uploading[upload_id] = first
        return await asyncio.shield(first[1])

    def _uploaded(self, upload_id: str, task: asyncio.Future) -> None:
        if upload_id:
            self._uploading.pop(upload_id, None)
        if not task.cancelled() and task.exception() is not None and not isinstance(task.exception(), Refused):
            log.error("storing an upload failed: %r", task.exception())

    async def _receive(self, request_iterator) -> tuple[control.UploadHeader, list[bytes]]:
        header = None
        parts: list[bytes] = []
        size = 0
        async for chunk in request_iterator:
            which = chunk.WhichOneof("part")
            if which == "header":
                if header is not None:
                    raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "upload: header sent twice")
                header = chunk.header
            elif which == "data":
                if header is None:
                    raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "upload: the header must come first")
                size += len(chunk.data)
                if size > self.db.max_upload_bytes:
                    raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  f"model file exceeds the upload limit of {self.db.max_upload_bytes} bytes")
                parts.append(chunk.data)
        if header is None:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "upload: no header")
        if header.late_requests not in control.LateRequests.values():
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"upload of {header.name!r} refused: unknown "
                                                            f"late_requests {header.late_requests}")
        return header, parts

    async def _store(self, header: control.UploadHeader, parts: list[bytes], began: float) -> control.UploadReply:
        late = LateRequests.from_pb(header.late_requests) if header.late_requests else None
        try:
            if header.upload_id:
                stored = await asyncio.to_thread(self.db.uploaded, header.upload_id, header.name)
                if stored is not None:
                    log.info("upload %s of %s sent again: answered with version %d, which it stored",
                             header.upload_id, header.name, stored.version)
                    return control.UploadReply(model=self.desc(stored.key))
            policy = policy_from_pb(header.version_policy) if header.HasField("version_policy") else None
            record = await asyncio.to_thread(
                self.db.add_model, header.name, parts, runtime=header.runtime or "onnxruntime",
                profile_json=header.profile_json, slo_ms=header.slo_ms, io_json=header.io_json,
                default_slo_ms=self.config.default_slo_ms, create_session=header.load, prefix_fn=self.prefix_fn,
                min_replicas=header.min_replicas,
                serving=ServingSettings(header.expected_rate_rps, header.batch_cap),
                warmup=warmup_from_pb(header.warmup), version=header.version, version_policy=policy,
                late_requests=late, upload_id=header.upload_id)
        except (UploadError, WarmupError, VersionError) as exc:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"upload of {header.name!r} refused: {exc}") from None
        self._forget_failures(record.key)          # a new upload starts afresh
        self.rollout.replaced(record.key)
        self.book.forget_model(record.key)         # its measurements were of the file it replaces
        if header.profile_json:
            for t, table in self.db.profiles(record.key).items():
                self.book.table_arrived((record.key, t), table, "an uploaded table")
        if header.load:
            self.readiness.started(record.key, at=began)
            self.readiness.reached([record.key], "stored")
        self.trigger.request(f"model {record.name} version {record.version} uploaded")
        return control.UploadReply(model=self.desc(record.key))

    async def download(self, sha256: str):
        """The model file in chunks, each read in a thread (a large file never blocks the loop, nor
        sits in memory whole)."""
        try:
            f = await asyncio.to_thread(self.db.open_blob, sha256)
        except KeyError as exc:
            raise Refused(grpc.StatusCode.NOT_FOUND, str(exc.args[0])) from None
        try:
            while chunk := await asyncio.to_thread(f.read, grpc_util.UPLOAD_CHUNK_BYTES):
                yield control.DownloadChunk(data=chunk)
        finally:
            f.close()

    def list_models(self) -> control.ListModelsReply:
        return control.ListModelsReply(models=list(self.descs().values()))

    async def load(self, request: control.LoadRequest) -> control.LoadReply:
        records = await asyncio.to_thread(self._load, request)
        for record in records:
            self._forget_failures(record.key)            # an explicit load tries afresh
            if record.key not in self.readiness.routed:
                self.readiness.started(record.key)
        self.trigger.request(f"model {request.name} loaded")
        return control.LoadReply()

    def _load(self, request: control.LoadRequest):
        """The database part of a load (in a thread): the session and its minimum replicas; the
        model's versions."""
        records = self.db.versions(request.name)
        if not records:
            raise Refused(grpc.StatusCode.NOT_FOUND, f"unknown model {request.name!r}")
        if request.slo_ms < 0:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"slo_ms must be positive, got {request.slo_ms}")
        if request.min_replicas:
            try:
                self.db.set_min_replicas(request.name, request.min_replicas)
            except ValueError as exc:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        self.db.set_session(request.name, request.slo_ms or records[-1].default_slo_ms)
        return records

    async def unload(self, request: control.UnloadRequest) -> control.UnloadReply:
        await asyncio.to_thread(self._unload, request.name)
        self.trigger.request(f"model {request.name} unloaded")
        return control.UnloadReply()

    def _unload(self, name: str) -> None:
        versions = self.db.versions(name)
        if not versions:
            raise Refused(grpc.StatusCode.NOT_FOUND, f"unknown model {name!r}")
        self.db.remove_session(name)
        self.readiness.forget(r.key for r in versions)

    async def add_profile(self, request: control.ProfileUpload) -> control.ProfileReply:
        key = version_key(request.model, request.version) if request.version > 0 else self.current_key(request.model)
        try:
            profile = Profile.from_json(request.profile_json)
            await asyncio.to_thread(self.db.add_profile, key, profile)
            self.profiling.unmeasurable.pop((key, profile.device_type), None)
            self.book.table_arrived((key, profile.device_type), profile, "an uploaded table")
        except ProfileError as exc:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"invalid profile: {exc}") from None
        except KeyError as exc:
            raise Refused(grpc.StatusCode.NOT_FOUND, str(exc.args[0])) from None
        self.trigger.request(f"profile of {key} for {profile.device_type} uploaded"
                             f"{' (pinned)' if profile.meta.get('pinned') else ''}; its measurement starts afresh")
        return control.ProfileReply()

    def current_key(self, name: str) -> str:
        """The version key a bare model name stands for (a query's stage, a profile by name): the
        newest version the model's policy serves (globalsched/state/modeldb.py); the name itself when unknown."""
        record = self.db.newest(name)
        return record.key if record is not None else name

    def selected_versions(self, name: str) -> tuple[int, ...]:
        """The stored versions of ``name`` that its version policy serves."""
        return self.db.served_versions(name)

    def _backends_by_type(self) -> dict[str, int]:
        present: dict[str, int] = {}
        for n in self.nodes.values():
            if n.kind == control.NODE_KIND_BACKEND:
                present[n.device_type] = present.get(n.device_type, 0) + 1
        return present

    def descs(self) -> dict[str, control.ModelDesc]:
        """Every stored version's description (:meth:`desc`) by version key, read in one pass: what the
        cluster's nodes and sessions are is read once, not once per model (a catalog of thousands of
        models is built at every plan)."""
        return drain(self._descs_steps())

    def _descs_steps(self) -> Steps[dict[str, control.ModelDesc]]:
        loaded = {s.model for s in self.db.sessions()}
        present = self._backends_by_type()
        descs = {}
        for m in self.db.models():
            descs[m.key] = self.desc(m.key, loaded=loaded, present=present)
            yield
        return descs

    def desc(self, key: str, *, loaded: AbstractSet[str] | None = None,
             present: Mapping[str, int] | None = None) -> control.ModelDesc:
        """The description of one version (by version key), as every message carries it. ``loaded``
        (the models with a session) and ``present`` (backends by device type): read here unless given."""
        record = self.db.model(key)
        name = record.name
        served = record.version in self.db.served_versions(name)
        if loaded is None:
            loaded = {s.model for s in self.db.sessions()}
        serving = self.db.serving(name)
        profiles = {t: p.capped(serving.batch_cap) for t, p in self.db.profiles(key).items()}
        desc = model_desc(record, profiles, served and name in loaded, self.db.min_replicas(name), serving)
        desc.version_policy.CopyFrom(policy_to_pb(self.db.version_policy(name)))
        present = self._backends_by_type() if present is None else present
        choices = self.in_service.profile_choices(key)
        for t in sorted(set(present) | set(profiles)):
            state, reason = self.device_type_state(key, t, t in profiles, choices.get(t))
            desc.device_types.add(device_type=t, state=state, reason=reason, backends=present.get(t, 0))
        desc.serving_state, desc.state_reason = serving_state(desc, key in self.readiness.routed,
                                                              self.readiness.cold.get(key, ""))
        desc.ready_after_s = self.readiness.ready_after_s.get(key, 0.0)
        for stage, after_s in self.readiness.stages.get(key, {}).items():
            desc.ready_stages.add(stage=stage, after_s=after_s)
        return desc

    async def wait_ready(self, request: control.WaitReadyRequest) -> control.ModelDesc:
        """The description of the version asked for once it is READY or FAILED (or STORED, or LOADING
        with no backend registered: those wait for nothing this call could see), or when ``timeout_s``
        passed; NOT_FOUND when there is no such version."""
        if request.version < 0 or request.timeout_s < 0 or not math.isfinite(request.timeout_s):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "version and timeout_s must not be negative")
        key = version_key(request.name, request.version) if request.version else self.current_key(request.name)
        if self.db.model(key) is None:
            what = f"version {request.version} of model" if request.version else "model"
            raise Refused(grpc.StatusCode.NOT_FOUND, f"no {what} {request.name!r}")
        deadline = time.monotonic() + request.timeout_s
        while True:
            desc = self.desc(key)
            left = deadline - time.monotonic()
            if desc.serving_state != control.LOADING or left <= 0 or not any(d.backends for d in desc.device_types):
                return desc         # decided, or out of time, or nothing to wait for until a backend registers
            await self.readiness.changed(min(left, READY_RECHECK_S))

    def device_type_state(self, model: str, device_type: str, profiled: bool,
                          choice: Choice | None = None) -> tuple[int, str]:
        """(control.DeviceTypeState, reason) of ``model`` on ``device_type``; ``choice``: what it plans
        with there (a table's measurement, or a prediction or its measurement where it has no table)."""
        failed = self.load_failures.reason_on(model, device_type)
        if failed:
            return control.CANNOT_LOAD, failed
        if profiled:
            return control.PROFILED, ""
        if choice is not None and choice.source == MEASURED:
            return control.PROFILED, "measured while serving (no table)"
        if (model, device_type) in self.profiling.running:
            return control.PROFILING, ""
        if choice is not None and choice.source == PREDICTED:
            predicted_from = choice.profile.meta.get("predicted_from", "?")
            why = self.profiling.unmeasurable.get((model, device_type), "")
            return control.PREDICTED, f"predicted from {predicted_from}" + (f"; {why}" if why else "")
        if (model, device_type) in self.profiling.unmeasurable:
            return control.NEEDS_PROFILE, self.profiling.unmeasurable[(model, device_type)]
        return control.NOT_PROFILED, ""

    # ---- queries -----------------------------------------------------------------------------------

    def _query_context(self):
        """Stages name models: what their newest served versions take and give, and how fast they are."""
        newest = {name: self.db.newest(name) for name in {m.name for m in self.db.models()}}
        models = {name: ModelIO(r.inputs, r.outputs) for name, r in newest.items()}
        min_latency = {}
        for name, record in newest.items():
            profiles = self.db.profiles(record.key)
            if profiles:
                min_latency[name] = min(p.latency_ms(1) for p in profiles.values())
        return models, min_latency

    async def register_query(self, text: str) -> control.QueryReply:
        try:
            q = parse_query(text)
            models, min_latency = await asyncio.to_thread(self._query_context)
            if q.name in models:
                raise QueryError(f"query {q.name!r}: a model already has that name")
            validate_query(q, models, min_latency)
        except QueryError as exc:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        await asyncio.to_thread(self.query_store.put, q.name, text)
        self.trigger.request(f"query {q.name} registered")
        return control.QueryReply(name=q.name)

    def queries(self) -> dict:
        """The stored queries that still parse, by name."""
        queries = {}
        for name, text in self.query_store.all().items():
            try:
                queries[name] = parse_query(text)
            except QueryError as exc:
                log.warning("stored query %s no longer parses: %s", name, exc)
        return queries

    # ---- the plan's readiness ---------------------------------------------------------------------

    async def apply(self, plan: ClusterPlan, epoch: int) -> None:
        """The actuator's part: the sessions ``plan`` places reached "planned", and which are cold."""
        self.readiness.reached((plan.model_of(s.model) for placement in plan.placements.values()
                                for b in placement.backends for s in b.sessions), "planned")
        self.readiness.cold = {plan.model_of(s): plan.unplaced.get(s, "") for s in plan.cold}

    # ---- load failures -----------------------------------------------------------------------------

    def _forget_failures(self, model: str) -> None:
        """``model``: a version key."""
        self.load_failures.forget(model)
        for key in [k for k in self.profiling.unmeasurable if k[0] == model]:
            del self.profiling.unmeasurable[key]

    def unloadable_on(self, model: str) -> frozenset[str]:
        """Device types on which the model cannot be served: its load attempts are spent, or it has no
        profile, the type cannot measure one and no prediction plans it there."""
        choices = self.in_service.profile_choices(model)
        return self.load_failures.exhausted_types(model) | {t for m, t in self.profiling.unmeasurable
                                                            if m == model and t not in choices}

    def load_failure_reason(self, model: str) -> str:
        """Why no backend can serve the model ("" when nothing rules a device type out)."""
        return self.load_failures.reason(model) or next(
            (why for (m, _), why in sorted(self.profiling.unmeasurable.items()) if m == model), "")

    def reread(self) -> None:
        """Forget what was read of the database before (another scheduler led meanwhile). Blocking."""
        self.db.forget_reads()
        self.in_service.reread()

    # ---- what a plan carries, and what its distribution reports back --------------------------------

    def catalog(self, plan: ClusterPlan) -> Catalog:
        """The descriptions and profiles ``plan``'s tables carry, read now (globalsched/state/catalog.py)."""
        return drain(self.catalog_steps(plan))

    def catalog_steps(self, plan: ClusterPlan) -> Steps[Catalog]:
        """:meth:`catalog` in steps, one per model and per placed backend (common/loop_slices.py: at
        2,400 models, 150-200 ms of the scheduler's loop in one piece at every plan). Run in slices, what
        changes between two steps (an upload, a node) shows only in what is read after it, as it would
        in the next plan's catalog."""
        descs = yield from self._descs_steps()
        profiles, emulated = {}, {}
        for device_type, placement in plan.placements.items():
            for b in placement.backends:
                yield
                for s in b.sessions:
                    model = plan.model_of(s.model)
                    if (model, device_type) in profiles or model not in descs:
                        continue
                    profile = self.in_service.profiles(model).get(device_type)
                    if profile is not None:
                        profiles[(model, device_type)] = profile
                    table = self.in_service.emulated_profile(model, device_type)
                    if table is not None:
                        emulated[(model, device_type)] = table
        unplanned = []
        for s in self.db.sessions():        # versions no backend could load: UNAVAILABLE with the reason
            selected = self.selected_versions(s.model)
            for key in [version_key(s.model, v) for v in selected]:
                why = self.load_failure_reason(key)
                if key not in plan.sessions and why:
                    unplanned.append(UnplannedRoute(key, s.slo_ms, why))
            newest = self.db.newest(s.model)
            if not selected and newest is not None and newest.key not in plan.sessions:
                policy = self.db.version_policy(s.model)
                unplanned.append(UnplannedRoute(
                    newest.key, s.slo_ms, f"its version_policy ({policy.describe()}) selects none of the stored "
                                          f"versions ({', '.join(str(r.version) for r in self.db.versions(s.model))})"))
        models = {planned.model for planned in plan.sessions.values()}
        unavailable = {m: why for m in sorted(models) if (why := self.load_failure_reason(m))}
        return Catalog(descs, profiles, emulated, unavailable, frozenset(self.profiling.models()), tuple(unplanned),
                       self.query_store.all())

    def load_failed(self, model: str, session: str, node_id: str, device_type: str, reason: str) -> None:
        """A backend's model table reply says it could not load ``model`` (for ``session``): the next
        plan tries again, or routes it UNAVAILABLE once the attempts are spent."""
        if reason.startswith(OUT_OF_MEMORY):
            # the device was full (a move briefly holds a session on two backends, globalsched/actuators/handover.py):
            # not the model's fault, and no load attempt of it is spent; the next plan tries again
            log.warning("%s did not fit on %s: %s", session, node_id, reason)
            self.trigger.request(f"{session} did not fit on {node_id}")
            return
        if self.db.model(model) is not None and not self.load_failures.exhausted(model, device_type):
            self.load_failures.record(model, device_type, node_id, reason)
            self.readiness.poke()
            self.trigger.request(f"{session} failed to load on {node_id}")

    def loaded(self, models: Iterable[str]) -> None:
        """Backends answered model tables that loaded (and warmed up) these version keys."""
        self.readiness.reached(models, "loaded")

    def routed(self, keys: list[str]) -> None:
        """A routing table routing these version keys reached the frontends: the version rollout retires
        the versions that routed successors replace."""
        self.rollout.routed(keys, self.selected_versions, time.monotonic())
        self.readiness.routed_now(keys)
