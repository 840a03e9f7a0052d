"""Profiling a model on this backend's device when the scheduler asks (``Backend.ProfileModel``)."""

from __future__ import annotations

from common.emulated_gpus import datasheet_profile
from common.profile import Profile
from common.tensors import TensorSpec
from profiler.profiling import profile_model

# Measured on demand; the profile interpolates the batch sizes in between.
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32)


def measure_profile(model_bytes: bytes, runtime_kind: str, device: str, device_type: str,
                    io: tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]], batch_sizes: list[int],
                    budget_s: float, threads: int | None, extend_to_batch: int = 0) -> Profile:
    """Measure a profile with the profiler's own routine, extended to ``extend_to_batch`` when that is
    beyond the sizes measured (a quick estimate: :meth:`common.profile.Profile.extended`). An emulated
    device cannot measure one: it answers from its datasheet for the sample models
    (:mod:`common.emulated_gpus`), else ValueError."""
    if device.startswith("emulated:"):
        sheet = datasheet_profile(model_bytes, device.split(":", 1)[1])
        return Profile.from_rows(sheet.rows, device_type, sheet.meta)
    measured = profile_model(model_bytes, device, runtime_kind, list(batch_sizes or DEFAULT_BATCH_SIZES),
                             warmup=2, iters=10, min_iters=3, time_budget_s=budget_s, threads=threads,
                             device_type=device_type)
    return measured.extended(extend_to_batch)
