"""Model runtimes of a backend: ONNX Runtime, PyTorch (optional extra) and the emulated GPU.

Use :func:`load_runtime`; onnxruntime and torch are imported only when a runtime of their kind is
loaded.
"""

from common.runtimes.base import (
    DeviceKind,
    DeviceSpec,
    DeviceUnavailableError,
    FeedError,
    IOSpecs,
    ModelFileError,
    Runtime,
    RuntimeClosedError,
    RuntimeKind,
    check_feeds,
)
from common.runtimes.loader import load_runtime

__all__ = [
    "DeviceKind", "DeviceSpec", "DeviceUnavailableError", "FeedError", "IOSpecs", "ModelFileError",
    "Runtime", "RuntimeClosedError", "RuntimeKind", "check_feeds", "load_runtime",
]
