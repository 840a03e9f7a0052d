"""Loading a model into the runtime the backend uses, so the profiler measures what is served.

Everything the profiler executes goes through :func:`common.runtimes.load_runtime`; this module
only translates the profiler's options (thread count, device) and turns load failures into
:class:`ProfilerError`.
"""

from __future__ import annotations

from typing import Any

from common.runtimes import load_runtime
from profiler.errors import ProfilerError

RUNTIME_KINDS = ("onnxruntime", "torch", "emulated")


def open_runtime(kind: str, model_bytes: bytes, device: str, *, threads: int | None = None,
                 profile: Any = None, io: Any = None, where: str = "model") -> Any:
    """Load ``model_bytes`` with runtime ``kind`` on ``device``; ProfilerError says why it failed.

    ``io``: (inputs, outputs) TensorSpecs, needed by TorchScript files (see ``load_runtime``)."""
    if kind not in RUNTIME_KINDS:
        raise ProfilerError(f"unknown runtime {kind!r}; choose one of {', '.join(RUNTIME_KINDS)}")
    try:
        return load_runtime(kind, model_bytes, device, profile=profile, intra_op_threads=threads, io=io)
    except ProfilerError:
        raise
    except Exception as exc:
        text = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise ProfilerError(f"{where}: cannot load with runtime {kind} on {device} ({text})") from None


def import_runtime(kind: str) -> None:
    """Import the runtime's libraries now (so that a memory baseline taken next excludes them)."""
    try:
        if kind == "onnxruntime":
            import onnxruntime  # noqa: F401 - lazy: ~30 ms at start-up, needed only to profile this kind
        elif kind == "torch":
            import torch  # noqa: F401 - lazy: torch is an optional extra (~1 s to import)
    except ImportError as exc:
        raise ProfilerError(f"runtime {kind} is not installed ({exc})") from None
