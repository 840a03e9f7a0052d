"""Emulated GPU types and the batch-latency profiles of the sample models on them.

``nexus serve --device emulated:<gpu>`` runs backends that execute each batch by waiting the latency
that the model's profile gives (``common/runtimes/emulated.py``). An emulated device cannot measure
a profile, so when the scheduler asks one to profile a model (``Backend.ProfileModel``) it answers
from this datasheet: a sample model (one built by :mod:`common.sample_models`, recognised by its
ONNX producer and graph name) gets the profile of its architecture class on that GPU type. Other
models still need ``nexus models upload --profile``.

How the figures are derived (estimates for emulation and planning, not measurements):

- Per GPU type, an anchor: large-batch ResNet-50 (224x224, 4.1 GMAC per image) inference images/s
  with an optimising runtime in the precision that GPU serves best without INT8 calibration: FP32
  on Pascal (the GTX 1080 Ti has no tensor cores), FP16 tensor cores on Turing, Volta, Ampere and
  Hopper. The anchors are rounded estimates of the order of the published figures (vendor
  inference-performance pages; MLPerf Inference offline results, which are INT8, scaled down to
  FP16), cross-checked against the ratios of the spec-sheet peak arithmetic rates; they are not
  quotes of one source. Memory is the spec-sheet capacity in decimal MB (11000 for the GTX 1080 Ti,
  as in the workload example of docs/planning.md); each model's m(b) carries the runtime's workspace.
  From the anchor: microseconds per MAC = 1e6 / (ips * 4.1e9).
- Per architecture class, the multiply-accumulates per item (counted from the sample graphs' Conv
  and Gemm nodes; ``tests/e2e/test_emulated_gpus.py`` recounts them), an efficiency relative to
  ResNet-50 at 224x224 (small 64x64 feature maps and narrow layers fill a GPU worse: fewer thread
  blocks per kernel), the number of kernels a batch launches, and the bytes per item copied over
  PCIe (input plus outputs; the detector's crops dominate).
- l(b) = (kernels * launch_us + fixed_us + b * (macs / efficiency * us_per_mac + bytes / pcie)) / 1000
  ms, times Nexus's 1.15 margin (the scheduler plans with conservative figures). Launch overhead is
  the CUDA launch plus the runtime's per-node cost, a few microseconds less on newer platforms.
- m(b) = weights (FP32) + the runtime's workspace + b * the largest live activations, rounded up.

The resulting l(1) and l(32) are in docs/models.md's "Emulated GPUs" table (``python -m
common.emulated_gpus`` prints it).
"""

from __future__ import annotations

from dataclasses import dataclass

from common.profile import LATENCY_MARGIN, BatchLatency, Profile

RESNET50_MACS = 4.1e9   # per 224x224 image

# How a backend's model table reply names a load beyond its device's memory (an emulated GPU's, as
# CUDA's out-of-memory): the scheduler treats it as capacity, not as a fault of the model.
OUT_OF_MEMORY = "OutOfMemory:"


class UnknownGpuError(ValueError):
    """An emulated GPU name that is not in the datasheet; the message lists the known ones."""


@dataclass(frozen=True)
class GpuType:
    name: str                 # the name in ``emulated:<name>`` and the profiles' device type
    product: str
    architecture: str
    memory_mb: float          # spec-sheet capacity, decimal MB
    resnet50_ips: float       # anchor: large-batch ResNet-50 inference images/s (see module doc)
    precision: str            # the precision the anchor is for
    launch_us: float          # per kernel launch, including the runtime's per-node overhead
    pcie_gb_s: float          # effective host<->device copy bandwidth

    @property
    def us_per_mac(self) -> float:
        return 1e6 / (self.resnet50_ips * RESNET50_MACS)


# Ordered from the oldest. Nexus (SOSP 2019) was evaluated on GTX 1080 Ti.
GPU_TYPES: dict[str, GpuType] = {g.name: g for g in (
    GpuType("gtx1080ti", "NVIDIA GeForce GTX 1080 Ti (11 GB)", "Pascal", 11_000, 1_000, "FP32", 12.0, 11.0),
    GpuType("t4", "NVIDIA T4 (16 GB)", "Turing", 16_000, 1_800, "FP16", 12.0, 11.0),
    GpuType("v100", "NVIDIA V100 SXM2 (16 GB)", "Volta", 16_000, 4_500, "FP16", 9.0, 11.0),
    GpuType("a100", "NVIDIA A100 SXM (40 GB)", "Ampere", 40_000, 12_000, "FP16", 7.0, 22.0),
    GpuType("h100", "NVIDIA H100 SXM (80 GB)", "Hopper", 80_000, 25_000, "FP16", 6.0, 45.0),
)}


@dataclass(frozen=True)
class ModelClass:
    name: str
    description: str
    macs: float                # multiply-accumulates per item
    efficiency: float          # per-MAC throughput relative to ResNet-50 at 224x224
    kernels: int               # kernels launched per batch (ONNX nodes after fusion, roughly)
    io_bytes: int              # bytes per item copied between host and device
    weights_mb: float
    activation_mb: float       # per item, largest live activations (FP32)
    max_batch: int


_FIXED_US = 30.0               # per batch: input/output copies' setup and synchronisation
_WORKSPACE_MB = 200.0          # runtime workspace and allocator slack per model
_IMAGE_BYTES = 3 * 64 * 64 * 4

MODEL_CLASSES: dict[str, ModelClass] = {c.name: c for c in (
    ModelClass("resnet18-64", "ResNet-18 CNN at 64x64 (resnet18_64)", 148.6e6, 0.5, 30,
               _IMAGE_BYTES + 4000, 46.7, 1.0, 64),
    ModelClass("backbone-cls", "shared-backbone CNN classifier at 64x64 (vehicle_cls, face_cls)", 63.8e6, 0.4, 20,
               _IMAGE_BYTES + 400, 5.1, 1.0, 64),
    ModelClass("detector", "small 3-layer CNN detector with 6 crops out (detector)", 2.8e6, 0.2, 12,
               _IMAGE_BYTES * 7 + 24, 0.1, 2.0, 64),
    ModelClass("mlp", "small 3-layer MLP (mlp_small)", 0.0259e6, 0.05, 4, 64 * 4 + 40, 0.1, 0.01, 128),
)}

# Graph name of a sample model (``common.sample_models``) -> its class.
_GRAPH_CLASSES = {"resnet18_64": "resnet18-64", "vehicle_cls": "backbone-cls", "face_cls": "backbone-cls",
                  "detector_64": "detector", "mlp_small": "mlp"}


def gpu_type(name: str) -> GpuType:
    """The datasheet entry of ``name``; :class:`UnknownGpuError` lists the known names."""
    try:
        return GPU_TYPES[name]
    except KeyError:
        raise UnknownGpuError(f"unknown emulated GPU {name!r}; known: {', '.join(GPU_TYPES)}") from None


def check_device(device: str) -> None:
    """Raise :class:`UnknownGpuError` for ``emulated:<gpu>`` with a GPU not in the datasheet."""
    if device.startswith("emulated:"):
        gpu_type(device.split(":", 1)[1])


def class_profile(model_class: str, gpu: str) -> Profile:
    """The profile of architecture class ``model_class`` on emulated GPU ``gpu``."""
    g = gpu_type(gpu)
    c = MODEL_CLASSES[model_class]
    fixed_us = c.kernels * g.launch_us + _FIXED_US
    per_item_us = c.macs / c.efficiency * g.us_per_mac + c.io_bytes / (g.pcie_gb_s * 1e3)
    rows = []
    for b in range(1, c.max_batch + 1):
        latency_ms = (fixed_us + b * per_item_us) / 1000.0 * LATENCY_MARGIN
        memory_mb = c.weights_mb + _WORKSPACE_MB + b * c.activation_mb
        rows.append(BatchLatency(b, round(latency_ms, 6), round(memory_mb, 2)))
    return Profile.from_rows(rows, device_type=g.name,
                             meta={"source": f"common/emulated_gpus.py datasheet: {c.name} on {g.product}"})


def model_class_of(model_bytes: bytes) -> str | None:
    """The architecture class of a sample model's ONNX bytes, or None for any other model."""
    import onnx  # lazy: onnx costs ~30 ms at start-up and common.config (every command) imports this module

    from common.sample_models import PRODUCER  # lazy: it imports onnx at its top, for the same reason

    try:
        model = onnx.load_model_from_string(model_bytes)
    except Exception:   # not ONNX (TorchScript, ...): not a sample model
        return None
    if model.producer_name != PRODUCER:
        return None
    name = model.graph.name
    if name.startswith("backbone_v"):
        return "backbone-cls"
    return _GRAPH_CLASSES.get(name)


class NoDatasheet(ValueError):
    """An emulated GPU asked to profile a model it has no datasheet for: it cannot measure one."""


def datasheet_profile(model_bytes: bytes, gpu: str) -> Profile:
    """The datasheet profile of a sample model on ``gpu``; :class:`NoDatasheet` for any other model."""
    gpu_type(gpu)
    model_class = model_class_of(model_bytes)
    if model_class is None:
        raise NoDatasheet(f"an emulated device (emulated:{gpu}) executes a given profile and cannot measure one, "
                         f"and built-in profiles exist only for the sample models; upload the model with "
                         f"--profile for device type {gpu!r}")
    return class_profile(model_class, gpu)


def table_markdown() -> str:
    """The docs/models.md table: per GPU type, l(1) / l(32) in ms of each class."""
    classes = list(MODEL_CLASSES.values())
    head = "| GPU | memory (MB) | ResNet-50 anchor (img/s) | " + " | ".join(
        f"{c.name} l(1) / l(32) ms" for c in classes) + " |"
    lines = [head, "| " + " | ".join(["---"] * (3 + len(classes))) + " |"]
    for g in GPU_TYPES.values():
        cells = []
        for c in classes:
            p = class_profile(c.name, g.name)
            cells.append(f"{p.latency_ms(1):.2f} / {p.latency_ms(32):.2f}")
        lines.append(f"| `{g.name}` ({g.architecture}, {g.precision}) | {g.memory_mb:,.0f} | {g.resnet50_ips:,.0f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table_markdown())
