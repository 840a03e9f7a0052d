"""Profiles in service (docs/models.md, "Profiles in service"): per (model, device type), the table, the measured profile and the
prediction, and which one the plan uses.

The sources of one (model, device type):

* the *table*: uploaded (``nexus models upload --profile``, ``AddProfile``), measured by a profiling
  run, or an emulated GPU's datasheet; it lives in the model database;
* the *measured* profile: the backends' serving samples (backend/latency_samples.py), folded by
  :func:`common.measured_profile.update_profile` against the profile they correct;
* the *prediction*, for a present device type the model has no table for
  (common/profile_prediction.py, computed by globalsched/state/model_admin.py).

Which one plans (:meth:`ProfileBook.choose`): a *pinned* table (``"meta": {"pinned": true}`` in the
profile file, ``nexus models upload --pin-profile``) always; else the measured profile once
``update_profile`` applied one (enough clean samples: see common/measured_profile.py); else the table,
else the prediction. With the scheduler's ``--no-measured-profiles`` the measurements are kept and
shown but never plan.

Updates. Samples wait per key; every ``update_interval_s`` (``--profile-update-s``) the key's
waiting samples are folded in, against the table, or the prediction when there is none. An update
whose drift reaches the threshold returns the reason to re-plan, for the log: "profile of m on t4
drifted 23% from its table: re-plan". No ratchet under overload: contended samples only ever lower
latencies (as upper bounds below the profile in use), and a raise of latencies beyond 10% needs
three agreeing updates (``update_profile``); so an overloaded minute moves a plan by at most 10% per
update.

Emulated device types (a backend registered as ``emulated:<gpu>``) are measured without the 1.15
planning margin: an emulated device waits exactly its table's latencies, which carry the margin
already, so a second one would make every emulated table look 15% optimistic.

Reset. A measurement belongs to the profile it corrects: its *basis* is the table's fingerprint
(sha256 of its JSON), or ``predicted``. A new table (an upload, ``AddProfile``, a profiling run)
changes the basis, and the measurement starts afresh, its samples dropped: an uploaded table is
the starting point the user asked for and plans until enough new samples count. Pin it to keep it.

Prediction error. When a prediction was planning a key and a measurement replaces it (a measured
profile applied on the prediction's basis, or a table arriving), :meth:`ProfileBook.prediction_replaced`
records how far off it was (:func:`common.profile_prediction.prediction_error`), for the log, the
status and the metrics.

Persistence. Whenever the applied measured profile of a key changes, ``store.save_measured`` keeps
it with its basis, raise streak and margin (``store.delete_measured`` when it goes); a restarted
scheduler restores them (:meth:`ProfileBook.restore`), so it plans with what it trusted before, and
its sample windows refill within seconds of serving. The windows themselves are not kept: hundreds
of numbers per batch size, rewritten at every update, for a state that serving rebuilds at once.
Prediction errors are not kept either (the log has them).

Nothing here reads a clock or the database: time is passed in, and the caller hands in tables and
predictions.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Iterable, Protocol

from common.measured_profile import EstimatorConfig, LatencySample, MeasuredProfile, ProfileUpdate, update_profile
from common.profile import Profile
from common.profile_prediction import PredictionError, prediction_error

log = logging.getLogger("nexus.scheduler")

PREDICTED_BASIS = "predicted"
PINNED = "pinned"
MAX_PENDING = 4096           # samples waiting per key between updates; the oldest go beyond


TABLE, MEASURED, PREDICTED = "table", "measured", "predicted"     # which profile plans a key

Key = tuple[str, str]         # (model, device type)


def fingerprint(table: Profile) -> str:
    return table.digest


def is_pinned(table: Profile | None) -> bool:
    return bool(table is not None and table.meta.get(PINNED, False))


@dataclass(frozen=True)
class Choice:
    """The profile a key plans with and where it comes from (``source``: table, measured, predicted)."""

    profile: Profile
    source: str
    pinned: bool = False


@dataclass(frozen=True)
class ReplacedPrediction:
    error: PredictionError
    predicted: Profile
    by: str                   # what replaced it: "serving measurements", "a table (uploaded or profiled)"


@dataclass
class Entry:
    """What the book keeps of one key."""

    state: MeasuredProfile
    basis: str = ""
    pending: list[LatencySample] = field(default_factory=list)
    next_update_s: float = 0.0
    last: ProfileUpdate | None = None
    lost: int = 0             # samples backends served but could not report, or that waited too long


class MeasurementStore(Protocol):
    def save_measured(self, model: str, device_type: str, basis: str, profile: Profile, raise_streak: int,
                      margin: float) -> None: ...

    def delete_measured(self, model: str, device_type: str) -> None: ...


class ProfileBook:
    def __init__(self, update_interval_s: float = 10.0, *, enabled: bool = True,
                 store: MeasurementStore | None = None, estimator: EstimatorConfig = EstimatorConfig()) -> None:
        if not update_interval_s > 0:
            raise ValueError(f"update_interval_s must be positive, got {update_interval_s}")
        self.update_interval_s = update_interval_s
        self.enabled = enabled
        self.store = store
        self.estimator = estimator
        self.entries: dict[Key, Entry] = {}
        self.predictions: dict[Key, Profile] = {}          # the latest prediction of each key that has one
        self.replaced: dict[Key, ReplacedPrediction] = {}
        self.generation = 0        # bumps whenever the profile a key plans with may have changed

    # ---- samples -----------------------------------------------------------------------------------

    def record(self, model: str, device_type: str, samples: Iterable[LatencySample], *, emulated: bool,
               now_s: float, lost: int = 0) -> None:
        """Keep ``samples`` of ``model`` on ``device_type`` for the key's next update (each one a valid
        measurement: the caller filters). ``emulated``: the type is an emulated GPU (no margin)."""
        key = (model, device_type)
        entry = self.entries.get(key)
        if entry is None:
            config = replace(self.estimator, margin=1.0) if emulated else self.estimator
            entry = self.entries[key] = Entry(MeasuredProfile(device_type, config=config),
                                              next_update_s=now_s + self.update_interval_s)
        entry.pending.extend(samples)
        entry.lost += lost
        if len(entry.pending) > MAX_PENDING:
            entry.lost += len(entry.pending) - MAX_PENDING
            del entry.pending[:-MAX_PENDING]

    def due(self, now_s: float) -> list[Key]:
        """Keys whose samples wait and whose update time has come."""
        return sorted(k for k, e in self.entries.items() if e.pending and now_s >= e.next_update_s)

    def update(self, key: Key, table: Profile | None, prediction: Profile | None, now_s: float) -> str:
        """Fold the key's waiting samples in, against ``table`` (else ``prediction``); returns why to
        re-plan now ("" when nothing to): the measurement planning uses moved by the drift threshold.
        A key with neither profile drops its samples (nothing to correct: the model is profiled first)."""
        entry = self.entries.get(key)
        if entry is None:
            return ""
        samples, entry.pending = entry.pending, []
        entry.next_update_s = now_s + self.update_interval_s
        base, basis = (table, fingerprint(table)) if table is not None else \
            (prediction, PREDICTED_BASIS) if prediction is not None else (None, "")
        if base is None:
            return ""
        if entry.basis != basis:
            if entry.basis:
                log.info("profile of %s on %s: a new %s; its measurement starts afresh", key[0], key[1],
                         "table" if table is not None else "prediction")
            self._reset(key, entry, basis)
        before = entry.state.applied
        entry.state, upd = update_profile(entry.state, samples, base)
        entry.last = upd
        if upd.held_back:
            log.info("profile of %s on %s: %s", key[0], key[1], upd.held_back)
        if entry.state.applied is before:
            return ""
        self.generation += 1
        if self.store is not None:
            self.store.save_measured(key[0], key[1], basis, entry.state.applied, entry.state.raise_streak,
                                     entry.state.config.margin)
        if before is None and basis == PREDICTED_BASIS:
            self.prediction_replaced(key, prediction, entry.state.applied, "serving measurements")
        what = ("its table" if table is not None else "its prediction") if before is None else \
            "the measured profile in use"
        if is_pinned(table) or not self.enabled:
            log.info("profile of %s on %s: measured %.0f%% from %s (not planned with: %s)", key[0], key[1],
                     100 * upd.drift, what, "the table is pinned" if is_pinned(table) else "measured profiles are off")
            return ""
        if upd.replan:
            return f"profile of {key[0]} on {key[1]} drifted {upd.drift:.0%} from {what}: re-plan"
        log.info("profile of %s on %s: the measured profile replaces %s (drift %.0f%%, below the re-plan threshold)",
                 key[0], key[1], what, 100 * upd.drift)
        return ""

    def _reset(self, key: Key, entry: Entry, basis: str) -> None:
        had = entry.state.applied is not None
        entry.state = MeasuredProfile(entry.state.device_type, config=entry.state.config)
        entry.basis = basis
        entry.last = None
        if had:
            self.generation += 1
            if self.store is not None:
                self.store.delete_measured(*key)

    # ---- tables and predictions ----------------------------------------------------------------------

    def note_prediction(self, key: Key, prediction: Profile) -> None:
        if self.predictions.get(key) is not prediction:
            self.predictions[key] = prediction

    def table_arrived(self, key: Key, table: Profile, how: str) -> None:
        """A table for ``key`` was stored (``how``: "an upload", "a profiling run"): it replaces the
        key's prediction, whose error is recorded."""
        prediction = self.predictions.pop(key, None)
        if prediction is not None and not (key in self.replaced and self.replaced[key].predicted is prediction):
            self.prediction_replaced(key, prediction, table, how)
        self.generation += 1

    def prediction_replaced(self, key: Key, predicted: Profile | None, measured: Profile, by: str) -> None:
        if predicted is None:
            return
        error = prediction_error(predicted, measured)
        self.replaced[key] = ReplacedPrediction(error, predicted, by)
        log.warning("prediction of %s on %s (from %s) replaced by %s: off by %.0f%% on average, %.0f%% at batch %d "
                    "(%s)", key[0], key[1], predicted.meta.get("predicted_from", "?"), by, 100 * error.mean_rel,
                    100 * error.max_rel, error.worst_batch, "pessimistic" if error.bias > 0 else "optimistic")

    # ---- planning ----------------------------------------------------------------------------------

    def choose(self, model: str, device_type: str, table: Profile | None, prediction: Profile | None) -> Choice | None:
        """The profile ``model`` plans with on ``device_type`` (module docstring), None without any."""
        if table is None and prediction is None:
            return None
        entry = self.entries.get((model, device_type))
        basis = fingerprint(table) if table is not None else PREDICTED_BASIS
        measured = entry.state.applied if entry is not None and entry.basis == basis else None
        if table is not None and (is_pinned(table) or measured is None or not self.enabled):
            return Choice(table, TABLE, is_pinned(table))
        if measured is not None and self.enabled:
            return Choice(measured, MEASURED)
        return Choice(prediction, PREDICTED)

    def measurement(self, model: str, device_type: str) -> Entry | None:
        return self.entries.get((model, device_type))

    def forget_model(self, model: str) -> None:
        """A model uploaded again (new file, its tables gone): every measurement of it starts afresh."""
        for key in [k for k in self.entries if k[0] == model]:
            entry = self.entries[key]
            self._reset(key, entry, "")
            entry.pending.clear()
        for key in [k for k in self.replaced if k[0] == model]:
            del self.replaced[key]

    # ---- restart -----------------------------------------------------------------------------------

    def restore(self, rows: Iterable[tuple[str, str, str, Profile, int, float]]) -> None:
        """Measured profiles a previous run saved: (model, device type, basis, profile, raise streak,
        margin) each; they plan again while their basis is the key's table (or prediction)."""
        for model, device_type, basis, profile, streak, margin in rows:
            config = replace(self.estimator, margin=margin)
            state = MeasuredProfile(device_type, applied=profile, raise_streak=streak, config=config)
            self.entries[(model, device_type)] = Entry(state, basis)
        self.generation += 1



@dataclass(frozen=True)
class ProfileReport:
    """One key's profiles for ``nexus status`` and the metrics: the table, the measured profile (once
    applied), the prediction, which one plans, the samples held and the prediction's error."""

    model: str
    device_type: str
    in_use: str
    pinned: bool
    table: Profile | None
    measured: Profile | None
    predicted: Profile | None
    samples_by_batch: tuple[tuple[int, int], ...] = ()
    contended_samples: int = 0
    lost_samples: int = 0
    drift: float = 0.0
    held_back: str = ""
    replaced: ReplacedPrediction | None = None

    @property
    def samples(self) -> int:
        return sum(n for _, n in self.samples_by_batch)


def report(pb: ProfileBook, model: str, device_type: str, table: Profile | None, choice: Choice) -> ProfileReport:
    """What ``pb`` knows of one key whose table is ``table`` and that plans with ``choice``."""
    entry = pb.entries.get((model, device_type))
    basis = fingerprint(table) if table is not None else PREDICTED_BASIS
    current = entry is not None and entry.basis == basis
    state = entry.state if current else None
    return ProfileReport(
        model, device_type, choice.source, choice.pinned, table,
        state.applied if state is not None else None,
        pb.predictions.get((model, device_type)) if table is None else None,
        tuple((b, len(v)) for b, v in state.windows) if state is not None else (),
        state.contended_samples() if state is not None else 0,
        entry.lost if entry is not None else 0,
        entry.last.drift if current and entry.last is not None else 0.0,
        entry.last.held_back if current and entry.last is not None else "",
        pb.replaced.get((model, device_type)))
