"""The frontend's routing table: internal types built from the scheduler's pushed RoutingTable."""

from __future__ import annotations

from dataclasses import dataclass

from common.pb import control
from common.tensors import TensorSpec


@dataclass(frozen=True)
class Route:
    node_id: str
    address: str
    weight: float


@dataclass(frozen=True)
class ModelEntry:
    name: str
    runtime: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    slo_ms: float
    max_batch: int
    served: bool                     # a session exists for it (loaded), even if no backend yet
    backends: tuple[Route, ...]
    reason: str = ""                 # why it has no backend

    @property
    def ready(self) -> bool:
        return bool(self.backends)

    @property
    def platform(self) -> str:
        return {"onnxruntime": "onnxruntime_onnx", "torch": "pytorch_libtorch"}.get(self.runtime, self.runtime)


DEFAULT_MAX_BATCH = 64


def _entry(desc: control.ModelDesc, slo_ms: float, served: bool, routes=(), reason: str = "") -> ModelEntry:
    spec = lambda t: TensorSpec(t.name, t.datatype, tuple(t.shape))  # noqa: E731
    return ModelEntry(desc.name, desc.runtime, tuple(spec(t) for t in desc.inputs),
                      tuple(spec(t) for t in desc.outputs), slo_ms or desc.default_slo_ms,
                      desc.max_batch or DEFAULT_MAX_BATCH, served,
                      tuple(Route(r.node_id, r.address, r.weight) for r in routes), reason)


@dataclass(frozen=True)
class RoutingTable:
    epoch: int
    models: dict[str, ModelEntry]

    @staticmethod
    def empty() -> "RoutingTable":
        return RoutingTable(0, {})

    @staticmethod
    def from_proto(table: control.RoutingTable) -> "RoutingTable":
        models = {}
        for r in table.routes:
            models[r.model.name] = _entry(r.model, r.slo_ms, True, r.backends, r.reason)
        for d in table.stored:
            models.setdefault(d.name, _entry(d, 0.0, False, (), "not loaded"))
        return RoutingTable(table.epoch, models)

    def addresses(self) -> set[str]:
        return {r.address for m in self.models.values() for r in m.backends}
