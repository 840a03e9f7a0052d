"""The KServe v2 HTTP/REST wire format, both ways: protobuf messages as JSON, and inference requests and
responses with JSON tensors or Triton's binary tensor data (``binary_data_size`` sections after a JSON
header of ``Inference-Header-Content-Length`` bytes). Pure functions; frontend/rest.py serves them.
A malformed request raises :class:`RequestError` (INVALID_ARGUMENT) naming what is wrong.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import grpc
import numpy as np

from common.pb import kserve
from common.tensors import KSERVE_TO_NUMPY
from frontend.requests import RequestError

HEADER_LENGTH = "Inference-Header-Content-Length"
_INTEGER_KINDS = "iu"


class HttpError(Exception):
    """An error with an HTTP status that has no gRPC twin (413)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


# ---- protobuf <-> JSON ------------------------------------------------------------------------------

def _value(fd, value, every_message: bool):
    if fd.enum_type is not None:
        known = fd.enum_type.values_by_number.get(value)
        return known.name if known is not None else value
    if fd.message_type is not None:
        return message_to_json(value, every_message)
    return value


def message_to_json(message, every_message: bool = True) -> dict:
    """A KServe or model-config message as Triton's HTTP server writes it: proto field names, 64-bit
    integers as JSON numbers, enums by name. Unset sub-messages are left out unless ``every_message``."""
    out: dict = {}
    for fd in message.DESCRIPTOR.fields:
        oneof = fd.containing_oneof
        if oneof is not None and message.WhichOneof(oneof.name) != fd.name:
            continue
        value = getattr(message, fd.name)
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            value_fd = fd.message_type.fields_by_name["value"]
            out[fd.name] = {k: _value(value_fd, v, every_message) for k, v in value.items()}
        elif fd.is_repeated:
            out[fd.name] = [_value(fd, v, every_message) for v in value]
        elif fd.message_type is not None:
            if every_message or message.HasField(fd.name):
                out[fd.name] = message_to_json(value, every_message)
        else:
            out[fd.name] = _value(fd, value, every_message)
    return out


def set_parameter(target, key: str, value, where: str) -> None:
    param = target[key]
    if isinstance(value, bool):
        param.bool_param = value
    elif isinstance(value, int):
        if not -2**63 <= value < 2**64:
            raise invalid(f"{where} parameter {key!r}: {value} does not fit in 64 bits")
        if value < 2**63:
            param.int64_param = value
        else:
            param.uint64_param = value
    elif isinstance(value, float):
        param.double_param = value
    elif isinstance(value, str):
        param.string_param = value
    else:
        raise invalid(f"{where} parameter {key!r}: expected a boolean, number or string, got {type(value).__name__}")


def json_object(value, where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid(f"{where} must be a JSON object, got {type(value).__name__}")
    return value


def load_json(data: bytes, where: str):
    try:
        return json.loads(data) if data.strip() else None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise invalid(f"malformed JSON in {where}: {exc}") from None
    except RecursionError:
        raise invalid(f"JSON in {where} is nested too deeply") from None


def _json_tensor_bytes(name: str, datatype: str, shape: list[int], data) -> bytes:
    """The raw bytes of a tensor given as JSON ``data`` (nested or flat, row-major)."""
    dtype = KSERVE_TO_NUMPY.get(datatype)
    if dtype is None:
        raise invalid(f"input {name!r}: datatype {datatype!r} cannot be sent as JSON data here; "
                       f"known datatypes are {sorted(KSERVE_TO_NUMPY)}")
    try:
        values = np.asarray(data)
    except ValueError as exc:
        raise invalid(f"input {name!r}: data is not a regular array: {exc}") from None
    kind = values.dtype.kind
    if values.size and not (kind == "b" if dtype.kind == "b" else
                            kind in _INTEGER_KINDS if dtype.kind in _INTEGER_KINDS else kind in "iuf"):
        wanted = "true/false" if dtype.kind == "b" else "integers" if dtype.kind in _INTEGER_KINDS else "numbers"
        raise invalid(f"input {name!r}: data of a {datatype} tensor must be {wanted}")
    count = math.prod(shape)
    if values.size != count:
        raise invalid(f"input {name!r}: shape {shape} needs {count} values, data has {values.size}")
    cast = values.astype(dtype)
    if dtype.kind in _INTEGER_KINDS and values.size and not np.array_equal(cast, values):
        raise invalid(f"input {name!r}: a value is out of range for {datatype}")
    return cast.tobytes()


@dataclass(frozen=True)
class OutputFormat:
    """Which outputs of an infer response go back as binary sections rather than JSON ``data``."""

    binary_default: bool = False               # the request's binary_data_output parameter
    binary: dict[str, bool] = field(default_factory=dict)   # per requested output: its binary_data parameter

    def is_binary(self, name: str) -> bool:
        return self.binary.get(name, self.binary_default)


def decode_infer_request(model: str, version: str, body: bytes, header_length: str | None
                         ) -> tuple[kserve.ModelInferRequest, OutputFormat]:
    """An HTTP infer body (JSON, optionally followed by binary tensor data) as a ModelInferRequest, and
    the form its outputs go back in. Raises RequestError (INVALID_ARGUMENT) naming what is wrong."""
    if header_length is None:
        header, binary = body, b""
    else:
        try:
            length = int(header_length)
        except ValueError:
            raise invalid(f"{HEADER_LENGTH} must be an integer, got {header_length!r}") from None
        if not 0 <= length <= len(body):
            raise invalid(f"{HEADER_LENGTH} {length} is outside the body of {len(body)} bytes")
        header, binary = body[:length], body[length:]
    doc = load_json(header, "the inference request")
    if not isinstance(doc, dict):
        raise invalid("the inference request must be a JSON object")
    request = kserve.ModelInferRequest(model_name=model, model_version=version)
    request_id = doc.get("id", "")
    if not isinstance(request_id, str):
        raise invalid(f"'id' must be a string, got {type(request_id).__name__}")
    request.id = request_id
    parameters = dict(json_object(doc.get("parameters"), "'parameters'"))
    binary_output = parameters.pop("binary_data_output", False)
    if not isinstance(binary_output, bool):
        raise invalid("parameter 'binary_data_output' must be true or false")
    for key, value in parameters.items():
        set_parameter(request.parameters, key, value, "request")
    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise invalid("'inputs' must be a non-empty list of tensors")
    offset = 0
    for i, tensor in enumerate(inputs):
        tensor = json_object(tensor, f"inputs[{i}]")
        name, datatype, shape = tensor.get("name"), tensor.get("datatype"), tensor.get("shape")
        if not isinstance(name, str) or not isinstance(datatype, str):
            raise invalid(f"inputs[{i}] needs a string 'name' and 'datatype'")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
            raise invalid(f"input {name!r}: 'shape' must be a list of integers")
        if any(d < 0 for d in shape):
            raise invalid(f"input {name!r}: shape {shape} has a negative dimension")
        if any(d >= 2**63 for d in shape):
            raise invalid(f"input {name!r}: shape {shape} has a dimension past 64 bits")
        params = dict(json_object(tensor.get("parameters"), f"input {name!r} 'parameters'"))
        size = params.pop("binary_data_size", None)
        request.inputs.add(name=name, datatype=datatype, shape=shape)
        for key, value in params.items():
            set_parameter(request.inputs[-1].parameters, key, value, f"input {name!r}")
        if "shared_memory_region" in params:       # read from the region (frontend/requests.py): no data here
            if size is not None or "data" in tensor:
                raise invalid(f"input {name!r} has both a shared_memory_region and "
                               f"{'data' if 'data' in tensor else 'a binary_data_size parameter'}")
        elif size is not None:
            if "data" in tensor:
                raise invalid(f"input {name!r} has both 'data' and a binary_data_size parameter")
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise invalid(f"input {name!r}: binary_data_size must be a non-negative integer, got {size!r}")
            if header_length is None:
                raise invalid(f"input {name!r} has a binary_data_size parameter but the request has no "
                               f"{HEADER_LENGTH} header")
            if offset + size > len(binary):
                raise invalid(f"input {name!r}: binary_data_size {size} runs past the end of the body "
                               f"({len(binary) - offset} bytes of binary data left)")
            request.raw_input_contents.append(binary[offset:offset + size])
            offset += size
        elif "data" in tensor:
            request.raw_input_contents.append(_json_tensor_bytes(name, datatype, shape, tensor["data"]))
        else:
            raise invalid(f"input {name!r} has neither 'data' nor a binary_data_size parameter")
    if offset != len(binary):
        raise invalid(f"the body has {len(binary) - offset} bytes of binary data beyond the inputs' "
                       f"binary_data_size total of {offset}")
    binary_outputs: dict[str, bool] = {}
    outputs = doc.get("outputs")
    if outputs is not None:
        if not isinstance(outputs, list):
            raise invalid("'outputs' must be a list")
        for i, out in enumerate(outputs):
            out = json_object(out, f"outputs[{i}]")
            name = out.get("name")
            if not isinstance(name, str):
                raise invalid(f"outputs[{i}] needs a string 'name'")
            params = dict(json_object(out.get("parameters"), f"output {name!r} 'parameters'"))
            if params.pop("classification", 0):
                raise invalid(f"output {name!r}: the classification extension is not supported")
            as_binary = params.pop("binary_data", binary_output)
            if not isinstance(as_binary, bool):
                raise invalid(f"output {name!r}: binary_data must be true or false")
            binary_outputs[name] = as_binary
            request.outputs.add(name=name)
            for key, value in params.items():
                set_parameter(request.outputs[-1].parameters, key, value, f"output {name!r}")
    return request, OutputFormat(binary_output, binary_outputs)


def encode_infer_response(response: kserve.ModelInferResponse, form: OutputFormat) -> tuple[bytes, list[bytes]]:
    """The JSON header of an infer response and the binary sections that follow it, in output order."""
    outputs, sections = [], []
    for out, raw in zip(response.outputs, response.raw_output_contents):
        entry = {"name": out.name, "datatype": out.datatype, "shape": list(out.shape)}
        if "shared_memory_region" in out.parameters:      # written to the region: only where it went
            entry["parameters"] = {k: getattr(p, p.WhichOneof("parameter_choice")) for k, p in out.parameters.items()}
        elif form.is_binary(out.name):
            entry["parameters"] = {"binary_data_size": len(raw)}
            sections.append(raw)
        else:
            entry["data"] = np.frombuffer(raw, KSERVE_TO_NUMPY[out.datatype]).tolist()
        outputs.append(entry)
    doc = {"model_name": response.model_name, "model_version": response.model_version}
    if response.id:
        doc["id"] = response.id
    if response.parameters:
        doc["parameters"] = {k: getattr(p, p.WhichOneof("parameter_choice")) for k, p in response.parameters.items()
                             if p.WhichOneof("parameter_choice")}
    doc["outputs"] = outputs
    return json.dumps(doc).encode(), sections


# ---- the server -------------------------------------------------------------------------------------
