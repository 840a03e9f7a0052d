"""The backend's wire codec: a request's raw tensors into arrays (no copy), an outcome into its reply,
the engine's counters into a ``BackendStats`` message; and the key a runtime is loaded under.

The engine's outcome statuses are :class:`common.exec_status.ExecStatus`, whose values are the control
protocol's, so the reply carries them as they are.
"""

from __future__ import annotations

import time

import numpy as np

from backend.engine import Engine

from backend.sessions import Session

from backend.work import ExecError, Outcome
from common.pb import control
from common.tensors import TensorSpec
from common.version_policy import version_key
from common.exec_status import ExecStatus

_BYTES_PER_MB = 1024 * 1024
UTILIZATION_WINDOW_S = 10.0


def tensor_spec(desc: control.TensorDesc) -> TensorSpec:
    return TensorSpec(desc.name, desc.datatype, tuple(desc.shape))


def model_key(model: control.ModelDesc) -> str:
    """What a backend loads a runtime for: one version of a model (its version key, common/version_policy.py),
    shared by every session that runs it (the version's own and query stages')."""
    return version_key(model.name, model.version or 1)


def io_specs(model: control.ModelDesc) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """The model's (inputs, outputs) as tensor specs."""
    return tuple(tensor_spec(t) for t in model.inputs), tuple(tensor_spec(t) for t in model.outputs)


def item_nbytes(session: Session) -> tuple[int | None, ...]:
    """Bytes of one batch row of each of the session's inputs (None where a dimension is variable)."""
    return tuple(spec.item_nbytes() for spec in session.inputs)


def decode_inputs(session: Session, item: control.ExecItem,
                  row_nbytes: tuple[int | None, ...] | None = None) -> list[np.ndarray]:
    """Raw input bytes -> arrays of shape (rows, *spec.shape); ExecError(EXEC_INVALID) if they do not fit.

    The frontend validated the request against the model's description already; this only checks
    that each tensor's length fits its shape (``row_nbytes``: :func:`item_nbytes`, computed once per
    session by the caller) before ``np.frombuffer`` (which copies nothing)."""
    if len(item.inputs) != len(session.inputs):
        raise ExecError(ExecStatus.INVALID, f"expected {len(session.inputs)} inputs, got {len(item.inputs)}")
    rows = item.rows or 1
    if row_nbytes is None:
        row_nbytes = item_nbytes(session)
    if not item.input_shapes and None not in row_nbytes:      # the common case: fixed item shapes
        arrays = []
        for spec, raw, size in zip(session.inputs, item.inputs, row_nbytes):
            if len(raw) != rows * size:
                raise ExecError(ExecStatus.INVALID, f"input {spec.name!r}: expected {rows * size} bytes for shape "
                                                f"{[rows, *spec.shape]}, got {len(raw)}")
            arrays.append(np.frombuffer(raw, dtype=spec.dtype).reshape(rows, *spec.shape))
        return arrays
    shapes = {d.name: tuple(d.shape) for d in item.input_shapes}
    arrays = []
    for spec, raw in zip(session.inputs, item.inputs):
        shape = shapes.get(spec.name) or (rows, *spec.shape)
        if any(d < 0 for d in shape):
            raise ExecError(ExecStatus.INVALID, f"input {spec.name!r}: variable dimensions need an explicit shape")
        expected = int(np.prod(shape, dtype=np.int64)) * spec.dtype.itemsize
        if len(raw) != expected:
            raise ExecError(ExecStatus.INVALID, f"input {spec.name!r}: expected {expected} bytes for shape "
                                            f"{list(shape)}, got {len(raw)}")
        arrays.append(np.frombuffer(raw, dtype=spec.dtype).reshape(shape))
    return arrays


def encode_result(request_id: int, outcome: Outcome, received_ns: int = 0) -> control.ExecResult:
    """The reply to a request; ``received_ns`` (``time.monotonic_ns`` when the item arrived) gives its
    ``backend_ns``."""
    result = control.ExecResult(request_id=request_id, status=outcome.status, message=outcome.message,
                                queue_ns=outcome.queue_ns, compute_ns=outcome.compute_ns,
                                batch_size=outcome.batch_size, compute_input_ns=outcome.input_ns,
                                first_in_batch=outcome.first_in_batch,
                                backend_ns=time.monotonic_ns() - received_ns if received_ns else 0)
    if outcome.outputs is not None:
        for arr in outcome.outputs:
            result.outputs.append(np.ascontiguousarray(arr).tobytes())
            result.output_shapes.append(control.TensorDesc(shape=list(arr.shape)))
    return result


def backend_stats(engine: Engine, node_id: str = "") -> control.BackendStats:
    """A snapshot of every session's and prefix group's counters, taken under the engine's stats lock."""
    reply = control.BackendStats(node_id=node_id, utilization=engine.utilization(UTILIZATION_WINDOW_S),
                                 utilization_total=engine.utilization())
    total = 0
    sessions, groups = list(engine.sessions.items()), list(engine.groups)
    memory = {name: int(s.memory_mb * _BYTES_PER_MB) for name, s in sessions}
    with engine.stats_lock:     # one consistent snapshot: no batch half counted
        for name, s in sessions:
            st = s.stats
            group = s.group if s.group in groups else None
            total += memory[name]
            reply.sessions.append(control.SessionStats(
                model=name, inference_count=st.inference_count, execution_count=st.execution_count,
                success_count=st.success_count, success_ns=st.success_ns, fail_count=st.fail_count,
                queue_ns=st.queue_ns, compute_ns=st.compute_ns, dropped=st.dropped, queue_length=s.depth.queued,
                batch_histogram=dict(st.batch_histogram), batch_compute_ns=dict(st.batch_compute_ns),
                memory_bytes=memory[name], last_inference_ms=st.last_inference_ms,
                prefix_group=group.name if group else "",
                shared_memory_bytes=int(group.memory_mb * _BYTES_PER_MB) if group else 0,
                request_compute_input_ns=st.request_compute_input_ns,
                request_compute_infer_ns=st.request_compute_infer_ns,
                request_compute_output_ns=st.request_compute_output_ns,
                batch_compute_input_ns=dict(st.batch_compute_input_ns),
                batch_compute_output_ns=dict(st.batch_compute_output_ns),
                warmup_count=st.warmup_count, warmup_ns=st.warmup_ns))
        for g in groups:
            gs = g.stats
            reply.prefix_groups.append(control.PrefixGroupStats(
                group=g.name, prefix_id=g.prefix_id, sessions=[m.name for m in g.members],
                execution_count=gs.execution_count, inference_count=gs.inference_count, compute_ns=gs.compute_ns,
                prefix_compute_ns=gs.prefix_ns, batch_histogram=dict(gs.batch_histogram),
                memory_bytes=int(g.memory_mb * _BYTES_PER_MB), max_batch=g.max_batch))
    reply.memory_bytes = total
    return reply
