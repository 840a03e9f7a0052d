"""Batch-latency profiles: the numbers every placement decision rests on.

A profile gives, for each batch size b from 1 to its largest profiled batch, the latency l(b) of
running one batch and the device memory m(b) that batch needs. ``latency_ms`` is always the
*conservative* figure the scheduler plans with; the profiler derives it from its measurements with
:func:`conservative_latency_ms`, the one place that rule lives.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

# Nexus planned with (mean + std) * 1.15; we keep its margin and also never plan below the
# measured p99, which matters on noisy CPUs where the distribution has a long tail.
LATENCY_MARGIN = 1.15


def conservative_latency_ms(mean_ms: float, std_ms: float, p99_ms: float | None = None) -> float:
    """The latency the scheduler plans with for one measured batch size.

    ``max((mean + std) * 1.15, p99)``: Nexus's margin, floored at the observed tail.
    """
    value = (mean_ms + std_ms) * LATENCY_MARGIN
    if p99_ms is not None:
        value = max(value, p99_ms)
    return value


class ProfileError(ValueError):
    """A profile that cannot be used for planning; the message names the problem."""


@dataclass(frozen=True)
class BatchLatency:
    """One row of a profile: a batch size, its conservative latency and its memory."""

    batch: int
    latency_ms: float
    memory_mb: float = 0.0
    # Optional raw measurements kept by the profiler (not used for planning).
    mean_ms: float | None = None
    std_ms: float | None = None
    p99_ms: float | None = None
    median_ms: float | None = None


@dataclass(frozen=True)
class Profile:
    """A validated batch-latency profile: rows for batch 1..max_batch, in order.

    Invariants (checked by :meth:`validate`): batch sizes are 1, 2, ..., n with no gaps; latencies
    and memory are finite and non-negative, latency positive; latency never decreases as the batch
    grows (within ``tolerance`` of relative noise when built from measurements).
    """

    rows: tuple[BatchLatency, ...]
    device_type: str = ""
    meta: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def max_batch(self) -> int:
        return len(self.rows)

    @functools.cached_property
    def latency_envelope_ms(self) -> tuple[float, ...]:
        """max(l(1), ..., l(b)) for b = 1..max_batch: non-decreasing even where measurement noise
        makes l(b) dip, so that a search by bisection stops where a scan from b = 1 would."""
        return tuple(itertools.accumulate((r.latency_ms for r in self.rows), max))

    def latency_ms(self, batch: int) -> float:
        """l(b) for 1 <= b <= max_batch."""
        return self.rows[batch - 1].latency_ms

    def memory_mb(self, batch: int) -> float:
        """m(b) for 1 <= b <= max_batch."""
        return self.rows[batch - 1].memory_mb

    def capped(self, max_batch: int) -> "Profile":
        """The profile up to ``max_batch`` (itself when that is no cap: 0 or beyond its rows)."""
        if max_batch <= 0 or max_batch >= len(self.rows):
            return self
        return Profile(self.rows[:max_batch], self.device_type, dict(self.meta, batch_cap=max_batch))

    def extended(self, to_batch: int) -> "Profile":
        """The profile with rows up to ``to_batch`` beyond its own (itself when it covers that): a quick
        estimate from a few measured batch sizes. Beyond the largest measured n, latency and memory
        grow by the last measured step's per-item increase, l(b) = l(n) + (b - n) * (l(n) - l(m)) / (n - m)
        for the row m before n: exact where latency is linear in the batch, an upper bound where a larger
        batch amortises better (a concave curve, the usual one). The latencies the backends measure while
        serving then correct it (common/measured_profile.py). ``meta["extrapolated_from_batch"]`` says
        where the estimate starts."""
        n = len(self.rows)
        if to_batch <= n:
            return self
        last = self.rows[-1]
        before = self.rows[-2] if n > 1 else BatchLatency(0, 0.0, 0.0)
        step = max(1, last.batch - before.batch)
        per_item_ms = max(0.0, (last.latency_ms - before.latency_ms) / step)
        per_item_mb = max(0.0, (last.memory_mb - before.memory_mb) / step)
        rows = list(self.rows)
        for b in range(n + 1, to_batch + 1):
            rows.append(BatchLatency(b, last.latency_ms + (b - n) * per_item_ms, last.memory_mb + (b - n) * per_item_mb))
        return Profile(tuple(rows), self.device_type, dict(self.meta, extrapolated_from_batch=n))

    def scaled(self, factor: float) -> "Profile":
        """The profile with every latency figure (l(b), and the raw mean, std and p99) times ``factor``
        (> 0); memory and meta unchanged."""
        if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 0):
            raise ProfileError(f"a latency scale factor must be a positive number, got {factor!r}")

        def scale(x: float | None) -> float | None:
            return None if x is None else x * factor

        return Profile(tuple(BatchLatency(r.batch, r.latency_ms * factor, r.memory_mb, scale(r.mean_ms),
                                          scale(r.std_ms), scale(r.p99_ms), scale(r.median_ms)) for r in self.rows),
                       self.device_type, dict(self.meta))

    def validate(self, where: str = "profile") -> None:
        if not self.rows:
            raise ProfileError(f"{where}: must list at least batch size 1")
        for i, row in enumerate(self.rows, start=1):
            if row.batch != i:
                raise ProfileError(
                    f"{where}[{i - 1}].batch: expected {i} (batch sizes must run 1, 2, ... with no gaps), got {row.batch}")
            if not (math.isfinite(row.latency_ms) and row.latency_ms > 0):
                raise ProfileError(f"{where}[{i - 1}].latency_ms: must be a positive number, got {row.latency_ms}")
            if not (math.isfinite(row.memory_mb) and row.memory_mb >= 0):
                raise ProfileError(f"{where}[{i - 1}].memory_mb: must be a non-negative number, got {row.memory_mb}")
            if i > 1 and row.latency_ms < self.rows[i - 2].latency_ms:
                raise ProfileError(
                    f"{where}[{i - 1}].latency_ms: latency decreases with batch size "
                    f"(batch {i - 1}: {self.rows[i - 2].latency_ms} ms, batch {i}: {row.latency_ms} ms)")

    # ---- construction -------------------------------------------------------------------------

    @staticmethod
    def from_rows(rows: Iterable[BatchLatency], device_type: str = "", meta: Mapping[str, Any] | None = None) -> "Profile":
        return Profile(tuple(rows), device_type, dict(meta or {}))

    @staticmethod
    def linear(alpha_ms: float, beta_ms: float, max_batch: int, memory_base_mb: float = 0.0,
               memory_per_item_mb: float = 0.0, device_type: str = "") -> "Profile":
        """l(b) = alpha*b + beta, m(b) = base + per_item*b: GPU-like synthetic profiles."""
        return Profile(tuple(
            BatchLatency(b, alpha_ms * b + beta_ms, memory_base_mb + memory_per_item_mb * b)
            for b in range(1, max_batch + 1)), device_type)

    @staticmethod
    def monotone_from_measurements(rows: Iterable[BatchLatency], device_type: str = "",
                                   meta: Mapping[str, Any] | None = None) -> "Profile":
        """Build from measured rows, lifting any latency dip to its predecessor.

        Measured latencies can dip by noise; a plan must never assume a larger batch is faster,
        so each row's latency is raised to the running maximum.
        """
        fixed: list[BatchLatency] = []
        running = 0.0
        for row in rows:
            running = max(running, row.latency_ms)
            fixed.append(BatchLatency(row.batch, running, row.memory_mb, row.mean_ms, row.std_ms, row.p99_ms,
                                      row.median_ms))
        return Profile(tuple(fixed), device_type, dict(meta or {}))

    # ---- JSON -----------------------------------------------------------------------------------

    def to_json_obj(self) -> dict[str, Any]:
        rows = []
        for r in self.rows:
            row: dict[str, Any] = {"batch": r.batch, "latency_ms": round(r.latency_ms, 6),
                                   "memory_mb": round(r.memory_mb, 6)}
            for key in ("mean_ms", "std_ms", "p99_ms", "median_ms"):
                value = getattr(r, key)
                if value is not None:
                    row[key] = round(value, 6)
            rows.append(row)
        obj: dict[str, Any] = {"device_type": self.device_type, "profile": rows}
        if self.meta:
            obj["meta"] = dict(self.meta)
        return obj

    def to_json(self) -> str:
        return self._json

    @functools.cached_property
    def _json(self) -> str:
        # written once per object: a scheduler sends each table to every backend that runs it, at every plan
        return json.dumps(self.to_json_obj(), indent=2, sort_keys=True)

    @functools.cached_property
    def digest(self) -> str:
        """SHA-256 of :meth:`to_json` (meta included): names this exact table; computed once per object."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    @staticmethod
    def from_json_obj(obj: Any, where: str = "profile") -> "Profile":
        """Parse either a bare list of rows or ``{"device_type": ..., "profile": [...], "meta": {...}}``."""
        device_type = ""
        meta: dict[str, Any] = {}
        if isinstance(obj, dict):
            unknown = set(obj) - {"device_type", "profile", "meta"}
            if unknown:
                raise ProfileError(f"{where}: unknown key(s) {sorted(unknown)}")
            if "profile" not in obj:
                raise ProfileError(f"{where}: missing field 'profile'")
            device_type = obj.get("device_type", "") or ""
            if not isinstance(device_type, str):
                raise ProfileError(f"{where}.device_type: must be a string")
            meta = obj.get("meta", {}) or {}
            if not isinstance(meta, dict):
                raise ProfileError(f"{where}.meta: must be an object")
            rows_obj = obj["profile"]
            where = f"{where}.profile"
        else:
            rows_obj = obj
        if not isinstance(rows_obj, list):
            raise ProfileError(f"{where}: must be a list of {{batch, latency_ms, memory_mb}} rows")
        rows = []
        allowed = {"batch", "latency_ms", "memory_mb", "mean_ms", "std_ms", "p99_ms", "median_ms"}
        for i, row in enumerate(rows_obj):
            if not isinstance(row, dict):
                raise ProfileError(f"{where}[{i}]: must be an object")
            unknown = set(row) - allowed
            if unknown:
                raise ProfileError(f"{where}[{i}]: unknown key(s) {sorted(unknown)}")
            for key in ("batch", "latency_ms"):
                if key not in row:
                    raise ProfileError(f"{where}[{i}]: missing field '{key}'")
            batch = row["batch"]
            if isinstance(batch, bool) or not isinstance(batch, int):
                raise ProfileError(f"{where}[{i}].batch: must be an integer, got {batch!r}")
            values = {}
            for key in ("latency_ms", "memory_mb", "mean_ms", "std_ms", "p99_ms", "median_ms"):
                if key in row:
                    v = row[key]
                    if isinstance(v, bool) or not isinstance(v, (int, float)):
                        raise ProfileError(f"{where}[{i}].{key}: must be a number, got {v!r}")
                    values[key] = float(v)
            rows.append(BatchLatency(batch, values["latency_ms"], values.get("memory_mb", 0.0),
                                     values.get("mean_ms"), values.get("std_ms"), values.get("p99_ms"),
                                     values.get("median_ms")))
        profile = object.__new__(Profile)
        object.__setattr__(profile, "rows", tuple(rows))
        object.__setattr__(profile, "device_type", device_type)
        object.__setattr__(profile, "meta", meta)
        profile.validate(where)
        return profile

    @staticmethod
    def from_json(text: str, where: str = "profile") -> "Profile":
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ProfileError(f"{where}: not valid JSON ({exc})") from None
        return Profile.from_json_obj(obj, where)
