"""Profiling a model on this backend's device when asked (``Backend.ProfileModel``).

A *background* measurement (``ProfileRequest.background``: ``nexus serve``'s CPU layout measures every
served model while the backend serves it, nexus/cpu_layout_switch.py) runs on a thread of its own
whose CPU priority is :data:`BACKGROUND_NICE` below the serving threads'. The runtime's own worker
threads, made by that thread, inherit it. Where both want the cores, the scheduler's CFS then gives
the serving threads about nine tenths of them, and the measurement the rest; an idle core is the
measurement's whole. Its figures then include that wait, as a measurement beside serving always did:
the layout decision compares medians of two passes (nexus/cpu_layout_switch.py).
"""

from __future__ import annotations

import concurrent.futures
import os
import threading

from common.emulated_gpus import datasheet_profile
from common.profile import Profile
from common.tensors import TensorSpec
from profiler.profiling import profile_model

# Measured on demand; the profile interpolates the batch sizes in between.
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32)
BACKGROUND_NICE = 10        # CFS weight 110 against a serving thread's 1024


def lower_thread_priority(by: int = BACKGROUND_NICE) -> None:
    """Raise the calling thread's nice value by ``by`` (Linux: a thread's own priority; threads it
    starts later inherit it). Where the system refuses, the thread keeps its priority."""
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(os.getpriority(os.PRIO_PROCESS, tid) + by, 19))
    except OSError:
        pass


def background_executor() -> concurrent.futures.ThreadPoolExecutor:
    """One thread, at :data:`BACKGROUND_NICE` below its creator, for background measurements."""
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="background-profile",
                                                 initializer=lower_thread_priority)


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
