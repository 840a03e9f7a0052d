"""Profiles across device types: predict a model's profile where it has none, and score predictions.

A model measured on device type S but not on T gets a predicted profile on T from the models
measured on both (as Bellamy reuses performance models across contexts): for each batch b,
``l_T(b) = l_S(b) * r(b)`` where r(b) is the median, over those models, of their own ratio
``l_T(b') / l_S(b')`` at ``b' = min(b, the largest batch both of their profiles have)`` (the
median: one odd model does not move it). Memory is scaled by the median ratio of the models'
memory at batch 1 where both are known (positive), else copied. The prediction then gets the same
non-decreasing repair as a measured table (:meth:`Profile.monotone_from_measurements`).

Among the device types the model is measured on, the one sharing the most measured models with T
is used (ties: its name). A prediction is marked: ``profile.meta["predicted"]`` is true, with
``predicted_from`` (S) and ``basis`` (the models used), which survive JSON, so a scheduler, a
status page or a later measurement can tell it from a measured table (:func:`is_predicted`). It is
used until a measurement replaces it; :func:`prediction_error` then says how far off it was.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Mapping

from common.profile import BatchLatency, Profile

PREDICTED = "predicted"


@dataclass(frozen=True)
class PredictedProfile:
    """A predicted profile and how it was made: ``latency_ratio[b-1]`` = r(b), ``memory_ratio``."""

    model: str
    device_type: str
    profile: Profile
    source_device_type: str
    basis: tuple[str, ...]
    latency_ratio: tuple[float, ...]
    memory_ratio: float


@dataclass(frozen=True)
class PredictionError:
    """How far a prediction was from the measurement that replaced it, over their common batches:
    relative errors |predicted - measured| / measured of l(b); ``bias`` is the mean signed one
    (positive: the prediction was pessimistic)."""

    batches: int
    mean_rel: float
    max_rel: float
    worst_batch: int
    bias: float


def is_predicted(profile: Profile) -> bool:
    return bool(profile.meta.get(PREDICTED, False))


def predict_profile(model: str, device_type: str,
                    measured: Mapping[tuple[str, str], Profile]) -> PredictedProfile | None:
    """The prediction of ``model`` on ``device_type`` from ``measured`` ((model, device type) ->
    measured profile; predicted ones are ignored as sources and as basis); None when the model is
    measured nowhere or no other model is measured both on one of its device types and on the
    target. ValueError when (model, device_type) is measured already: nothing to predict."""
    real = {k: p for k, p in measured.items() if not is_predicted(p)}
    if (model, device_type) in real:
        raise ValueError(f"model {model!r} is already measured on {device_type!r}")
    sources = sorted(t for (m, t) in real if m == model and t != device_type)
    best: tuple[int, str, list[str]] | None = None
    for s in sources:
        basis = sorted(m for (m, t) in real if t == s and m != model and (m, device_type) in real)
        if basis and (best is None or len(basis) > best[0]):
            best = (len(basis), s, basis)
    if best is None:
        return None
    _, source, basis = best
    base = real[(model, source)]
    ratios = []
    for b in range(1, base.max_batch + 1):
        per_model = []
        for m in basis:
            ps, pt = real[(m, source)], real[(m, device_type)]
            common = min(b, ps.max_batch, pt.max_batch)
            per_model.append(pt.latency_ms(common) / ps.latency_ms(common))
        ratios.append(statistics.median(per_model))
    mem_ratios = [real[(m, device_type)].memory_mb(1) / real[(m, source)].memory_mb(1) for m in basis
                  if real[(m, source)].memory_mb(1) > 0 and real[(m, device_type)].memory_mb(1) > 0]
    mem_ratio = statistics.median(mem_ratios) if mem_ratios else 1.0
    rows = [BatchLatency(r.batch, r.latency_ms * ratios[r.batch - 1], r.memory_mb * mem_ratio) for r in base.rows]
    meta = {PREDICTED: True, "predicted_from": source, "basis": list(basis)}
    profile = Profile.monotone_from_measurements(rows, device_type, meta)
    return PredictedProfile(model, device_type, profile, source, tuple(basis), tuple(ratios), mem_ratio)


def prediction_error(predicted: Profile, measured: Profile) -> PredictionError:
    """Relative error of ``predicted`` against ``measured`` over the batches both list."""
    n = min(predicted.max_batch, measured.max_batch)
    errors = [(predicted.latency_ms(b) - measured.latency_ms(b)) / measured.latency_ms(b) for b in range(1, n + 1)]
    worst = max(range(n), key=lambda i: abs(errors[i]))
    return PredictionError(n, statistics.fmean(abs(e) for e in errors), abs(errors[worst]), worst + 1,
                           statistics.fmean(errors))
