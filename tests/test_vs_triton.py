"""The pure parts of benchmarks/vs_triton.py: its py-spy reduction, its models and
its argument refusals. The benchmark itself (servers under load) is run by hand; see
benchmarks/vs_triton.md."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from benchmarks import vs_triton
from common.sample_models import model_bytes, resnet18_64


def test_top_functions_reduces_collapsed_stacks(tmp_path):
    raw = tmp_path / "spy.txt"
    raw.write_text(
        "thread (1): MainThread;run (asyncio/base_events.py:1);infer (frontend/kserve.py:10) 30\n"
        "thread (1): MainThread;run (asyncio/base_events.py:1);parse (frontend/requests.py:5) 10\n"
        "thread (2): Thread-1;Thread.run (threading.py:982) 60\n"
        "thread (1): MainThread;run (asyncio/base_events.py:1);select (selectors.py:468) 500\n"
    )
    top = vs_triton.top_functions(raw, seconds=1.0, rate_hz=100)
    assert top["busy_samples"] == 100 and top["idle_samples"] == 500
    assert top["self_pct"]["Thread.run (threading.py)"] == 60.0
    assert top["self_pct"]["infer (frontend/kserve.py)"] == 30.0
    assert top["inclusive_pct"]["run (asyncio/base_events.py)"] == 40.0
    assert top["thread_cores"] == {"Thread-1": 0.6, "MainThread": 0.4}


def test_models_are_valid_and_the_resnet_is_another_file(tmp_path):
    paths = vs_triton.build_models(tmp_path)
    assert set(paths) == set(vs_triton.MODELS)
    assert paths["r18_64"].read_bytes() != model_bytes(resnet18_64())
    for name, path in paths.items():
        onnx.checker.check_model(onnx.load(str(path)))
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        x = np.zeros((2, *vs_triton.MODELS[name][1]), np.float32)
        assert session.run(None, {"input": x})[0].shape[0] == 2


@pytest.mark.parametrize("argv, message", [
    (["--models", "nope"], "unknown model or server"),
    (["--servers", "tritonx"], "unknown model or server"),
    (["--triton-python", "/nonexistent/python"], "does not exist"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        vs_triton.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
