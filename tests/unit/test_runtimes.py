"""Runtimes: ONNX Runtime, PyTorch, the emulated GPU, device strings and every load/run error path."""

from __future__ import annotations

import io
import json
import os
import threading
import time
import zipfile

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from common.runtimes import (
    DeviceKind, DeviceSpec, DeviceUnavailableError, FeedError, ModelFileError, RuntimeClosedError, RuntimeKind,
    load_runtime,
)
from common.runtimes.emulated import precise_sleep
from common.runtimes.onnx_runtime import CPU_EP, CUDA_EP, providers_for
from common import sample_models as sm
from common.profile import BatchLatency, Profile
from common.tensors import TensorSpec

HAS_ORT_CUDA = CUDA_EP in ort.get_available_providers()

# torch 2.13 deprecates TorchScript; the runtime still serves it.
pytestmark = pytest.mark.filterwarnings(r"ignore:`torch\.jit\.\w+` is deprecated:DeprecationWarning")


# ---- models built here ---------------------------------------------------------------------------

def two_input_model() -> bytes:
    """y = relu(x @ W + b) * scale (x: FP32 [batch, 4], scale: FP32 [batch, 1]); ids: INT64 [batch, 2] -> ids + 1."""
    rng = np.random.default_rng(3)
    w = numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "W")
    b = numpy_helper.from_array(rng.standard_normal(3).astype(np.float32), "B")
    one = numpy_helper.from_array(np.array(1, dtype=np.int64), "one")
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["xw"]),
        helper.make_node("Add", ["xw", "B"], ["xwb"]),
        helper.make_node("Relu", ["xwb"], ["r"]),
        helper.make_node("Mul", ["r", "scale"], ["y"]),
        helper.make_node("Add", ["ids", "one"], ["ids_next"]),
    ]
    graph = helper.make_graph(
        nodes, "two_inputs",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4]),
         helper.make_tensor_value_info("scale", TensorProto.FLOAT, ["batch", 1]),
         helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3]),
         helper.make_tensor_value_info("ids_next", TensorProto.INT64, ["batch", 2])],
        [w, b, one])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


def variable_dim_model() -> bytes:
    """Identity on FP16 [batch, n] with a symbolic second dimension."""
    graph = helper.make_graph([helper.make_node("Identity", ["a"], ["b"])], "var",
                              [helper.make_tensor_value_info("a", TensorProto.FLOAT16, ["batch", "n"])],
                              [helper.make_tensor_value_info("b", TensorProto.FLOAT16, ["batch", "n"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


@pytest.fixture(scope="module")
def mlp_bytes() -> bytes:
    return sm.model_bytes(sm.mlp_small())


def direct_ort(model_bytes: bytes, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(model_bytes, providers=[CPU_EP])
    return session.run(None, feeds)


def feeds_for_two_inputs(batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((batch, 4)).astype(np.float32),
            "scale": rng.uniform(0.5, 2.0, (batch, 1)).astype(np.float32),
            "ids": rng.integers(0, 100, (batch, 2)).astype(np.int64)}


# ---- device strings and the factory --------------------------------------------------------------

@pytest.mark.parametrize("text, kind, index, name, canonical", [
    ("cpu", DeviceKind.CPU, 0, "", "cpu"),
    ("CPU", DeviceKind.CPU, 0, "", "cpu"),
    ("cuda", DeviceKind.CUDA, 0, "", "cuda:0"),
    ("cuda:3", DeviceKind.CUDA, 3, "", "cuda:3"),
    ("emulated:gtx1080ti", DeviceKind.EMULATED, 0, "gtx1080ti", "emulated:gtx1080ti"),
    ("emulated:A100-80GB.sxm", DeviceKind.EMULATED, 0, "A100-80GB.sxm", "emulated:A100-80GB.sxm"),
])
def test_device_spec_parses_valid_strings(text, kind, index, name, canonical):
    spec = DeviceSpec.parse(text)
    assert (spec.kind, spec.index, spec.gpu_name, str(spec)) == (kind, index, name, canonical)
    assert DeviceSpec.parse(str(spec)) == spec
    assert DeviceSpec.parse(spec) is spec


@pytest.mark.parametrize("text", ["", "gpu", "cuda:", "cuda:-1", "cuda:x", "cuda:1:2", "cpu:0", "emulated",
                                  "emulated:", "emulated:bad name", "emulated:../x", "tpu:0", "cuda:٣", None, 3])
def test_device_spec_rejects_bad_strings(text):
    with pytest.raises(ValueError, match="invalid device"):
        DeviceSpec.parse(text)


def test_load_runtime_rejects_bad_device(mlp_bytes):
    with pytest.raises(ValueError, match="invalid device 'gpu0'"):
        load_runtime("onnxruntime", mlp_bytes, "gpu0")


def test_load_runtime_rejects_unknown_kind(mlp_bytes):
    with pytest.raises(ValueError, match="unknown runtime kind 'tensorrt'"):
        load_runtime("tensorrt", mlp_bytes, "cpu")


@pytest.mark.parametrize("kind, device", [("onnxruntime", "emulated:t4"), ("torch", "emulated:t4"),
                                          ("emulated", "cpu"), ("emulated", "cuda:0")])
def test_load_runtime_rejects_kind_device_mismatch(mlp_bytes, kind, device):
    with pytest.raises(ValueError, match="emulated:<gpu> devices"):
        load_runtime(kind, mlp_bytes, device, profile=Profile.linear(1.0, 1.0, 4))


@pytest.mark.parametrize("threads", [0, -1, 1.5, True, "2"])
def test_load_runtime_rejects_bad_thread_counts(mlp_bytes, threads):
    with pytest.raises(ValueError, match="intra_op_threads"):
        load_runtime("onnxruntime", mlp_bytes, "cpu", intra_op_threads=threads)


@pytest.mark.parametrize("io_arg, match", [
    ("nope", "pair"),
    (((), (TensorSpec("y", "FP32", (1,)),)), "at least one input"),
    (((TensorSpec("x", "FP32", (1,)),), ("y",)), "must be TensorSpec"),
    (((TensorSpec("x", "STRING", (1,)),), (TensorSpec("y", "FP32", (1,)),)), "unsupported datatype"),
    (((TensorSpec("x", "FP32", (1,)), TensorSpec("x", "FP32", (1,))), (TensorSpec("y", "FP32", (1,)),)), "unique"),
])
def test_load_runtime_rejects_malformed_io(mlp_bytes, io_arg, match):
    with pytest.raises(ValueError, match=match):
        load_runtime("emulated", mlp_bytes, "emulated:t4", profile=Profile.linear(1.0, 1.0, 4), io=io_arg)


def test_load_runtime_rejects_non_bytes_model():
    with pytest.raises(ValueError, match="model_bytes must be bytes"):
        load_runtime("onnxruntime", "model.onnx", "cpu")


# ---- ONNX Runtime --------------------------------------------------------------------------------

def test_onnxruntime_specs_come_from_the_model():
    with load_runtime(RuntimeKind.ONNXRUNTIME, two_input_model(), "cpu") as rt:
        assert rt.inputs == (TensorSpec("x", "FP32", (4,)), TensorSpec("scale", "FP32", (1,)),
                             TensorSpec("ids", "INT64", (2,)))
        assert rt.outputs == (TensorSpec("y", "FP32", (3,)), TensorSpec("ids_next", "INT64", (2,)))
        assert rt.device == "cpu" and rt.kind is RuntimeKind.ONNXRUNTIME and rt.providers == [CPU_EP]
    with load_runtime("onnxruntime", variable_dim_model(), "cpu") as rt:
        assert rt.inputs == (TensorSpec("a", "FP16", (-1,)),)


@pytest.mark.parametrize("batch", [1, 7, 32])
def test_onnxruntime_matches_a_direct_session(mlp_bytes, batch):
    x = sm.sample_input(sm.mlp_small(), batch, seed=batch)
    (expected,) = direct_ort(mlp_bytes, {"input": x})
    with load_runtime("onnxruntime", mlp_bytes, "cpu", intra_op_threads=1) as rt:
        out = rt.run({"input": x})
    assert list(out) == ["logits"]
    np.testing.assert_allclose(out["logits"], expected, rtol=1e-5, atol=1e-6)


def test_onnxruntime_matches_a_direct_session_on_resnet():
    model = sm.resnet18_64()
    data = sm.model_bytes(model)
    x = sm.sample_input(model, 2, seed=1)
    (expected,) = direct_ort(data, {"input": x})
    with load_runtime("onnxruntime", data, "cpu") as rt:
        out = rt.run({"input": x})
    np.testing.assert_allclose(out[rt.outputs[0].name], expected, rtol=1e-5, atol=1e-5)


def test_onnxruntime_runs_several_inputs_and_dtypes():
    data = two_input_model()
    feeds = feeds_for_two_inputs(5)
    expected = direct_ort(data, feeds)
    with load_runtime("onnxruntime", data, "cpu") as rt:
        out = rt.run(feeds)
    np.testing.assert_allclose(out["y"], expected[0], rtol=1e-5)
    assert out["ids_next"].dtype == np.int64 and np.array_equal(out["ids_next"], feeds["ids"] + 1)


def test_onnxruntime_accepts_read_only_feeds(mlp_bytes):
    x = sm.sample_input(sm.mlp_small(), 3)
    frozen = np.frombuffer(x.tobytes(), dtype=np.float32).reshape(x.shape)  # as decoded from a request
    with load_runtime("onnxruntime", mlp_bytes, "cpu") as rt:
        np.testing.assert_allclose(rt.run({"input": frozen})["logits"], rt.run({"input": x})["logits"])


def test_onnxruntime_io_override_must_match_the_model(mlp_bytes):
    override = ((TensorSpec("input", "FP32", (64,)),), (TensorSpec("logits", "FP32", (10,)),))
    with load_runtime("onnxruntime", mlp_bytes, "cpu", io=override) as rt:
        assert (rt.inputs, rt.outputs) == override
    with pytest.raises(ValueError, match="do not match the model"):
        load_runtime("onnxruntime", mlp_bytes, "cpu",
                     io=((TensorSpec("image", "FP32", (64,)),), (TensorSpec("logits", "FP32", (10,)),)))
    with pytest.raises(ValueError, match="datatype FP16 but the model declares FP32"):
        load_runtime("onnxruntime", mlp_bytes, "cpu",
                     io=((TensorSpec("input", "FP16", (64,)),), (TensorSpec("logits", "FP32", (10,)),)))


@pytest.mark.parametrize("corrupt", [b"", b"definitely not an onnx model", b"\x08\x07\x12\xff\xff\xff"])
def test_onnxruntime_rejects_corrupt_bytes(corrupt):
    with pytest.raises(ModelFileError, match="onnxruntime cannot load the model"):
        load_runtime("onnxruntime", corrupt, "cpu")


def test_onnxruntime_rejects_truncated_model(mlp_bytes):
    with pytest.raises(ModelFileError):
        load_runtime("onnxruntime", mlp_bytes[: len(mlp_bytes) // 2], "cpu")


def test_onnxruntime_rejects_unsupported_tensor_types():
    graph = helper.make_graph([helper.make_node("Identity", ["s"], ["t"])], "strings",
                              [helper.make_tensor_value_info("s", TensorProto.STRING, ["batch"])],
                              [helper.make_tensor_value_info("t", TensorProto.STRING, ["batch"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    with pytest.raises(ModelFileError, match="unsupported type tensor\\(string\\)"):
        load_runtime("onnxruntime", model.SerializeToString(), "cpu")


def test_onnxruntime_rejects_scalar_inputs():
    graph = helper.make_graph([helper.make_node("Identity", ["s"], ["t"])], "scalar",
                              [helper.make_tensor_value_info("s", TensorProto.FLOAT, [])],
                              [helper.make_tensor_value_info("t", TensorProto.FLOAT, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    with pytest.raises(ModelFileError, match="leading batch dimension"):
        load_runtime("onnxruntime", model.SerializeToString(), "cpu")


def test_provider_choice_follows_the_device():
    assert providers_for(DeviceSpec.parse("cpu"), [CUDA_EP, CPU_EP]) == [CPU_EP]
    assert providers_for(DeviceSpec.parse("cuda:1"), [CUDA_EP, CPU_EP]) == [(CUDA_EP, {"device_id": 1}), CPU_EP]
    with pytest.raises(DeviceUnavailableError, match="CUDA requested but onnxruntime has no CUDAExecutionProvider"):
        providers_for(DeviceSpec.parse("cuda"), [CPU_EP])


@pytest.mark.skipif(HAS_ORT_CUDA, reason="onnxruntime here has the CUDA provider")
def test_onnxruntime_cuda_without_provider_is_a_clear_error(mlp_bytes):
    with pytest.raises(DeviceUnavailableError, match="CUDA requested but onnxruntime has no CUDAExecutionProvider"):
        load_runtime("onnxruntime", mlp_bytes, "cuda:0")


@pytest.mark.parametrize("mutate, match", [
    (lambda f: {k: v for k, v in f.items() if k != "scale"}, "missing \\['scale'\\]"),
    (lambda f: {**f, "extra": f["x"]}, "unexpected \\['extra'\\]"),
    (lambda f: {**f, "x": f["x"].astype(np.float64)}, "expected FP32"),
    (lambda f: {**f, "x": f["x"][:, :, None]}, "expected shape \\[batch, 4\\]"),
    (lambda f: {**f, "x": f["x"][:, :3]}, "dimension 1 must be 4, got 3"),
    (lambda f: {**f, "scale": f["scale"][:2]}, "batch size 2 differs"),
    (lambda f: {k: v[:0] for k, v in f.items()}, "empty batch"),
    (lambda f: {**f, "x": f["x"].tolist()}, "expected a numpy array"),
])
def test_run_rejects_bad_feeds(mutate, match):
    with load_runtime("onnxruntime", two_input_model(), "cpu") as rt:
        with pytest.raises(FeedError, match=match):
            rt.run(mutate(feeds_for_two_inputs(4)))
        assert rt.run(feeds_for_two_inputs(4))["y"].shape == (4, 3)  # still usable afterwards


def test_closed_runtime_refuses_to_run(mlp_bytes):
    rt = load_runtime("onnxruntime", mlp_bytes, "cpu")
    rt.close()
    rt.close()  # idempotent
    assert rt.closed
    with pytest.raises(RuntimeClosedError, match="closed"):
        rt.run({"input": sm.sample_input(sm.mlp_small(), 1)})


def test_onnxruntime_memory_estimate_covers_weights_and_grows_with_batch(mlp_bytes):
    with load_runtime("onnxruntime", mlp_bytes, "cpu") as rt:
        before = rt.memory_mb()
        assert before >= len(mlp_bytes) / 2**20
        rt.run({"input": sm.sample_input(sm.mlp_small(), 64)})
        assert rt.memory_mb() > before


def test_runtimes_run_concurrently_in_threads(mlp_bytes):
    """Two runtimes driven from two threads at once each give the single-threaded answers."""
    two = two_input_model()
    feeds_a = {"input": sm.sample_input(sm.mlp_small(), 8)}
    feeds_b = feeds_for_two_inputs(8)
    expected_a = direct_ort(mlp_bytes, feeds_a)[0]
    expected_b = direct_ort(two, feeds_b)[0]
    errors: list[BaseException] = []

    def drive(rt, feeds, name, expected):
        try:
            for _ in range(30):
                np.testing.assert_allclose(rt.run(feeds)[name], expected, rtol=1e-5, atol=1e-6)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    with load_runtime("onnxruntime", mlp_bytes, "cpu", intra_op_threads=1) as a, \
            load_runtime("onnxruntime", two, "cpu", intra_op_threads=1) as b:
        threads = [threading.Thread(target=drive, args=(a, feeds_a, "logits", expected_a)),
                   threading.Thread(target=drive, args=(b, feeds_b, "y", expected_b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []


# ---- emulated ------------------------------------------------------------------------------------

FIDELITY_PROFILE = Profile.linear(alpha_ms=5.0, beta_ms=0.0, max_batch=8, memory_base_mb=100.0,
                                  memory_per_item_mb=10.0)  # l(b) = 5..40 ms


def test_emulated_batch_latencies_follow_the_profile():
    """The one wall-clock assertion of the suite: a batch never returns before l(b), and within 10% of it.

    A busy machine (parallel test workers) can only delay a wake-up, never advance it, so the best of
    up to 25 runs is what measures the emulator rather than the scheduler.
    """
    with load_runtime("emulated", two_input_model(), "emulated:gtx1080ti", profile=FIDELITY_PROFILE) as rt:
        for batch in (1, 2, 4, 8):
            feeds = feeds_for_two_inputs(batch)
            want = FIDELITY_PROFILE.latency_ms(batch)
            samples: list[float] = []
            while len(samples) < 25 and not (samples and min(samples) <= 1.1 * want):
                start = time.perf_counter()
                rt.run(feeds)
                samples.append((time.perf_counter() - start) * 1000.0)
            assert min(samples) >= want, (batch, samples, want)
            assert min(samples) <= 1.1 * want, (batch, samples, want)


def test_emulated_outputs_have_declared_shapes_and_dtypes():
    profile = Profile.linear(0.01, 0.01, 8)
    with load_runtime("emulated", two_input_model(), "emulated:t4", profile=profile) as rt:
        assert rt.inputs[2] == TensorSpec("ids", "INT64", (2,)) and rt.device == "emulated:t4"
        out = rt.run(feeds_for_two_inputs(3))
    assert out["y"].shape == (3, 3) and out["y"].dtype == np.float32 and not out["y"].any()
    assert out["ids_next"].shape == (3, 2) and out["ids_next"].dtype == np.int64
    with load_runtime("emulated", variable_dim_model(), "emulated:t4", profile=profile) as rt:
        out = rt.run({"a": np.ones((2, 5), dtype=np.float16)})
    assert out["b"].shape == (2, 1) and out["b"].dtype == np.float16  # a variable dim is emulated as 1


def test_emulated_specs_from_io_need_no_onnx():
    io_specs = ((TensorSpec("image", "UINT8", (8, 8, 3)),), (TensorSpec("score", "FP64", (2,)),))
    with load_runtime("emulated", b"any format at all", "emulated:v100", profile=Profile.linear(0.01, 0.01, 4),
                      io=io_specs) as rt:
        assert (rt.inputs, rt.outputs) == io_specs
        out = rt.run({"image": np.zeros((4, 8, 8, 3), dtype=np.uint8)})
    assert out["score"].shape == (4, 2) and out["score"].dtype == np.float64


def test_emulated_rejects_batches_above_the_profile():
    with load_runtime("emulated", two_input_model(), "emulated:t4", profile=Profile.linear(0.01, 0.01, 4)) as rt:
        with pytest.raises(ValueError, match="batch size 5 exceeds the profile's largest batch 4"):
            rt.run(feeds_for_two_inputs(5))


def test_emulated_needs_a_profile():
    with pytest.raises(ValueError, match="needs the model's profile"):
        load_runtime("emulated", two_input_model(), "emulated:t4")
    with pytest.raises(ValueError, match="must be a common.profile.Profile"):
        load_runtime("emulated", two_input_model(), "emulated:t4", profile=[BatchLatency(1, 1.0)])


@pytest.mark.parametrize("corrupt", [b"", b"not onnx at all", b"\x08\x07\x12\xff\xff\xff"])
def test_emulated_rejects_corrupt_onnx_without_io(corrupt):
    with pytest.raises(ModelFileError):
        load_runtime("emulated", corrupt, "emulated:t4", profile=Profile.linear(1.0, 1.0, 4))


def test_emulated_memory_is_the_profile_memory_of_the_largest_batch():
    profile = Profile.linear(0.01, 0.01, 8, memory_base_mb=100.0, memory_per_item_mb=10.0)
    with load_runtime("emulated", two_input_model(), "emulated:t4", profile=profile) as rt:
        assert rt.memory_mb() == 110.0
        rt.run(feeds_for_two_inputs(6))
        rt.run(feeds_for_two_inputs(2))
        assert rt.memory_mb() == 160.0


def test_precise_sleep_sleeps_then_spins_to_the_end():
    now = [100.0]
    slept: list[float] = []

    def clock() -> float:
        now[0] += 0.0001  # each reading costs 0.1 ms: the spin makes progress
        return now[0]

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    precise_sleep(0.020, spin_s=0.001, clock=clock, sleep=sleep)
    assert len(slept) == 1 and abs(slept[0] - 0.019) < 0.0005
    assert 100.020 <= now[0] < 100.0205
    precise_sleep(0.020, clock=clock, sleep=sleep)        # by default it spins only the last 0.2 ms
    assert len(slept) == 2 and abs(slept[1] - 0.0197) < 0.00005    # 20 ms less the spin and one clock reading


def test_precise_sleep_returns_at_once_for_non_positive_durations():
    calls: list[float] = []
    precise_sleep(0.0, sleep=calls.append)
    precise_sleep(-1.0, sleep=calls.append)
    assert calls == []


# ---- torch -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def torch_mod():
    return pytest.importorskip("torch", reason="torch is an optional extra")


def _modules(torch_mod):
    nn = torch_mod.nn

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch_mod.manual_seed(0)
            self.fc = nn.Linear(4, 3)

        def forward(self, x, scale):
            y = self.fc(x).relu() * scale
            return y, y.sum(dim=1, keepdim=True)

    class Named(nn.Module):
        def forward(self, x):
            return {"double": x * 2, "neg": -x}

    class Ints(nn.Module):
        def forward(self, x):
            return x + 1

    return Head, Named, Ints


HEAD_IO = ((TensorSpec("x", "FP32", (4,)), TensorSpec("scale", "FP32", (1,))),
           (TensorSpec("y", "FP32", (3,)), TensorSpec("total", "FP32", (1,))))


def _script_bytes(torch_mod, module) -> bytes:
    buf = io.BytesIO()
    torch_mod.jit.save(torch_mod.jit.script(module), buf)
    return buf.getvalue()


def _export_bytes(torch_mod, module, example) -> bytes:
    batch = torch_mod.export.Dim("batch", min=1, max=1024)
    program = torch_mod.export.export(module, example, dynamic_shapes=tuple({0: batch} for _ in example))
    buf = io.BytesIO()
    torch_mod.export.save(program, buf)
    return buf.getvalue()


def test_torchscript_matches_eager(torch_mod):
    Head, _, _ = _modules(torch_mod)
    module = Head().eval()
    feeds = {k: v for k, v in feeds_for_two_inputs(6).items() if k != "ids"}
    with torch_mod.inference_mode():
        eager = module(torch_mod.from_numpy(feeds["x"]), torch_mod.from_numpy(feeds["scale"]))
    threads = torch_mod.get_num_threads()
    try:
        with load_runtime("torch", _script_bytes(torch_mod, module), "cpu", io=HEAD_IO, intra_op_threads=1) as rt:
            assert rt.format == "torchscript" and rt.kind is RuntimeKind.TORCH
            assert torch_mod.get_num_threads() == 1  # torch's intra-op pool is process-wide
            out = rt.run(feeds)
            assert rt.memory_mb() > 0
    finally:
        torch_mod.set_num_threads(threads)
    np.testing.assert_allclose(out["y"], eager[0].numpy(), rtol=1e-5)
    np.testing.assert_allclose(out["total"], eager[1].numpy(), rtol=1e-5)


def test_torchscript_dict_outputs_are_matched_by_name(torch_mod):
    _, Named, _ = _modules(torch_mod)
    io_specs = ((TensorSpec("x", "FP32", (2,)),), (TensorSpec("neg", "FP32", (2,)), TensorSpec("double", "FP32", (2,))))
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    with load_runtime("torch", _script_bytes(torch_mod, Named()), "cpu", io=io_specs) as rt:
        out = rt.run({"x": x})
    assert np.array_equal(out["neg"], -x) and np.array_equal(out["double"], 2 * x)


def test_torchscript_needs_io(torch_mod):
    Head, _, _ = _modules(torch_mod)
    with pytest.raises(ValueError, match="TorchScript models carry no input/output specs"):
        load_runtime("torch", _script_bytes(torch_mod, Head()), "cpu")


def test_torch_output_mismatching_its_specs_is_an_error(torch_mod):
    from common.runtimes.torch_runtime import ModelOutputError

    Head, _, Ints = _modules(torch_mod)
    ints = _script_bytes(torch_mod, Ints())
    x = np.ones((2, 3), dtype=np.float32)
    wrong_dtype = ((TensorSpec("x", "FP32", (3,)),), (TensorSpec("y", "INT64", (3,)),))
    with load_runtime("torch", ints, "cpu", io=wrong_dtype) as rt, pytest.raises(ModelOutputError, match="float32"):
        rt.run({"x": x})
    wrong_shape = ((TensorSpec("x", "FP32", (3,)),), (TensorSpec("y", "FP32", (4,)),))
    with load_runtime("torch", ints, "cpu", io=wrong_shape) as rt, pytest.raises(ModelOutputError, match="shape"):
        rt.run({"x": x})
    too_many = ((TensorSpec("x", "FP32", (3,)),), (TensorSpec("y", "FP32", (3,)), TensorSpec("z", "FP32", (3,))))
    with load_runtime("torch", ints, "cpu", io=too_many) as rt, pytest.raises(ModelOutputError, match="1 output"):
        rt.run({"x": x})


def test_exported_program_matches_eager_with_derived_specs(torch_mod):
    Head, _, _ = _modules(torch_mod)
    module = Head().eval()
    example = (torch_mod.randn(2, 4), torch_mod.ones(2, 1))
    data = _export_bytes(torch_mod, module, example)
    feeds = {k: v for k, v in feeds_for_two_inputs(9).items() if k != "ids"}
    with torch_mod.inference_mode():
        eager = module(torch_mod.from_numpy(feeds["x"]), torch_mod.from_numpy(feeds["scale"]))
    with load_runtime("torch", data, "cpu") as rt:
        assert rt.format == "exported_program"
        assert rt.inputs == (TensorSpec("x", "FP32", (4,)), TensorSpec("scale", "FP32", (1,)))
        assert rt.outputs == (TensorSpec("output_0", "FP32", (3,)), TensorSpec("output_1", "FP32", (1,)))
        out = rt.run(feeds)
    np.testing.assert_allclose(out["output_0"], eager[0].numpy(), rtol=1e-5)
    with load_runtime("torch", data, "cpu", io=HEAD_IO) as rt:
        np.testing.assert_allclose(rt.run(feeds)["total"], eager[1].numpy(), rtol=1e-5)


def _rewrite_pt2(data: bytes, edit) -> bytes:
    """Copy a .pt2 zip, letting ``edit(member, bytes) -> bytes | None`` change or drop members, then add extras."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w") as dst:
        root = src.namelist()[0].split("/", 1)[0]
        for info in src.infolist():
            member = info.filename.split("/", 1)[1]
            new = edit(member, src.read(info))
            if new is not None:
                dst.writestr(info.filename, new)
        for member, payload in getattr(edit, "extra", {}).items():
            dst.writestr(f"{root}/{member}", payload)
    return out.getvalue()


class _Marker:
    """Unpickling this would create the file named in the environment: proof that a pickle ran."""

    def __reduce__(self):
        return (open, (os.environ["NEXUS_TEST_PICKLE_MARKER"], "w"))


def test_exported_program_with_pickled_weights_is_refused_unpickled(torch_mod, tmp_path, monkeypatch):
    import pickle

    marker = tmp_path / "pickle-ran"
    monkeypatch.setenv("NEXUS_TEST_PICKLE_MARKER", str(marker))
    data = _export_bytes(torch_mod, torch_mod.nn.Linear(3, 2), (torch_mod.randn(2, 3),))

    def edit(member, raw):
        if member.endswith("_weights_config.json"):
            config = json.loads(raw)
            for meta in config["config"].values():
                meta["use_pickle"] = True
            return json.dumps(config).encode()
        if member.startswith("data/weights/weight_"):
            return pickle.dumps(_Marker())
        return raw

    with pytest.raises(ModelFileError, match="stored as a pickle"):
        load_runtime("torch", _rewrite_pt2(data, edit), "cpu")

    def swap_sample_inputs(member, raw):
        return pickle.dumps(_Marker()) if member.startswith("data/sample_inputs/") else raw

    with load_runtime("torch", _rewrite_pt2(data, swap_sample_inputs), "cpu") as rt:  # sample inputs are never read
        assert rt.run({"input": np.ones((2, 3), dtype=np.float32)})["output_0"].shape == (2, 2)
    assert not marker.exists()


@pytest.mark.parametrize("extra, match", [
    ({"data/aotinductor/model/model.so": b"\x7fELF"}, "not plain data"),
    ({"data/weights/model.pt": b"legacy"}, "not plain data"),
    ({"data/constants/custom_obj_0": b"x"}, "not plain data"),
])
def test_exported_program_with_unsafe_members_is_refused(torch_mod, extra, match):
    data = _export_bytes(torch_mod, torch_mod.nn.Linear(3, 2), (torch_mod.randn(2, 3),))

    def edit(member, raw):
        return raw
    edit.extra = extra
    with pytest.raises(ModelFileError, match=match):
        load_runtime("torch", _rewrite_pt2(data, edit), "cpu")


@pytest.mark.parametrize("expr", ["__import__('os').system('true')", "Symbol('s0').__class__",
                                  "exec('1')", "Symbol('s0'); 1", "[1][0]"])
def test_exported_program_with_code_in_shape_expressions_is_refused(torch_mod, expr):
    data = _export_bytes(torch_mod, torch_mod.nn.Linear(3, 2), (torch_mod.randn(2, 3),))

    def edit(member, raw):
        if member.startswith("models/"):
            text = raw.decode()
            assert '"expr_str"' in text
            return json.dumps(_replace_exprs(json.loads(text), expr)).encode()
        return raw

    with pytest.raises(ModelFileError, match="refused shape expression"):
        load_runtime("torch", _rewrite_pt2(data, edit), "cpu")


def _replace_exprs(obj, expr):
    if isinstance(obj, dict):
        return {k: (expr if k == "expr_str" else _replace_exprs(v, expr)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_replace_exprs(v, expr) for v in obj]
    return obj


def test_exported_program_guard_code_is_never_executed(torch_mod, tmp_path):
    marker = tmp_path / "guard-ran"
    data = _export_bytes(torch_mod, torch_mod.nn.Linear(3, 2), (torch_mod.randn(2, 3),))

    def edit(member, raw):
        if member.startswith("models/"):
            program = json.loads(raw)
            program["guards_code"] = [f"open({str(marker)!r}, 'w') is None"]
            return json.dumps(program).encode()
        return raw

    with load_runtime("torch", _rewrite_pt2(data, edit), "cpu") as rt:
        rt.run({"input": np.ones((4, 3), dtype=np.float32)})
    assert not marker.exists()


@pytest.mark.parametrize("corrupt, match", [
    (b"garbage", "expected a zip file"),
    (b"", "expected a zip file"),
    (None, "neither TorchScript"),
])
def test_torch_rejects_corrupt_bytes(torch_mod, corrupt, match):
    if corrupt is None:
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as z:
            z.writestr("model/readme.txt", "hello")
        corrupt = buf.getvalue()
    with pytest.raises(ModelFileError, match=match):
        load_runtime("torch", corrupt, "cpu", io=HEAD_IO)


def test_torch_rejects_damaged_torchscript(torch_mod):
    Head, _, _ = _modules(torch_mod)
    data = _script_bytes(torch_mod, Head())
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            raw = src.read(info)
            dst.writestr(info.filename, b"\x80\x02garbage" if info.filename.endswith("data.pkl") else raw)
    with pytest.raises(ModelFileError, match="torch cannot load the torchscript"):
        load_runtime("torch", out.getvalue(), "cpu", io=HEAD_IO)


def test_torch_cuda_without_a_gpu_is_a_clear_error(torch_mod):
    if torch_mod.cuda.is_available():
        pytest.skip("torch has a CUDA device here")
    Head, _, _ = _modules(torch_mod)
    with pytest.raises(DeviceUnavailableError, match="CUDA requested but torch has no CUDA device"):
        load_runtime("torch", _script_bytes(torch_mod, Head()), "cuda", io=HEAD_IO)


# ---- CUDA (only where there is one) -----------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not HAS_ORT_CUDA, reason="onnxruntime has no CUDAExecutionProvider here")
def test_onnxruntime_on_cuda_matches_cpu(mlp_bytes):
    x = sm.sample_input(sm.mlp_small(), 16)
    with load_runtime("onnxruntime", mlp_bytes, "cuda:0") as gpu, load_runtime("onnxruntime", mlp_bytes, "cpu") as cpu:
        assert gpu.providers[0] == CUDA_EP and gpu.device == "cuda:0"
        np.testing.assert_allclose(gpu.run({"input": x})["logits"], cpu.run({"input": x})["logits"],
                                   rtol=1e-3, atol=1e-4)


@pytest.mark.gpu
def test_torch_on_cuda_matches_cpu(torch_mod):
    if not torch_mod.cuda.is_available():
        pytest.skip("torch.cuda.is_available() is False here")
    Head, _, _ = _modules(torch_mod)
    data = _script_bytes(torch_mod, Head().eval())
    feeds = {k: v for k, v in feeds_for_two_inputs(16).items() if k != "ids"}
    with load_runtime("torch", data, "cuda:0", io=HEAD_IO) as gpu, load_runtime("torch", data, "cpu", io=HEAD_IO) as cpu:
        np.testing.assert_allclose(gpu.run(feeds)["y"], cpu.run(feeds)["y"], rtol=1e-3, atol=1e-4)
        assert gpu.memory_mb() > 0
