"""Validation and conversion of KServe v2 inference requests at the frontend's edge.

:func:`parse_infer_request` turns a ``ModelInferRequest`` into a :class:`ParsedRequest` (raw input
bytes in the model's input order, the row count, the outputs asked for) or raises
:class:`RequestError` with the gRPC status and a precise message. It never decodes tensors that
arrive as raw bytes; typed ``contents`` are packed into raw bytes once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import grpc
import numpy as np

from common.tensors import KSERVE_TO_NUMPY
from frontend.routing import ModelEntry

_CONTENTS_FIELD = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents",
}


class RequestError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class ParsedRequest:
    inputs: list[bytes]
    rows: int
    output_indices: tuple[int, ...]     # which of the model's outputs to return, in order
    timeout_us: int                      # from the request's "timeout" parameter, 0 when absent


def _invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


def parse_infer_request(request, model: ModelEntry) -> ParsedRequest:
    by_name = {}
    for i, tensor in enumerate(request.inputs):
        name = tensor.name
        if name in by_name:
            raise _invalid(f"input {name!r} is given twice")
        by_name[name] = (i, tensor)
    specs = model.inputs
    if len(by_name) != len(specs) or any(s.name not in by_name for s in specs):
        expected = {s.name for s in specs}
        unknown = sorted(set(by_name) - expected)
        if unknown:
            raise _invalid(f"unexpected input {unknown[0]!r} for model {model.name!r}; "
                           f"expected {sorted(expected)}")
        missing = sorted(expected - set(by_name))
        if missing:
            raise _invalid(f"missing input {missing[0]!r} for model {model.name!r}")
    raw_contents = request.raw_input_contents
    raw_count = len(raw_contents)
    if raw_count and raw_count != len(by_name):
        raise _invalid(f"raw_input_contents has {raw_count} entries for {len(by_name)} inputs")
    rows = None
    raws = []
    item_counts = model.input_item_counts
    for k, spec in enumerate(specs):
        index, tensor = by_name[spec.name]
        if tensor.datatype != spec.datatype:
            raise _invalid(f"input {spec.name!r}: datatype {tensor.datatype} does not match the model's "
                           f"{spec.datatype}")
        shape = tuple(tensor.shape)
        item_shape = spec.shape
        if len(shape) != len(item_shape) + 1:
            raise _invalid(f"input {spec.name!r}: shape {list(shape)} does not match the model's "
                           f"{[-1, *item_shape]} (a leading batch dimension, then {list(item_shape)})")
        if shape[1:] != item_shape:
            for got, want in zip(shape[1:], item_shape):
                if want >= 0 and got != want:
                    raise _invalid(f"input {spec.name!r}: shape {list(shape)} does not match the model's "
                                   f"{[-1, *item_shape]}")
        if shape[0] < 1:
            raise _invalid(f"input {spec.name!r}: batch dimension must be at least 1, got {shape[0]}")
        if rows is None:
            rows = shape[0]
        elif shape[0] != rows:
            raise _invalid(f"input {spec.name!r}: batch dimension {shape[0]} differs from the other inputs' {rows}")
        if min(shape) < 0:
            raise _invalid(f"input {spec.name!r}: shape {list(shape)} has a negative dimension")
        dtype = KSERVE_TO_NUMPY[spec.datatype]
        item_count = item_counts[k]
        # exact (Python ints): no int64 wrap-around on absurd shapes
        count = rows * item_count if item_count is not None else math.prod(shape)
        if raw_count:
            raw = raw_contents[index]
            nbytes = count * dtype.itemsize
            if len(raw) != nbytes:
                raise _invalid(f"input {spec.name!r}: expected {nbytes} bytes of raw data for shape "
                               f"{list(shape)} {spec.datatype}, got {len(raw)}")
        else:
            field = _CONTENTS_FIELD.get(spec.datatype)
            if field is None:
                raise _invalid(f"input {spec.name!r}: datatype {spec.datatype} must be sent as raw_input_contents")
            values = getattr(tensor.contents, field)
            if len(values) != count:
                raise _invalid(f"input {spec.name!r}: expected {count} values in contents.{field} for shape "
                               f"{list(shape)}, got {len(values)}")
            raw = np.asarray(values).astype(dtype).tobytes()
        raws.append(raw)
    if rows > model.max_batch:
        raise _invalid(f"batch of {rows} rows exceeds the model's max_batch_size {model.max_batch}")
    if request.outputs:
        names = [o.name for o in request.outputs]
        index = {s.name: i for i, s in enumerate(model.outputs)}
        for n in names:
            if n not in index:
                raise _invalid(f"unknown requested output {n!r} for model {model.name!r}; "
                               f"outputs are {sorted(index)}")
        outputs = tuple(index[n] for n in names)
    else:
        outputs = tuple(range(len(model.outputs)))
    timeout_us = 0
    parameters = request.parameters
    if "timeout" in parameters:
        timeout_us = max(int(parameters["timeout"].int64_param), 0)
    return ParsedRequest(raws, rows, outputs, timeout_us)
