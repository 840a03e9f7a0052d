"""Validation and conversion of KServe v2 inference requests at the frontend's edge.

:func:`parse_infer_request` turns a ``ModelInferRequest`` into a :class:`ParsedRequest` (raw input
bytes in the model's input order, the row count, the outputs asked for) or raises
:class:`RequestError` with the gRPC status and a precise message. It never decodes tensors that
arrive as raw bytes; typed ``contents`` are packed into raw bytes once. An input whose parameters
name a system shared-memory region (``shared_memory_region``, ``shared_memory_byte_size``,
``shared_memory_offset``) is read from that region (frontend/shared_memory.py) and has no entry in
``raw_input_contents``, as in Triton; an output naming one is written there by :func:`add_output`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

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
class Region:
    """Where a tensor lives in a registered shared-memory region."""

    name: str
    offset: int
    byte_size: int


@dataclass(frozen=True)
class ParsedRequest:
    inputs: list[bytes]
    rows: int
    output_indices: tuple[int, ...]     # which of the model's outputs to return, in order
    timeout_us: int                      # from the request's "timeout" parameter, 0 when absent
    output_regions: dict[int, Region] = field(default_factory=dict)   # output index -> its shared memory


def _invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


def _integer(parameters, key: str, what: str) -> int | None:
    if key not in parameters:
        return None
    p = parameters[key]
    which = p.WhichOneof("parameter_choice")
    if which not in ("int64_param", "uint64_param") or getattr(p, which) < 0:
        raise _invalid(f"{what}: parameter {key!r} must be a non-negative integer")
    return getattr(p, which)


def _region(parameters, what: str) -> Region | None:
    """The shared-memory region a tensor's parameters name, or None when they name none."""
    if "shared_memory_region" not in parameters:
        for key in ("shared_memory_byte_size", "shared_memory_offset"):
            if key in parameters:
                raise _invalid(f"{what}: parameter {key!r} without 'shared_memory_region'")
        return None
    name = parameters["shared_memory_region"]
    if name.WhichOneof("parameter_choice") != "string_param" or not name.string_param:
        raise _invalid(f"{what}: parameter 'shared_memory_region' must be a region's name (a string)")
    byte_size = _integer(parameters, "shared_memory_byte_size", what)
    if byte_size is None:
        raise _invalid(f"{what}: parameter 'shared_memory_byte_size' is required with 'shared_memory_region'")
    return Region(name.string_param, _integer(parameters, "shared_memory_offset", what) or 0, byte_size)


def parse_infer_request(request, model: ModelEntry, shared_memory=None) -> ParsedRequest:
    """``shared_memory``: the frontend's :class:`frontend.shared_memory.SharedMemoryRegistry`, which
    inputs naming a region are read from (None: no region may be named)."""
    by_name = {}
    regions = {}                          # input index -> its shared memory (none: most requests)
    for i, tensor in enumerate(request.inputs):
        name = tensor.name
        if name in by_name:
            raise _invalid(f"input {name!r} is given twice")
        by_name[name] = (i, tensor)
        if tensor.parameters:
            region = _region(tensor.parameters, f"input {name!r}")
            if region is not None:
                if shared_memory is None:
                    raise _invalid(f"input {name!r}: shared memory cannot be used here")
                regions[i] = region
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
    if raw_count and raw_count != len(by_name) - len(regions):
        raise _invalid(f"raw_input_contents has {raw_count} entries for {len(by_name) - len(regions)} inputs "
                       f"not in shared memory")
    raw_index = None                      # an input's entry in raw_input_contents: shared-memory ones have none
    if regions:
        raw_index = {i: k for k, i in enumerate(i for i in range(len(request.inputs)) if i not in regions)}
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
        if index in regions:
            region = regions[index]
            nbytes = count * dtype.itemsize
            if region.byte_size != nbytes:
                raise _invalid(f"input {spec.name!r}: shared_memory_byte_size {region.byte_size} does not match the "
                               f"{nbytes} bytes of shape {list(shape)} {spec.datatype}")
            raw = shared_memory.read(f"input {spec.name!r}", region.name, region.offset, region.byte_size)
        elif raw_count:
            raw = raw_contents[index if raw_index is None else raw_index[index]]
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
    output_regions = {}
    if request.outputs:
        names = [o.name for o in request.outputs]
        index = {s.name: i for i, s in enumerate(model.outputs)}
        for n in names:
            if n not in index:
                raise _invalid(f"unknown requested output {n!r} for model {model.name!r}; "
                               f"outputs are {sorted(index)}")
        outputs = tuple(index[n] for n in names)
        for o in request.outputs:
            region = _region(o.parameters, f"output {o.name!r}") if o.parameters else None
            if region is None:
                continue
            if shared_memory is None:
                raise _invalid(f"output {o.name!r}: shared memory cannot be used here")
            spec = model.outputs[index[o.name]]
            if all(d >= 0 for d in spec.shape):     # known before it runs: refuse a region too small now
                nbytes = rows * math.prod(spec.shape) * KSERVE_TO_NUMPY[spec.datatype].itemsize
                if region.byte_size < nbytes:
                    raise _invalid(f"output {o.name!r}: shared_memory_byte_size {region.byte_size} is too small for "
                                   f"the {nbytes} bytes of shape {[rows, *spec.shape]} {spec.datatype}")
            shared_memory.locate(f"output {o.name!r}", region.name, region.offset, region.byte_size)
            output_regions[index[o.name]] = region
    else:
        outputs = tuple(range(len(model.outputs)))
    timeout_us = 0
    parameters = request.parameters
    if "timeout" in parameters:
        timeout_us = max(int(parameters["timeout"].int64_param), 0)
    return ParsedRequest(raws, rows, outputs, timeout_us, output_regions)


def add_output(response, parsed: ParsedRequest, index: int, name: str, datatype: str, shape, raw: bytes,
               shared_memory=None) -> None:
    """Add output ``index`` of the model (``raw`` bytes of ``shape``) to a ModelInferResponse: into its
    shared-memory region when the request named one (an empty ``raw_output_contents`` entry keeps the
    outputs and their contents aligned, as Triton does), else as raw contents."""
    tensor = response.outputs.add(name=name, datatype=datatype, shape=shape)
    region = parsed.output_regions.get(index)
    if region is None:
        response.raw_output_contents.append(raw)
        return
    shared_memory.write(f"output {name!r}", region.name, region.offset, region.byte_size, raw)
    tensor.parameters["shared_memory_region"].string_param = region.name
    tensor.parameters["shared_memory_byte_size"].int64_param = len(raw)
    if region.offset:
        tensor.parameters["shared_memory_offset"].int64_param = region.offset
    response.raw_output_contents.append(b"")
