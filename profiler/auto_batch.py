"""Which batch sizes to measure, and when the automatic search for the largest batch stops.

Automatic mode (``--max-batch auto``, Nexus's rule) walks a geometric grid 1, 2, 3, 4, 6, 8, 12, 16,
24, 32, 48, ... (powers of two and their 1.5x midpoints) and stops at the first of:

- for ``patience`` (2) consecutive grid points, the throughput fails to beat the best of all
  smaller batches by ``min_gain`` (1%): larger batches only add latency. The profile then ends at
  the measured batch with the best throughput. Comparing with the best so far, over two points,
  keeps one noisy measurement from ending the search: on a CPU, throughput still grows by 4-8% per
  grid step up to batch 25 (ResNet-18 at 64x64, benchmarks/vs_triton.md), well within the noise of
  a single step;
- a batch needs more memory than ``memory_limit_mb``, or the runtime runs out of memory or fails
  (that batch is not in the profile);
- the conservative latency exceeds ``max_latency_ms`` (no SLO could use a larger batch);
- the grid reaches ``limit`` (512 by default).

Batch sizes between measured grid points are filled in by :mod:`profiler.fill`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from profiler.errors import ProfilerError
from profiler.measure import BatchMeasurement

DEFAULT_LIMIT = 512
DEFAULT_MIN_GAIN = 0.01
DEFAULT_PATIENCE = 2


def probe_grid(limit: int) -> list[int]:
    """1, 2, 3, 4, 6, 8, 12, 16, ... up to ``limit``; ``limit`` itself is always the last point."""
    if limit < 1:
        raise ProfilerError(f"largest batch size must be >= 1, got {limit}")
    grid, p = [1], 2
    while p <= limit:
        if p >= 4 and p - p // 4 > grid[-1]:
            grid.append(p - p // 4)  # the 1.5x midpoint below p
        grid.append(p)
        p *= 2
    if p // 2 < limit and p - p // 4 <= limit:
        grid.append(p - p // 4)
    if grid[-1] != limit:
        grid.append(limit)
    return grid


@dataclass(frozen=True)
class BatchPlan:
    """What to measure: an explicit list, or a grid with or without the automatic stop rule."""

    sizes: tuple[int, ...]
    auto: bool
    min_gain: float = DEFAULT_MIN_GAIN
    patience: int = DEFAULT_PATIENCE
    max_latency_ms: float | None = None
    memory_limit_mb: float | None = None

    @staticmethod
    def make(batch_sizes: "str | int | Sequence[int]" = "auto", *, limit: int = DEFAULT_LIMIT,
             min_gain: float = DEFAULT_MIN_GAIN, patience: int = DEFAULT_PATIENCE, max_latency_ms: float | None = None,
             memory_limit_mb: float | None = None) -> "BatchPlan":
        """``"auto"``; an int N (the grid up to N, all measured); or explicit sizes (1 is always added)."""
        if min_gain < 0:
            raise ProfilerError(f"minimum throughput gain must be >= 0, got {min_gain}")
        if patience < 1:
            raise ProfilerError(f"patience must be >= 1, got {patience}")
        if max_latency_ms is not None and not max_latency_ms > 0:
            raise ProfilerError(f"maximum latency must be positive, got {max_latency_ms}")
        if memory_limit_mb is not None and not memory_limit_mb > 0:
            raise ProfilerError(f"memory limit must be positive, got {memory_limit_mb}")
        common = dict(min_gain=min_gain, patience=patience, max_latency_ms=max_latency_ms,
                      memory_limit_mb=memory_limit_mb)
        if isinstance(batch_sizes, str):
            if batch_sizes != "auto":
                raise ProfilerError(f"batch sizes: expected 'auto', a largest batch or a list, got {batch_sizes!r}")
            return BatchPlan(tuple(probe_grid(limit)), True, **common)
        if isinstance(batch_sizes, bool):
            raise ProfilerError("batch sizes must be positive integers")
        if isinstance(batch_sizes, int):
            return BatchPlan(tuple(probe_grid(batch_sizes)), False, **common)
        sizes = list(batch_sizes)
        if not sizes:
            raise ProfilerError("batch sizes: the list is empty")
        bad = [b for b in sizes if isinstance(b, bool) or not isinstance(b, int) or b < 1]
        if bad:
            raise ProfilerError(f"batch sizes must be positive integers, got {bad}")
        return BatchPlan(tuple(sorted(set(sizes) | {1})), False, **common)

    def stop_reason(self, done: Sequence[BatchMeasurement]) -> tuple[str, str] | None:
        """``(kind, reason)`` to measure no further after ``done`` (in order), or None to go on.

        Kinds: ``latency_cap`` and, in automatic mode, ``throughput``."""
        last = done[-1]
        if self.max_latency_ms is not None and last.latency_ms > self.max_latency_ms:
            return ("latency_cap",
                    f"latency {last.latency_ms:.3g} ms at batch {last.batch} exceeds the "
                    f"{self.max_latency_ms:g} ms cap")
        if self.auto and len(done) > self.patience:
            first = len(done) - self.patience
            best = max(done[:first], key=lambda m: m.throughput)
            gains = [m.throughput / best.throughput - 1.0 for m in done[first:]]
            if all(g < self.min_gain for g in gains):
                tried = ", ".join(str(m.batch) for m in done[first:])
                return ("throughput", f"throughput at batch {tried} gains at most {max(gains) * 100:+.1f}% over "
                                      f"batch {best.batch}, under {self.min_gain * 100:g}%")
        return None

    def over_memory(self, m: BatchMeasurement) -> str | None:
        if self.memory_limit_mb is not None and m.memory_mb > self.memory_limit_mb:
            return f"batch {m.batch} needs {m.memory_mb:.0f} MB, over the {self.memory_limit_mb:g} MB limit"
        return None


def trim_to_best_throughput(done: list[BatchMeasurement]) -> list[BatchMeasurement]:
    """After a throughput-gain stop: end the profile at the measured batch with the best throughput."""
    best = max(range(len(done)), key=lambda i: done[i].throughput)
    return done[: best + 1]
