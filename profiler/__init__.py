"""Profiler: batch-latency profiles of a model on a device, and multi-tenant measurement.

Entry points (imported lazily, so ``import profiler`` stays cheap):

- :func:`profiler.profiling.profile_model` -> :class:`common.profile.Profile`
- :func:`profiler.multitenant.measure_multitenant` -> report dict
- :func:`profiler.slowdown.apply_colocation_slowdown` -> Profile with l(b) inflated for a shared device

Formats and method: ``profiler/README.md``.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "profile_model": "profiler.profiling",
    "measure_multitenant": "profiler.multitenant",
    "TenantSpec": "profiler.multitenant",
    "apply_colocation_slowdown": "profiler.slowdown",
    "slowdowns_from_report": "profiler.slowdown",
    "ProfilerError": "profiler.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'profiler' has no attribute {name!r}")
