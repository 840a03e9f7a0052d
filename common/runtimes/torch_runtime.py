"""PyTorch runtime: TorchScript archives and ``torch.export`` (.pt2) programs, on CPU or CUDA.

torch is an optional extra: it is imported only when this runtime is loaded.

Specs. TorchScript carries no static input/output description, so ``io`` (inputs, outputs) is
required for it; the model database stores it in the model's io sidecar JSON
(``{"inputs": [{name, datatype, shape}], "outputs": [...]}``, shapes without the batch dimension,
see :func:`common.model_io.parse_io_json`). Exported programs carry example shapes: without ``io``,
inputs are named after the forward arguments, outputs ``output_0``, ``output_1``, ..., dynamic
dimensions -1. The model is called positionally with the inputs in spec order; it may return one
tensor, a tuple/list in output order, or a dict keyed by output name.

Safety. No pickle from the model file is ever unpickled by Python's pickle or ``torch.load``:
- TorchScript goes through ``torch.jit.load``, whose archive reader rebuilds only TorchScript
  types and code (no arbitrary Python objects).
- ``torch.export.load`` in torch 2.x would call ``torch.load(weights_only=False)`` for pickled
  payloads and as a fallback for sample inputs, ``sympy.sympify`` (``eval``) on shape
  expressions, and ``exec`` on guard code. Before loading, the archive is rebuilt with only the
  members that the loader reads as plain data: pickled payloads, custom/opaque objects,
  AOTInductor/ExecuTorch artifacts and legacy ``.pt`` files are refused; sample inputs are
  dropped; guard code is dropped (feeds are validated against the specs instead); every shape
  expression must be a sympy expression over a whitelist of symbolic-shape functions.
"""

from __future__ import annotations

import enum
import io as _io
import json
import re
import zipfile
from typing import Any, Mapping

import numpy as np

from common.runtimes.base import (
    DeviceSpec, DeviceUnavailableError, IOSpecs, ModelFileError, Runtime, RuntimeClosedError, RuntimeKind,
    io_nbytes,
)
from common.tensors import TensorSpec, kserve_datatype

_BYTES_PER_MB = 1024.0 * 1024.0


class TorchFormat(enum.StrEnum):
    TORCHSCRIPT = "torchscript"
    EXPORTED_PROGRAM = "exported_program"


class ModelOutputError(RuntimeError):
    """The model returned outputs that do not match its declared output specs."""


def detect_format(model_bytes: bytes) -> TorchFormat:
    """TorchScript or torch.export archive, from the zip's members; ModelFileError for anything else."""
    try:
        with zipfile.ZipFile(_io.BytesIO(model_bytes)) as archive:
            names = archive.namelist()
            formats = [n for n in names if n.endswith("/archive_format") or n == "archive_format"]
            if formats and archive.read(formats[0]).strip() == b"pt2":
                return TorchFormat.EXPORTED_PROGRAM
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
        raise ModelFileError(f"not a TorchScript or torch.export archive (expected a zip file): {exc}") from None
    if any(n.endswith("/data.pkl") for n in names) and any("/code/" in n for n in names):
        return TorchFormat.TORCHSCRIPT
    raise ModelFileError("zip archive is neither TorchScript (data.pkl + code/) nor torch.export (archive_format pt2)")


# ---- torch.export archive sanitizing ------------------------------------------------------------

_PT2_PLAIN_MEMBERS = re.compile(
    r"(archive_format|archive_version|byteorder|\.data/[A-Za-z0-9_.]+|extra/[^/]+"
    r"|models/(?P<model>[A-Za-z0-9_\-]+)\.json"
    r"|data/weights/[A-Za-z0-9_\-]+_weights_config\.json|data/weights/weight_\d+"
    r"|data/constants/[A-Za-z0-9_\-]+_constants_config\.json|data/constants/tensor_\d+)")
_PT2_SAMPLE_INPUTS = re.compile(r"data/sample_inputs/[A-Za-z0-9_\-]+\.pt")

_SYMPY_NAMES = frozenset("""
Symbol Integer Float Rational Half One Zero NegativeOne Infinity NegativeInfinity oo zoo nan
true false True False BooleanTrue BooleanFalse Add Mul Pow Mod Max Min Abs floor ceiling sqrt
Eq Ne Lt Le Gt Ge Equality Unequality StrictLessThan StrictGreaterThan LessThan GreaterThan
And Or Not Piecewise ExprCondPair
positive negative integer real nonnegative nonpositive finite infinite precision evaluate commutative
zero nonzero even odd
""".split())
_SYM_STRING = re.compile(r"'[A-Za-z0-9_.+\-]*'")
_SYM_TOKEN = re.compile(r"\s*(?:(?P<name>[A-Za-z_][A-Za-z0-9_]*)|(?P<num>\d+(?:\.\d*)?(?:[eE][+\-]?\d+)?)"
                        r"|(?P<op>==|!=|<=|>=|\*\*|//|[()+\-*/%,=<>&|~]))")
_PLAIN_SYMBOL = re.compile(r"[a-z]+\d+")


def _torch_sympy_functions() -> frozenset[str]:
    try:
        import sympy  # lazy: sympy (torch's dependency) and torch are an optional extra, ~1 s to import
        import torch.utils._sympy.functions as functions  # lazy: torch, as above
    except ImportError:  # pragma: no cover - layout of a future torch
        return frozenset()
    return frozenset(n for n in dir(functions) if not n.startswith("_")
                     and isinstance(getattr(functions, n), type) and issubclass(getattr(functions, n), sympy.Basic))


def check_sym_expr(expr: str, allowed: frozenset[str]) -> None:
    """ModelFileError unless ``expr`` is a sympy expression over whitelisted names (no attribute access)."""
    text = _SYM_STRING.sub("0", expr)
    pos = 0
    while pos < len(text):
        if text[pos:].strip() == "":
            return
        match = _SYM_TOKEN.match(text, pos)
        if match is None:
            raise ModelFileError(f"torch.export archive: refused shape expression {expr[:80]!r} "
                                 f"(unexpected character {text[pos:].lstrip()[:1]!r})")
        name = match.group("name")
        if name is not None and name not in allowed and not _PLAIN_SYMBOL.fullmatch(name):
            raise ModelFileError(f"torch.export archive: refused shape expression {expr[:80]!r} (name {name!r})")
        pos = match.end()


def _walk_sym_exprs(obj: Any, allowed: frozenset[str]) -> None:
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key == "expr_str":
                if not isinstance(value, str):
                    raise ModelFileError("torch.export archive: expr_str must be a string")
                check_sym_expr(value, allowed)
            else:
                _walk_sym_exprs(value, allowed)
    elif isinstance(obj, list):
        for value in obj:
            _walk_sym_exprs(value, allowed)


def _check_payload_config(raw: bytes, member: str, prefix: str) -> None:
    try:
        config = json.loads(raw)
        entries = config["config"]
        if not isinstance(entries, dict):
            raise TypeError("config is not an object")
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelFileError(f"torch.export archive: malformed {member}: {exc}") from None
    for fqn, meta in entries.items():
        if not isinstance(meta, dict):
            raise ModelFileError(f"torch.export archive: malformed entry {fqn!r} in {member}")
        if meta.get("use_pickle"):
            raise ModelFileError(f"torch.export archive: {fqn!r} is stored as a pickle; refused "
                                 f"(re-export with plain tensors)")
        path = meta.get("path_name", "")
        if not (isinstance(path, str) and re.fullmatch(prefix + r"\d+", path)):
            raise ModelFileError(f"torch.export archive: {fqn!r} refers to {path!r}, not a plain tensor payload")


def sanitize_pt2(model_bytes: bytes) -> bytes:
    """Rebuild a torch.export archive from its plain-data members only; ModelFileError when anything is unsafe."""
    allowed = _SYMPY_NAMES | _torch_sympy_functions()
    out = _io.BytesIO()
    try:
        with zipfile.ZipFile(_io.BytesIO(model_bytes)) as archive, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as new:
            infos = [i for i in archive.infolist() if not i.is_dir()]
            roots = {i.filename.split("/", 1)[0] for i in infos}
            if len(roots) != 1 or any("/" not in i.filename for i in infos):
                raise ModelFileError("torch.export archive: expected every member under one root folder")
            for info in infos:
                member = info.filename.split("/", 1)[1]
                if _PT2_SAMPLE_INPUTS.fullmatch(member):
                    new.writestr(info.filename, b"")  # loads as "no example inputs"; never unpickled
                    continue
                if not _PT2_PLAIN_MEMBERS.fullmatch(member):
                    raise ModelFileError(f"torch.export archive: member {member!r} is not plain data "
                                         f"(pickles, AOTInductor/ExecuTorch artifacts are refused)")
                data = archive.read(info)
                if member.startswith("models/"):
                    try:
                        program = json.loads(data)
                    except ValueError as exc:
                        raise ModelFileError(f"torch.export archive: {member} is not JSON: {exc}") from None
                    if not isinstance(program, dict):
                        raise ModelFileError(f"torch.export archive: {member} is not a JSON object")
                    _walk_sym_exprs(program, allowed)
                    program["guards_code"] = []  # executed as Python by ExportedProgram.module()
                    data = json.dumps(program).encode()
                elif member.endswith("_weights_config.json"):
                    _check_payload_config(data, member, "weight_")
                elif member.endswith("_constants_config.json"):
                    _check_payload_config(data, member, "tensor_")
                new.writestr(info.filename, data)
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise ModelFileError(f"torch.export archive: unreadable zip: {exc}") from None
    return out.getvalue()


# ---- the runtime -------------------------------------------------------------------------------

def _torch_device(device: DeviceSpec):
    import torch  # lazy: torch is an optional extra (~1 s to import)

    if device.is_cuda:
        if not torch.cuda.is_available():
            raise DeviceUnavailableError("CUDA requested but torch has no CUDA device "
                                         "(torch built without CUDA, or no GPU visible)")
        if device.index >= torch.cuda.device_count():
            raise DeviceUnavailableError(f"CUDA requested on {device} but torch sees "
                                         f"{torch.cuda.device_count()} CUDA device(s)")
        return torch.device("cuda", device.index)
    if device.is_emulated:
        raise ValueError(f"the torch runtime cannot run on {device}")
    return torch.device("cpu")


def _spec_from_value(name: str, value: Any, role: str) -> TensorSpec:
    import torch  # lazy: torch is an optional extra (~1 s to import)

    if not isinstance(value, torch.Tensor):
        raise ModelFileError(f"exported program {role} {name!r} is not a tensor; pass io=... to describe it")
    try:
        datatype = kserve_datatype(torch.empty(0, dtype=value.dtype).numpy().dtype)
    except (KeyError, TypeError, RuntimeError):
        raise ModelFileError(f"exported program {role} {name!r}: unsupported dtype {value.dtype}") from None
    dims = [int(d) if isinstance(d, int) else -1 for d in value.shape]
    if not dims:
        raise ModelFileError(f"exported program {role} {name!r}: needs a leading batch dimension")
    return TensorSpec(name, datatype, tuple(dims[1:]))


def _exported_specs(program) -> IOSpecs:
    """Specs from an ExportedProgram's placeholders and outputs (batch dim stripped)."""
    nodes = {n.name: n for n in program.graph.nodes}
    signature = program.graph_signature
    inputs = tuple(_spec_from_value(name, nodes[name].meta.get("val"), "input") for name in signature.user_inputs)
    outputs = tuple(_spec_from_value(f"output_{i}", nodes[name].meta.get("val") if name in nodes else None, "output")
                    for i, name in enumerate(signature.user_outputs))
    if not inputs or not outputs:
        raise ModelFileError("exported program needs at least one tensor input and one tensor output")
    return inputs, outputs


class TorchRuntime(Runtime):
    kind = RuntimeKind.TORCH

    def __init__(self, model_bytes: bytes, device: DeviceSpec, *, intra_op_threads: int | None = None,
                 io: IOSpecs | None = None) -> None:
        super().__init__()
        import torch  # lazy: torch is an optional extra (~1 s to import)

        torch_device = _torch_device(device)
        fmt = detect_format(model_bytes)
        if fmt is TorchFormat.TORCHSCRIPT and io is None:
            raise ValueError("TorchScript models carry no input/output specs: pass io=(inputs, outputs) "
                             "(the model database keeps them in the model's io sidecar JSON)")
        if intra_op_threads is not None:
            torch.set_num_threads(intra_op_threads)  # process-wide in torch
        allocated_before = torch.cuda.memory_allocated(torch_device) if device.is_cuda else 0
        try:
            if fmt is TorchFormat.TORCHSCRIPT:
                module = torch.jit.load(_io.BytesIO(model_bytes), map_location=torch_device)
            else:
                program = torch.export.load(_io.BytesIO(sanitize_pt2(model_bytes)))
                if io is None:
                    io = _exported_specs(program)
                module = program.module(check_guards=False).to(torch_device)
        except ModelFileError:
            raise
        except Exception as exc:  # torch raises RuntimeError, AssertionError, KeyError, ... on bad archives
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise ModelFileError(f"torch cannot load the {fmt.value}: {type(exc).__name__}: {message}") from None
        if fmt is TorchFormat.TORCHSCRIPT:
            module.eval()  # exported programs are already in inference form and refuse eval()
        self.inputs, self.outputs = tuple(io[0]), tuple(io[1])
        self.device = str(device)
        self.format = fmt
        self._torch = torch
        self._torch_device = torch_device
        self._module = module
        weights = sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))
        measured = torch.cuda.memory_allocated(torch_device) - allocated_before if device.is_cuda else 0
        self._weights_bytes = max(weights, measured)
        self._max_batch_seen = 1

    def _to_tensor(self, array: np.ndarray):
        if not array.flags.writeable or not array.flags.c_contiguous:
            array = np.array(array, order="C", copy=True)  # torch.from_numpy needs a writable array
        tensor = self._torch.from_numpy(array)
        return tensor.to(self._torch_device, non_blocking=False) if self._torch_device.type != "cpu" else tensor

    def _run(self, feeds: Mapping[str, np.ndarray], batch: int) -> dict[str, np.ndarray]:
        module = self._module
        if module is None:
            raise RuntimeClosedError(f"torch runtime on {self.device} is closed")
        self._max_batch_seen = max(self._max_batch_seen, batch)
        args = [self._to_tensor(feeds[spec.name]) for spec in self.inputs]
        with self._torch.inference_mode():
            result = module(*args)
        return self._collect(result, batch)

    def _collect(self, result: Any, batch: int) -> dict[str, np.ndarray]:
        torch = self._torch
        if isinstance(result, torch.Tensor):
            values = [result]
        elif isinstance(result, (tuple, list)):
            values = list(result)
        elif isinstance(result, dict):
            missing = [s.name for s in self.outputs if s.name not in result]
            if missing:
                raise ModelOutputError(f"model returned a dict without output(s) {missing}")
            values = [result[s.name] for s in self.outputs]
        else:
            raise ModelOutputError(f"model returned {type(result).__name__}; expected tensor(s)")
        if len(values) != len(self.outputs):
            raise ModelOutputError(f"model returned {len(values)} output(s), its specs declare {len(self.outputs)}")
        outputs: dict[str, np.ndarray] = {}
        for spec, value in zip(self.outputs, values):
            if not isinstance(value, torch.Tensor):
                raise ModelOutputError(f"output {spec.name!r}: model returned {type(value).__name__}, not a tensor")
            array = value.detach().cpu().numpy()
            if array.dtype != spec.dtype:
                raise ModelOutputError(f"output {spec.name!r}: model returned {array.dtype}, spec says {spec.datatype}")
            if array.ndim != len(spec.shape) + 1 or array.shape[0] != batch or any(
                    want >= 0 and want != got for want, got in zip(spec.shape, array.shape[1:])):
                raise ModelOutputError(f"output {spec.name!r}: model returned shape {list(array.shape)}, spec says "
                                       f"[{batch}, {', '.join(map(str, spec.shape))}]")
            outputs[spec.name] = array
        return outputs

    def memory_mb(self) -> float:
        """Weights (parameters + buffers, or the measured CUDA allocation at load, whichever is larger)
        plus inputs and outputs of the largest batch run so far."""
        return (self._weights_bytes + io_nbytes(self.inputs + self.outputs, self._max_batch_seen)) / _BYTES_PER_MB

    def _release(self) -> None:
        self._module = None
        if self._torch_device.type == "cuda":
            self._torch.cuda.empty_cache()
