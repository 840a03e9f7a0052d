"""Warm-up: ``model_warmup`` in config.pbtxt is read, checked and carried to the backends; a backend
runs a session's warm-up batches before it answers the table push that placed it (so frontends are
routed to it only once it is warm), without stalling the sessions it already serves, and never
counts them as serving."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from common.model_repository import RepositoryError, read_model
from common.sample_models import mlp_small, model_bytes
from common.tensors import TensorSpec
from common.warmup import (
    WarmupData, WarmupError, WarmupInput, WarmupSample, check_samples, default_samples, feeds, from_json, from_pb,
    to_json, to_pb,
)

MLP_CONFIG = """
max_batch_size: 16
model_warmup [
  {
    name: "ones"
    batch_size: 4
    inputs { key: "input" value: { data_type: TYPE_FP32 dims: [ 64 ] input_data_file: "ones.bin" } }
    count: 3
  },
  {
    name: "zeros"
    batch_size: 1
    inputs { key: "input" value: { data_type: TYPE_FP32 dims: [ 64 ] zero_data: true } }
  }
]
"""


def _mlp_repo(root: pathlib.Path, config: str, files: dict[str, bytes] | None = None) -> pathlib.Path:
    d = root / "mlp"
    (d / "1").mkdir(parents=True, exist_ok=True)
    (d / "1" / "model.onnx").write_bytes(model_bytes(mlp_small()))
    (d / "config.pbtxt").write_text(config)
    for name, data in (files or {}).items():
        (d / "warmup").mkdir(exist_ok=True)
        (d / "warmup" / name).write_bytes(data)
    return d


def _refused(model_dir: pathlib.Path) -> str:
    with pytest.raises(RepositoryError) as info:
        read_model(model_dir)
    return str(info.value)


ONES = np.ones(64, np.float32).tobytes()


def test_model_warmup_is_read_from_config_pbtxt(tmp_path):
    m = read_model(_mlp_repo(tmp_path, MLP_CONFIG, {"ones.bin": ONES}))
    assert m.warnings == ()
    ones, zeros = m.warmup
    assert (ones.name, ones.batch_size, ones.runs, zeros.name, zeros.batch_size, zeros.runs) == ("ones", 4, 3,
                                                                                                  "zeros", 1, 1)
    assert ones.inputs == (WarmupInput("input", "FP32", (64,), WarmupData.FILE, ONES, "ones.bin"),)
    assert zeros.inputs[0].data is WarmupData.ZERO
    batch = feeds(ones, np.random.default_rng(0))["input"]
    assert batch.shape == (4, 64) and batch.dtype == np.float32 and (batch == 1).all()
    assert (feeds(zeros, np.random.default_rng(0))["input"] == 0).all()
    # Through the wire and the model database unchanged.
    assert from_pb(to_pb(m.warmup)) == m.warmup
    assert from_json(to_json(m.warmup)) == m.warmup


@pytest.mark.parametrize("replace, error", [
    (("batch_size: 4", "batch_size: 0"), "model_warmup[0] ('ones').batch_size must be >= 1, got 0"),
    (("batch_size: 4", "batch_size: 32"), "model_warmup[0] ('ones').batch_size 32 exceeds max_batch_size 16"),
    (("count: 3", "count: 5000"), "model_warmup[0] ('ones').count 5000 exceeds 1000"),
    (("dims: [ 64 ] zero_data", "dims: [ 32 ] zero_data"),
     'model_warmup[1] (\'zeros\').inputs["input"].dims [32] do not fit the model\'s [64]'),
    (("TYPE_FP32 dims: [ 64 ] zero", "TYPE_FP16 dims: [ 64 ] zero"),
     'model_warmup[1] (\'zeros\').inputs["input"].data_type TYPE_FP16 contradicts the model\'s TYPE_FP32'),
    (('key: "input" value: { data_type: TYPE_FP32 dims: [ 64 ] zero', 'key: "x" value: { data_type: TYPE_FP32 '
                                                                       'dims: [ 64 ] zero'),
     'model_warmup[1] (\'zeros\').inputs: no entry for the model\'s input(s) \'input\''),
    ((" zero_data: true", ""),
     'model_warmup[1] (\'zeros\').inputs["input"]: one of zero_data, random_data or input_data_file is required'),
    (("data_type: TYPE_FP32 dims: [ 64 ] zero", "dims: [ 64 ] zero"),
     'model_warmup[1] (\'zeros\').inputs["input"].data_type is required'),
    (('"ones.bin"', '"../1/model.onnx"'),
     'model_warmup[0] (\'ones\').inputs["input"].input_data_file \'../1/model.onnx\' is not a file in'),
    (('"ones.bin"', '"/etc/passwd"'),
     'model_warmup[0] (\'ones\').inputs["input"].input_data_file \'/etc/passwd\' is not a file in'),
    (('"ones.bin"', '"missing.bin"'),
     'model_warmup[0] (\'ones\').inputs["input"].input_data_file \'missing.bin\': cannot read'),
    (('"ones.bin"', '"short.bin"'),
     'model_warmup[0] (\'ones\').inputs["input"].input_data_file \'short.bin\' holds 12 bytes; one row of dims '
     '[64] FP32 takes 256'),
    (("count: 3", "count: 3 colour: 2"), "8:14: unsupported setting 'colour': not a ModelWarmup setting"),
])
def test_a_bad_model_warmup_is_refused_naming_the_field(tmp_path, replace, error):
    d = _mlp_repo(tmp_path, MLP_CONFIG.replace(*replace), {"ones.bin": ONES, "short.bin": b"x" * 12})
    message = _refused(d)
    assert message.startswith(str(d / "config.pbtxt") + ":"), message
    assert error in message, message


def test_a_data_file_reached_through_a_symlink_out_of_the_model_is_refused(tmp_path):
    outside = tmp_path / "secret.bin"
    outside.write_bytes(ONES)
    d = _mlp_repo(tmp_path / "repo", MLP_CONFIG, {"placeholder": b""})
    (d / "warmup" / "ones.bin").symlink_to(outside)
    assert "input_data_file 'ones.bin' is not a file in" in _refused(d)


def test_samples_are_checked_against_the_model_inputs():
    inputs = (TensorSpec("image", "FP32", (3, -1, -1)), TensorSpec("ids", "INT64", (4,)))
    image = WarmupInput("image", "FP32", (3, 8, 8), WarmupData.RANDOM)
    ids = WarmupInput("ids", "INT64", (4,), WarmupData.RANDOM)
    check_samples([WarmupSample("ok", 2, (image, ids))], inputs)
    with pytest.raises(WarmupError, match=r'inputs\["image"\].dims \[3, 8, -1\] do not fit'):
        check_samples([WarmupSample("", 2, (WarmupInput("image", "FP32", (3, 8, -1), WarmupData.ZERO), ids))], inputs)
    with pytest.raises(WarmupError, match=r'model_warmup\[0\].inputs\["ids"\] is given twice'):
        check_samples([WarmupSample("", 1, (image, ids, ids))], inputs)
    with pytest.raises(WarmupError, match=r"inputs\[\"extra\"\]: the model has no input of that name"):
        check_samples([WarmupSample("", 1, (image, ids, WarmupInput("extra", "FP32", (1,), WarmupData.ZERO)))], inputs)
    batch = feeds(WarmupSample("ok", 2, (image, ids)), np.random.default_rng(1))
    assert batch["image"].shape == (2, 3, 8, 8) and 0 <= batch["image"].min() and batch["image"].max() < 1
    assert batch["ids"].dtype == np.int64 and set(np.unique(batch["ids"])) <= {0, 1}


def test_the_default_warm_up_runs_batch_1_and_the_planned_batch_twice_on_random_data():
    inputs = (TensorSpec("x", "FP32", (4, -1)),)
    samples = default_samples(inputs, planned_batch=6)
    assert [(s.batch_size, s.runs) for s in samples] == [(1, 2), (6, 2)]
    check_samples(samples, inputs)
    assert feeds(samples[1], np.random.default_rng(0))["x"].shape == (6, 4, 1)
    assert [s.batch_size for s in default_samples(inputs, planned_batch=1)] == [1]
