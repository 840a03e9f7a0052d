"""Rows for every batch size 1..n from measurements at some of them.

Planning needs l(b) for every b (``common.profile.Profile`` has no gaps). A batch size that was not
measured gets, in ``interpolate`` mode (the default), the linear interpolation of the mean, standard
deviation, p99 and memory of the measured sizes on either side, and its planning latency is derived
from those by :func:`common.profile.conservative_latency_ms`, as for a measured row (from the
median-based terms where a neighbour was measured on contended cores, profiler/measure.py). ``step`` mode
instead gives it the figures of the next measured size up: pessimistic, for devices whose latency
moves in steps (GPU waves). Afterwards latency is lifted to its running maximum (a larger batch is
never planned as faster) and so is memory.
"""

from __future__ import annotations

from typing import Sequence

from common.profile import BatchLatency, conservative_latency_ms
from profiler.errors import ProfilerError
from profiler.measure import BatchMeasurement

FILL_MODES = ("interpolate", "step")


def fill_rows(measured: Sequence[BatchMeasurement], mode: str = "interpolate") -> list[BatchLatency]:
    if mode not in FILL_MODES:
        raise ProfilerError(f"fill mode {mode!r}: choose one of {', '.join(FILL_MODES)}")
    points = sorted(measured, key=lambda m: m.batch)
    if not points or points[0].batch != 1:
        raise ProfilerError("a profile needs a measurement at batch size 1")
    by_batch = {m.batch: m for m in points}
    rows: list[BatchLatency] = []
    lat_max = mem_max = 0.0
    for lo, hi in zip(points, points[1:] + [None]):
        stop = hi.batch if hi is not None else lo.batch + 1
        for b in range(lo.batch, stop):
            if b in by_batch:
                m = by_batch[b]
                mean, std, p99, median, mem = m.mean_ms, m.std_ms, m.p99_ms, m.median_ms, m.memory_mb
                center, spread, floor = m.planning_terms()
            else:
                t = (b - lo.batch) / (hi.batch - lo.batch) if mode == "interpolate" else 1.0

                def between(x: float, y: float) -> float:
                    return x + t * (y - x)

                mean, std = between(lo.mean_ms, hi.mean_ms), between(lo.std_ms, hi.std_ms)
                p99, mem = between(lo.p99_ms, hi.p99_ms), between(lo.memory_mb, hi.memory_mb)
                median = between(lo.median_ms, hi.median_ms)
                (c0, s0, f0), (c1, s1, f1) = lo.planning_terms(), hi.planning_terms()
                # a contended neighbour has no p99 floor: nor has the size between
                center, spread = between(c0, c1), between(s0, s1)
                floor = between(f0, f1) if f0 is not None and f1 is not None else None
            lat_max = max(lat_max, conservative_latency_ms(center, spread, floor))
            mem_max = max(mem_max, mem)
            rows.append(BatchLatency(b, lat_max, mem_max, mean, std, p99, median))
    return rows
