"""Model administration: the model database behind the admin RPCs, queries, profiling, load failures.

Uploads are validated and stored in a thread (globalsched/modeldb.py); loads, unloads, profiles and
query registrations change what the plan must serve and so ask for a re-plan. A model without a
profile for a present device type is profiled on a backend of that type on demand.

Profiles in service (globalsched/profile_book.py decides which one plans): the backends' latency
samples arrive with their heartbeats (:meth:`ModelAdmin.serving_samples`) and correct the tables;
a measurement that drifted beyond the threshold asks for a re-plan, with the reason. A model with a
table on one device type but none on a present one gets a prediction there
(common/profile_prediction.py, from the profiles planning uses, measured ones included), which plans
at once; a backend of that type still profiles it in the background when it can measure (a CPU or
a GPU; an emulated GPU can only for the sample models), and until a profiling run or serving
measures it the prediction plans. Whatever replaces a prediction, its error is logged and shown. A model file
that a backend cannot load (while profiling it or from a model table) is recorded in
:class:`globalsched.load_failures.LoadFailures`: retried on another backend a bounded number of
times, then routed UNAVAILABLE with the reason. Every refusal raises :class:`Refused`.

Serving states (globalsched/readiness.py): every description carries where its version is on the
way to serving (stored, loading and what it waits for, ready and how long that took, or failed and
why); :meth:`ModelAdmin.wait_ready` answers when it is ready or cannot be.

Versions: what belongs to one version of a model (its file, profiles, load failures, description)
is keyed by its version key (common/versions.py); loads, unloads and settings are by model name.
:attr:`ModelAdmin.rollout` (globalsched/versions.py) keeps an old version served until its
successor is routed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import pathlib
import time
from typing import Iterable, Mapping

import grpc

from common import grpc_util
from common.config import SchedulerConfig
from common.measured_profile import LatencySample
from common.pb import control
from common.emulated_gpus import OUT_OF_MEMORY
from common.profile import Profile, ProfileError
from common.profile_prediction import predict_profile
from common.query_def import ModelIO, QueryError, parse_query, validate_query
from common.versions import VersionError, from_pb as policy_from_pb, split_key, to_pb as policy_to_pb, version_key
from common.warmup import WarmupError, from_pb as warmup_from_pb
from globalsched.catalog import Catalog, UnplannedRoute
from globalsched.cluster import ClusterPlan
from globalsched.convert import model_desc
from globalsched.load_failures import LoadFailures
from globalsched.membership import Node
from globalsched.modeldb import ModelDatabase, ServingSettings, UploadError
from globalsched.profile_book import MEASURED, PREDICTED, Choice, ProfileBook, ProfileReport, report
from globalsched.querydb import QueryStore
from globalsched.readiness import Readiness, serving_state
from globalsched.refusal import Refused
from globalsched.replan_trigger import ReplanTrigger
from globalsched.versions import VersionRollout

log = logging.getLogger("nexus.scheduler")

PROFILE_BUDGET_S = 20.0         # what a backend may spend measuring a model's profile
# A model is profiled at a few batch sizes, a quick estimate that its serving measurements refine
# (common/measured_profile.py): the largest batches took most of a whole profile's time (ResNet-18
# at 64x64 on 2 cores: 16 and 32 were over half of 3.7 s). The estimate is extended to the model's
# batch cap, or to the largest batch a whole profile measures (backend/profiling.py).
QUICK_BATCH_SIZES = (1, 2, 4, 8)
QUICK_EXTEND_TO_BATCH = 32
PROFILE_TIMEOUT_S = 300         # how long the scheduler waits for that profile
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
        self.slowdowns = load_slowdowns(config.colocation_report)
        self.load_failures = LoadFailures()     # models a backend could not load: bounded retries
        self.profiling: set[tuple[str, str]] = set()
        # (model, device type) -> why the type cannot measure the profile it lacks (an emulated GPU)
        self.unmeasurable: dict[tuple[str, str], str] = {}
        self.trigger = trigger
        self.rollout = VersionRollout(trigger.request)
        self.readiness = Readiness()
        self.book = ProfileBook(config.profile_update_s, enabled=config.measured_profiles, store=db)
        self.book.restore(db.measured_profiles())
        self.invalid_samples = 0            # latency samples backends sent that are no measurement
        self._invalid_logged = 0.0
        self._tables_cache: tuple[int, dict[str, dict[str, Profile]]] | None = None
        self._choices_cache: tuple[tuple, dict[str, dict[str, Choice]]] | None = None

    def close(self) -> None:
        self.query_store.close()

    # ---- the model database ------------------------------------------------------------------------

    async def upload(self, request_iterator) -> control.UploadReply:
        began = time.monotonic()
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
        try:
            policy = policy_from_pb(header.version_policy) if header.HasField("version_policy") else None
            record = await asyncio.to_thread(
                self.db.add_model, header.name, parts, runtime=header.runtime or "onnxruntime",
                profile_json=header.profile_json, slo_ms=header.slo_ms, io_json=header.io_json,
                default_slo_ms=self.config.default_slo_ms, create_session=header.load, prefix_fn=self.prefix_fn,
                min_replicas=header.min_replicas,
                serving=ServingSettings(header.expected_rate_rps, header.batch_cap),
                warmup=warmup_from_pb(header.warmup), version=header.version, version_policy=policy)
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
        return control.ListModelsReply(models=[self.desc(m.key) for m in self.db.models()])

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
            self.unmeasurable.pop((key, profile.device_type), None)
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
        newest version the model's policy serves (globalsched/modeldb.py); the name itself when unknown."""
        record = self.db.newest(name)
        return record.key if record is not None else name

    def selected_versions(self, name: str) -> tuple[int, ...]:
        """The stored versions of ``name`` that its version policy serves."""
        return self.db.served_versions(name)

    def desc(self, key: str) -> control.ModelDesc:
        """The description of one version (by version key), as every message carries it."""
        record = self.db.model(key)
        name = record.name
        served = record.version in self.db.served_versions(name)
        loaded = served and any(s.model == name for s in self.db.sessions())
        serving = self.db.serving(name)
        profiles = {t: p.capped(serving.batch_cap) for t, p in self.db.profiles(key).items()}
        desc = model_desc(record, profiles, loaded, self.db.min_replicas(name), serving)
        desc.version_policy.CopyFrom(policy_to_pb(self.db.version_policy(name)))
        present: dict[str, int] = {}
        for n in self.nodes.values():
            if n.kind == control.NODE_KIND_BACKEND:
                present[n.device_type] = present.get(n.device_type, 0) + 1
        choices = self.profile_choices(key)
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
        if (model, device_type) in self.profiling:
            return control.PROFILING, ""
        if choice is not None and choice.source == PREDICTED:
            predicted_from = choice.profile.meta.get("predicted_from", "?")
            why = self.unmeasurable.get((model, device_type), "")
            return control.PREDICTED, f"predicted from {predicted_from}" + (f"; {why}" if why else "")
        if (model, device_type) in self.unmeasurable:
            return control.NEEDS_PROFILE, self.unmeasurable[(model, device_type)]
        return control.NOT_PROFILED, ""

    # ---- profiles in service -----------------------------------------------------------------------

    def tables(self) -> dict[str, dict[str, Profile]]:
        """Every stored version's tables (by version key) by device type, uncapped (read once per change
        of a table)."""
        cached = self._tables_cache
        if cached is None or cached[0] != self.db.profiles_version:
            cached = self._tables_cache = (self.db.profiles_version,
                                           {m.key: self.db.profiles(m.key) for m in self.db.models()})
        return cached[1]

    def present_types(self) -> tuple[str, ...]:
        return tuple(sorted({n.device_type for n in self.nodes.values() if n.kind == control.NODE_KIND_BACKEND}))

    def _choices(self) -> dict[str, dict[str, Choice]]:
        """Every model's :class:`Choice` by device type, uncapped: its tables' (or their measurements'),
        and predictions on the present device types it has no table for."""
        tables = self.tables()
        present = self.present_types()
        key = (self.db.profiles_version, self.book.generation, present)
        if self._choices_cache is not None and self._choices_cache[0] == key:
            return self._choices_cache[1]
        choices: dict[str, dict[str, Choice]] = {}
        real: dict[tuple[str, str], Profile] = {}
        for model, by_type in tables.items():
            mine = choices[model] = {}
            for t, table in by_type.items():
                mine[t] = self.book.choose(model, t, table, None)
                real[(model, t)] = mine[t].profile
        for model, by_type in tables.items():
            for t in present:
                if t in by_type or not by_type:
                    continue
                predicted = predict_profile(model, t, real)
                if predicted is not None:
                    self.book.note_prediction((model, t), predicted.profile)
                    choices[model][t] = self.book.choose(model, t, None, predicted.profile)
        self._choices_cache = (key, choices)
        return choices

    def profile_choices(self, model: str) -> dict[str, Choice]:
        """What ``model`` plans with on each device type (uncapped), and where it comes from."""
        return self._choices().get(model, {})

    def _served_form(self, model: str, profile: Profile, measured: bool) -> Profile:
        """``profile`` of a version (``model``: its version key) up to the model's batch cap, inflated by its co-location slowdown unless it was
        measured while serving (its samples include whatever shared the device)."""
        profile = profile.capped(self.db.serving(split_key(model)[0]).batch_cap)
        if measured:
            return profile
        record = self.db.model(model)
        factor = self.slowdowns.get(model) or self.slowdowns.get(record.sha256 if record else "")
        if factor and factor > 1.0:
            from profiler.slowdown import apply_colocation_slowdown
            profile = apply_colocation_slowdown(profile, factor)
        return profile

    def profiles(self, model: str) -> dict[str, Profile]:
        """The profiles the plan uses for the model by device type (globalsched/profile_book.py: a
        pinned table, a measured profile, the table or a prediction), up to its batch cap, inflated by
        its co-location slowdown unless measured."""
        return {t: self._served_form(model, c.profile, c.source == MEASURED)
                for t, c in self.profile_choices(model).items()}

    def profile_reports(self) -> list[ProfileReport]:
        """Every stored model's profiles per device type it has one for (status and metrics)."""
        tables = self.tables()
        out = []
        for model, choices in sorted(self._choices().items()):
            for t, choice in sorted(choices.items()):
                out.append(report(self.book, model, t, tables.get(model, {}).get(t), choice))
        return out

    def emulated_profile(self, model: str, device_type: str) -> Profile | None:
        """What an emulated device of ``device_type`` executes for ``model``: its table, else its
        prediction, never a measured profile (served as the plan's profiles are otherwise)."""
        table = self.tables().get(model, {}).get(device_type)
        base = table if table is not None else self.book.predictions.get((model, device_type))
        return self._served_form(model, base, False) if base is not None else None

    def serving_samples(self, node: Node, reports: Iterable[control.BatchSamples], now_s: float) -> None:
        """A backend's heartbeat samples (backend/latency_samples.py): kept per model and its device
        type; the keys whose update is due fold them in, and a drift asks for a re-plan. Samples of
        unknown models are ignored; samples that are no measurement (batch 0, a latency not positive
        and finite) are counted and logged, and change nothing."""
        tables = self.tables()
        emulated = node.device.startswith("emulated:")
        invalid = 0
        for batches in reports:
            if batches.model not in tables:
                continue
            good = [LatencySample(s.batch, s.latency_ms, s.contended) for s in batches.samples
                    if s.batch >= 1 and math.isfinite(s.latency_ms) and s.latency_ms > 0]
            invalid += len(batches.samples) - len(good)
            self.book.record(batches.model, node.device_type, good, emulated=emulated, now_s=now_s,
                             lost=batches.lost)
        if invalid:
            self.invalid_samples += invalid
            if time.monotonic() - self._invalid_logged > 60:
                self._invalid_logged = time.monotonic()
                log.warning("%s reported %d latency samples that are no measurement (ignored; %d so far)",
                            node.node_id, invalid, self.invalid_samples)
        due = self.book.due(now_s)
        if not due:
            return
        self._choices()                     # the predictions of the types present now
        for key in due:
            table = tables.get(key[0], {}).get(key[1])
            why = self.book.update(key, table, None if table is not None else self.book.predictions.get(key), now_s)
            if why:
                self.trigger.request(why)

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

    # ---- profiling on demand -----------------------------------------------------------------------

    async def apply(self, plan: ClusterPlan, epoch: int) -> None:
        """The actuator's part: profile every model the plan has no profile for on a present device type,
        and, in the background, every served model that plans with a prediction on a present type."""
        for model, device_type in plan.need_profile.items():
            self.start_profiling(model, device_type)
        self.readiness.reached((plan.model_of(s.model) for placement in plan.placements.values()
                                for b in placement.backends for s in b.sessions), "planned")
        self.readiness.cold = {plan.model_of(s): plan.unplaced.get(s, "") for s in plan.cold}
        served = {plan.model_of(s) for s in plan.sessions}
        present = set(self.present_types())
        for model, device_type in sorted(self.book.predictions):
            if model in served and device_type in present:
                self.start_profiling(model, device_type)

    def profiling_models(self) -> set[str]:
        return {m for m, _ in self.profiling}

    def start_profiling(self, model: str, device_type: str) -> None:
        key = (model, device_type)
        if key in self.profiling or key in self.unmeasurable or self.load_failures.exhausted(model, device_type):
            return
        tried = self.load_failures.tried(model, device_type)
        candidates = [n for n in self.nodes.values()
                      if n.kind == control.NODE_KIND_BACKEND and n.device_type == device_type]
        node = next((n for n in candidates if n.node_id not in tried), candidates[0] if candidates else None)
        if node is None:
            return
        self.profiling.add(key)
        asyncio.create_task(self._profile(node, model, key))

    async def _profile(self, node: Node, model: str, key: tuple[str, str]) -> None:
        try:
            desc = self.desc(model)
            request = control.ProfileRequest(model=desc, budget_s=PROFILE_BUDGET_S, batch_sizes=QUICK_BATCH_SIZES,
                                             extend_to_batch=desc.batch_cap or QUICK_EXTEND_TO_BATCH)
            reply = await node.stub.ProfileModel(request, timeout=PROFILE_TIMEOUT_S)
            if reply.unmeasurable:          # not the model's fault, and no other backend of the type can either
                log.warning("%s has no profile for %s, which cannot measure one: %s", model, node.device_type,
                            reply.error)
                self.unmeasurable[key] = reply.error
                return
            if reply.error:
                log.warning("profiling %s on %s failed: %s", model, node.node_id, reply.error)
                self.load_failures.record(model, node.device_type, node.node_id, reply.error)
                return
            profile = Profile.from_json(reply.profile_json)
            await asyncio.to_thread(self.db.add_profile, model, profile)
            self.book.table_arrived(key, profile, "a profiling run")
            self.readiness.reached([model], "profiled")
            extended = profile.meta.get("extrapolated_from_batch")
            log.info("profiled %s on %s (max batch %d%s)", model, profile.device_type, profile.max_batch,
                     f"; measured to {extended}, beyond that an estimate that serving refines" if extended else "")
            from profiler.tables import load_warning

            if busy := load_warning(profile):
                log.warning("profiling %s on %s: %s", model, node.node_id, busy)
        except (grpc.aio.AioRpcError, ProfileError, KeyError) as exc:
            log.warning("profiling %s on %s failed: %s", model, node.node_id, exc)
            self.load_failures.record(model, node.device_type, node.node_id, str(exc))
        finally:
            self.profiling.discard(key)
            self.readiness.poke()
            self.trigger.request(f"profile of {model} done")

    # ---- load failures -----------------------------------------------------------------------------

    def _forget_failures(self, model: str) -> None:
        """``model``: a version key."""
        self.load_failures.forget(model)
        for key in [k for k in self.unmeasurable if k[0] == model]:
            del self.unmeasurable[key]

    def unloadable_on(self, model: str) -> frozenset[str]:
        """Device types on which the model cannot be served: its load attempts are spent, or it has no
        profile, the type cannot measure one and no prediction plans it there."""
        choices = self.profile_choices(model)
        return self.load_failures.exhausted_types(model) | {t for m, t in self.unmeasurable
                                                            if m == model and t not in choices}

    def load_failure_reason(self, model: str) -> str:
        """Why no backend can serve the model ("" when nothing rules a device type out)."""
        return self.load_failures.reason(model) or next(
            (why for (m, _), why in sorted(self.unmeasurable.items()) if m == model), "")

    def reread(self) -> None:
        """Forget what was read of the database before (another scheduler led meanwhile and wrote to
        it): the measured profiles in service are restored again and every cached table goes. Blocking."""
        self.book.restore(self.db.measured_profiles())
        self.db.profiles_version += 1       # what every cache of tables and choices is keyed by

    # ---- what a plan carries, and what its distribution reports back --------------------------------

    def catalog(self, plan: ClusterPlan) -> Catalog:
        """The descriptions and profiles ``plan``'s tables carry, read now (globalsched/catalog.py)."""
        descs = {m.key: self.desc(m.key) for m in self.db.models()}
        profiles, emulated = {}, {}
        for device_type, placement in plan.placements.items():
            for b in placement.backends:
                for s in b.sessions:
                    model = plan.model_of(s.model)
                    if (model, device_type) in profiles or model not in descs:
                        continue
                    profile = self.profiles(model).get(device_type)
                    if profile is not None:
                        profiles[(model, device_type)] = profile
                    table = self.emulated_profile(model, device_type)
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
        return Catalog(descs, profiles, emulated, unavailable, frozenset(self.profiling_models()), tuple(unplanned),
                       self.query_store.all())

    def load_failed(self, model: str, session: str, node_id: str, device_type: str, reason: str) -> None:
        """A backend's model table reply says it could not load ``model`` (for ``session``): the next
        plan tries again, or routes it UNAVAILABLE once the attempts are spent."""
        if reason.startswith(OUT_OF_MEMORY):
            # the device was full (a move briefly holds a session on two backends, globalsched/handover.py):
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


def load_slowdowns(path: str) -> dict[str, float]:
    """Slowdown factors by model name and sha256 from a multi-tenant report; {} without one."""
    if not path:
        return {}
    from profiler.slowdown import slowdowns_from_report

    try:
        report = json.loads(pathlib.Path(path).read_text())
        return slowdowns_from_report(report)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"nexus scheduler: error: --colocation-report {path}: {exc}") from None
