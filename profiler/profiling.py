"""Profiling a model: measure batch sizes with the serving runtime and build a :class:`Profile`.

:func:`profile_model` is the entry point the CLI (``nexus profile``), the scheduler (profiling on
upload) and the backend call. It loads the model through ``common.runtimes.load_runtime``, measures
the planned batch sizes in increasing order (see :mod:`profiler.auto_batch`), fills the sizes in
between (:mod:`profiler.fill`) and records what makes the result reproducible in ``meta``, and the
host's load while each size was measured (``meta.host_load``; ``meta.contended_batches``: the sizes
that other work's use of the cores spoiled, planned at a median-based figure, profiler/measure.py). A batch
size that fails (runtime error, out of memory, wrong output shape) ends the profile at the largest
size that worked; ``meta["stop"]`` says where and why. The format is documented in
``profiler/README.md``.
"""

from __future__ import annotations

import datetime as _dt
import random
from dataclasses import replace
from typing import Any, Callable, Sequence

from common.profile import Profile
from profiler.auto_batch import DEFAULT_LIMIT, DEFAULT_MIN_GAIN, DEFAULT_PATIENCE, BatchPlan, trim_to_best_throughput
from common.host_load import HostLoadMeter
from profiler.environment import available_cpus, device_type_of, environment_meta, parse_device, resolve_threads
from profiler.errors import ProfilerError
from profiler.fill import fill_rows
from profiler.measure import BatchFailed, BatchMeasurement, measure_batch
from profiler.memory import MemoryProbe
from profiler.model_file import model_sha256
from profiler.runtime import import_runtime, open_runtime
from profiler.timer import make_timer

PROFILER_VERSION = 1

# progress(batch, measurement or None when it failed, planned number of batch sizes)
ProgressFn = Callable[[int, "BatchMeasurement | None", int], None]


def _seed_everything(seed: int, runtime_kind: str) -> None:
    random.seed(seed)
    if runtime_kind == "torch":
        try:
            import torch  # lazy: torch is an optional extra (~1 s to import)

            torch.manual_seed(seed)
        except Exception:
            pass


def measure_plan(runtime: Any, plan: BatchPlan, *, device: str, warmup: int = 3, iters: int = 30,
                 min_iters: int = 5, time_budget_s: float | None = None, seed: int = 0,
                 input_shapes: dict[str, tuple[int, ...]] | None = None, memory: MemoryProbe | None = None,
                 progress: ProgressFn | None = None, threads: int | None = None
                 ) -> tuple[list[BatchMeasurement], dict | None, Any]:
    """Measure ``plan`` on a loaded runtime. Returns (measurements, stop, timer); ``stop`` is
    ``{"batch", "kind", "reason"}`` when the profile ended before the plan's last size.

    The host's load is read around every batch size (common/host_load.py) and kept with it; on a CPU
    device, a size measured while other work took the cores that ``threads`` runtime threads need
    (default: every available CPU) is marked contended, and plans at the median-based figure
    (profiler/measure.py)."""
    if warmup < 0 or iters < 1 or min_iters < 1:
        raise ProfilerError(f"need warmup >= 0 and iterations >= 1 (got warmup={warmup}, iters={iters})")
    timer = make_timer(device)
    memory = memory or MemoryProbe(device)
    meter = HostLoadMeter(processes=True)
    judged = (threads or len(available_cpus())) if device == "cpu" else None
    done: list[BatchMeasurement] = []
    stop: dict | None = None
    total = len(plan.sizes)

    def measured(batch: int, warm: int) -> BatchMeasurement:
        meter.sample()          # the window starts with the size's warm-up
        m = measure_batch(runtime, batch, timer=timer, memory=memory, warmup=warm, iters=iters,
                          min_iters=min(min_iters, iters), time_budget_s=time_budget_s, seed=seed,
                          input_shapes=input_shapes)
        load = meter.sample()
        return replace(m, load=load, contended=bool(judged and load is not None and load.contended(judged)))

    for index, batch in enumerate(plan.sizes):
        try:
            m = measured(batch, warmup + (2 if index == 0 else 0))
        except BatchFailed as exc:
            if progress:
                progress(batch, None, total)
            if not done:
                raise ProfilerError(f"the model fails at batch size {batch}: {exc.reason}") from None
            stop = {"batch": batch, "kind": "out_of_memory" if exc.out_of_memory else "failed",
                    "reason": f"batch {batch} failed: {exc.reason}"}
            break
        if progress:
            progress(batch, m, total)
        over = plan.over_memory(m)
        if over:
            if not done:
                raise ProfilerError(over)
            stop = {"batch": batch, "kind": "memory_limit", "reason": over}
            break
        done.append(m)
        why = plan.stop_reason(done)
        if why and why[0] == "throughput":
            # Confirm before stopping: a burst of contention can fake a plateau. Re-measure the
            # points the rule compared and decide on all samples.
            try:
                first = len(done) - plan.patience
                best = max(range(first), key=lambda i: done[i].throughput)
                for i in (best, *range(first, len(done))):
                    done[i] = done[i].merged(measured(done[i].batch, warmup))
            except BatchFailed:
                pass  # keep the first measurements
            why = plan.stop_reason(done)
        if why:
            kind, reason = why
            if kind == "throughput":
                done = trim_to_best_throughput(done)
            stop = {"batch": batch, "kind": kind, "reason": reason}
            break
    else:
        if plan.auto:
            stop = {"batch": plan.sizes[-1], "kind": "limit",
                    "reason": f"reached the largest batch size allowed ({plan.sizes[-1]})"}
    return done, stop, timer


def profile_model(model_bytes: bytes, device: str = "cpu", runtime_kind: str = "onnxruntime",
                  batch_sizes: "str | int | Sequence[int]" = "auto", *, warmup: int = 3, iters: int = 30,
                  min_iters: int = 5, time_budget_s: float | None = None, threads: int | None = None,
                  seed: int = 0, limit: int = DEFAULT_LIMIT, min_gain: float = DEFAULT_MIN_GAIN,
                  patience: int = DEFAULT_PATIENCE, max_latency_ms: float | None = None,
                  memory_limit_mb: float | None = None, fill: str = "interpolate",
                  input_shapes: dict[str, tuple[int, ...]] | None = None, device_type: str | None = None,
                  runtime_profile: Profile | None = None, io: Any = None, model_name: str | None = None,
                  progress: ProgressFn | None = None) -> Profile:
    """Measure ``model_bytes`` on ``device`` with runtime ``runtime_kind`` and return its profile.

    ``batch_sizes``: ``"auto"`` (largest batch found automatically, up to ``limit``), an int N (the
    grid 1, 2, 3, 4, 6, ... N, all measured) or an explicit list (batch 1 is always measured).
    ``io`` (inputs, outputs TensorSpecs) is passed to ``load_runtime``: TorchScript files need it.
    ``runtime_profile`` is what the emulated runtime executes. Raises :class:`ProfilerError` when the
    model cannot be loaded or fails at batch size 1.
    """
    device = parse_device(device)
    plan = BatchPlan.make(batch_sizes, limit=limit, min_gain=min_gain, patience=patience,
                          max_latency_ms=max_latency_ms, memory_limit_mb=memory_limit_mb)
    threads = resolve_threads(threads, device)
    _seed_everything(seed, runtime_kind)
    import_runtime(runtime_kind)
    memory = MemoryProbe(device)  # baseline: runtime libraries loaded, the model not yet
    runtime = open_runtime(runtime_kind, model_bytes, device, threads=threads, profile=runtime_profile, io=io,
                           where=model_name or "model")
    try:
        done, stop, timer = measure_plan(runtime, plan, device=device, warmup=warmup, iters=iters,
                                         min_iters=min_iters, time_budget_s=time_budget_s, seed=seed,
                                         input_shapes=input_shapes, memory=memory, progress=progress,
                                         threads=threads)
    finally:
        try:
            runtime.close()
        except Exception:
            pass
    meta = environment_meta(device, runtime_kind, threads, seed)
    if model_name:
        meta["model"] = model_name
    meta.update({
        "model_sha256": model_sha256(model_bytes),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "profiler_version": PROFILER_VERSION,
        "timer": timer.name,
        "warmup": warmup,
        "iters": iters,
        "batch_mode": "auto" if plan.auto else "list",
        "fill": fill,
        "measured_batches": [m.batch for m in done],
        "samples": {str(m.batch): len(m.samples_ms) for m in done},
        "host_load": {str(m.batch): {**m.load.to_json_obj(threads or 1), "contended": m.contended}
                      for m in done if m.load is not None},
        "contended_batches": [m.batch for m in done if m.contended],
    })
    if stop:
        meta["stop"] = stop
    rows = fill_rows(done, fill)
    return Profile.monotone_from_measurements(rows, device_type or device_type_of(device), meta)
