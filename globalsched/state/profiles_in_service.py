"""Profiles in service (docs/models.md, "Profiles in service"): what each stored model version plans
with on each device type, and the serving measurements that correct it.

globalsched/state/profile_book.py decides which profile plans: a pinned table, a measured profile,
the table, or a prediction (common/profile_prediction.py) where a model has no table on a present
device type. This room reads the tables once per change, caches the choices, serves them up to the
model's batch cap and inflated by its co-location slowdown (a multi-tenant report, ``--colocation-report``),
and folds the backends' heartbeat samples in; a measurement that drifted beyond the threshold asks
for a re-plan, with the reason.
"""

from __future__ import annotations

import json
import logging
import math
import pathlib
import time
from typing import Iterable, Mapping

from common.config import SchedulerConfig
from common.measured_profile import LatencySample
from common.pb import control
from common.profile import Profile
from common.profile_prediction import predict_profile
from common.version_policy import split_key
from globalsched.planning.replan_trigger import ReplanTrigger
from globalsched.state.membership import Node
from globalsched.state.modeldb import ModelDatabase
from globalsched.state.profile_book import MEASURED, Choice, ProfileBook, ProfileReport, report
from profiler.slowdown import apply_colocation_slowdown, slowdowns_from_report

log = logging.getLogger("nexus.scheduler")


class ProfilesInService:
    """The profiles each version plans with, per device type, kept current by serving measurements."""

    def __init__(self, config: SchedulerConfig, db: ModelDatabase, nodes: Mapping[str, Node],
                 trigger: ReplanTrigger) -> None:
        self.db = db
        self.nodes = nodes
        self.trigger = trigger
        self.slowdowns = load_slowdowns(config.colocation_report)
        self.book = ProfileBook(config.profile_update_s, enabled=config.measured_profiles, store=db)
        self.book.restore(db.measured_profiles())
        self.invalid_samples = 0            # latency samples backends sent that are no measurement
        self._invalid_logged = 0.0
        self._tables_cache: tuple[int, dict[str, dict[str, Profile]]] | None = None
        self._parsed: dict[str, Profile] = {}          # stored table text -> its object (tables())
        self._present: tuple[int, tuple[str, ...]] | None = None     # (node table generation, types)
        self._choices_cache: tuple[tuple, dict[str, dict[str, Choice]]] | None = None
        self._tabled: tuple[tuple, dict[str, dict[str, Choice]]] | None = None     # the tables' choices

    def tables(self) -> dict[str, dict[str, Profile]]:
        """Every stored version's tables (by version key) by device type, uncapped (read once per change
        of a table)."""
        cached = self._tables_cache
        if cached is None or cached[0] != self.db.profiles_version:
            # A table whose text did not change keeps its object (and the digest it computed once).
            before, parsed = self._parsed, {}
            tables: dict[str, dict[str, Profile]] = {}
            for key, by_type in self.db.profile_texts().items():
                mine = tables[key] = {}
                for device_type, text in by_type.items():
                    profile = before.get(text)
                    mine[device_type] = parsed[text] = profile if profile is not None else Profile.from_json(text)
            self._parsed = parsed
            cached = self._tables_cache = (self.db.profiles_version, tables)
        return cached[1]

    def present_types(self) -> tuple[str, ...]:
        """The device types of the backends registered now (once per change of a node table that
        counts its changes, globalsched/state/membership.py's ``NodeTable``)."""
        generation = getattr(self.nodes, "generation", None)
        if generation is not None and self._present is not None and self._present[0] == generation:
            return self._present[1]
        types = tuple(sorted({n.device_type for n in self.nodes.values() if n.kind == control.NODE_KIND_BACKEND}))
        self._present = (generation, types) if generation is not None else None
        return types

    def choices(self) -> dict[str, dict[str, Choice]]:
        """Every model's :class:`Choice` by device type, uncapped: its tables' (or their measurements'),
        and predictions on the present device types it has no table for. The tables' choices do not
        depend on the types present: a fleet's first backend of a type (a new set of types) recomputes
        only the predictions (at 2,400 models the whole took 110 ms of the loop while a fleet
        registered)."""
        tables = self.tables()
        present = self.present_types()
        generations = (self.db.profiles_version, self.book.generation)
        key = (*generations, present)
        if self._choices_cache is not None and self._choices_cache[0] == key:
            return self._choices_cache[1]
        if self._tabled is None or self._tabled[0] != generations:
            tabled = {model: {t: self.book.choose(model, t, table, None) for t, table in by_type.items()}
                      for model, by_type in tables.items()}
            self._tabled = (generations, tabled)
        tabled = self._tabled[1]
        real = {(model, t): c.profile for model, by_type in tabled.items() for t, c in by_type.items()}
        choices: dict[str, dict[str, Choice]] = {}
        for model, by_type in tables.items():
            mine = choices[model] = dict(tabled[model])
            for t in present:
                if t in by_type or not by_type:
                    continue
                predicted = predict_profile(model, t, real)
                if predicted is not None:
                    self.book.note_prediction((model, t), predicted.profile)
                    mine[t] = self.book.choose(model, t, None, predicted.profile)
        self._choices_cache = (key, choices)
        return choices

    def profile_choices(self, model: str) -> dict[str, Choice]:
        """What ``model`` plans with on each device type (uncapped), and where it comes from."""
        return self.choices().get(model, {})

    def served_form(self, model: str, profile: Profile, measured: bool) -> Profile:
        """``profile`` of a version (``model``: its version key) up to the model's batch cap, inflated by its co-location slowdown unless it was
        measured while serving (its samples include whatever shared the device)."""
        profile = profile.capped(self.db.serving(split_key(model)[0]).batch_cap)
        if measured:
            return profile
        record = self.db.model(model)
        factor = self.slowdowns.get(model) or self.slowdowns.get(record.sha256 if record else "")
        if factor and factor > 1.0:
            profile = apply_colocation_slowdown(profile, factor)
        return profile

    def profiles(self, model: str) -> dict[str, Profile]:
        """The profiles the plan uses for the model by device type (globalsched/state/profile_book.py: a
        pinned table, a measured profile, the table or a prediction), up to its batch cap, inflated by
        its co-location slowdown unless measured."""
        return {t: self.served_form(model, c.profile, c.source == MEASURED)
                for t, c in self.profile_choices(model).items()}

    def profile_reports(self) -> list[ProfileReport]:
        """Every stored model's profiles per device type it has one for (status and metrics)."""
        tables = self.tables()
        out = []
        for model, choices in sorted(self.choices().items()):
            for t, choice in sorted(choices.items()):
                out.append(report(self.book, model, t, tables.get(model, {}).get(t), choice))
        return out

    def emulated_profile(self, model: str, device_type: str) -> Profile | None:
        """What an emulated device of ``device_type`` executes for ``model``: its table, else its
        prediction, never a measured profile (served as the plan's profiles are otherwise)."""
        table = self.tables().get(model, {}).get(device_type)
        base = table if table is not None else self.book.predictions.get((model, device_type))
        return self.served_form(model, base, False) if base is not None else None

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
        self.choices()                     # the predictions of the types present now
        for key in due:
            table = tables.get(key[0], {}).get(key[1])
            why = self.book.update(key, table, None if table is not None else self.book.predictions.get(key), now_s)
            if why:
                self.trigger.request(why)

    def reread(self) -> None:
        """Forget what was read of the database before (another scheduler led meanwhile and wrote to
        it): the measured profiles in service are restored again and every cached table goes. Blocking."""
        self.book.restore(self.db.measured_profiles())
        self.db.profiles_version += 1       # what every cache of tables and choices is keyed by


def load_slowdowns(path: str) -> dict[str, float]:
    """Slowdown factors by model name and sha256 from a multi-tenant report; {} without one."""
    if not path:
        return {}
    try:
        report = json.loads(pathlib.Path(path).read_text())
        return slowdowns_from_report(report)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"nexus scheduler: error: --colocation-report {path}: {exc}") from None
