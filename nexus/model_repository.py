"""Triton model repositories: ``<repo>/<name>/config.pbtxt`` and ``<repo>/<name>/<version>/model.onnx``.

:func:`read_repository` reads a repository the way Triton lays it out and returns, per model, what
``nexus models upload`` needs: the model file, its runtime, the input/output description, the SLO.

- ``config.pbtxt`` is parsed with protobuf's text format into Triton's ``ModelConfig`` (the subset
  in ``protos/inference/model_config.proto``, Triton's field numbers). A syntax error, or a setting
  this server does not know, is reported with the file, line and column.
- A minimal or missing config is completed from the model file, as Triton's auto-complete does:
  platform from the file, inputs and outputs from the ONNX graph, batching from its first dimension.
- What the config states is checked against the model file: a contradiction (an input the model
  does not have, another data type or shape, ``max_batch_size`` on a model without a batch
  dimension) is refused, naming the field (``input[0].dims``).
- The SLO comes from ``parameters { key: "slo_ms" value { string_value: "50" } }``, the rate the
  model is planned for until one is measured from ``parameters { key: "expected_rate_rps" value {
  string_value: "200" } }``, what becomes of its late requests from ``parameters { key:
  "late_requests" value { string_value: "serve" } }`` (or ``drop``; common/late_requests.py), and
  ``max_batch_size`` > 0 caps every batch of the model (the plan's and a request's), as in Triton.
- ``model_warmup`` samples are read as Triton reads them (an ``input_data_file`` from the model's
  ``warmup/`` folder, never from outside it) and checked against the model's inputs
  (:func:`common.warmup_spec.check_samples`); backends run them before the model takes traffic.
- Settings that have no meaning here are named: ``instance_group`` and ``dynamic_batching``'s
  parameters are ignored with a warning (the scheduler places sessions and sets batch sizes
  itself); ensembles, other platforms, reshapes, shape tensors and ragged batches are errors.

Versions: every version folder that the ``version_policy`` selects (default: ``latest { num_versions:
1 }``, as Triton) is read and checked against the config, and uploaded as that version with the
policy (common/version_policy.py); the scheduler serves what the policy selects of what it stores.
"""

from __future__ import annotations

import pathlib
import re
from dataclasses import dataclass

from google.protobuf import text_format

from common.model_io import ModelFileError, io_to_json, onnx_io, torch_archive_check
from common.late_requests import LateRequests
from common.pb import model_config as mc
from common.tensors import TensorSpec
from common.version_policy import DEFAULT_POLICY, PolicyKind, VersionError, VersionPolicy, from_pb as policy_from_pb
from common.warmup_spec import WarmupData, WarmupError, WarmupInput, WarmupSample, check_samples, describe as describe_warmup

CONFIG_FILE = "config.pbtxt"
WARMUP_FOLDER = "warmup"       # Triton's: input_data_file names a file in <model>/warmup/
SLO_PARAMETER = "slo_ms"
EXPECTED_RATE_PARAMETER = "expected_rate_rps"
LATE_REQUESTS_PARAMETER = "late_requests"

# Triton platform / backend names -> (runtime, default model file name).
_ONNX = ("onnxruntime", "model.onnx")
_TORCH = ("torch", "model.pt")
PLATFORMS = {"onnxruntime_onnx": _ONNX, "pytorch_libtorch": _TORCH}
BACKENDS = {"onnxruntime": _ONNX, "pytorch": _TORCH}

# KServe datatype names <-> Triton's DataType enum (TYPE_<name>, FP32 <-> TYPE_FP32).
_KSERVE_TO_TRITON = {"BOOL": "BOOL", "UINT8": "UINT8", "UINT16": "UINT16", "UINT32": "UINT32", "UINT64": "UINT64",
                     "INT8": "INT8", "INT16": "INT16", "INT32": "INT32", "INT64": "INT64", "FP16": "FP16",
                     "FP32": "FP32", "FP64": "FP64", "BYTES": "STRING", "BF16": "BF16"}
_TRITON_TO_KSERVE = {v: k for k, v in _KSERVE_TO_TRITON.items()}

# Triton ModelConfig fields that this server's subset leaves out, with why they cannot be honoured.
_UNSUPPORTED_FIELDS = {
    "sequence_batching": "stateful sequence batching is not supported",
    "ensemble_scheduling": "ensembles are not supported; register a multi-model query (nexus queries register)",
    "optimization": "runtime optimisation settings are not supported",
    "batch_input": "batch inputs are not supported",
    "batch_output": "batch outputs are not supported",
    "model_transaction_policy": "decoupled models are not supported",
    "response_cache": "the response cache is not supported",
    "cc_model_filenames": "per-GPU model files are not supported",
    "model_repository_agents": "repository agents are not supported",
    "metric_tags": "metric tags are not supported",
    "model_operations": "model operations settings are not supported",
}


class RepositoryError(ValueError):
    """A repository that cannot be served; the message names the file and the field or line."""


@dataclass(frozen=True)
class RepositoryModel:
    name: str
    version: int
    path: pathlib.Path                 # the model file
    runtime: str                       # "onnxruntime" | "torch"
    inputs: tuple[TensorSpec, ...]     # without the batch dimension
    outputs: tuple[TensorSpec, ...]
    slo_ms: float = 0.0                # 0: the scheduler's default
    max_batch_size: int = 0            # from the config (0: not given, or full shapes in dims); the batch cap
    warnings: tuple[str, ...] = ()
    warmup: tuple[WarmupSample, ...] = ()   # model_warmup; empty: the backends' default warm-up
    version_policy: VersionPolicy = DEFAULT_POLICY   # the model's (every version read carries it)
    expected_rate_rps: float = 0.0     # planned for until a rate is measured (0: the scheduler's default)
    late_requests: LateRequests | None = None   # None: not stated (the model's setting stays)

    @property
    def io_json(self) -> str:
        return io_to_json(self.inputs, self.outputs)


def parse_config(text: str, where: str) -> mc.ModelConfig:
    """Parse config.pbtxt text; errors say ``where:LINE:COLUMN: ...``."""
    config = mc.ModelConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as exc:
        line, column = exc.GetLine(), exc.GetColumn()
        message = str(exc)
        # The library prefixes "LINE:COLUMN : "; keep only its own words.
        message = re.sub(r"^\d+:\d+ : ", "", message)
        message = re.sub(r"^'': ", "at the end of the file: ", message)
        unknown = re.search(r'type "(?:\w+\.)*(\w+)" has no field named "(\w+)"', message)
        if unknown:
            kind, name = unknown.groups()
            reason = (_UNSUPPORTED_FIELDS.get(name) if kind == "ModelConfig" else None) or \
                f"not a {kind} setting this server knows"
            message = f"unsupported setting '{name}': {reason}"
        raise RepositoryError(f"{where}:{line}:{column}: {message}") from None
    return config


def _datatype_name(value: int) -> str:
    return mc.DataType.Name(value).removeprefix("TYPE_")


def _onnx_first_dims(data: bytes) -> dict[str, int]:
    """Leading dimension of every graph input and output: -1 when symbolic or absent."""
    import onnx  # lazy: onnx costs ~30 ms at start-up; the nexus command imports this module for --help

    model = onnx.load_model_from_string(data)
    initializers = {t.name for t in model.graph.initializer}
    first = {}
    for value in [*model.graph.input, *model.graph.output]:
        if value.name in initializers:
            continue
        dims = value.type.tensor_type.shape.dim
        first[value.name] = dims[0].dim_value if dims and dims[0].HasField("dim_value") else -1
    return first


def _pick_versions(model_dir: pathlib.Path, config: mc.ModelConfig, where: str) -> tuple[list[int], VersionPolicy]:
    """The version folders the config's version_policy selects, oldest first, and the policy."""
    versions = sorted(int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit())
    if versions and versions[0] == 0:
        raise RepositoryError(f"{model_dir / '0'}: version 0: versions are positive integers (1, 2, ...)")
    if not versions:
        raise RepositoryError(f"{model_dir}: no version folder (expected {model_dir.name}/1/...)")
    try:
        policy = policy_from_pb(config.version_policy)
    except VersionError as exc:
        raise RepositoryError(f"{where}: {exc}") from None
    if policy.kind is PolicyKind.SPECIFIC:
        missing = [v for v in policy.versions if v not in versions]
        if missing:
            raise RepositoryError(f"{where}: version_policy.specific.versions: no folder for version(s) "
                                  f"{', '.join(map(str, missing))} (found {', '.join(map(str, versions))})")
    return list(policy.select(versions)), policy


def _runtime_of(config: mc.ModelConfig, version_dir: pathlib.Path, where: str) -> tuple[str, pathlib.Path]:
    if config.platform == "ensemble":
        raise RepositoryError(f"{where}: platform 'ensemble': ensembles are not supported; register a "
                              f"multi-model query (nexus queries register) instead")
    choice = None
    if config.platform:
        if config.platform not in PLATFORMS:
            raise RepositoryError(f"{where}: platform {config.platform!r} is not supported "
                                  f"(supported: {', '.join(PLATFORMS)})")
        choice = PLATFORMS[config.platform]
    if config.backend:
        if config.backend not in BACKENDS:
            raise RepositoryError(f"{where}: backend {config.backend!r} is not supported "
                                  f"(supported: {', '.join(BACKENDS)})")
        if choice is not None and BACKENDS[config.backend] != choice:
            raise RepositoryError(f"{where}: backend {config.backend!r} contradicts platform {config.platform!r}")
        choice = BACKENDS[config.backend]
    if config.default_model_filename:
        path = version_dir / config.default_model_filename
        if choice is None:
            choice = _TORCH if path.suffix in (".pt", ".pt2") else _ONNX
    elif choice is not None:
        path = version_dir / choice[1]
    else:   # auto-complete: whichever model file is there
        found = [version_dir / f for _, f in (_ONNX, _TORCH) if (version_dir / f).is_file()]
        if not found:
            raise RepositoryError(f"{version_dir}: no model.onnx or model.pt (and no platform or "
                                  f"default_model_filename in {CONFIG_FILE})")
        path = found[0]
        choice = _ONNX if path.name == _ONNX[1] else _TORCH
    if not path.is_file():
        raise RepositoryError(f"{where}: model file {path} does not exist")
    return choice[0], path


def _config_specs(tensors, kind: str, max_batch_size: int, where: str) -> list[TensorSpec]:
    """Config inputs/outputs as specs without the batch dimension."""
    specs = []
    for i, t in enumerate(tensors):
        field_name = f"{kind}[{i}]"
        if not t.name:
            raise RepositoryError(f"{where}: {field_name}.name is required")
        if t.HasField("reshape"):
            raise RepositoryError(f"{where}: {field_name}.reshape ({t.name!r}) is not supported")
        if t.is_shape_tensor:
            raise RepositoryError(f"{where}: {field_name}.is_shape_tensor ({t.name!r}) is not supported")
        if kind == "input" and t.allow_ragged_batch:
            raise RepositoryError(f"{where}: {field_name}.allow_ragged_batch ({t.name!r}) is not supported")
        if t.data_type == mc.TYPE_INVALID:
            raise RepositoryError(f"{where}: {field_name}.data_type is required ({t.name!r})")
        datatype = _TRITON_TO_KSERVE.get(_datatype_name(t.data_type))
        if datatype is None:
            raise RepositoryError(f"{where}: {field_name}.data_type {mc.DataType.Name(t.data_type)} is not supported")
        dims = tuple(int(d) for d in t.dims)
        if any(d < -1 or d == 0 for d in dims):
            raise RepositoryError(f"{where}: {field_name}.dims {list(dims)}: each must be positive or -1")
        if max_batch_size == 0:
            # Full shapes: the leading dimension is the batch, which this server always batches along.
            if not dims or dims[0] != -1:
                raise RepositoryError(
                    f"{where}: {field_name}.dims {list(dims)} with max_batch_size 0: this server batches every "
                    f"model along its first dimension, so it must be -1 (or set max_batch_size > 0 and list "
                    f"the dims without the batch dimension)")
            dims = dims[1:]
        specs.append(TensorSpec(t.name, datatype, dims))
    return specs


def _check_against(config_specs: list[TensorSpec], model_specs: tuple[TensorSpec, ...], kind: str,
                   where: str) -> tuple[TensorSpec, ...]:
    """Config tensors checked against the model's; missing ones completed from the model."""
    by_name = {s.name: s for s in model_specs}
    names = {s.name for s in config_specs}
    for i, c in enumerate(config_specs):
        m = by_name.get(c.name)
        if m is None:
            raise RepositoryError(f"{where}: {kind}[{i}].name {c.name!r}: the model has no {kind} of that name "
                                  f"(its {kind}s: {', '.join(by_name)})")
        if c.datatype != m.datatype:
            raise RepositoryError(f"{where}: {kind}[{i}].data_type TYPE_{_KSERVE_TO_TRITON[c.datatype]} ({c.name!r}) "
                                  f"contradicts the model's TYPE_{_KSERVE_TO_TRITON.get(m.datatype, m.datatype)}")
        if len(c.shape) != len(m.shape) or any(a != b and a != -1 and b != -1 for a, b in zip(c.shape, m.shape)):
            raise RepositoryError(f"{where}: {kind}[{i}].dims {list(c.shape)} ({c.name!r}) contradict the model's "
                                  f"{list(m.shape)} (without the batch dimension)")
    return tuple(next((c for c in config_specs if c.name == m.name), m) if m.name in names else m
                 for m in model_specs)


def _warnings(config: mc.ModelConfig, where: str) -> list[str]:
    out = []
    if len(config.instance_group):
        groups = ", ".join(f"{mc.ModelInstanceGroup.Kind.Name(g.kind)} count {g.count or 1}"
                           + (f" gpus {list(g.gpus)}" if g.gpus else "") for g in config.instance_group)
        out.append(f"{where}: instance_group ({groups}) is ignored: the scheduler decides how many devices "
                   f"serve the model and which")
    if config.HasField("dynamic_batching"):
        db = config.dynamic_batching
        ignored = [name for name, set_ in (
            ("preferred_batch_size", len(db.preferred_batch_size) > 0),
            ("max_queue_delay_microseconds", db.max_queue_delay_microseconds > 0),
            ("preserve_ordering", db.preserve_ordering),
            ("priority_levels", db.priority_levels > 0),
            ("default_priority_level", db.default_priority_level > 0)) if set_]
        if ignored:
            out.append(f"{where}: dynamic_batching {', '.join(ignored)} ignored: batch sizes and timing follow "
                       f"the scheduler's plan (the model's SLO and duty cycle)")
    for i, o in enumerate(config.output):
        if o.label_filename:
            out.append(f"{where}: output[{i}].label_filename is ignored (no classification extension)")
    for i, t in enumerate(config.input):
        if t.format != mc.ModelInput.FORMAT_NONE:
            out.append(f"{where}: input[{i}].format is ignored (inputs are passed as they come)")
        if t.optional:
            out.append(f"{where}: input[{i}].optional is ignored: every input is required")
    known = (SLO_PARAMETER, EXPECTED_RATE_PARAMETER, LATE_REQUESTS_PARAMETER)
    unknown = sorted(set(config.parameters) - set(known))
    if unknown:
        out.append(f"{where}: parameters {', '.join(unknown)} ignored (known: {', '.join(known)})")
    return out


def _number_parameter(config: mc.ModelConfig, key: str, what: str, where: str, *, zero_ok: bool) -> float:
    """The finite number in ``parameters[key]`` (0.0 when absent); RepositoryError names the key."""
    if key not in config.parameters:
        return 0.0
    text = config.parameters[key].string_value
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value >= 0 if zero_ok else value > 0) or value == float("inf"):
        raise RepositoryError(f"{where}: parameters.{key} must be {what}, got {text!r}")
    return value


def _slo(config: mc.ModelConfig, where: str) -> float:
    return _number_parameter(config, SLO_PARAMETER, "a positive number of milliseconds", where, zero_ok=False)


def _expected_rate(config: mc.ModelConfig, where: str) -> float:
    return _number_parameter(config, EXPECTED_RATE_PARAMETER, "a number of requests per second, at least 0", where,
                             zero_ok=True)


def _late_requests(config: mc.ModelConfig, where: str) -> LateRequests | None:
    if LATE_REQUESTS_PARAMETER not in config.parameters:
        return None
    text = config.parameters[LATE_REQUESTS_PARAMETER].string_value
    try:
        return LateRequests(text)
    except ValueError:
        raise RepositoryError(f"{where}: parameters.{LATE_REQUESTS_PARAMETER} must be "
                              f"{' or '.join(x.value for x in LateRequests)}, got {text!r}") from None


def _warmup_file(model_dir: pathlib.Path, name: str, field: str, where: str) -> bytes:
    """The bytes of an ``input_data_file``: a file in the model's warmup/ folder, symlinks resolved."""
    folder = (model_dir / WARMUP_FOLDER).resolve()
    path = (folder / name).resolve()
    if not name or not path.is_relative_to(folder):
        raise RepositoryError(f"{where}: {field}.input_data_file {name!r} is not a file in {model_dir / WARMUP_FOLDER} "
                              f"(warm-up data files live there, as in Triton)")
    try:
        return path.read_bytes()
    except OSError as exc:
        raise RepositoryError(f"{where}: {field}.input_data_file {name!r}: cannot read "
                              f"{model_dir / WARMUP_FOLDER / name}: {exc.strerror or exc}") from None


def _warmup(config: mc.ModelConfig, model_dir: pathlib.Path, inputs: tuple[TensorSpec, ...],
            where: str) -> tuple[WarmupSample, ...]:
    """``model_warmup`` as samples, checked against the model's inputs; RepositoryError names the field."""
    samples = []
    for i, w in enumerate(config.model_warmup):
        field = f"model_warmup[{i}]" + (f" ({w.name!r})" if w.name else "")
        tensors = []
        for name in sorted(w.inputs):
            t = w.inputs[name]
            input_field = f'{field}.inputs["{name}"]'
            if t.data_type == mc.TYPE_INVALID:
                raise RepositoryError(f"{where}: {input_field}.data_type is required")
            datatype = _TRITON_TO_KSERVE.get(_datatype_name(t.data_type), _datatype_name(t.data_type))
            which = t.WhichOneof("input_data_type")
            if which is None:
                raise RepositoryError(f"{where}: {input_field}: one of zero_data, random_data or input_data_file is "
                                      f"required")
            raw = b""
            if which == "input_data_file":
                raw = _warmup_file(model_dir, t.input_data_file, input_field, where)
            tensors.append(WarmupInput(name, datatype, tuple(int(d) for d in t.dims), WarmupData(which), raw,
                                       t.input_data_file))
        samples.append(WarmupSample(w.name, w.batch_size, tuple(tensors), w.count))
    try:
        check_samples(samples, inputs, config.max_batch_size)
    except WarmupError as exc:
        raise RepositoryError(f"{where}: {exc}") from None
    return tuple(samples)


def read_model(model_dir: pathlib.Path) -> RepositoryModel:
    """The newest version of a model folder that its version policy selects (:func:`read_model_versions`)."""
    return read_model_versions(model_dir)[-1]


def read_model_versions(model_dir: pathlib.Path) -> list[RepositoryModel]:
    """Every version of one model folder that its version policy selects, oldest first; RepositoryError
    names the file and the field."""
    model_dir = pathlib.Path(model_dir)
    name = model_dir.name
    config_path = model_dir / CONFIG_FILE
    where = str(config_path)
    if not name or len(name) > 128 or not all(c.isalnum() or c in "-_." for c in name):
        raise RepositoryError(f"{model_dir}: invalid model name {name!r}: use 1-128 letters, digits, '-', '_' or '.'")
    if config_path.is_file():
        try:
            text = config_path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise RepositoryError(f"{where}: cannot read: {exc}") from None
        config = parse_config(text, where)
    else:
        config = mc.ModelConfig()
    if config.name and config.name != name:
        raise RepositoryError(f"{where}: name {config.name!r} contradicts the folder's name {name!r}")
    if config.max_batch_size < 0:
        raise RepositoryError(f"{where}: max_batch_size must be >= 0, got {config.max_batch_size}")
    versions, policy = _pick_versions(model_dir, config, where)
    warnings = tuple(_warnings(config, where))
    slo = _slo(config, where)
    return [_read_version(model_dir, version, config, where, warnings, slo, policy) for version in versions]


def _read_version(model_dir: pathlib.Path, version: int, config: mc.ModelConfig, where: str,
                  warnings: tuple[str, ...], slo: float, policy: VersionPolicy) -> RepositoryModel:
    """One version folder's model file, checked against the model's config."""
    runtime, path = _runtime_of(config, model_dir / str(version), where)
    data = path.read_bytes()
    inputs = _config_specs(config.input, "input", config.max_batch_size, where)
    outputs = _config_specs(config.output, "output", config.max_batch_size, where)
    try:
        if runtime == "onnxruntime":
            model_inputs, model_outputs = onnx_io(data)
            if config.max_batch_size > 0:
                fixed = {n: d for n, d in _onnx_first_dims(data).items() if d != -1}
                if fixed:
                    tensor, dim = next(iter(fixed.items()))
                    raise RepositoryError(
                        f"{where}: max_batch_size {config.max_batch_size} contradicts the model: {tensor!r} has a "
                        f"fixed first dimension of {dim} in version {version}, so it takes no batch dimension")
            final_inputs = _check_against(inputs, model_inputs, "input", where)
            final_outputs = _check_against(outputs, model_outputs, "output", where)
        else:
            torch_archive_check(data)
            if not inputs or not outputs:
                raise RepositoryError(f"{where}: a TorchScript model carries no input/output description: "
                                      f"{'input' if not inputs else 'output'} must be listed in {CONFIG_FILE}")
            final_inputs, final_outputs = tuple(inputs), tuple(outputs)
    except ModelFileError as exc:
        raise RepositoryError(f"{path}: {exc}") from None
    warmup = _warmup(config, model_dir, final_inputs, where)
    return RepositoryModel(model_dir.name, version, path, runtime, final_inputs, final_outputs, slo,
                           config.max_batch_size, warnings, warmup, policy,
                           _expected_rate(config, where), _late_requests(config, where))


def read_repository(root: str | pathlib.Path) -> list[RepositoryModel]:
    """Every model version of a repository that its policy selects, by name and version;
    RepositoryError for the first that cannot be served."""
    root = pathlib.Path(root)
    if not root.is_dir():
        raise RepositoryError(f"{root}: not a directory")
    models = [m for d in sorted(root.iterdir()) if d.is_dir() and not d.name.startswith(".")
              for m in read_model_versions(d)]
    if not models:
        raise RepositoryError(f"{root}: no model folders (expected <name>/config.pbtxt and <name>/1/model.onnx)")
    return models


def describe(model: RepositoryModel) -> dict:
    return {"name": model.name, "version": model.version, "version_policy": model.version_policy.describe(),
            "file": str(model.path), "runtime": model.runtime,
            "slo_ms": model.slo_ms, "max_batch_size": model.max_batch_size,
            "expected_rate_rps": model.expected_rate_rps,
            "late_requests": model.late_requests.value if model.late_requests else None,
            "inputs": [t.to_json_obj() for t in model.inputs], "outputs": [t.to_json_obj() for t in model.outputs],
            "warmup": describe_warmup(model.warmup), "warnings": list(model.warnings)}
