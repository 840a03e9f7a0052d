"""Profiling a model on this backend's device when the scheduler asks (``Backend.ProfileModel``)."""

from __future__ import annotations

from common.profile import Profile
from common.tensors import TensorSpec

# Measured on demand; the profile interpolates the batch sizes in between.
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32)


def measure_profile(model_bytes: bytes, runtime_kind: str, device: str, device_type: str,
                    io: tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]], batch_sizes: list[int],
                    budget_s: float, threads: int | None) -> Profile:
    """Measure a profile with the profiler's own routine; emulated devices cannot be measured."""
    if device.startswith("emulated:"):
        raise ValueError(f"an emulated device ({device}) executes a given profile and cannot measure one; "
                         f"upload the model with --profile for device type {device_type!r}")
    from profiler.profiling import profile_model

    return profile_model(model_bytes, device, runtime_kind, list(batch_sizes or DEFAULT_BATCH_SIZES),
                         warmup=2, iters=10, min_iters=3, time_budget_s=budget_s, threads=threads,
                         device_type=device_type)
