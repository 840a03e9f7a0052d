"""The runtime interface: one loaded model on one device, run batch by batch.

A :class:`Runtime` is created by :func:`common.runtimes.loader.load_runtime` from model bytes, a
:class:`RuntimeKind` and a :class:`DeviceSpec`. Contract every runtime keeps:

- ``inputs`` / ``outputs`` describe the tensors without the batch dimension; ``run`` takes and
  returns arrays batched along dim 0, every input with the same batch size, every output with it.
- ``run`` is called from one executor thread at a time per runtime; runtimes of different models
  may run concurrently in different threads (no shared mutable state between runtimes).
- Errors: :class:`ModelFileError` (a ``ValueError``) for model bytes that cannot be loaded,
  :class:`DeviceUnavailableError` when the device asked for is not there, ``ValueError`` for bad
  device strings and bad feeds, :class:`RuntimeClosedError` after :meth:`Runtime.close`.
"""

from __future__ import annotations

import enum
import re
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from common.model_io import ModelFileError
from common.tensors import TensorSpec

__all__ = [
    "DeviceKind", "DeviceSpec", "DeviceUnavailableError", "FeedError", "IOSpecs", "ModelFileError",
    "Runtime", "RuntimeClosedError", "RuntimeKind", "check_feeds",
]

IOSpecs = tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]
"""(inputs, outputs), each a tuple of :class:`TensorSpec` without the batch dimension."""


class RuntimeKind(enum.StrEnum):
    ONNXRUNTIME = "onnxruntime"
    TORCH = "torch"
    EMULATED = "emulated"


class DeviceKind(enum.StrEnum):
    CPU = "cpu"
    CUDA = "cuda"
    EMULATED = "emulated"


class DeviceUnavailableError(RuntimeError):
    """The device asked for does not exist here (no CUDA provider, no such ordinal, ...)."""


class FeedError(ValueError):
    """Feeds that do not match the runtime's inputs (names, dtype, rank, shape, batch size)."""


class RuntimeClosedError(RuntimeError):
    """``run`` called after ``close``."""


_DEVICE_USAGE = 'expected "cpu", "cuda", "cuda:N" or "emulated:<gpu-name>"'
_GPU_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")


@dataclass(frozen=True)
class DeviceSpec:
    """A parsed device string. ``index`` is the CUDA ordinal; ``gpu_name`` names an emulated GPU."""

    kind: DeviceKind
    index: int = 0
    gpu_name: str = ""

    @staticmethod
    def parse(text: "str | DeviceSpec") -> "DeviceSpec":
        """Parse "cpu", "cuda" (= "cuda:0"), "cuda:N" or "emulated:<gpu-name>"; ValueError otherwise."""
        if isinstance(text, DeviceSpec):
            return text
        if not isinstance(text, str):
            raise ValueError(f"invalid device {text!r}: {_DEVICE_USAGE}")
        head, sep, tail = text.strip().partition(":")
        head = head.lower()
        if head == "cpu" and not sep:
            return DeviceSpec(DeviceKind.CPU)
        if head == "cuda":
            if not sep:
                return DeviceSpec(DeviceKind.CUDA, 0)
            if tail.isdigit() and tail.isascii():
                return DeviceSpec(DeviceKind.CUDA, int(tail))
            raise ValueError(f"invalid device {text!r}: CUDA ordinal must be a non-negative integer; {_DEVICE_USAGE}")
        if head == "emulated":
            if sep and _GPU_NAME_RE.fullmatch(tail):
                return DeviceSpec(DeviceKind.EMULATED, gpu_name=tail)
            raise ValueError(f"invalid device {text!r}: an emulated device needs a GPU name "
                             f"(letters, digits, '_', '.', '-'); {_DEVICE_USAGE}")
        raise ValueError(f"invalid device {text!r}: {_DEVICE_USAGE}")

    @property
    def is_cuda(self) -> bool:
        return self.kind is DeviceKind.CUDA

    @property
    def is_emulated(self) -> bool:
        return self.kind is DeviceKind.EMULATED

    def __str__(self) -> str:
        if self.kind is DeviceKind.CUDA:
            return f"cuda:{self.index}"
        if self.kind is DeviceKind.EMULATED:
            return f"emulated:{self.gpu_name}"
        return "cpu"


def check_feeds(inputs: Sequence[TensorSpec], feeds: Mapping[str, np.ndarray]) -> int:
    """Validate ``feeds`` against ``inputs`` and return the batch size; :class:`FeedError` says what is wrong."""
    expected = {spec.name for spec in inputs}
    given = set(feeds)
    if given != expected:
        missing, extra = sorted(expected - given), sorted(given - expected)
        parts = ([f"missing {missing}"] if missing else []) + ([f"unexpected {extra}"] if extra else [])
        raise FeedError(f"feeds do not match the model's inputs: {', '.join(parts)}")
    batch: int | None = None
    for spec in inputs:
        array = feeds[spec.name]
        if not isinstance(array, np.ndarray):
            raise FeedError(f"input {spec.name!r}: expected a numpy array, got {type(array).__name__}")
        if array.dtype != spec.dtype:
            raise FeedError(f"input {spec.name!r}: expected {spec.datatype} ({spec.dtype}), got {array.dtype}")
        if array.ndim != len(spec.shape) + 1:
            raise FeedError(f"input {spec.name!r}: expected shape [batch, {', '.join(map(str, spec.shape))}], "
                            f"got {list(array.shape)}")
        for axis, (want, got) in enumerate(zip(spec.shape, array.shape[1:]), start=1):
            if want >= 0 and want != got:
                raise FeedError(f"input {spec.name!r}: dimension {axis} must be {want}, got {got} "
                                f"(shape {list(array.shape)})")
        if batch is None:
            batch = array.shape[0]
        elif array.shape[0] != batch:
            raise FeedError(f"input {spec.name!r}: batch size {array.shape[0]} differs from the other inputs' {batch}")
    if not batch:
        raise FeedError("empty batch: batch size must be at least 1")
    return batch


class Runtime(ABC):
    """One model loaded on one device. Subclasses set ``inputs``, ``outputs``, ``device`` in ``__init__``."""

    kind: RuntimeKind
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    device: str

    def __init__(self) -> None:
        self._closed = False
        self._close_lock = threading.Lock()

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one batch: feeds by input name, batched along dim 0; outputs by name, same batch size."""
        if self._closed:
            raise RuntimeClosedError(f"{type(self).__name__} on {self.device} is closed")
        batch = check_feeds(self.inputs, feeds)
        return self._run(feeds, batch)

    @abstractmethod
    def _run(self, feeds: Mapping[str, np.ndarray], batch: int) -> dict[str, np.ndarray]:
        """Run validated feeds of ``batch`` items."""

    @abstractmethod
    def memory_mb(self) -> float:
        """Memory this model holds: measured device memory where measurable, else weights + activations estimate."""

    def close(self) -> None:
        """Release the model; idempotent. ``run`` afterwards raises :class:`RuntimeClosedError`."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._release()

    def _release(self) -> None:
        """Free resources (called once by :meth:`close`)."""

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(device={self.device!r}, inputs={[s.name for s in self.inputs]}, "
                f"outputs={[s.name for s in self.outputs]})")


def io_nbytes(specs: Sequence[TensorSpec], batch: int) -> int:
    """Bytes of a batch of these tensors; variable dimensions count as 1."""
    total = 0
    for spec in specs:
        items = int(np.prod([d if d >= 0 else 1 for d in spec.shape], dtype=np.int64))
        total += items * spec.dtype.itemsize * batch
    return total


def check_io_override(io: IOSpecs | None) -> IOSpecs | None:
    """Normalise an ``io`` override to tuples and check its datatypes; ValueError when malformed."""
    if io is None:
        return None
    try:
        inputs, outputs = io
    except (TypeError, ValueError):
        raise ValueError("io must be a pair (inputs, outputs) of TensorSpec sequences") from None
    inputs, outputs = tuple(inputs), tuple(outputs)
    if not inputs or not outputs:
        raise ValueError("io must list at least one input and one output")
    for spec in inputs + outputs:
        if not isinstance(spec, TensorSpec):
            raise ValueError(f"io entries must be TensorSpec, got {type(spec).__name__}")
        try:
            spec.dtype
        except KeyError as exc:
            raise ValueError(f"io tensor {spec.name!r}: {exc.args[0]}") from None
    names = [s.name for s in inputs] + [s.name for s in outputs]
    if len(set(s.name for s in inputs)) != len(inputs) or len(set(s.name for s in outputs)) != len(outputs):
        raise ValueError(f"io tensor names must be unique among inputs and among outputs, got {names}")
    return inputs, outputs
