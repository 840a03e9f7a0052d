"""ONNX Runtime: an InferenceSession built from model bytes on CPU or a CUDA device.

Providers come from the device: "cpu" uses only the CPU execution provider; "cuda:N" uses the CUDA
execution provider on device N (CPU EP as fallback for unsupported nodes) and fails with
:class:`DeviceUnavailableError` when onnxruntime has no CUDA provider or silently could not enable it.
Specs are read from the session: the leading dimension of every input and output is the batch.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from common.runtimes.base import (
    DeviceSpec, DeviceUnavailableError, IOSpecs, ModelFileError, Runtime, RuntimeClosedError, RuntimeKind, io_nbytes,
)
from common.tensors import TensorSpec

CUDA_EP = "CUDAExecutionProvider"
CPU_EP = "CPUExecutionProvider"

# onnxruntime NodeArg.type strings -> KServe datatypes.
_ORT_TO_KSERVE = {
    "tensor(float)": "FP32", "tensor(double)": "FP64", "tensor(float16)": "FP16", "tensor(bool)": "BOOL",
    "tensor(int8)": "INT8", "tensor(int16)": "INT16", "tensor(int32)": "INT32", "tensor(int64)": "INT64",
    "tensor(uint8)": "UINT8", "tensor(uint16)": "UINT16", "tensor(uint32)": "UINT32", "tensor(uint64)": "UINT64",
}

_BYTES_PER_MB = 1024.0 * 1024.0


def providers_for(device: DeviceSpec, available: list[str]) -> list:
    """The provider list for ``device`` given onnxruntime's available providers (pure)."""
    if device.is_cuda:
        if CUDA_EP not in available:
            raise DeviceUnavailableError(
                f"CUDA requested but onnxruntime has no {CUDA_EP} (available: {', '.join(available)}); "
                f"install onnxruntime-gpu or use device 'cpu'")
        return [(CUDA_EP, {"device_id": device.index}), CPU_EP]
    if device.is_emulated:
        raise ValueError(f"onnxruntime cannot run on {device}")
    return [CPU_EP]


def _spec(node_arg, role: str) -> TensorSpec:
    datatype = _ORT_TO_KSERVE.get(node_arg.type)
    if datatype is None:
        raise ModelFileError(f"{role} {node_arg.name!r}: unsupported type {node_arg.type}")
    dims = [d if isinstance(d, int) and d >= 0 else -1 for d in (node_arg.shape or [])]
    if not dims:
        raise ModelFileError(f"{role} {node_arg.name!r}: needs a leading batch dimension (it is a scalar)")
    return TensorSpec(node_arg.name, datatype, tuple(dims[1:]))


def _merge_override(model: tuple[TensorSpec, ...], override: tuple[TensorSpec, ...], role: str) -> tuple[TensorSpec, ...]:
    """Use ``override`` specs, which must name the model's tensors with the same datatypes."""
    by_name = {s.name: s for s in model}
    if sorted(by_name) != sorted(s.name for s in override):
        raise ValueError(f"io override {role}s {[s.name for s in override]} do not match the model's "
                         f"{[s.name for s in model]}")
    for spec in override:
        if spec.datatype != by_name[spec.name].datatype:
            raise ValueError(f"io override {role} {spec.name!r}: datatype {spec.datatype} but the model "
                             f"declares {by_name[spec.name].datatype}")
    return override


class OnnxRuntime(Runtime):
    kind = RuntimeKind.ONNXRUNTIME

    def __init__(self, model_bytes: bytes, device: DeviceSpec, *, intra_op_threads: int | None = None,
                 io: IOSpecs | None = None) -> None:
        super().__init__()
        import onnxruntime as ort  # lazy: costs ~30 ms at start-up; only processes that run ONNX models need it

        providers = providers_for(device, ort.get_available_providers())
        options = ort.SessionOptions()
        # A backend serves many models from one executor thread: idle ORT threads must not spin
        # (ten spinning pools made ten models 2-10x slower on two cores; benchmarks/prefix_batching.md).
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.add_session_config_entry("session.inter_op.allow_spinning", "0")
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.inter_op_num_threads = 1
        if intra_op_threads is not None:
            options.intra_op_num_threads = intra_op_threads
        options.log_severity_level = 3  # errors only
        try:
            session = ort.InferenceSession(model_bytes, sess_options=options, providers=providers)
        except Exception as exc:  # onnxruntime raises InvalidProtobuf, Fail, InvalidGraph, ... (all RuntimeError)
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ModelFileError(f"onnxruntime cannot load the model: {type(exc).__name__}: {message}") from None
        if device.is_cuda and CUDA_EP not in session.get_providers():
            raise DeviceUnavailableError(
                f"CUDA requested but onnxruntime could not enable {CUDA_EP} on {device} "
                f"(CUDA/cuDNN libraries missing or no such device)")
        inputs = tuple(_spec(a, "input") for a in session.get_inputs())
        outputs = tuple(_spec(a, "output") for a in session.get_outputs())
        if io is not None:
            inputs = _merge_override(inputs, io[0], "input")
            outputs = _merge_override(outputs, io[1], "output")
        self.inputs, self.outputs, self.device = inputs, outputs, str(device)
        self._session = session
        self._output_names = [a.name for a in session.get_outputs()]
        self._weights_bytes = len(model_bytes)
        self._max_batch_seen = 1

    def _run(self, feeds: Mapping[str, np.ndarray], batch: int) -> dict[str, np.ndarray]:
        session = self._session
        if session is None:
            raise RuntimeClosedError(f"onnxruntime session on {self.device} is closed")
        self._max_batch_seen = max(self._max_batch_seen, batch)
        results = session.run(self._output_names, dict(feeds))
        return dict(zip(self._output_names, results))

    def memory_mb(self) -> float:
        """Estimate: serialized model size (≈ weights) + inputs and outputs of the largest batch run so far.

        onnxruntime exposes no per-session memory counter, so this is an estimate on CUDA too.
        """
        return (self._weights_bytes + io_nbytes(self.inputs + self.outputs, self._max_batch_seen)) / _BYTES_PER_MB

    @property
    def providers(self) -> list[str]:
        """The execution providers the session actually uses, in priority order."""
        return list(self._session.get_providers())

    def _release(self) -> None:
        self._session = None
