"""Shared-prefix detection and splitting of ONNX models."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from common import onnx_prefix as op
from common import sample_models as sm


def _run(model: onnx.ModelProto | bytes, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    data = model if isinstance(model, bytes) else model.SerializeToString()
    sess = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _check_composition(split: op.PrefixSplit, models: dict[str, onnx.ModelProto], batch: int):
    onnx.checker.check_model(onnx.load_from_string(split.prefix))
    x = sm.sample_input(next(iter(models.values())), batch, seed=batch)
    (feat,) = _run(split.prefix, {"input": x})
    assert feat.shape[0] == batch
    for name, model in models.items():
        onnx.checker.check_model(onnx.load_from_string(split.suffixes[name]))
        expected = _run(model, {"input": x})
        got = _run(split.suffixes[name], {split.cut_tensor: feat})
        assert len(got) == len(expected)
        for e, g in zip(expected, got):
            np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


def _weight_bytes(model: onnx.ModelProto) -> int:
    return sum(numpy_helper.to_array(t).nbytes for t in model.graph.initializer)


def _perturb(model: onnx.ModelProto, init_name: str, delta: float = 1e-3) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for t in out.graph.initializer:
        if t.name == init_name:
            arr = numpy_helper.to_array(t).copy()
            arr.flat[0] += delta
            t.CopyFrom(numpy_helper.from_array(arr, t.name))
            return out
    raise AssertionError(init_name)


def _renamed(model: onnx.ModelProto, tag: str) -> onnx.ModelProto:
    """As a separate export would look: other node/tensor/initializer names, other init order."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    keep = {i.name for i in g.input} | {o.name for o in g.output}
    mapping: dict[str, str] = {}

    def new(name: str) -> str:
        if not name or name in keep:
            return name
        return mapping.setdefault(name, f"{tag}_{len(mapping)}")

    for node in g.node:
        node.name = f"{tag}_node_{node.name}"
        node.input[:] = [new(i) for i in node.input]
        node.output[:] = [new(o) for o in node.output]
    inits = list(g.initializer)
    for t in inits:
        t.name = new(t.name)
    del g.initializer[:]
    g.initializer.extend(reversed(inits))
    for vi in g.value_info:
        vi.name = new(vi.name)
    return out


@pytest.fixture(scope="module")
def family() -> dict[str, onnx.ModelProto]:
    return {sm.variant_name(i): sm.backbone_variant(i) for i in range(3)}


def test_backbone_family_splits_at_the_backbone(family):
    models = {k: family[k] for k in ("vehicle_cls", "face_cls")}
    split = op.find_shared_prefix(models)
    assert split is not None
    # The whole backbone, up to the pooled feature vector, is shared.
    assert split.source_cut_names == {
        "vehicle_cls": "bb_flatten0_out",
        "face_cls": "bb_flatten0_out",
    }
    backbone_bytes = sum(
        numpy_helper.to_array(t).nbytes
        for t in family["face_cls"].graph.initializer
        if t.name.startswith("bb_")
    )
    assert split.prefix_weight_bytes == backbone_bytes
    for name, model in models.items():
        assert split.prefix_weight_bytes + split.suffix_weight_bytes[name] == _weight_bytes(model)
        assert split.suffix_weight_bytes[name] < split.prefix_weight_bytes / 20
    assert split.total_weight_bytes < sum(_weight_bytes(m) for m in models.values())
    assert split.prefix_node_count > 20
    assert len(split.prefix_id) == op.PREFIX_ID_HEX
    prefix_model = onnx.load_from_string(split.prefix)
    assert [o.name for o in prefix_model.graph.output] == [split.cut_tensor]
    assert [i.name for i in prefix_model.graph.input] == ["input"]
    for batch in (1, 6):
        _check_composition(split, models, batch)


def test_prefix_cuts_list_every_signature_prefix_with_growing_weights(family):
    model = family["vehicle_cls"]
    cuts, total = op.prefix_cuts(model)
    ids = [pid for pid, _ in cuts]
    weights = [w for _, w in cuts]
    assert ids == op.prefix_signature(model)          # the signature lists the same cuts (floor of 1 byte)...
    heavy = op.prefix_signature(model, min_prefix_weight_bytes=weights[len(weights) // 2])
    assert heavy == [pid for pid, w in cuts if w >= weights[len(weights) // 2]]   # ...or those above a floor
    assert weights == sorted(weights) and 0 < weights[-1] <= total


def test_three_models_and_signatures_agree(family):
    split = op.find_shared_prefix(family)
    assert split is not None and set(split.suffixes) == set(family)
    _check_composition(split, family, 4)
    sigs = [op.prefix_signature(m) for m in family.values()]
    assert op.common_prefix_id(sigs) == split.prefix_id
    assert op.common_prefix_id(sigs[:1]) is None
    # Splitting each model on its own gives the very same prefix graph.
    singles = [op.split_at(m, split.prefix_id) for m in family.values()]
    assert {s.prefix for s in singles} == {split.prefix}
    assert [s.suffix for s in singles] == [split.suffixes[n] for n in family]
    with pytest.raises(ValueError, match="not a cut point"):
        op.split_at(family["face_cls"], "0" * op.PREFIX_ID_HEX)


def test_matching_is_structural_not_by_name(family):
    renamed = _renamed(family["face_cls"], "exported")
    assert not {t.name for t in renamed.graph.initializer} & {
        t.name for t in family["face_cls"].graph.initializer
    }
    original = op.find_shared_prefix({"a": family["vehicle_cls"], "b": family["face_cls"]})
    split = op.find_shared_prefix({"a": family["vehicle_cls"], "b": renamed})
    assert split is not None and original is not None
    assert split.prefix_id == original.prefix_id
    assert split.prefix == original.prefix  # canonical names inside the prefix
    assert split.source_cut_names["b"].startswith("exported_")
    _check_composition(split, {"a": family["vehicle_cls"], "b": renamed}, 3)
    assert op.prefix_signature(renamed) == op.prefix_signature(family["face_cls"])
    # Bytes in, too.
    from_bytes = op.find_shared_prefix(
        {"a": family["vehicle_cls"].SerializeToString(), "b": renamed.SerializeToString()}
    )
    assert from_bytes == split


def test_different_first_conv_weight_shares_nothing(family):
    face = family["face_cls"]
    first_conv_w = face.graph.node[0].input[1]
    changed = _perturb(face, first_conv_w)
    assert op.find_shared_prefix({"vehicle": family["vehicle_cls"], "face": changed}) is None
    assert op.find_shared_prefix({"face": face, "face2": changed}) is None
    sig_a = op.prefix_signature(family["vehicle_cls"])
    sig_b = op.prefix_signature(changed)
    assert not set(sig_a) & set(sig_b)
    assert op.common_prefix_id([sig_a, sig_b]) is None
    # Unrelated architectures share nothing either.
    assert op.find_shared_prefix({"mlp": sm.mlp_small(), "face": face}) is None


def test_change_in_a_later_layer_moves_the_cut_earlier(family):
    face = family["face_cls"]
    convs = [n for n in face.graph.node if n.op_type == "Conv"]
    target = convs[6]  # a conv in the third stage
    changed = _perturb(face, target.input[1])
    split = op.find_shared_prefix({"vehicle": family["vehicle_cls"], "face": changed})
    assert split is not None
    full = op.find_shared_prefix({"vehicle": family["vehicle_cls"], "face": face})
    assert split.prefix_weight_bytes < full.prefix_weight_bytes
    # The changed conv (and everything after it) is in the suffix, not the prefix.
    prefix_model = onnx.load_from_string(split.prefix)
    changed_w = numpy_helper.to_array(
        next(t for t in changed.graph.initializer if t.name == target.input[1])
    )
    assert all(
        numpy_helper.to_array(t).shape != changed_w.shape
        or not np.array_equal(numpy_helper.to_array(t), changed_w)
        for t in prefix_model.graph.initializer
    )
    cut = split.source_cut_names["face"]
    assert cut.endswith("_out") and "relu" in cut  # output of a residual block
    _check_composition(split, {"vehicle": family["vehicle_cls"], "face": changed}, 2)


# --- small hand-made graphs -------------------------------------------------------------------


def _tiny(nodes, inits, outputs, in_dim=8, input_name="input", batch="batch") -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(input_name, TensorProto.FLOAT, [batch, in_dim])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, ["batch", None]) for o in outputs],
        initializer=[numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _w(seed: int, *shape: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.3


def test_model_that_is_exactly_the_prefix():
    trunk = [
        helper.make_node("Gemm", ["input", "w1", "b1"], ["h"], transB=1),
        helper.make_node("Relu", ["h"], ["feat"]),
    ]
    inits = {"w1": _w(1, 16, 8), "b1": _w(2, 16)}
    only_trunk = _tiny(trunk, inits, ["feat"])
    with_head = _tiny(
        trunk + [helper.make_node("Gemm", ["feat", "w2", "b2"], ["y"], transB=1)],
        {**inits, "w2": _w(3, 4, 16), "b2": _w(4, 4)},
        ["y"],
    )
    models = {"trunk": only_trunk, "full": with_head}
    split = op.find_shared_prefix(models)
    assert split is not None
    assert split.source_cut_names == {"trunk": "feat", "full": "feat"}
    assert split.suffix_weight_bytes["trunk"] == 0
    assert split.prefix_weight_bytes == (16 * 8 + 16) * 4
    x = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32)
    (feat,) = _run(split.prefix, {"input": x})
    for name, model in models.items():
        np.testing.assert_allclose(
            _run(split.suffixes[name], {split.cut_tensor: feat})[0],
            _run(model, {"input": x})[0],
            rtol=1e-5,
        )


def test_weight_free_shared_part_is_trivial():
    a = _tiny(
        [helper.make_node("Relu", ["input"], ["r"]), helper.make_node("MatMul", ["r", "w"], ["y"])],
        {"w": _w(1, 8, 3)},
        ["y"],
    )
    b = _tiny(
        [helper.make_node("Relu", ["input"], ["r"]), helper.make_node("MatMul", ["r", "w"], ["y"])],
        {"w": _w(2, 8, 3)},
        ["y"],
    )
    assert op.find_shared_prefix({"a": a, "b": b}) is None
    split = op.find_shared_prefix({"a": a, "b": b}, min_prefix_weight_bytes=0)
    assert split is not None and split.prefix_weight_bytes == 0
    assert split.source_cut_names == {"a": "r", "b": "r"}


def test_suffix_reading_the_raw_input_forbids_the_later_cut():
    """A head that also reads Shape(input) cannot be fed by the shared tensor alone."""
    shared = [
        helper.make_node("MatMul", ["input", "w1"], ["h1"]),
        helper.make_node("Relu", ["h1"], ["r1"]),
        helper.make_node("MatMul", ["r1", "w2"], ["h2"]),
        helper.make_node("Relu", ["h2"], ["r2"]),
    ]
    inits = {"w1": _w(1, 8, 8), "w2": _w(2, 8, 8)}
    plain = _tiny(
        shared + [helper.make_node("MatMul", ["r2", "w3"], ["y"])],
        {**inits, "w3": _w(3, 8, 2)},
        ["y"],
    )
    # This head reshapes using the raw input's shape, i.e. it reads the graph input directly...
    reader = _tiny(
        shared
        + [
            helper.make_node("Shape", ["input"], ["s"]),
            helper.make_node("Reshape", ["r2", "s"], ["r2b"]),
            helper.make_node("MatMul", ["r2b", "w4"], ["y"]),
        ],
        {**inits, "w4": _w(4, 8, 2)},
        ["y"],
    )
    # ...so its only cut points are where the input's path rejoins (r2b) and the output y,
    # neither of which the plain model has.
    sig_reader = op.prefix_signature(reader)
    assert len(sig_reader) == 2
    assert not set(sig_reader) & set(op.prefix_signature(plain))
    assert op.find_shared_prefix({"plain": plain, "reader": reader}) is None
    # ... whereas a model that reads an intermediate shared tensor twice still has r1 as a cut.
    skip = _tiny(
        shared
        + [
            helper.make_node("Add", ["r2", "r1"], ["s2"]),
            helper.make_node("MatMul", ["s2", "w5"], ["y"]),
        ],
        {**inits, "w5": _w(5, 8, 2)},
        ["y"],
    )
    split = op.find_shared_prefix({"plain": plain, "skip": skip})
    assert split is not None
    assert split.source_cut_names == {"plain": "r1", "skip": "r1"}
    x = np.random.default_rng(1).standard_normal((3, 8)).astype(np.float32)
    (feat,) = _run(split.prefix, {"input": x})
    for name, model in {"plain": plain, "skip": skip}.items():
        np.testing.assert_allclose(
            _run(split.suffixes[name], {split.cut_tensor: feat})[0],
            _run(model, {"input": x})[0],
            rtol=1e-5,
        )


def test_multi_output_node_and_shared_constants():
    """One output of a Split is no cut; a Constant used on both sides is copied into the suffix."""
    nodes = [
        helper.make_node("Constant", [], ["two"], value=numpy_helper.from_array(np.float32(2.0))),
        helper.make_node("MatMul", ["input", "w1"], ["h"]),
        helper.make_node("Mul", ["h", "two"], ["h2"]),
        helper.make_node("Split", ["h2", "sizes"], ["p", "q"], axis=1),
    ]
    inits = {"w1": _w(1, 8, 8), "sizes": np.array([4, 4], dtype=np.int64)}
    a = _tiny(
        nodes
        + [
            helper.make_node("Add", ["p", "q"], ["s"]),
            helper.make_node("Mul", ["s", "two"], ["y"]),
        ],
        inits,
        ["y"],
    )
    b = _tiny(
        nodes
        + [
            helper.make_node("Sub", ["p", "q"], ["s"]),
            helper.make_node("Mul", ["s", "two"], ["y"]),
        ],
        inits,
        ["y"],
    )
    split = op.find_shared_prefix({"a": a, "b": b})
    assert split is not None
    assert split.source_cut_names == {"a": "h2", "b": "h2"}
    assert split.prefix_weight_bytes == 8 * 8 * 4 + 4  # w1 and the Constant
    x = np.random.default_rng(2).standard_normal((4, 8)).astype(np.float32)
    (feat,) = _run(split.prefix, {"input": x})
    for name, model in {"a": a, "b": b}.items():
        suffix = onnx.load_from_string(split.suffixes[name])
        assert "Constant" in [n.op_type for n in suffix.graph.node]
        np.testing.assert_allclose(
            _run(split.suffixes[name], {split.cut_tensor: feat})[0],
            _run(model, {"input": x})[0],
            rtol=1e-5,
        )


def test_different_attribute_is_not_shared():
    def model(alpha: float) -> onnx.ModelProto:
        return _tiny(
            [
                helper.make_node("MatMul", ["input", "w1"], ["h"]),
                helper.make_node("LeakyRelu", ["h"], ["r"], alpha=alpha),
                helper.make_node("MatMul", ["r", "w2"], ["y"]),
            ],
            {"w1": _w(1, 8, 8), "w2": _w(2, 8, 2)},
            ["y"],
        )

    split = op.find_shared_prefix({"a": model(0.1), "b": model(0.2)})
    assert split is not None and split.source_cut_names == {"a": "h", "b": "h"}
    same = op.find_shared_prefix({"a": model(0.1), "b": model(0.1)})
    assert same is not None and same.source_cut_names == {"a": "y", "b": "y"}
    assert same.suffix_weight_bytes == {"a": 0, "b": 0}


def test_graph_input_names_and_batch_symbols_do_not_matter():
    def model(inp: str, batch: str, head_seed: int) -> onnx.ModelProto:
        return _tiny(
            [
                helper.make_node("MatMul", [inp, "w1"], ["h"]),
                helper.make_node("Relu", ["h"], ["r"]),
                helper.make_node("MatMul", ["r", "w2"], ["y"]),
            ],
            {"w1": _w(1, 8, 8), "w2": _w(head_seed, 8, 2)},
            ["y"],
            input_name=inp,
            batch=batch,
        )

    a, b = model("input", "batch", 2), model("x", "N", 3)
    split = op.find_shared_prefix({"a": a, "b": b})
    assert split is not None and split.source_cut_names == {"a": "r", "b": "r"}
    # The prefix takes the inputs of the alphabetically first model, matched by position.
    assert [i.name for i in onnx.load_from_string(split.prefix).graph.input] == ["input"]
    # A different static input shape is a different input: even the same ops and weights
    # downstream are not shared.
    def reducer(in_dim: int) -> onnx.ModelProto:
        return _tiny(
            [
                helper.make_node("ReduceSum", ["input", "axes"], ["m"], keepdims=1),
                helper.make_node("MatMul", ["m", "w"], ["y"]),
            ],
            {"axes": np.array([1], dtype=np.int64), "w": _w(1, 1, 2)},
            ["y"],
            in_dim=in_dim,
        )

    assert op.find_shared_prefix({"a": reducer(8), "b": reducer(8)}) is not None
    assert op.find_shared_prefix({"a": reducer(8), "b": reducer(9)}) is None


def test_errors_are_clear_value_errors(family):
    good = family["vehicle_cls"]
    with pytest.raises(ValueError, match="'broken'.*not a parseable ONNX model"):
        op.find_shared_prefix({"ok": good, "broken": b"\xff\xfe definitely not protobuf"})
    with pytest.raises(ValueError, match="'empty'"):
        op.find_shared_prefix({"ok": good, "empty": b""})
    with pytest.raises(ValueError, match="'bad'"):
        op.find_shared_prefix({"ok": good, "bad": onnx.ModelProto()})
    with pytest.raises(ValueError, match="expected onnx.ModelProto or bytes"):
        op.find_shared_prefix({"ok": good, "str": "model.onnx"})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="at least two models"):
        op.find_shared_prefix({"ok": good})
    with pytest.raises(ValueError, match="not a parseable ONNX model"):
        op.prefix_signature(b"\x00\x01\x02garbage")
