"""Reading and checking a model file before anything is loaded into a runtime.

ONNX files are parsed and run through the ONNX checker here (the same check model upload uses), so
that a corrupt or truncated file is reported as such instead of as an obscure runtime error.
TorchScript / exported-program files (``.pt``, ``.pt2``) are only read; the torch runtime validates
them when it loads them (never with pickle).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

from common.model_io import ModelFileError, onnx_io
from profiler.errors import ProfilerError

TORCH_SUFFIXES = (".pt", ".pt2", ".torchscript")
ONNX_SUFFIXES = (".onnx",)


@dataclass(frozen=True)
class ModelFile:
    """A model's bytes with what the profiler records about them."""

    path: str
    data: bytes
    runtime: str  # the runtime kind that serves this format: "onnxruntime" or "torch"
    sha256: str

    @property
    def name(self) -> str:
        """The file name without directory or extension: the default model name in reports."""
        base = os.path.basename(self.path)
        return os.path.splitext(base)[0] or base


def model_sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def runtime_for_path(path: str) -> str:
    """The runtime kind a model file's extension asks for (ONNX Runtime unless it is a torch file)."""
    return "torch" if path.lower().endswith(TORCH_SUFFIXES) else "onnxruntime"


def check_onnx_bytes(data: bytes, where: str) -> None:
    """Raise :class:`ProfilerError` unless ``data`` is an ONNX model the project can serve.

    Uses the same check as model upload (:func:`common.model_io.onnx_io`: parse, ONNX checker,
    a leading batch dimension on every input and output).
    """
    try:
        onnx_io(data)
    except ModelFileError as exc:
        raise ProfilerError(f"{where}: {_first_line(exc)}") from None


def read_model_file(path: str, runtime: str | None = None) -> ModelFile:
    """Read and validate ``path``; ``runtime`` overrides the kind guessed from the extension."""
    if not os.path.exists(path):
        raise ProfilerError(f"{path}: model file not found")
    if not os.path.isfile(path):
        raise ProfilerError(f"{path}: not a regular file")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ProfilerError(f"{path}: cannot read model file ({exc.strerror or exc})") from None
    if not data:
        raise ProfilerError(f"{path}: model file is empty")
    kind = runtime or runtime_for_path(path)
    if kind == "onnxruntime" or (kind == "emulated" and path.lower().endswith(ONNX_SUFFIXES)):
        check_onnx_bytes(data, path)
    return ModelFile(path=path, data=data, runtime=kind, sha256=model_sha256(data))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]
