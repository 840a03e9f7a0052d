"""Protobuf <-> internal types at the scheduler's edge."""

from __future__ import annotations

from common.pb import control
from common.profile import Profile
from common.tensors import TensorSpec
from globalsched.modeldb import ModelRecord


def tensor_desc(spec: TensorSpec) -> control.TensorDesc:
    return control.TensorDesc(name=spec.name, datatype=spec.datatype, shape=list(spec.shape))


def model_desc(record: ModelRecord, profiles: dict[str, Profile], loaded: bool) -> control.ModelDesc:
    return control.ModelDesc(
        name=record.name, sha256=record.sha256, runtime=record.runtime,
        inputs=[tensor_desc(t) for t in record.inputs], outputs=[tensor_desc(t) for t in record.outputs],
        size_bytes=record.size_bytes, default_slo_ms=record.default_slo_ms,
        max_batch=max((p.max_batch for p in profiles.values()), default=0),
        profiled_device_types=sorted(profiles), prefix_group=record.prefix_group, loaded=loaded,
        created_unix_ms=record.created_ms)
