"""Reading a model file's input/output description without running it (no pickle is ever loaded)."""

from __future__ import annotations

import io
import json
import zipfile

from common.tensors import TensorSpec

# onnx.TensorProto element types -> KServe datatype names.
_ONNX_ELEM_TO_KSERVE = {1: "FP32", 2: "UINT8", 3: "INT8", 4: "UINT16", 5: "INT16", 6: "INT32", 7: "INT64",
                        9: "BOOL", 10: "FP16", 11: "FP64", 12: "UINT32", 13: "UINT64"}


class ModelFileError(ValueError):
    """A model file that cannot be served; the message says why."""


def onnx_io(model_bytes: bytes) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """Validate an ONNX file with the ONNX checker and return (inputs, outputs), batch dim stripped.

    Every input and output must have a leading batch dimension (dynamic, or fixed); the specs list
    the remaining dimensions, -1 where symbolic.
    """
    import onnx  # lazy: onnx costs ~30 ms at start-up; the nexus command imports this module for --help

    try:
        model = onnx.load_model_from_string(model_bytes)
    except Exception as exc:  # protobuf DecodeError and friends
        raise ModelFileError(f"not an ONNX model: {exc.__class__.__name__}: {exc}".strip()) from None
    if not model.graph.node and not model.graph.output:
        raise ModelFileError("not an ONNX model: the file holds no graph")
    try:
        onnx.checker.check_model(model)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
        raise ModelFileError(f"ONNX checker rejected the model: {first}") from None
    initializers = {t.name for t in model.graph.initializer}

    def spec(value, kind: str) -> TensorSpec:
        tensor_type = value.type.tensor_type
        datatype = _ONNX_ELEM_TO_KSERVE.get(tensor_type.elem_type)
        if datatype is None:
            raise ModelFileError(f"{kind} {value.name!r}: unsupported element type {tensor_type.elem_type}")
        dims = [d.dim_value if d.HasField("dim_value") else -1 for d in tensor_type.shape.dim]
        if not dims:
            raise ModelFileError(f"{kind} {value.name!r}: needs a leading batch dimension")
        return TensorSpec(value.name, datatype, tuple(dims[1:]))

    inputs = tuple(spec(v, "input") for v in model.graph.input if v.name not in initializers)
    outputs = tuple(spec(v, "output") for v in model.graph.output)
    if not inputs or not outputs:
        raise ModelFileError("the model needs at least one input and one output")
    return inputs, outputs


def parse_io_json(text: str) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """Parse ``{"inputs": [{name, datatype, shape}], "outputs": [...]}`` (shapes without batch dim)."""
    try:
        obj = json.loads(text)
        inputs = tuple(TensorSpec.from_json_obj(o) for o in obj["inputs"])
        outputs = tuple(TensorSpec.from_json_obj(o) for o in obj["outputs"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelFileError(f"io description: expected {{'inputs': [...], 'outputs': [...]}} with name, "
                             f"datatype and shape per tensor ({exc.__class__.__name__}: {exc})") from None
    for t in inputs + outputs:
        try:
            t.dtype
        except KeyError as exc:
            raise ModelFileError(f"io description: tensor {t.name!r}: {exc.args[0]}") from None
    if not inputs or not outputs:
        raise ModelFileError("io description: needs at least one input and one output")
    return inputs, outputs


def io_to_json(inputs, outputs) -> str:
    return json.dumps({"inputs": [t.to_json_obj() for t in inputs], "outputs": [t.to_json_obj() for t in outputs]})


def torch_archive_check(model_bytes: bytes) -> None:
    """A TorchScript / torch.export file is a zip archive; refuse anything else before loading it."""
    if not zipfile.is_zipfile(io.BytesIO(model_bytes)):
        raise ModelFileError("not a TorchScript or torch.export archive (expected a zip file)")
