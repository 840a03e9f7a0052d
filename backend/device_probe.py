"""Which device a backend can use, and how much memory it has: probed once at start, so that a
backend that cannot use its ``--device`` says why before it registers."""

from __future__ import annotations

import os

from common.emulated_gpus import GPU_TYPES
from common.runtimes import DeviceSpec


def device_problem(device: str) -> str | None:
    """Why this backend cannot use ``device`` (a clear message for the operator), or None when it can.

    CPU and emulated devices always work. A CUDA device works when onnxruntime's CUDA execution
    provider actually starts on it (probed with a one-node model) or torch sees it.
    """
    try:
        spec = DeviceSpec.parse(device)
    except ValueError as exc:
        return str(exc)
    if not spec.is_cuda:
        return None
    reasons = []
    try:
        import onnxruntime as ort  # lazy: ~30 ms at start-up, and only a CUDA device is probed with it

        providers = ort.get_available_providers()
        if "CUDAExecutionProvider" in providers:
            if _ort_cuda_works(ort, spec.index):
                return None
            reasons.append(f"onnxruntime's CUDAExecutionProvider could not start on {spec} "
                           f"(no such GPU, or CUDA/cuDNN libraries missing)")
        else:
            reasons.append(f"onnxruntime has no CUDAExecutionProvider (available: {', '.join(providers)}; "
                           f"install onnxruntime-gpu)")
    except ImportError:
        reasons.append("onnxruntime is not installed")
    try:
        import torch  # lazy: torch is an optional extra (~1 s to import)

        if torch.cuda.is_available():
            count = torch.cuda.device_count()
            if spec.index < count:
                return None
            reasons.append(f"torch sees {count} CUDA device(s), so no {spec}")
        else:
            reasons.append("torch sees no CUDA device")
    except ImportError:
        reasons.append("torch is not installed")
    return f"device {spec} is not available: {'; '.join(reasons)}. Use --device cpu or emulated:<gpu-name>"


def _ort_cuda_works(ort, index: int) -> bool:
    from onnx import TensorProto, helper  # lazy: onnx costs ~30 ms at start-up; only the CUDA probe needs it

    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    options = ort.SessionOptions()
    options.log_severity_level = 4
    try:
        session = ort.InferenceSession(model.SerializeToString(), sess_options=options,
                                       providers=[("CUDAExecutionProvider", {"device_id": index})])
    except Exception:
        return False
    return "CUDAExecutionProvider" in session.get_providers()


def detect_memory_mb(device: str) -> float:
    if device == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1024 * 1024)
        except (ValueError, OSError):
            return 0.0
    if device.startswith("emulated:"):
        gpu = GPU_TYPES.get(device.split(":", 1)[1])
        return gpu.memory_mb if gpu else 0.0
    return 0.0
