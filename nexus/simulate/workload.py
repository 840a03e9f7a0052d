"""The simulator's workloads: arrival streams of requests to many models, deterministic per seed.

Every generator returns an :class:`Arrivals`, one time-sorted stream over all models. Three sources:

* :func:`scheduled_arrivals`: each model a renewal process (``common.arrivals.arrival_times``, the
  project's one arrival process) at its share of a time-varying total rate, a :class:`RateSchedule`
  (steps and linear ramps, written as ``"0:60,120:300,240~60"`` for :func:`parse_schedule`, or a
  :func:`diurnal_schedule`); :func:`zipf_shares` gives the usual skewed popularity.
* :func:`synthetic_azure`: per-minute statistics after the Azure Functions trace.
* :func:`load_trace`: a recorded trace (CSV or JSON lines); :func:`write_trace` writes one.

All arrays are built with numpy, never a Python loop per arrival: 12 million arrivals take seconds
and a few hundred MB. Every invalid input is a :class:`WorkloadError` whose message says what, where
and what was expected.
"""

from __future__ import annotations

import csv
import json
import math
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Collection, Iterator, Mapping, Sequence

import numpy as np

from common.arrivals import arrival_times

# The Azure Functions trace reports invocation counts per function per minute: the time bin over
# which synthetic_azure holds a model's rate constant.
AZURE_BIN_S = 60.0
# A trace file's two columns (CSV header, JSON-lines keys).
TRACE_FIELDS = ("time_s", "model")
CSV_SUFFIX = ".csv"
JSONL_SUFFIXES = (".jsonl", ".json-lines")
# How many unknown model names a load_trace error lists before giving only their count.
MAX_LISTED_UNKNOWN = 5
# write_trace formats this many rows at a time, so its memory does not grow with the trace.
WRITE_CHUNK_ROWS = 1 << 20


class WorkloadError(ValueError):
    """An invalid workload input; the message names the file, line, field or item and what was expected."""


def _below(limit: float) -> float:
    """The largest float below ``limit``: where rounding would put a time on an open upper end."""
    return float(np.nextafter(limit, -math.inf))


def _check_finite_nonneg(name: str, value: float) -> float:
    value = float(value)
    if not (math.isfinite(value) and value >= 0):
        raise WorkloadError(f"{name} must be a finite number >= 0, got {value}")
    return value


def _check_names(names: Sequence[str]) -> tuple[str, ...]:
    """``names`` as a tuple, each a non-empty string, none repeated."""
    names = tuple(names)
    seen: set[str] = set()
    for i, name in enumerate(names):
        if not isinstance(name, str) or not name:
            raise WorkloadError(f"model name {i + 1} must be a non-empty string, got {name!r}")
        if name in seen:
            raise WorkloadError(f"model name {name!r} appears twice")
        seen.add(name)
    return names


@dataclass(frozen=True, eq=False)
class Arrivals:
    """One time-sorted stream of request arrivals over a set of models.

    Contract (checked on construction): ``times_s`` is 1-D float64, sorted non-decreasing, every
    value in ``[0, duration_s)``; ``models`` is int32 of the same length, each an index into
    ``names``; ``names`` are distinct non-empty strings. Arrays already of the right dtype are kept,
    not copied; do not modify them afterwards. Equality is identity (arrays have no single truth
    value); compare the fields with numpy.
    """

    times_s: np.ndarray
    models: np.ndarray
    names: tuple[str, ...]
    duration_s: float

    def __post_init__(self) -> None:
        times = np.asarray(self.times_s, dtype=np.float64)
        models = np.asarray(self.models, dtype=np.int32)
        names = _check_names(self.names)
        duration = _check_finite_nonneg("duration_s", self.duration_s)
        if times.ndim != 1 or models.shape != times.shape:
            raise WorkloadError(f"times_s and models must be 1-D of one length, got shapes "
                                f"{times.shape} and {models.shape}")
        if len(times):
            if not (times[0] >= 0 and times[-1] < duration):
                raise WorkloadError(f"arrival times must lie in [0, {duration}), got "
                                    f"{times[0]} .. {times[-1]}")
            if not np.all(times[1:] >= times[:-1]):  # also rejects NaN
                raise WorkloadError("arrival times must be sorted non-decreasing")
            if models.min() < 0 or models.max() >= len(names):
                raise WorkloadError(f"model indices must lie in [0, {len(names)}), got "
                                    f"{models.min()} .. {models.max()}")
        object.__setattr__(self, "times_s", times)
        object.__setattr__(self, "models", models)
        object.__setattr__(self, "names", names)
        object.__setattr__(self, "duration_s", duration)

    def count(self) -> int:
        """The number of arrivals."""
        return len(self.times_s)

    def per_model_counts(self) -> dict[str, int]:
        """Arrivals per model name, every name present (0 for a model without arrivals)."""
        counts = np.bincount(self.models, minlength=len(self.names))
        return {name: int(n) for name, n in zip(self.names, counts)}


def _validate_points(points: Sequence[tuple[float, float, bool]], label: Callable[[int], str]) -> None:
    """Raise WorkloadError, naming the point by ``label(index)``, unless the first point is a step at
    0, times are finite and strictly increasing, and rates finite and >= 0."""
    if not points:
        raise WorkloadError("a rate schedule needs at least one point")
    for i, (time_s, rps, ramp) in enumerate(points):
        if not math.isfinite(time_s):
            raise WorkloadError(f"{label(i)}: time must be a finite number of seconds, got {time_s}")
        if not (math.isfinite(rps) and rps >= 0):
            raise WorkloadError(f"{label(i)}: rate must be a finite number >= 0 rps, got {rps}")
        if i == 0:
            if time_s != 0:
                raise WorkloadError(f"{label(i)}: the first point must be at time 0, got {time_s}")
            if ramp:
                raise WorkloadError(f"{label(i)}: the first point must be a step (':'), "
                                    f"there is no earlier rate to ramp from")
        elif time_s <= points[i - 1][0]:
            raise WorkloadError(f"{label(i)}: times must be strictly increasing, got {time_s} "
                                f"after {points[i - 1][0]}")


@dataclass(frozen=True)
class RateSchedule:
    """A total request rate over time, piecewise constant and linear.

    ``points`` are ``(time_s, rps, ramp)``. From a point's time to the next point's time the rate is
    the point's ``rps``, unless the next point has ``ramp=True``: then the rate moves linearly from
    this point's ``rps`` to the next one's, reaching it at the next point's time. After the last
    point the rate stays at its ``rps`` forever; the rate is undefined before 0. Contract (checked):
    the first point is at 0 and not a ramp, times are finite and strictly increasing, rates finite
    and >= 0.
    """

    points: tuple[tuple[float, float, bool], ...]
    # Per segment i (from point i to point i+1; the last one unbounded): start time, rate at the
    # start, rate slope (rps per second), end time (inf for the last), and the integral of the rate
    # from 0 to the start. Derived from points in __post_init__.
    _start_s: np.ndarray = field(init=False, repr=False, compare=False)
    _rate0: np.ndarray = field(init=False, repr=False, compare=False)
    _slope: np.ndarray = field(init=False, repr=False, compare=False)
    _end_s: np.ndarray = field(init=False, repr=False, compare=False)
    _cum: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        points = tuple((float(t), float(r), bool(ramp)) for t, r, ramp in self.points)
        _validate_points(points, lambda i: f"schedule point {i + 1} {points[i]}")
        object.__setattr__(self, "points", points)
        start = np.array([p[0] for p in points])
        rate0 = np.array([p[1] for p in points])
        # The rate just before each segment's end: the next point's rate after a ramp, else unchanged.
        rate1 = np.array([nxt[1] if nxt[2] else cur[1] for cur, nxt in zip(points, points[1:])]
                         + [points[-1][1]])
        end = np.append(start[1:], math.inf)
        length = end - start
        finite = np.isfinite(length)
        slope = np.zeros(len(points))
        slope[finite] = (rate1[finite] - rate0[finite]) / length[finite]
        cum = np.concatenate(([0.0], np.cumsum(0.5 * (rate0[finite] + rate1[finite]) * length[finite])))
        for name, value in (("_start_s", start), ("_rate0", rate0), ("_slope", slope),
                            ("_end_s", end), ("_cum", cum)):
            object.__setattr__(self, name, value)

    @property
    def end_s(self) -> float:
        """The last point's time; the rate is constant from there on."""
        return self.points[-1][0]

    def rate_at(self, t_s: float) -> float:
        """The rate (rps) at time ``t_s >= 0``."""
        t = self._check_time("t_s", t_s)
        k = self._segment(t)
        return float(self._rate0[k] + self._slope[k] * (t - self._start_s[k]))

    def integral(self, t0_s: float, t1_s: float) -> float:
        """Expected arrivals in ``[t0_s, t1_s)``: the exact integral of the rate, ``0 <= t0_s <= t1_s``."""
        t0, t1 = self._check_time("t0_s", t0_s), self._check_time("t1_s", t1_s)
        if t1 < t0:
            raise WorkloadError(f"integral needs t0_s <= t1_s, got {t0} > {t1}")
        return float(self._cumulative(np.array([t1]))[0] - self._cumulative(np.array([t0]))[0])

    @staticmethod
    def _check_time(name: str, t_s: float) -> float:
        t = float(t_s)
        if not (math.isfinite(t) and t >= 0):
            raise WorkloadError(f"{name} must be a finite time >= 0 s, got {t}")
        return t

    def _segment(self, t: np.ndarray | float) -> np.ndarray:
        """Index of the segment holding each time (>= 0)."""
        return np.searchsorted(self._start_s, t, side="right") - 1

    def _cumulative(self, t: np.ndarray) -> np.ndarray:
        """Lambda(t), the integral of the rate from 0 to each time (>= 0)."""
        k = self._segment(t)
        dt = t - self._start_s[k]
        return self._cum[k] + dt * (self._rate0[k] + 0.5 * self._slope[k] * dt)

    def _inverse_cumulative(self, v: np.ndarray) -> np.ndarray:
        """The exact inverse of Lambda: for each ``v`` in ``[0, Lambda(inf))`` the time at which the
        integral of the rate reaches it (solving the segment's quadratic in a form stable at any
        slope). Over a stretch of zero rate Lambda is flat and the time is the stretch's end."""
        # side="right" skips the zero-mass segments whose start equals v.
        k = np.searchsorted(self._cum, v, side="right") - 1
        w = v - self._cum[k]
        r0, a = self._rate0[k], self._slope[k]
        # r0*dt + a/2*dt**2 = w  ->  dt = 2w / (r0 + sqrt(r0**2 + 2*a*w)); the root is >= 0 and
        # never cancels, even when a < 0; rounding can only push the discriminant just below 0.
        denom = r0 + np.sqrt(np.maximum(r0 * r0 + 2.0 * a * w, 0.0))
        dt = np.divide(2.0 * w, denom, out=np.zeros_like(w), where=denom > 0)
        return np.minimum(self._start_s[k] + dt, self._end_s[k])


def parse_schedule(text: str) -> RateSchedule:
    """Parse ``"SECONDS:RPS,..."``: from SECONDS the total rate is RPS (a step). ``SECONDS~RPS`` is a
    linear ramp from the previous point's rate, reaching RPS at SECONDS. Example:
    ``"0:60,120:300,240~60"`` is 60 rps from 0 s, a step to 300 rps at 120 s, then a ramp back down
    to 60 rps reached at 240 s. The first point must be ``0:RPS``; times strictly increasing; rates
    finite and >= 0. Errors name the offending item and its 1-based position."""
    items = [item.strip() for item in text.split(",")]
    points: list[tuple[float, float, bool]] = []
    for i, item in enumerate(items):
        where = f"schedule item {i + 1} {item!r}"
        sep = ":" if ":" in item else "~"
        time_text, found, rps_text = item.partition(sep)
        if not found or not time_text.strip() or not rps_text.strip():
            raise WorkloadError(f"{where}: expected SECONDS:RPS (a step) or SECONDS~RPS (a ramp)")
        try:
            time_s = float(time_text)
        except ValueError:
            raise WorkloadError(f"{where}: time {time_text.strip()!r} is not a number of seconds") from None
        try:
            rps = float(rps_text)
        except ValueError:
            raise WorkloadError(f"{where}: rate {rps_text.strip()!r} is not a number of rps") from None
        points.append((time_s, rps, sep == "~"))
    _validate_points(points, lambda i: f"schedule item {i + 1} {items[i]!r}")
    return RateSchedule(tuple(points))


def diurnal_schedule(duration_s: float, low_rps: float, high_rps: float, period_s: float = 86400.0,
                     step_s: float = 60.0) -> RateSchedule:
    """A daily cycle: ``low + (high - low) * (1 - cos(2 pi t / period)) / 2``, which starts at
    ``low_rps``, peaks at ``high_rps`` half a period later and returns. Approximated by linear ramps
    between samples every ``step_s`` seconds up to the first sample at or after ``duration_s``."""
    duration = _check_finite_nonneg("duration_s", duration_s)
    low = _check_finite_nonneg("low_rps", low_rps)
    high = _check_finite_nonneg("high_rps", high_rps)
    for name, value in (("period_s", period_s), ("step_s", step_s)):
        if not (math.isfinite(value) and value > 0):
            raise WorkloadError(f"{name} must be a finite number > 0, got {value}")
    times = np.arange(math.ceil(duration / step_s) + 1) * float(step_s)
    rates = low + (high - low) * 0.5 * (1.0 - np.cos(2.0 * math.pi * times / period_s))
    return RateSchedule(tuple((float(t), float(r), i > 0)
                              for i, (t, r) in enumerate(zip(times, rates))))


def zipf_shares(names: Sequence[str], exponent: float = 1.0) -> dict[str, float]:
    """Zipf popularity: the share of ``names[i]`` (rank ``i + 1``) is proportional to
    ``1 / (i + 1) ** exponent``; shares sum to 1 and never increase with rank (exponent 0: equal)."""
    names = _check_names(names)
    if not names:
        raise WorkloadError("zipf_shares needs at least one model name")
    exponent = _check_finite_nonneg("exponent", exponent)
    weights = np.arange(1, len(names) + 1, dtype=np.float64) ** -exponent
    return dict(zip(names, (weights / weights.sum()).tolist()))


def _merge(times: list[np.ndarray], duration_s: float, names: tuple[str, ...]) -> Arrivals:
    """One Arrivals from per-model time arrays (model i's in ``times[i]``): a stable sort, so that
    equal times keep model order."""
    counts = [len(t) for t in times]
    all_times = np.concatenate(times) if times else np.zeros(0)
    models = np.repeat(np.arange(len(times), dtype=np.int32), counts)
    order = np.argsort(all_times, kind="stable")
    return Arrivals(all_times[order], models[order], names, duration_s)


def scheduled_arrivals(schedule: RateSchedule, shares: Mapping[str, float], duration_s: float, *,
                       cv: float | Mapping[str, float] = 1.0, seed: int = 0) -> Arrivals:
    """Arrivals in ``[0, duration_s)``: each model of ``shares`` its own renewal process with gaps of
    coefficient of variation ``cv`` (1: Poisson; see common.arrivals) at rate
    ``share * schedule.rate_at(t)``, shares normalised to sum to 1 (each finite and >= 0, the sum > 0).

    Time-varying rates by time rescaling: a model's unit-rate renewal process is drawn in
    operational time ``u`` over ``[0, Lambda(duration))``, ``Lambda(t) = share * schedule.integral(0, t)``,
    and each ``u`` is mapped to real time by the exact inverse of Lambda. So a model's expected
    count is ``share * schedule.integral(0, duration_s)`` and the burstiness of its gaps is kept
    across rate changes. ``names`` is the order of ``shares``; model i's generator is child i of
    ``np.random.SeedSequence(seed)``, so a model's arrivals depend only on its position, its
    normalised share, the schedule, ``cv`` and ``seed``: appending a model (and scaling the schedule
    to keep the others' rates) leaves the others' arrivals unchanged up to float rounding. ``cv`` may
    be given per model (a mapping by name, every model of ``shares`` in it).
    """
    names = _check_names(list(shares))
    duration = _check_finite_nonneg("duration_s", duration_s)
    if isinstance(cv, Mapping):
        missing = [name for name in names if name not in cv]
        if missing:
            raise WorkloadError(f"cv: no coefficient of variation for {', '.join(map(repr, missing[:5]))}")
        cvs = [_check_finite_nonneg(f"cv of {name!r}", cv[name]) for name in names]
    else:
        cvs = [_check_finite_nonneg("cv", cv)] * len(names)
    weights = np.array([_check_finite_nonneg(f"share of {name!r}", shares[name]) for name in names])
    if not weights.sum() > 0:
        raise WorkloadError("shares must sum to more than 0")
    weights = weights / weights.sum()
    total = schedule.integral(0.0, duration)
    latest = _below(duration)
    times: list[np.ndarray] = []
    for share, model_cv, child in zip(weights.tolist(), cvs, np.random.SeedSequence(seed).spawn(len(names))):
        u = arrival_times(1.0, share * total, np.random.default_rng(child), cv=model_cv)
        # u / share < total up to rounding; a time rounded onto duration_s is kept just below it.
        times.append(np.minimum(schedule._inverse_cumulative(u / share), latest) if len(u) else u)
    return _merge(times, duration, names)


def synthetic_azure(names: Sequence[str], duration_s: float, total_rps: float, *, seed: int = 0,
                    popularity_sigma: float = 2.0, burst_cv: float = 1.5,
                    idle_fraction: float = 0.0) -> Arrivals:
    """Arrivals in ``[0, duration_s)`` with per-minute statistics like the Azure Functions trace.

    Basis: Shahrad et al., "Serverless in the Wild", USENIX ATC 2020, characterise two weeks of
    Azure Functions invocations, published as counts per function per minute. They report that
    popularity is extremely skewed (mean rates across functions span about eight orders of
    magnitude; under a fifth of the functions make up over 99% of the invocations), that per-minute
    counts are bursty, and that many functions are idle most minutes. The model below reproduces those
    three features with one parameter each; it is not fitted to the trace:

    * ``popularity_sigma``: each model's mean rate is lognormal with this sigma (of the log),
      normalised so the means sum to ``total_rps``. 0 gives equal rates; the default 2 puts about
      three quarters of the requests on the top tenth of models (the trace is more skewed still).
    * ``burst_cv``: each minute a model's rate is its mean times an independent lognormal factor of
      mean 1 and coefficient of variation ``burst_cv`` (0: constant rate).
    * ``idle_fraction``: each (model, minute) is independently silent with this probability, in
      ``[0, 1)``; active minutes are scaled by ``1 / (1 - idle_fraction)`` to keep every model's mean.

    Within a minute (the last one possibly partial) arrivals are Poisson at that minute's rate. The
    expected total is therefore ``total_rps * duration_s``; the realised total also varies with the
    bursts of the most popular models. Popularity, bursts, idle minutes and arrival times each draw
    from their own child of ``np.random.SeedSequence(seed)``: changing ``burst_cv`` or
    ``idle_fraction`` keeps the popularity.
    """
    names = _check_names(names)
    if not names:
        raise WorkloadError("synthetic_azure needs at least one model name")
    duration = _check_finite_nonneg("duration_s", duration_s)
    total_rps = _check_finite_nonneg("total_rps", total_rps)
    popularity_sigma = _check_finite_nonneg("popularity_sigma", popularity_sigma)
    burst_cv = _check_finite_nonneg("burst_cv", burst_cv)
    idle_fraction = float(idle_fraction)
    if not 0 <= idle_fraction < 1:
        raise WorkloadError(f"idle_fraction must lie in [0, 1), got {idle_fraction}")
    pop_rng, burst_rng, idle_rng, arrival_rng = (
        np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(4))

    popularity = pop_rng.lognormal(0.0, popularity_sigma, len(names))
    mean_rps = total_rps * popularity / popularity.sum()
    bin_start = np.arange(math.ceil(duration / AZURE_BIN_S)) * AZURE_BIN_S
    bin_len = np.minimum(bin_start + AZURE_BIN_S, duration) - bin_start
    # A lognormal of mean 1 and CV c has log-sigma^2 = ln(1 + c^2) and log-mean -sigma^2 / 2.
    burst_var = math.log1p(burst_cv * burst_cv)
    factor = burst_rng.lognormal(-0.5 * burst_var, math.sqrt(burst_var), (len(bin_start), len(names)))
    active = idle_rng.random(factor.shape) >= idle_fraction
    rate = mean_rps * factor * active / (1.0 - idle_fraction)  # (bin, model)
    counts = arrival_rng.poisson(rate * bin_len[:, None]).ravel()
    # Cells in (bin, model) order; given its count, a Poisson cell's arrivals are uniform in the bin.
    cell_bin = np.repeat(np.repeat(np.arange(len(bin_start)), len(names)), counts)
    models = np.repeat(np.tile(np.arange(len(names), dtype=np.int32), len(bin_start)), counts)
    times = bin_start[cell_bin] + arrival_rng.random(len(cell_bin)) * bin_len[cell_bin]
    np.minimum(times, _below(duration), out=times)  # rounding must not reach duration_s
    order = np.argsort(times, kind="stable")
    return Arrivals(times[order], models[order], names, duration)


def _trace_time(value: object, where: str) -> float:
    """A trace row's time: a finite number of seconds >= 0 (a string in CSV, a number in JSON)."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise WorkloadError(f"{where}: time_s must be a number of seconds, got {value!r}")
    try:
        t = float(value)
    except ValueError:
        raise WorkloadError(f"{where}: time_s must be a number of seconds, got {value!r}") from None
    if not math.isfinite(t):
        raise WorkloadError(f"{where}: time_s must be finite, got {value!r}")
    if t < 0:
        raise WorkloadError(f"{where}: time_s must be >= 0, got {value!r}")
    return t


def _trace_model(value: object, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise WorkloadError(f"{where}: model must be a non-empty name, got {value!r}")
    return value


def _read_csv(path: Path) -> Iterator[tuple[int, float, str]]:
    """(line, time, model) per row of a CSV trace whose header names exactly TRACE_FIELDS (either
    order); blank lines are skipped; a quoted field may span lines (line = where the row ends)."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        expected = ",".join(TRACE_FIELDS)
        if header is None:
            raise WorkloadError(f"{path}: line 1: empty file, expected the header {expected!r}")
        columns = [c.strip() for c in header]
        extra = [c for c in columns if c not in TRACE_FIELDS]
        if extra:
            raise WorkloadError(f"{path}: line {reader.line_num}: unexpected column(s) "
                                f"{', '.join(map(repr, extra))}; expected the header {expected!r}")
        if sorted(columns) != sorted(TRACE_FIELDS):
            raise WorkloadError(f"{path}: line {reader.line_num}: header {','.join(columns)!r}, "
                                f"expected {expected!r}")
        time_col, model_col = columns.index("time_s"), columns.index("model")
        for row in reader:
            if not row:
                continue
            where = f"{path}: line {reader.line_num}"
            if len(row) != len(columns):
                raise WorkloadError(f"{where}: expected {len(columns)} fields ({expected}), got {len(row)}")
            yield reader.line_num, _trace_time(row[time_col].strip(), where), _trace_model(row[model_col], where)


def _read_jsonl(path: Path) -> Iterator[tuple[int, float, str]]:
    """(line, time, model) per line of a JSON-lines trace: each non-blank line one object with
    exactly the keys TRACE_FIELDS, ``time_s`` a number and ``model`` a string."""
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}: line {line_no}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise WorkloadError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise WorkloadError(f"{where}: expected an object with keys {list(TRACE_FIELDS)}, "
                                    f"got {type(obj).__name__}")
            extra = sorted(set(obj) - set(TRACE_FIELDS))
            missing = [k for k in TRACE_FIELDS if k not in obj]
            if extra or missing:
                raise WorkloadError(f"{where}: expected exactly the keys {list(TRACE_FIELDS)}; "
                                    f"unexpected {extra}, missing {missing}")
            if not isinstance(obj["time_s"], (int, float)):
                raise WorkloadError(f"{where}: time_s must be a number of seconds, got {obj['time_s']!r}")
            yield line_no, _trace_time(obj["time_s"], where), _trace_model(obj["model"], where)


def load_trace(path: str | Path, known_models: Collection[str] | None = None) -> Arrivals:
    """Read a recorded trace: one arrival per row, ``time_s`` (seconds from the trace's start, finite
    and >= 0) and ``model``.

    Format by extension: ``.csv`` with the header ``time_s,model`` and no other column, or
    ``.jsonl``/``.json-lines`` with one object ``{"time_s": ..., "model": ...}`` per line and no
    other key. Rows may be in any order; they are sorted stably by time. ``names`` lists the models
    in order of first appearance in the file. With ``known_models``, a name outside it is an error
    listing up to MAX_LISTED_UNKNOWN of them (with the line each first appears on) and their count.
    ``duration_s`` is the smallest float above the last time. A trace without arrivals is an error.
    Every error is a WorkloadError naming the path and the 1-based line.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == CSV_SUFFIX:
        rows = _read_csv(path)
    elif suffix in JSONL_SUFFIXES:
        rows = _read_jsonl(path)
    else:
        raise WorkloadError(f"{path}: unknown trace format {path.suffix!r}; expected "
                            f"{', '.join((CSV_SUFFIX,) + JSONL_SUFFIXES)}")
    times = array("d")
    models = array("i")
    index: dict[str, int] = {}
    first_line: dict[str, int] = {}
    last_line = 0
    for line_no, t, model in rows:
        last_line = line_no
        i = index.get(model)
        if i is None:
            i = index[model] = len(index)
            first_line[model] = line_no
        times.append(t)
        models.append(i)
    if not times:
        raise WorkloadError(f"{path}: line {max(last_line, 1)}: no arrivals")
    if known_models is not None:
        known = set(known_models)
        unknown = [name for name in index if name not in known]
        if unknown:
            listed = ", ".join(f"{name!r} (line {first_line[name]})" for name in unknown[:MAX_LISTED_UNKNOWN])
            more = f" and {len(unknown) - MAX_LISTED_UNKNOWN} more" if len(unknown) > MAX_LISTED_UNKNOWN else ""
            raise WorkloadError(f"{path}: line {first_line[unknown[0]]}: {len(unknown)} unknown model "
                                f"name(s), not among the known models: {listed}{more}")
    t = np.frombuffer(times, dtype=np.float64)
    m = np.frombuffer(models, dtype=np.int32)
    order = np.argsort(t, kind="stable")
    return Arrivals(t[order], m[order], tuple(index), float(np.nextafter(t[order[-1]], math.inf)))


def write_trace(arrivals: Arrivals, path: str | Path) -> None:
    """Write ``arrivals`` as a CSV trace (header ``time_s,model``, one row per arrival in time order)
    that :func:`load_trace` reads back to the same times and per-arrival model names: times are
    written as Python's shortest exact repr. The path must end in ``.csv`` and there must be at
    least one arrival (load_trace rejects an empty trace)."""
    path = Path(path)
    if path.suffix.lower() != CSV_SUFFIX:
        raise WorkloadError(f"{path}: a trace is written as CSV, the path must end in {CSV_SUFFIX!r}")
    if not arrivals.count():
        raise WorkloadError(f"{path}: no arrivals to write (load_trace rejects an empty trace)")
    names = arrivals.names
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(TRACE_FIELDS)
        for start in range(0, arrivals.count(), WRITE_CHUNK_ROWS):
            stop = start + WRITE_CHUNK_ROWS
            writer.writerows(zip(map(repr, arrivals.times_s[start:stop].tolist()),
                                 [names[i] for i in arrivals.models[start:stop].tolist()]))
