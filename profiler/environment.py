"""The device, thread and version facts that make a profile reproducible, and the CPU pinning.

A profile is only meaningful for the device type, runtime and thread count it was measured with, so
all three are recorded in its ``meta`` (see ``profiler/README.md``). On CPU the profiler pins its
threads: ONNX Runtime / torch get a fixed intra-op thread count (default: the number of CPUs this
process may run on) and, when asked, the process is bound to a CPU set.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from functools import lru_cache
from importlib import metadata

import numpy

from common.runtimes.base import DeviceSpec
from profiler.errors import ProfilerError

def parse_device(device: str) -> str:
    """Normalise ``cpu`` / ``cuda`` / ``cuda:N`` / ``emulated:<gpu>`` (the backend's device strings)."""
    try:
        return str(DeviceSpec.parse(device))
    except ValueError as exc:
        raise ProfilerError(str(exc)) from None


def is_cuda(device: str) -> bool:
    return device.startswith("cuda")


def is_emulated(device: str) -> bool:
    return device.startswith("emulated:")


def cuda_index(device: str) -> int:
    return int(device.split(":", 1)[1]) if ":" in device else 0


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


@lru_cache(maxsize=None)
def gpu_name(device: str) -> str | None:
    """The marketing name of a CUDA device (torch if present, else nvidia-smi), or None."""
    index = cuda_index(device)
    try:
        import torch  # noqa: PLC0415 - lazy: torch is an optional extra (~1 s to import)

        if torch.cuda.is_available() and index < torch.cuda.device_count():
            return torch.cuda.get_device_name(index)
    except Exception:
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", str(index)],
                             capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        return out or None
    except Exception:
        return None


def device_type_of(device: str) -> str:
    """The device *type* a profile is valid for: ``cpu``, the GPU's name as a slug, or the name of an
    emulated GPU.

    Profiles are kept per device type by the scheduler: ``cuda:0`` and ``cuda:1`` of the same model
    of GPU share one profile (``nvidia-h100-80gb-hbm3``); an unknown GPU is ``cuda``.
    """
    device = parse_device(device)
    if device == "cpu":
        return "cpu"
    if is_emulated(device):
        return device.split(":", 1)[1]
    name = gpu_name(device)
    return _slug(name) if name else "cuda"


def available_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def pin_cpus(cpus: list[int] | None) -> list[int]:
    """Bind this process to ``cpus`` (when given); returns the CPU set now in effect."""
    if cpus:
        bad = [c for c in cpus if c < 0]
        if bad:
            raise ProfilerError(f"--cpus: CPU ids must be >= 0, got {bad}")
        try:
            os.sched_setaffinity(0, set(cpus))
        except (AttributeError, OSError) as exc:
            raise ProfilerError(f"--cpus {','.join(map(str, cpus))}: cannot pin to these CPUs ({exc})") from None
    return available_cpus()


def resolve_threads(threads: int | None, device: str) -> int | None:
    """The intra-op thread count to pin: as given, or one per available CPU on a CPU device."""
    if threads is not None:
        if threads < 1:
            raise ProfilerError(f"threads must be >= 1, got {threads}")
        return threads
    if parse_device(device) == "cpu":
        return len(available_cpus())
    return None  # the runtime's default on a GPU (its CPU threads hardly matter there)


def runtime_version(kind: str) -> str:
    try:
        if kind == "onnxruntime":
            import onnxruntime  # lazy: ~30 ms at start-up, and only its own kind's profile needs its version

            return onnxruntime.__version__
        if kind == "torch":
            import torch  # lazy: torch is an optional extra (~1 s to import)

            return torch.__version__
    except Exception:
        return "unavailable"
    if kind == "emulated":
        try:
            return "nexus-serving " + metadata.version("nexus-serving")
        except metadata.PackageNotFoundError:
            return "nexus-serving (source tree)"
    return "unknown"


@lru_cache(maxsize=None)
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment_meta(device: str, kind: str, threads: int | None, seed: int) -> dict:
    """The reproducibility part of a profile's ``meta``."""
    device = parse_device(device)
    meta = {
        "runtime": kind,
        "runtime_version": runtime_version(kind),
        "device": device,
        "device_name": (cpu_model() if device == "cpu" else f"emulated {device.split(':', 1)[1]}"
                        if is_emulated(device) else (gpu_name(device) or "unknown GPU")),
        "threads": threads,
        "cpus": available_cpus(),
        "seed": seed,
        "host": platform.node(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "numpy": numpy.__version__,
    }
    return meta
