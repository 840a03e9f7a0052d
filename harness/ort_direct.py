"""The direct-ONNX-Runtime baseline: the model's own limit, with no server around it.

A benchmark states served throughput and added latency against this: a model file in an
``onnxruntime.InferenceSession`` with the session options the backend uses
(``common/runtimes/onnx_runtime.py``: sequential execution, one inter-op thread, intra-op spinning
off unless ``spin``), called in a loop on the CPU. :func:`ort_limit` finds the saturated batch b*
(Nexus's: the largest b with 2*l(b) <= SLO, l(b) the median of timed runs) and its throughput
b*/l(b*); :func:`paced_latencies` times batch-1 runs that arrive at Poisson gaps, as a server at a
low rate sees them (ORT is slower after idling).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any, Callable, Mapping

import numpy as np


def ort_session(model: bytes | str | os.PathLike, threads: int = 0, *, spin: bool = False,
                config: Mapping[str, str] | None = None):
    """A CPU InferenceSession of ``model`` (bytes or a path): ``threads`` intra-op threads (0: ORT's
    default, one per core); ``spin`` keeps intra-op spin-waiting on (ORT's own default; an idle
    worker that spins takes a core from the server's threads); ``config`` adds session config entries."""
    import onnxruntime as ort

    o = ort.SessionOptions()
    o.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    o.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    o.inter_op_num_threads = 1
    if threads:
        o.intra_op_num_threads = threads
    o.log_severity_level = 3
    if not spin:
        o.add_session_config_entry("session.intra_op.allow_spinning", "0")
    for key, value in (config or {}).items():
        o.add_session_config_entry(key, value)
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    return ort.InferenceSession(model, sess_options=o, providers=["CPUExecutionProvider"])


def _feeds(session, x: np.ndarray) -> dict[str, np.ndarray]:
    return {session.get_inputs()[0].name: x}


def time_batch(session, x: np.ndarray, repeats: int, warmup: int = 3, idle_s: float = 0.0) -> list[float]:
    """Milliseconds of ``repeats`` timed runs on the input ``x`` after ``warmup`` untimed ones, each
    timed run ``idle_s`` after the last one ended."""
    feeds = _feeds(session, x)
    for _ in range(warmup):
        session.run(None, feeds)
    out = []
    for _ in range(repeats):
        if idle_s:
            time.sleep(idle_s)
        t = time.perf_counter()
        session.run(None, feeds)
        out.append((time.perf_counter() - t) * 1000)
    return out


def ort_limit(session, slo_ms: float, inputs: Callable[[int], np.ndarray], repeats: int = 15, *,
              next_batch: Callable[[int], int] = lambda b: b + 1, max_batch: int = 256) -> dict[str, Any]:
    """Median l(b) for b = 1, ``next_batch(1)``, ... until 2*l(b) exceeds the SLO twice in a row (or b
    passes ``max_batch``), each on ``inputs(b)``; the saturated batch b*, l(b*) and b*/l(b*).

    Returns ``latency_ms`` (b -> median ms), ``batch`` (b*, 1 when no b fits), ``l_ms`` and
    ``throughput_rps``."""
    lat: dict[int, float] = {}
    over, b = 0, 1
    while over < 2 and b <= max_batch:
        lat[b] = statistics.median(time_batch(session, inputs(b), repeats))
        over = over + 1 if 2 * lat[b] > slo_ms else 0
        b = next_batch(b)
    ok = [k for k, v in lat.items() if 2 * v <= slo_ms]
    best = max(ok) if ok else 1
    return {"latency_ms": lat, "batch": best, "l_ms": lat[best], "throughput_rps": best * 1000 / lat[best]}


def paced_latencies(session, x: np.ndarray, rate_rps: float, duration_s: float,
                    rng: np.random.Generator) -> list[float]:
    """Milliseconds of runs on ``x`` for ``duration_s``, each after an exponential idle gap of mean
    1/``rate_rps`` (the gaps of Poisson arrivals at that rate)."""
    feeds = _feeds(session, x)
    out = []
    end = time.monotonic() + duration_s
    while time.monotonic() < end:
        time.sleep(rng.exponential(1.0 / rate_rps))
        t = time.perf_counter()
        session.run(None, feeds)
        out.append((time.perf_counter() - t) * 1000)
    return out
