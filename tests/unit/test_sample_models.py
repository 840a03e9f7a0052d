"""The sample models: valid ONNX, deterministic bytes, sane outputs, a real shared backbone."""

from __future__ import annotations

import hashlib

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from common import sample_models as sm


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(sm.model_bytes(model), opts, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def built() -> dict[str, onnx.ModelProto]:
    return {name: entry.builder() for name, entry in sm.SAMPLE_MODELS.items()}


def test_registry_shape():
    assert list(sm.SAMPLE_MODELS)[:1] == ["resnet18_64"]
    assert {"resnet18_64", "vehicle_cls", "face_cls", "mlp_small"} <= set(sm.SAMPLE_MODELS)
    for name, (builder, slo_ms) in sm.SAMPLE_MODELS.items():
        assert callable(builder)
        assert slo_ms > 0, name
    with pytest.raises(KeyError, match="unknown sample model 'nope'"):
        sm.build_sample_model("nope")


@pytest.mark.parametrize("name", list(sm.SAMPLE_MODELS))
def test_model_is_valid_and_runs(built, name):
    model = built[name]
    onnx.checker.check_model(model, full_check=True)
    assert model.opset_import[0].version == sm.OPSET
    assert not any(n.op_type == "BatchNormalization" for n in model.graph.node)
    (inp,) = model.graph.input
    assert inp.name == "input"
    assert inp.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert inp.type.tensor_type.shape.dim[0].dim_param == "batch"
    for out in model.graph.output:
        assert out.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
        assert out.type.tensor_type.shape.dim[0].dim_param == "batch"

    sess = _session(model)
    for batch in (1, 5):
        x = sm.sample_input(model, batch, seed=batch)
        outs = sess.run(None, {"input": x})
        assert len(outs) == len(model.graph.output)
        for y in outs:
            assert y.dtype == np.float32
            assert y.shape[0] == batch
            assert np.isfinite(y).all()
            rms = float(np.sqrt(np.mean(y.astype(np.float64) ** 2)))
            # Of order one: neither blown up nor vanished.
            assert 0.1 < rms < 10.0, (name, batch, rms)
            if batch > 1:
                # Different inputs give different outputs (the network is not degenerate).
                assert not np.allclose(y[0], y[1])


def test_batch_rows_are_independent(built):
    model = built["vehicle_cls"]
    sess = _session(model)
    x = sm.sample_input(model, 4, seed=3)
    full = sess.run(None, {"input": x})[0]
    single = np.concatenate([sess.run(None, {"input": x[i : i + 1]})[0] for i in range(4)])
    np.testing.assert_allclose(full, single, rtol=1e-4, atol=1e-5)


def test_bytes_are_deterministic(built):
    for name in ("vehicle_cls", "face_cls", "mlp_small", "resnet18_64"):
        again = sm.build_sample_model(name)
        assert sm.model_bytes(again) == sm.model_bytes(built[name]), name


def test_resnet18_structure(built):
    model = built["resnet18_64"]
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("Add") == 8  # 4 stages x 2 basic blocks
    # 1 stem + 8 blocks x 2 + 3 projection shortcuts
    assert ops.count("Conv") == 20
    conv_channels = sorted(
        {int(i.dims[0]) for i in model.graph.initializer if len(i.dims) == 4}
    )
    assert conv_channels == [64, 128, 256, 512]
    params = sum(int(np.prod(i.dims)) for i in model.graph.initializer)
    assert 11_000_000 < params < 12_500_000
    assert model.graph.output[0].type.tensor_type.shape.dim[1].dim_value == 1000


def _init_digests(model: onnx.ModelProto) -> dict[str, str]:
    return {i.name: hashlib.sha256(i.raw_data).hexdigest() for i in model.graph.initializer}


def test_backbone_family_shares_backbone_and_differs_in_head():
    variants = [sm.backbone_variant(i) for i in range(10)]
    digests = [_init_digests(v) for v in variants]
    backbone = {k: v for k, v in digests[0].items() if k.startswith("bb_")}
    assert len(backbone) >= 10
    heads = []
    for i, d in enumerate(digests):
        assert {k: v for k, v in d.items() if k.startswith("bb_")} == backbone
        head = {k: v for k, v in d.items() if not k.startswith("bb_")}
        assert head, i
        heads.append(frozenset(head.values()))
    # Every head has its own weights.
    assert len(set(heads)) == 10
    # Backbone nodes identical across variants.
    bb_nodes = [n for n in variants[0].graph.node if n.name.startswith("bb_")]
    for v in variants[1:]:
        assert [n for n in v.graph.node if n.name.startswith("bb_")] == bb_nodes
    # Backbone is much heavier than the head in parameters.
    sizes = {i.name: int(np.prod(i.dims)) for i in variants[1].graph.initializer}
    bb_params = sum(s for k, s in sizes.items() if k.startswith("bb_"))
    head_params = sum(s for k, s in sizes.items() if not k.startswith("bb_"))
    assert bb_params > 20 * head_params
    # Default class counts and names.
    assert variants[0].graph.output[0].type.tensor_type.shape.dim[1].dim_value == 10
    assert variants[1].graph.output[0].type.tensor_type.shape.dim[1].dim_value == 100
    assert sm.variant_name(0) == "vehicle_cls" and sm.variant_name(1) == "face_cls"
    assert sm.variant_name(7) == "backbone_v7"
    custom = sm.backbone_variant(3, num_classes=7)
    assert custom.graph.output[0].type.tensor_type.shape.dim[1].dim_value == 7
    with pytest.raises(ValueError):
        sm.backbone_variant(-1)
    with pytest.raises(ValueError):
        sm.backbone_variant(0, num_classes=0)


def test_mlp_seeds_give_distinct_models_that_share_no_prefix():
    from common.onnx_prefix import find_shared_prefix

    default, other = sm.mlp_small(), sm.mlp_small(seed=10_001)
    assert sm.model_bytes(sm.mlp_small(seed=sm.MLP_SEED)) == sm.model_bytes(default)
    a, b = _init_digests(default), _init_digests(other)
    assert a.keys() == b.keys() and all(a[k] != b[k] for k in a)     # same layers, other weights
    assert find_shared_prefix({"a": default, "b": other}) is None


def test_write_sample_models_skips_identical(tmp_path):
    names = ["mlp_small", "vehicle_cls"]
    paths = sm.write_sample_models(tmp_path, names)
    assert list(paths) == names
    for name, path in paths.items():
        assert path == tmp_path / f"{name}.onnx"
        assert path.read_bytes() == sm.model_bytes(sm.build_sample_model(name))
        onnx.checker.check_model(onnx.load(str(path)))
    mtimes = {n: p.stat().st_mtime_ns for n, p in paths.items()}
    inodes = {n: p.stat().st_ino for n, p in paths.items()}
    # A corrupted file is rewritten; an intact one is left alone.
    paths["mlp_small"].write_bytes(b"garbage")
    again = sm.write_sample_models(tmp_path, names)
    assert again == paths
    assert again["mlp_small"].read_bytes() == sm.model_bytes(sm.mlp_small())
    assert again["vehicle_cls"].stat().st_mtime_ns == mtimes["vehicle_cls"]
    assert again["vehicle_cls"].stat().st_ino == inodes["vehicle_cls"]
    assert not [p for p in tmp_path.iterdir() if p.suffix == ".tmp"]
