"""Warm-up of a session before it takes traffic: Triton's ``model_warmup`` samples, or a default.

A backend runs a session's warm-up batches after loading its runtime and before it answers the
model-table push that placed the session there (backend/model_table.py); the scheduler routes frontends
to a backend only after that answer (globalsched/actuators/distribution.py), so no request meets a cold
session. This module holds the value types, their checks against a model's inputs, the default
warm-up and the arrays a sample feeds; the backend decides when the batches run.

- **Samples** (:class:`WarmupSample`) come from ``config.pbtxt``'s ``model_warmup``
  (nexus/model_repository.py), travel with the model (``UploadHeader.warmup``, the model database,
  ``ModelDesc.warmup``) and are checked on every way in (:func:`check_samples`): every model input
  exactly once, its data type, concrete dims that fit the model's, one data source, a file's bytes
  the size of one row; ``batch_size`` >= 1 and within ``max_batch_size`` when the config sets one;
  ``count`` 0 means once, as in Triton. Each sample runs ``count`` batches of ``batch_size`` rows.
- **Default** (a model without ``model_warmup``, :func:`default_samples`): batches at each of
  batch 1 and the session's planned batch, random data of the model's input shapes (a variable
  dimension as 1). Batch 1 is what a lone request after a quiet spell runs; the planned batch is what
  the plan expects under load; eager batching runs every size in between, whose first runs cost
  ONNX Runtime on CPU little (benchmarks/warmup.md). Each size runs as many times as the runtime
  needs before that shape runs at its steady time (:func:`default_runs`): ONNX Runtime once (its
  session creation optimises the graph and plans memory; on a GPU its first run at a shape loads
  the kernels and searches cuDNN's convolution algorithms, and later runs reuse them), TorchScript
  twice (its profiling executor optimises the graph it recorded in the first call), an emulated
  device once (it stands for a GPU under ONNX Runtime). A warm-up batch that holds the backend's
  answer to the table push holds a plan's make step too (globalsched/actuators/distribution.py): a
  run more than the runtime needs delays the capacity a load step waits for (benchmarks/elastic.md).
  Which batches hold the answer and which run after it, the backend decides
  (backend/warmup_runner.py).
- **Data**: ``zero_data`` zeros; ``random_data`` uniform [0, 1) for floating types and 0 or 1 for
  integer and boolean ones (an index any embedding table has); ``input_data_file`` one row of raw
  row-major bytes, repeated to fill the batch. The default uses random data: zeros take fast paths
  (sparse, denormal-free) that real inputs do not.
"""

from __future__ import annotations

import base64
import enum
import json
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np

from common.pb import control
from common.runtimes.base import RuntimeKind
from common.tensors import TensorSpec, numpy_dtype

MAX_SAMPLES = 64               # samples per model
MAX_COUNT = 1000               # executions of one sample
MAX_BATCH_SIZE = 1024          # rows of one warm-up batch
MAX_DATA_BYTES = 16 * 1024 * 1024   # input_data_file bytes per model, all samples together
# Default warm-up: batches at each size, by runtime (module docstring); a runtime not named, the most.
DEFAULT_RUNS = {RuntimeKind.ONNXRUNTIME: 1, RuntimeKind.TORCH: 2, RuntimeKind.EMULATED: 1}


class WarmupError(ValueError):
    """Warm-up samples that cannot run on the model; the message names the field."""


class WarmupData(enum.StrEnum):
    """Where a warm-up input's values come from (Triton's ``input_data_type``)."""

    ZERO = "zero_data"
    RANDOM = "random_data"
    FILE = "input_data_file"


@dataclass(frozen=True)
class WarmupInput:
    name: str
    datatype: str                  # KServe datatype name
    dims: tuple[int, ...]          # one row, without the batch dimension
    data: WarmupData
    raw: bytes = b""               # FILE: one row, row-major little-endian
    source: str = ""               # FILE: the file it came from, for messages


@dataclass(frozen=True)
class WarmupSample:
    name: str
    batch_size: int
    inputs: tuple[WarmupInput, ...]
    count: int = 1                 # batches of this sample, at least 1

    @property
    def runs(self) -> int:
        return max(self.count, 1)


def _field(index: int, sample: WarmupSample) -> str:
    return f"model_warmup[{index}]" + (f" ({sample.name!r})" if sample.name else "")


def check_samples(samples: Sequence[WarmupSample], inputs: Sequence[TensorSpec], max_batch_size: int = 0) -> None:
    """Raise :class:`WarmupError` naming the field when ``samples`` cannot run on a model whose inputs
    (without the batch dimension) are ``inputs``; ``max_batch_size`` > 0 bounds ``batch_size``."""
    if len(samples) > MAX_SAMPLES:
        raise WarmupError(f"model_warmup: {len(samples)} samples; at most {MAX_SAMPLES} are accepted")
    by_name = {s.name: s for s in inputs}
    data_bytes = 0
    for i, sample in enumerate(samples):
        where = _field(i, sample)
        if sample.batch_size < 1:
            raise WarmupError(f"{where}.batch_size must be >= 1, got {sample.batch_size}")
        if 0 < max_batch_size < sample.batch_size:
            raise WarmupError(f"{where}.batch_size {sample.batch_size} exceeds max_batch_size {max_batch_size}")
        if sample.batch_size > MAX_BATCH_SIZE:
            raise WarmupError(f"{where}.batch_size {sample.batch_size} exceeds the largest warm-up batch, "
                              f"{MAX_BATCH_SIZE}")
        if sample.count > MAX_COUNT:
            raise WarmupError(f"{where}.count {sample.count} exceeds {MAX_COUNT}")
        given = [t.name for t in sample.inputs]
        for name in given:
            if given.count(name) > 1:
                raise WarmupError(f'{where}.inputs["{name}"] is given twice')
        missing = [n for n in by_name if n not in given]
        if missing:
            raise WarmupError(f"{where}.inputs: no entry for the model's input(s) {', '.join(map(repr, missing))} "
                              f"(every input needs one)")
        for t in sample.inputs:
            field = f'{where}.inputs["{t.name}"]'
            spec = by_name.get(t.name)
            if spec is None:
                raise WarmupError(f"{field}: the model has no input of that name (its inputs: {', '.join(by_name)})")
            if t.datatype != spec.datatype:
                raise WarmupError(f"{field}.data_type {_triton_type(t.datatype)} contradicts the model's "
                                  f"{_triton_type(spec.datatype)}")
            try:
                itemsize = numpy_dtype(t.datatype).itemsize
            except KeyError:
                raise WarmupError(f"{field}.data_type {_triton_type(t.datatype)}: warm-up data of this type is not "
                                  f"supported") from None
            if len(t.dims) != len(spec.shape) or any(d < 1 for d in t.dims) or any(
                    m not in (-1, d) for d, m in zip(t.dims, spec.shape)):
                raise WarmupError(f"{field}.dims {list(t.dims)} do not fit the model's {list(spec.shape)} (without "
                                  f"the batch dimension; each must be positive, and equal where the model's is fixed)")
            if t.data is WarmupData.FILE:
                expected = int(np.prod(t.dims, dtype=np.int64)) * itemsize
                if len(t.raw) != expected:
                    raise WarmupError(f"{field}.input_data_file {t.source or '(inline)'!r} holds {len(t.raw)} bytes; "
                                      f"one row of dims {list(t.dims)} {t.datatype} takes {expected}")
                data_bytes += len(t.raw)
                if data_bytes > MAX_DATA_BYTES:
                    raise WarmupError(f"{field}.input_data_file: warm-up data over {MAX_DATA_BYTES} bytes in all")


def _triton_type(datatype: str) -> str:
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


def default_batch_sizes(planned_batch: int) -> tuple[int, ...]:
    """Batch sizes of the default warm-up: 1 and the planned batch."""
    return tuple(sorted({1, max(1, planned_batch)}))


def default_runs(kind: RuntimeKind) -> int:
    """Batches of the default warm-up at each size on a runtime of ``kind`` (module docstring)."""
    return DEFAULT_RUNS.get(kind, max(DEFAULT_RUNS.values()))


def default_samples(inputs: Sequence[TensorSpec], planned_batch: int, kind: RuntimeKind) -> tuple[WarmupSample, ...]:
    """The default warm-up of a session on a runtime of ``kind`` (module docstring): random data, batch 1
    and the planned batch, each :func:`default_runs` times."""
    row = tuple(WarmupInput(s.name, s.datatype, tuple(d if d > 0 else 1 for d in s.shape), WarmupData.RANDOM)
                for s in inputs)
    runs = default_runs(kind)
    return tuple(WarmupSample(f"default batch {b}", b, row, runs) for b in default_batch_sizes(planned_batch))


def feeds(sample: WarmupSample, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The batch a sample runs: every input's row repeated ``batch_size`` times."""
    out = {}
    for t in sample.inputs:
        dtype = numpy_dtype(t.datatype)
        shape = (sample.batch_size, *t.dims)
        if t.data is WarmupData.FILE:
            row = np.frombuffer(t.raw, dtype=dtype).reshape(t.dims)
            out[t.name] = np.ascontiguousarray(np.broadcast_to(row, shape))
        elif t.data is WarmupData.RANDOM and np.issubdtype(dtype, np.floating):
            out[t.name] = rng.random(shape, dtype=np.float64).astype(dtype)
        elif t.data is WarmupData.RANDOM:
            out[t.name] = rng.integers(0, 2, shape).astype(dtype)
        else:
            out[t.name] = np.zeros(shape, dtype)
    return out


# ---- protobuf and JSON (the edges: uploads, the model database, model tables) -----------------------


def to_pb(samples: Iterable[WarmupSample]) -> list[control.WarmupSample]:
    out = []
    for s in samples:
        msg = control.WarmupSample(name=s.name, batch_size=s.batch_size, count=s.count)
        for t in s.inputs:
            i = msg.inputs.add(name=t.name, datatype=t.datatype, dims=list(t.dims), source=t.source)
            if t.data is WarmupData.FILE:
                i.raw = t.raw
            elif t.data is WarmupData.RANDOM:
                i.random_data = True
            else:
                i.zero_data = True
        out.append(msg)
    return out


def from_pb(messages: Iterable[control.WarmupSample]) -> tuple[WarmupSample, ...]:
    """Samples from their messages; WarmupError naming the field when an input has no data source."""
    samples = []
    for i, m in enumerate(messages):
        inputs = []
        for t in m.inputs:
            which = t.WhichOneof("data")
            if which is None:
                raise WarmupError(f'model_warmup[{i}].inputs["{t.name}"]: one of zero_data, random_data or '
                                  f"input_data_file is required")
            data = {"zero_data": WarmupData.ZERO, "random_data": WarmupData.RANDOM, "raw": WarmupData.FILE}[which]
            inputs.append(WarmupInput(t.name, t.datatype, tuple(t.dims), data, t.raw, t.source))
        samples.append(WarmupSample(m.name, m.batch_size, tuple(inputs), m.count))
    return tuple(samples)


def to_json(samples: Sequence[WarmupSample]) -> str:
    """The model database's form ("" for none); file data in base64."""
    if not samples:
        return ""
    return json.dumps([{"name": s.name, "batch_size": s.batch_size, "count": s.count,
                        "inputs": [{"name": t.name, "datatype": t.datatype, "dims": list(t.dims), "data": t.data.value,
                                    "raw": base64.b64encode(t.raw).decode(), "source": t.source}
                                   for t in s.inputs]} for s in samples])


def from_json(text: str) -> tuple[WarmupSample, ...]:
    if not text:
        return ()
    return tuple(WarmupSample(s["name"], s["batch_size"], tuple(
        WarmupInput(t["name"], t["datatype"], tuple(t["dims"]), WarmupData(t["data"]), base64.b64decode(t["raw"]),
                    t.get("source", "")) for t in s["inputs"]), s["count"]) for s in json.loads(text))


def describe(samples: Sequence[WarmupSample]) -> list[Mapping]:
    """For listings: each sample's name, batch size, count and inputs' sources (no data)."""
    return [{"name": s.name, "batch_size": s.batch_size, "count": s.runs,
             "inputs": {t.name: t.source or t.data.value for t in s.inputs}} for s in samples]
