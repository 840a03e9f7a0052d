"""Measuring one batch size: warm-up, repeated timed runs, statistics and memory.

The statistics kept per batch size are the mean, the sample standard deviation and the 99th
percentile (numpy's linear interpolation) of the timed runs; the planning latency is derived from
them by :func:`common.profile.conservative_latency_ms` and nowhere else.

Unless the size was measured while other work took the cores the runtime's threads need
(``contended``; common/host_load.py, judged by profiler/profiling.py): the mean, the deviation and
above all the p99 of such runs describe the other work. The planning latency then comes from robust
estimates of the same two terms, the median and 1.4826 times the median absolute deviation, with no
p99 floor, as the scheduler's measured profiles do (common/measured_profile.py).
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from common.host_load import HostLoad
from common.measured_profile import MAD_TO_STD
from common.profile import BatchLatency, conservative_latency_ms
from profiler.inputs import make_feeds
from profiler.memory import MemoryProbe, is_out_of_memory


class BatchFailed(Exception):
    """Running a batch of this size failed; the profile stops before it."""

    def __init__(self, batch: int, reason: str, out_of_memory: bool = False) -> None:
        super().__init__(f"batch {batch}: {reason}")
        self.batch = batch
        self.reason = reason
        self.out_of_memory = out_of_memory


@dataclass(frozen=True)
class BatchMeasurement:
    """The timed runs of one batch size and the memory it needed."""

    batch: int
    samples_ms: tuple[float, ...]
    memory_mb: float
    load: HostLoad | None = None       # what else ran on the host meanwhile (None: not measured)
    contended: bool = False            # other work took the cores the runtime's threads need

    @property
    def mean_ms(self) -> float:
        return float(np.mean(self.samples_ms))

    @property
    def std_ms(self) -> float:
        return float(np.std(self.samples_ms, ddof=1)) if len(self.samples_ms) > 1 else 0.0

    @property
    def p99_ms(self) -> float:
        return float(np.percentile(self.samples_ms, 99))

    @property
    def latency_ms(self) -> float:
        """The conservative planning latency (see :func:`common.profile.conservative_latency_ms`)."""
        return conservative_latency_ms(*self.planning_terms())

    @property
    def median_ms(self) -> float:
        return float(np.median(self.samples_ms))

    @property
    def mad_std_ms(self) -> float:
        """1.4826 times the median absolute deviation: the standard deviation of the bulk of the runs."""
        return MAD_TO_STD * float(np.median(np.abs(np.asarray(self.samples_ms) - self.median_ms)))

    def planning_terms(self) -> tuple[float, float, float | None]:
        """(center, spread, floor) of the planning latency: mean, std and p99; median-based without a
        floor when the size was measured on contended cores (module docstring)."""
        if self.contended:
            return self.median_ms, self.mad_std_ms, None
        return self.mean_ms, self.std_ms, self.p99_ms

    @property
    def throughput(self) -> float:
        """Items per second at the median latency (robust to the odd slow run; used to find the
        largest useful batch)."""
        return self.batch * 1000.0 / self.median_ms

    def merged(self, other: "BatchMeasurement") -> "BatchMeasurement":
        """Both measurements' samples of the same batch size together."""
        loads = [m.load for m in (self, other) if m.load is not None]
        return BatchMeasurement(self.batch, self.samples_ms + other.samples_ms, max(self.memory_mb, other.memory_mb),
                                max(loads, key=lambda load: load.other_cores + load.steal_cores, default=None),
                                self.contended or other.contended)

    def to_row(self) -> BatchLatency:
        return BatchLatency(self.batch, self.latency_ms, self.memory_mb, self.mean_ms, self.std_ms, self.p99_ms,
                            self.median_ms)


def _reason(exc: BaseException) -> str:
    text = (str(exc).strip().splitlines() or [""])[0].strip()
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__


def check_outputs(outputs: Any, batch: int, expected: tuple[str, ...]) -> None:
    """Every output must be an array with ``batch`` rows; raise ValueError otherwise."""
    if not isinstance(outputs, dict):
        raise ValueError(f"runtime returned {type(outputs).__name__}, expected a dict of arrays")
    missing = [n for n in expected if n not in outputs]
    if missing:
        raise ValueError(f"runtime returned no output(s) {missing}")
    for name, value in outputs.items():
        shape = getattr(value, "shape", None)
        if not shape or shape[0] != batch:
            raise ValueError(f"output {name!r} has shape {list(shape or ())}, expected a leading batch "
                             f"dimension of {batch}")


def measure_batch(runtime: Any, batch: int, *, timer: Any, memory: MemoryProbe, warmup: int = 3,
                  iters: int = 30, min_iters: int = 5, time_budget_s: float | None = None, seed: int = 0,
                  input_shapes: dict[str, tuple[int, ...]] | None = None) -> BatchMeasurement:
    """Warm up, then time ``iters`` runs of a batch of ``batch`` (fewer, but at least ``min_iters``,
    when ``time_budget_s`` runs out). Raises :class:`BatchFailed` when the runtime fails."""
    feeds = make_feeds(runtime.inputs, batch, seed + batch, input_shapes)
    expected = tuple(o.name for o in runtime.outputs)
    gc.collect()
    memory.start_batch()
    try:
        outputs = runtime.run(feeds)  # first run: also checks the outputs
        check_outputs(outputs, batch, expected)
        del outputs
        for _ in range(max(0, warmup - 1)):
            runtime.run(feeds)
    except Exception as exc:
        raise BatchFailed(batch, _reason(exc), is_out_of_memory(exc)) from exc
    samples: list[float] = []
    gc_was_enabled = gc.isenabled()
    gc.disable()  # a collector pause belongs to this process, not to the model
    try:
        deadline = time.monotonic() + time_budget_s if time_budget_s else math.inf
        while len(samples) < iters:
            samples.append(timer.time_ms(lambda: runtime.run(feeds)))
            if len(samples) >= min_iters and time.monotonic() > deadline:
                break
    except Exception as exc:
        raise BatchFailed(batch, _reason(exc), is_out_of_memory(exc)) from exc
    finally:
        if gc_was_enabled:
            gc.enable()
    reported = 0.0
    try:
        reported = float(runtime.memory_mb() or 0.0)
    except Exception:
        pass
    return BatchMeasurement(batch, tuple(samples), memory.batch_mb(reported))
