"""The project's sample ONNX models, built deterministically in code (no download, no torch).

Every model takes one FP32 input named ``input`` whose leading dimension is the symbolic batch
dimension ``batch``, and gives FP32 outputs with the same leading dimension. Weights come from a
fixed numpy seed, so the serialized bytes are identical across runs and machines; BatchNorm is
folded into the convolutions' biases, as an exporter would do for inference.

The models:

- :func:`resnet18_64`: a ResNet-18 for 3x64x64 images (conv stem, 4 stages of 2 basic blocks,
  64/128/256/512 channels, global average pool, FC to 1000 classes). The heaviest sample.
- :func:`backbone_variant`: a family of classifiers that share a CNN backbone (same layers, same
  weights) and differ only in a small head; the case that prefix batching is for. Variant 0 is
  served as ``vehicle_cls`` and variant 1 as ``face_cls``.
- :func:`mlp_small`: a tiny MLP for quick tests.

:data:`SAMPLE_MODELS` lists them with their default SLOs; :func:`write_sample_models` writes them
as ``.onnx`` files.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
# ONNX IR version 8 is the one that goes with opset 17; every onnxruntime since 1.10 loads it.
IR_VERSION = 8
PRODUCER = "nexus-sample-models"
BATCH_DIM = "batch"

# Seeds: the backbone's seed is fixed for the whole family so every variant carries the same
# backbone weights; each head draws from its own seed.
RESNET_SEED = 18
BACKBONE_SEED = 1234
HEAD_SEED_BASE = 5000
MLP_SEED = 7

# Residual branches end in a conv whose weights are scaled down so that the identity path
# dominates and activations stay of order one through the blocks (as zero-init of the last BN
# gamma does in trained-from-scratch ResNets).
_RESIDUAL_SCALE = 0.3


class _GraphBuilder:
    """Appends nodes and initializers with deterministic names and weights."""

    def __init__(self, seed: int, prefix: str = "") -> None:
        self.rng = np.random.default_rng(seed)
        self.prefix = prefix
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._count: dict[str, int] = {}

    def reseed(self, seed: int, prefix: str) -> None:
        """Draw later weights from another seed and name later nodes with another prefix."""
        self.rng = np.random.default_rng(seed)
        self.prefix = prefix

    def _name(self, kind: str) -> str:
        key = self.prefix + kind
        n = self._count.get(key, 0)
        self._count[key] = n + 1
        return f"{key}{n}"

    def _init(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def node(self, op: str, inputs: Sequence[str], **attrs) -> str:
        name = self._name(op.lower())
        out = f"{name}_out"
        self.nodes.append(helper.make_node(op, list(inputs), [out], name=name, **attrs))
        return out

    def conv(
        self,
        x: str,
        cin: int,
        cout: int,
        k: int,
        stride: int = 1,
        gain: float = 1.0,
    ) -> str:
        """Conv with BatchNorm folded in: He-initialised weights, small bias."""
        name = self._name("conv")
        fan_in = cin * k * k
        std = gain * np.sqrt(2.0 / fan_in)
        w = (self.rng.standard_normal((cout, cin, k, k)) * std).astype(np.float32)
        b = (self.rng.standard_normal(cout) * 0.05).astype(np.float32)
        wn = self._init(f"{name}.weight", w)
        bn = self._init(f"{name}.bias", b)
        out = f"{name}_out"
        pad = k // 2
        self.nodes.append(
            helper.make_node(
                "Conv",
                [x, wn, bn],
                [out],
                name=name,
                kernel_shape=[k, k],
                strides=[stride, stride],
                pads=[pad, pad, pad, pad],
            )
        )
        return out

    def gemm(self, x: str, fin: int, fout: int, gain: float = 1.0) -> str:
        """Fully connected layer: y = x @ W^T + b, W of shape (fout, fin)."""
        name = self._name("fc")
        std = gain * np.sqrt(1.0 / fin)
        w = (self.rng.standard_normal((fout, fin)) * std).astype(np.float32)
        b = (self.rng.standard_normal(fout) * 0.05).astype(np.float32)
        wn = self._init(f"{name}.weight", w)
        bn = self._init(f"{name}.bias", b)
        out = f"{name}_out"
        self.nodes.append(helper.make_node("Gemm", [x, wn, bn], [out], name=name, transB=1))
        return out

    def relu(self, x: str) -> str:
        return self.node("Relu", [x])

    def basic_block(self, x: str, cin: int, cout: int, stride: int) -> str:
        """ResNet basic block: two 3x3 convs plus the (projected if needed) identity."""
        y = self.relu(self.conv(x, cin, cout, 3, stride))
        y = self.conv(y, cout, cout, 3, 1, gain=_RESIDUAL_SCALE)
        if stride != 1 or cin != cout:
            # Projection shortcut; its input is post-ReLU, so He gain keeps the second moment.
            shortcut = self.conv(x, cin, cout, 1, stride)
        else:
            shortcut = x
        return self.relu(self.node("Add", [y, shortcut]))

    def model(
        self,
        graph_name: str,
        input_shape: Sequence[int],
        outputs: Sequence[tuple[str, str, int]],
        doc: str,
    ) -> onnx.ModelProto:
        """Wrap into a checked ModelProto; ``outputs`` lists (tensor, output name, width)."""
        nodes = list(self.nodes)
        out_infos = []
        for tensor, out_name, width in outputs:
            nodes.append(helper.make_node("Identity", [tensor], [out_name], name=f"{out_name}_id"))
            out_infos.append(
                helper.make_tensor_value_info(out_name, TensorProto.FLOAT, [BATCH_DIM, width])
            )
        graph = helper.make_graph(
            nodes,
            graph_name,
            [helper.make_tensor_value_info("input", TensorProto.FLOAT, [BATCH_DIM, *input_shape])],
            out_infos,
            initializer=self.initializers,
        )
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", OPSET)],
            producer_name=PRODUCER,
            producer_version="1",
            doc_string=doc,
        )
        model.ir_version = IR_VERSION
        onnx.checker.check_model(model)
        return model


def _pool_flatten(b: _GraphBuilder, x: str) -> str:
    pooled = b.node("GlobalAveragePool", [x])
    return b.node("Flatten", [pooled], axis=1)


def resnet18_64(num_classes: int = 1000, seed: int = RESNET_SEED) -> onnx.ModelProto:
    """ResNet-18 for 3x64x64 input: 7x7/2 stem + 3x3/2 max pool, 4 stages x 2 basic blocks.

    Channels 64/128/256/512, spatial 16/8/4/2, global average pool, FC to ``num_classes``.
    About 0.15 GFLOP per image, 11.7 M parameters with 1000 classes. Another ``seed`` gives a
    different file of the same architecture (benchmarks/vs_triton.py).
    """
    b = _GraphBuilder(seed)
    # Stem gain 0.5: the 3x3 max pool that follows roughly doubles the RMS of a ReLU map.
    x = b.relu(b.conv("input", 3, 64, 7, stride=2, gain=0.5))
    x = b.node("MaxPool", [x], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    cin = 64
    for stage, cout in enumerate((64, 128, 256, 512)):
        for block in range(2):
            stride = 2 if (stage > 0 and block == 0) else 1
            x = b.basic_block(x, cin, cout, stride)
            cin = cout
    x = _pool_flatten(b, x)
    # The pooled features are all positive with RMS ~1.3; a smaller gain keeps logits ~1.
    logits = b.gemm(x, 512, num_classes, gain=0.75)
    return b.model(
        "resnet18_64",
        (3, 64, 64),
        [(logits, "logits", num_classes)],
        "ResNet-18 for 3x64x64 images, BatchNorm folded; deterministic weights.",
    )


def tiny_cnn(seed: int = 2020, size: int = 32) -> onnx.ModelProto:
    """A tiny CNN on 3x``size``x``size`` (32 by default): three 3x3/2 convs (3->8->16->32 channels),
    global pool, FC to 10. Its compute is a few microseconds, so serving it measures the per-request
    overhead (benchmarks/vs_triton.py). Not a served sample."""
    b = _GraphBuilder(seed, prefix="tiny_")
    x = b.relu(b.conv("input", 3, 8, 3, stride=2))
    x = b.relu(b.conv(x, 8, 16, 3, stride=2))
    x = b.relu(b.conv(x, 16, 32, 3, stride=2))
    logits = b.gemm(_pool_flatten(b, x), 32, 10)
    return b.model("tiny_cnn", (3, size, size), [(logits, "logits", 10)], "Tiny CNN for per-request overhead.")


# --- the shared-backbone family -------------------------------------------------------------

# Names of the variants served by default; further variants are called "backbone_v{i}".
VARIANT_NAMES = ("vehicle_cls", "face_cls")
# Default number of classes per variant, cycled for i beyond the table.
_VARIANT_CLASSES = (10, 100, 20, 50, 2, 37, 64, 5, 200, 16)
BACKBONE_INPUT_SHAPE = (3, 64, 64)
BACKBONE_FEATURES = 256
_HEAD_HIDDEN = 128


def variant_name(i: int) -> str:
    """The served name of backbone variant ``i``."""
    return VARIANT_NAMES[i] if 0 <= i < len(VARIANT_NAMES) else f"backbone_v{i}"


def _backbone(b: _GraphBuilder) -> str:
    """A compact ResNet at 64x64: 3x3/2 stem to 32x32, stages of 32/64/128/256 channels."""
    x = b.relu(b.conv("input", 3, 32, 3, stride=2))
    cin = 32
    for stage, cout in enumerate((32, 64, 128, BACKBONE_FEATURES)):
        stride = 1 if stage == 0 else 2
        x = b.basic_block(x, cin, cout, stride)
        cin = cout
    return _pool_flatten(b, x)


def backbone_variant(i: int, num_classes: int | None = None) -> onnx.ModelProto:
    """Variant ``i`` of the shared-backbone family.

    Every variant has the same backbone layers and weights (seed :data:`BACKBONE_SEED`) up to the
    pooled 256-wide feature vector; the head (FC 256->128, ReLU, FC 128->classes) is drawn from
    seed ``HEAD_SEED_BASE + i``. ``num_classes`` defaults to a per-variant figure (10 for variant 0,
    100 for variant 1, ...).
    """
    if i < 0:
        raise ValueError(f"variant index must be >= 0, got {i}")
    if num_classes is None:
        num_classes = _VARIANT_CLASSES[i % len(_VARIANT_CLASSES)]
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    b = _GraphBuilder(BACKBONE_SEED, prefix="bb_")
    feats = _backbone(b)
    b.reseed(HEAD_SEED_BASE + i, prefix=f"head{i}_")
    h = b.relu(b.gemm(feats, BACKBONE_FEATURES, _HEAD_HIDDEN, gain=np.sqrt(2.0)))
    logits = b.gemm(h, _HEAD_HIDDEN, num_classes)
    return b.model(
        variant_name(i),
        BACKBONE_INPUT_SHAPE,
        [(logits, "logits", num_classes)],
        f"Shared-backbone classifier, variant {i} ({num_classes} classes).",
    )


def vehicle_cls() -> onnx.ModelProto:
    """Backbone variant 0 (10 classes)."""
    return backbone_variant(0)


def face_cls() -> onnx.ModelProto:
    """Backbone variant 1 (100 classes)."""
    return backbone_variant(1)


def mlp_small(in_features: int = 64, hidden: int = 128, num_classes: int = 10,
              seed: int = MLP_SEED) -> onnx.ModelProto:
    """A tiny MLP (in_features -> hidden -> hidden -> classes), microseconds per batch. Another
    ``seed`` gives other weights: a distinct model that shares no prefix with the sample."""
    b = _GraphBuilder(seed)
    x = b.relu(b.gemm("input", in_features, hidden, gain=np.sqrt(2.0)))
    x = b.relu(b.gemm(x, hidden, hidden, gain=np.sqrt(2.0)))
    logits = b.gemm(x, hidden, num_classes)
    return b.model(
        "mlp_small",
        (in_features,),
        [(logits, "logits", num_classes)],
        "Tiny MLP for quick tests; deterministic weights.",
    )


DETECTOR_BOXES = 6
DETECTOR_SEED = 64


def detector_64(num_boxes: int = DETECTOR_BOXES) -> onnx.ModelProto:
    """A toy detector for multi-model queries: ``scores`` [B, K] and ``crops`` [B, K, 3, 64, 64].

    A small CNN scores K candidate boxes (sigmoid; about half exceed 0.5 on random images, so a
    query that fans out on ``scores > 0.5`` sees gamma near K/2); each crop is the image scaled by a
    per-box constant, shaped like the classifiers' input so crops can feed them.
    """
    b = _GraphBuilder(DETECTOR_SEED, prefix="det_")
    x = b.relu(b.conv("input", 3, 16, 3, stride=2))
    x = b.relu(b.conv(x, 16, 32, 3, stride=2))
    x = b.relu(b.conv(x, 32, 64, 3, stride=2))
    feats = _pool_flatten(b, x)
    logits = b.gemm(feats, 64, num_boxes)
    scores = b.node("Sigmoid", [logits])
    scale = np.linspace(0.5, 1.5, num_boxes, dtype=np.float32).reshape(1, num_boxes, 1, 1, 1)
    b._init("det_crop_scale", scale)
    axes = b._init("det_unsqueeze_axes", np.array([1], dtype=np.int64))
    expanded = b.node("Unsqueeze", ["input", axes])
    crops = b.node("Mul", [expanded, "det_crop_scale"])
    nodes = list(b.nodes) + [helper.make_node("Identity", [scores], ["scores"], name="scores_id"),
                             helper.make_node("Identity", [crops], ["crops"], name="crops_id")]
    graph = helper.make_graph(
        nodes, "detector_64",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [BATCH_DIM, 3, 64, 64])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [BATCH_DIM, num_boxes]),
         helper.make_tensor_value_info("crops", TensorProto.FLOAT, [BATCH_DIM, num_boxes, 3, 64, 64])],
        initializer=b.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name=PRODUCER,
                              producer_version="1", doc_string=f"Toy detector with {num_boxes} candidate boxes.")
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model


class SampleModel(NamedTuple):
    """A registry entry: the builder and the SLO the model is served with by default."""

    builder: Callable[[], onnx.ModelProto]
    slo_ms: float


# Ordered: the order in which `nexus serve` registers them. Their SLOs let one device of a small
# machine hold them all (the default `nexus serve` has one backend): every session's duty cycle must
# hold one batch of each, so the sum of their batch-1 latencies (26 ms on a 2-core Xeon, resnet18_64
# 11 of them), plus the path allowance, must stay within the tightest SLO. mlp_small's 20 ms did not
# (issue 26: "the plan needs 2 devices" on the default configuration).
SAMPLE_MODELS: dict[str, SampleModel] = {
    "resnet18_64": SampleModel(resnet18_64, 100.0),
    "vehicle_cls": SampleModel(vehicle_cls, 50.0),
    "face_cls": SampleModel(face_cls, 50.0),
    "mlp_small": SampleModel(mlp_small, 50.0),
    "detector": SampleModel(detector_64, 100.0),
}


def build_sample_model(name: str) -> onnx.ModelProto:
    """Build the sample model called ``name``; KeyError lists the known names."""
    try:
        entry = SAMPLE_MODELS[name]
    except KeyError:
        known = ", ".join(SAMPLE_MODELS)
        raise KeyError(f"unknown sample model {name!r}; known: {known}") from None
    return entry.builder()


def model_bytes(model: onnx.ModelProto) -> bytes:
    """Deterministic serialization of a model."""
    return model.SerializeToString(deterministic=True)


def write_sample_models(
    directory: str | os.PathLike[str], names: Sequence[str] | None = None
) -> dict[str, Path]:
    """Write the sample models (all, or ``names``) as ``<directory>/<name>.onnx``.

    A file that already holds exactly the right bytes is left untouched; others are replaced
    atomically (write to a temporary file, then rename). Returns name -> path, in registry order.
    """
    out_dir = Path(directory)
    out_dir.mkdir(parents=True, exist_ok=True)
    wanted = list(SAMPLE_MODELS) if names is None else list(names)
    paths: dict[str, Path] = {}
    for name in wanted:
        data = model_bytes(build_sample_model(name))
        path = out_dir / f"{name}.onnx"
        if not (path.is_file() and path.stat().st_size == len(data) and path.read_bytes() == data):
            fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{name}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)
            except BaseException:
                if os.path.exists(tmp):
                    os.unlink(tmp)
                raise
        paths[name] = path
    return paths


def input_shape(model: onnx.ModelProto) -> tuple[int, ...]:
    """The per-item shape of the model's ``input`` (the dims after the batch dim)."""
    (inp,) = [i for i in model.graph.input if i.name == "input"]
    dims = inp.type.tensor_type.shape.dim[1:]
    return tuple(int(d.dim_value) for d in dims)


def sample_input(model: onnx.ModelProto, batch: int, seed: int = 0) -> np.ndarray:
    """A random standard-normal FP32 batch for ``model``'s ``input``."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((batch, *input_shape(model))).astype(np.float32)
