"""Loading a model into the runtime of its kind: the one place that knows every implementation.

:mod:`common.runtimes.base` holds the interface and imports none of its implementations; this
module imports them all and picks one. The implementations import onnxruntime / torch only when a
runtime of their kind is loaded.
"""

from __future__ import annotations

from common.profile import Profile
from common.runtimes.base import DeviceSpec, IOSpecs, Runtime, RuntimeKind, check_io_override
from common.runtimes.emulated import EmulatedRuntime
from common.runtimes.onnx_runtime import OnnxRuntime
from common.runtimes.torch_runtime import TorchRuntime


def load_runtime(kind: "RuntimeKind | str", model_bytes: bytes, device: "DeviceSpec | str", *,
                 profile: Profile | None = None, intra_op_threads: int | None = None,
                 io: IOSpecs | None = None) -> Runtime:
    """Load ``model_bytes`` as a runtime of ``kind`` on ``device``.

    - ``onnxruntime``: an ONNX model on "cpu" or "cuda[:N]"; specs read from the model (``io`` may
      override them, with the same names and datatypes).
    - ``torch``: a TorchScript archive or a ``torch.export`` (.pt2) archive on "cpu" or "cuda[:N]";
      TorchScript carries no static specs, so ``io`` is required for it (the model database keeps
      them in the model's io sidecar JSON, see :func:`common.model_io.parse_io_json`).
    - ``emulated``: only on "emulated:<gpu>" devices, and emulated devices take only this kind;
      needs ``profile``; specs from the ONNX model, or from ``io`` when given (then the bytes are
      not parsed, so any model format can be emulated).

    ``intra_op_threads``: threads per model on CPU (None: the runtime's default, all cores).
    """
    try:
        kind = RuntimeKind(kind)
    except ValueError:
        raise ValueError(f"unknown runtime kind {kind!r}; known: {', '.join(k.value for k in RuntimeKind)}") from None
    spec = DeviceSpec.parse(device)
    if intra_op_threads is not None and (isinstance(intra_op_threads, bool) or not isinstance(intra_op_threads, int)
                                         or intra_op_threads < 1):
        raise ValueError(f"intra_op_threads must be a positive integer or None, got {intra_op_threads!r}")
    io = check_io_override(io)
    if not isinstance(model_bytes, (bytes, bytearray, memoryview)):
        raise ValueError(f"model_bytes must be bytes, got {type(model_bytes).__name__}")
    model_bytes = bytes(model_bytes)
    if (kind is RuntimeKind.EMULATED) != spec.is_emulated:
        raise ValueError(f"runtime kind {kind.value!r} cannot run on device {str(spec)!r}: the emulated runtime "
                         f"runs exactly on emulated:<gpu> devices")
    if kind is RuntimeKind.ONNXRUNTIME:
        return OnnxRuntime(model_bytes, spec, intra_op_threads=intra_op_threads, io=io)
    if kind is RuntimeKind.TORCH:
        return TorchRuntime(model_bytes, spec, intra_op_threads=intra_op_threads, io=io)
    if profile is None:
        raise ValueError("the emulated runtime needs the model's profile (profile=...)")
    return EmulatedRuntime(model_bytes, spec, profile, io=io)
