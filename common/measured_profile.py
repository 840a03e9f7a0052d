"""Measured profiles: what a model's batches really take on a device type, from serving itself.

Backends report the (batch, latency) of every batch they serve; the scheduler folds them, per model
and device type, into a :class:`MeasuredProfile` (pure: :meth:`MeasuredProfile.add` returns a new
value) and asks :func:`update_profile` which table to plan with. Issue 18, item 1.

The estimator.
* Per batch size it keeps the most recent ``window`` samples. Samples flagged ``contended`` (taken
  while the device was overloaded: a queue beyond one planned batch, drops; or while its CPU was
  contended: steal, other busy processes) are counted, and reported, but never enter a figure.
* A batch size *counts* once it holds ``min_samples`` samples. Its planning figure is docs/planning.md's
  conservative figure with robust estimates: ``(median + 1.4826 * MAD) * 1.15`` (Nexus's mean + std
  times 1.15; the median and the scaled median absolute deviation estimate the mean and standard
  deviation of the bulk of the samples, so a few outliers - a GC pause, a page fault - move neither;
  no p99, which is what a busy machine spoils first).
* Batch sizes not counted come from a Theil-Sen fit l(b) = a + c*b over the counted sizes' medians
  (the median of pairwise slopes: robust too), scaled by the counted sizes' median ratio of figure to
  median, and clamped between the figures of the counted sizes around them (beyond the largest, at
  least its figure); the table is then made non-decreasing.
* *Enough samples*: ``min_batch_sizes`` counted sizes (one when the table has only batch 1). Until
  then the uploaded or profiled table stays in use.
* *Upper bounds from contended samples.* Contention only ever slows a batch down, so a contended
  sample is an upper bound of what the batch takes uncontended. A batch size without enough clean
  samples, but with ``min_samples`` clean and contended ones together, counts as a *bound*: its
  figure is the samples' 84th percentile (the median + 1 std of normal samples) times the margin, a
  statistic that can only grow when samples are slowed, so it is at least what the clean samples
  would give. A bound counts only where it lies below the profile in use (it shows that profile
  pessimistic; above it, it tells nothing), and while bounds count, every batch size not counted from
  clean samples is kept at most at the profile in use: bounds lower latencies, never raise them. Without this a
  pessimistic table kept itself: it planned too small a batch, every batch then left a queue behind
  and was flagged contended, and the clean samples that would have corrected it never came
  (benchmarks/profile_vs_serving.md, "Adoption under load").

Drift and re-planning. The drift is the largest relative difference, over counted batch sizes,
between the measured figure and the table in use. Once the measurement is trusted it replaces the
uploaded table (the first time whatever the drift); later it replaces the table in use only when
the drift reaches ``drift_threshold``, so that noise does not re-plan. ``ProfileUpdate.replan`` says
when the change is large enough to re-plan now.

No ratchet under overload. Contended samples never count. Beyond that, a measurement that *raises*
latencies (cuts capacity, so the plan needs more devices) by more than ``max_raise_per_update`` of
the table in use is applied only up to that step, unless ``corroborating_updates`` consecutive
updates asked for such a raise: one overloaded window whose contention went unflagged moves the
plan by at most 10%. A measurement lowering latencies is applied at once: it comes from clean
samples, and an optimistic table shows itself as load that the devices do not keep up with, which
the next samples then show.
"""

from __future__ import annotations

import enum
import math
import statistics
from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping

from common.profile import LATENCY_MARGIN, BatchLatency, Profile

MAD_TO_STD = 1.4826  # MAD * this estimates the standard deviation of normal samples
P84 = 0.8413         # the quantile at the median + 1 std of normal samples


class ProfileSource(str, enum.Enum):
    TABLE = "table"          # the uploaded or profiled table
    MEASURED = "measured"    # measured while serving


@dataclass(frozen=True)
class LatencySample:
    """One batch served: its size (rows), its execution time, and whether the device was overloaded
    or its CPU contended meanwhile (see the module docstring)."""

    batch: int
    latency_ms: float
    contended: bool = False


@dataclass(frozen=True)
class EstimatorConfig:
    """The estimator's knobs (module docstring): samples kept per batch size, samples that make a
    size count, counted sizes that make the profile trusted, the drift that replaces the table in
    use, the largest latency raise one update applies, the updates that corroborate a larger one,
    and the planning margin (Nexus's 1.15)."""

    window: int = 256
    min_samples: int = 20
    min_batch_sizes: int = 2
    drift_threshold: float = 0.15
    max_raise_per_update: float = 0.10
    corroborating_updates: int = 3
    margin: float = LATENCY_MARGIN

    def __post_init__(self) -> None:
        if self.window < self.min_samples or self.min_samples < 3 or self.min_batch_sizes < 1:
            raise ValueError("need window >= min_samples >= 3 and min_batch_sizes >= 1")
        if not (self.drift_threshold > 0 and self.max_raise_per_update > 0 and self.corroborating_updates >= 1):
            raise ValueError("drift_threshold and max_raise_per_update must be positive, corroborating_updates >= 1")


@dataclass(frozen=True)
class BatchFigure:
    batch: int
    samples: int
    median_ms: float
    std_ms: float      # 1.4826 * MAD
    planning_ms: float


@dataclass(frozen=True)
class MeasuredProfile:
    """Recent clean samples per batch size, contended samples counted, and what planning uses."""

    device_type: str = ""
    windows: tuple[tuple[int, tuple[float, ...]], ...] = ()
    contended: tuple[tuple[int, int], ...] = ()
    bound_windows: tuple[tuple[int, tuple[float, ...]], ...] = ()   # recent contended latencies per size
    applied: Profile | None = None         # the measured table in use; None: the uploaded table
    raise_streak: int = 0                  # consecutive updates asking for a raise beyond one step
    config: EstimatorConfig = field(default_factory=EstimatorConfig)

    def add(self, samples: Iterable[LatencySample]) -> "MeasuredProfile":
        """A copy with ``samples`` folded in; ValueError on a sample that is no measurement."""
        windows = {b: list(v) for b, v in self.windows}
        contended = dict(self.contended)
        bounds = {b: list(v) for b, v in self.bound_windows}
        for s in samples:
            if not (isinstance(s.batch, int) and s.batch >= 1 and math.isfinite(s.latency_ms) and s.latency_ms > 0):
                raise ValueError(f"sample {s!r}: batch must be a positive integer and latency a positive number")
            if s.contended:
                contended[s.batch] = contended.get(s.batch, 0) + 1
            w = (bounds if s.contended else windows).setdefault(s.batch, [])
            w.append(s.latency_ms)
            del w[:-self.config.window]
        return replace(self, windows=tuple(sorted((b, tuple(v)) for b, v in windows.items())),
                       contended=tuple(sorted(contended.items())),
                       bound_windows=tuple(sorted((b, tuple(v)) for b, v in bounds.items())))

    def figures(self) -> dict[int, BatchFigure]:
        """The counted batch sizes' figures (module docstring)."""
        out = {}
        for b, values in self.windows:
            if len(values) < self.config.min_samples:
                continue
            med = statistics.median(values)
            std = MAD_TO_STD * statistics.median(abs(v - med) for v in values)
            out[b] = BatchFigure(b, len(values), med, std, (med + std) * self.config.margin)
        return out

    def bound_figures(self, ceiling: Profile) -> dict[int, BatchFigure]:
        """Upper bounds (module docstring) at the batch sizes of ``ceiling`` (the profile in use) that
        have no clean figure, where they lie below ``ceiling``; ``std_ms`` is the 84th percentile less
        the median."""
        clean = dict(self.windows)
        out = {}
        for b, contended in self.bound_windows:
            mine = clean.get(b, ())
            values = sorted(mine + contended)
            if b > ceiling.max_batch or len(mine) >= self.config.min_samples or len(values) < self.config.min_samples:
                continue
            med = statistics.median(values)
            p84 = values[min(len(values) - 1, math.ceil(P84 * len(values)) - 1)]
            planning = p84 * self.config.margin
            if planning < ceiling.latency_ms(b):
                out[b] = BatchFigure(b, len(values), med, p84 - med, planning)
        return out

    def counted(self, ceiling: Profile | None = None) -> dict[int, BatchFigure]:
        """The clean figures, and with ``ceiling`` the upper bounds below it where no clean one is."""
        return {**(self.bound_figures(ceiling) if ceiling is not None else {}), **self.figures()}

    def contended_samples(self) -> int:
        return sum(n for _, n in self.contended)

    def trusted(self, max_batch: int, ceiling: Profile | None = None) -> bool:
        """Enough samples to plan with, for a table of batches 1..``max_batch`` (bounds below
        ``ceiling`` count)."""
        counted = [b for b in self.counted(ceiling) if b <= max_batch]
        return len(counted) >= min(self.config.min_batch_sizes, max_batch)


def theil_sen(points: Iterable[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of the Theil-Sen line through ``points`` (slope 0 with a single x)."""
    pts = list(points)
    slopes = [(y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(pts) for x2, y2 in pts[i + 1:] if x2 != x1]
    slope = statistics.median(slopes) if slopes else 0.0
    return statistics.median(y - slope * x for x, y in pts), slope


def measured_table(measured: MeasuredProfile, table: Profile, ceiling: Profile | None = None) -> Profile | None:
    """The measured profile over the table's batch sizes (memory from the table), None until
    trusted; meta ``source: measured`` with the counted sizes, those of them that are bounds, and
    the contended samples. With ``ceiling`` (the profile in use), upper bounds below it count, and
    every size not counted from clean samples stays at most at it (module docstring)."""
    if not measured.trusted(table.max_batch, ceiling):
        return None
    clean = measured.figures()
    figs = {b: f for b, f in measured.counted(ceiling).items() if b <= table.max_batch}
    counted = sorted(figs)
    intercept, slope = theil_sen((b, figs[b].median_ms) for b in counted)
    scale = statistics.median(figs[b].planning_ms / figs[b].median_ms for b in counted)
    values = []
    for b in range(1, table.max_batch + 1):
        if b in figs:
            values.append(figs[b].planning_ms)
            continue
        guess = (intercept + slope * b) * scale
        below = [figs[k].planning_ms for k in counted if k < b]
        above = [figs[k].planning_ms for k in counted if k > b]
        if below:
            guess = max(guess, below[-1])
        if above:
            guess = min(guess, above[0])
        if not below:  # below every counted size: positive, at most the smallest counted figure
            guess = max(guess, figs[counted[0]].planning_ms * b / counted[0])
        values.append(guess)
    bounds = [b for b in counted if b not in clean]
    if bounds and ceiling is not None:  # bounds exist only below a ceiling
        values = [v if b in clean else min(v, ceiling.latency_ms(b)) for b, v in zip(range(1, table.max_batch + 1), values)]
    rows = [BatchLatency(b, v, table.memory_mb(b), figs[b].median_ms if b in figs else None,
                         figs[b].std_ms if b in figs else None) for b, v in zip(range(1, table.max_batch + 1), values)]
    meta = {"source": ProfileSource.MEASURED.value, "counted_batches": counted,
            "bound_batches": bounds,
            "contended_samples": measured.contended_samples()}
    return Profile.monotone_from_measurements(rows, table.device_type or measured.device_type, meta)


@dataclass(frozen=True)
class ProfileUpdate:
    """What :func:`update_profile` decided: the profile to plan with and why."""

    profile: Profile
    source: ProfileSource
    drift: float                  # largest relative difference measured vs in use, over counted sizes
    replan: bool                  # the table in use changed by at least the drift threshold
    held_back: str = ""           # why a raise was limited ("" when nothing was)


def drift(measured: Mapping[int, BatchFigure], in_use: Profile) -> float:
    """Largest |measured figure - table| / table over the counted batch sizes the table has."""
    diffs = [abs(f.planning_ms - in_use.latency_ms(b)) / in_use.latency_ms(b)
             for b, f in measured.items() if b <= in_use.max_batch]
    return max(diffs, default=0.0)


def update_profile(state: MeasuredProfile, samples: Iterable[LatencySample],
                   table: Profile) -> tuple[MeasuredProfile, ProfileUpdate]:
    """Fold ``samples`` in and decide the profile to plan with, against the uploaded ``table``
    (module docstring: enough samples, drift threshold, no ratchet under overload)."""
    state = state.add(samples)
    cfg = state.config
    in_use = state.applied or table
    source = ProfileSource.MEASURED if state.applied is not None else ProfileSource.TABLE
    candidate = measured_table(state, table, ceiling=in_use)
    d = drift(state.counted(in_use), in_use)
    if candidate is None:
        return state, ProfileUpdate(in_use, source, d, False)
    if state.applied is not None and d < cfg.drift_threshold:
        return replace(state, raise_streak=0), ProfileUpdate(in_use, source, d, False)
    step = 1 + cfg.max_raise_per_update
    wants_raise = any(candidate.latency_ms(b) > in_use.latency_ms(b) * step for b in range(1, table.max_batch + 1))
    streak = state.raise_streak + 1 if wants_raise else 0
    held = ""
    if wants_raise and streak < cfg.corroborating_updates:
        rows = [BatchLatency(r.batch, min(r.latency_ms, in_use.latency_ms(r.batch) * step), r.memory_mb, r.mean_ms,
                             r.std_ms) for r in candidate.rows]
        candidate = Profile.monotone_from_measurements(rows, candidate.device_type, candidate.meta)
        held = (f"latency raise limited to {cfg.max_raise_per_update:.0%} until {cfg.corroborating_updates} updates "
                f"agree ({streak} so far)")
    state = replace(state, applied=candidate, raise_streak=streak)
    return state, ProfileUpdate(candidate, ProfileSource.MEASURED, d, d >= cfg.drift_threshold, held)
