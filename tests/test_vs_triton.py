"""The parts of benchmarks/vs_triton.py that run without servers: the py-spy reduction
(nexus/bench/pyspy.py), its models, and the driver's argument refusals (run as a command, as a user
would). The benchmark itself (servers under load) is run by hand; see benchmarks/vs_triton.md."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from common.sample_models import model_bytes, resnet18_64, tiny_cnn
from nexus.bench.pyspy import top_functions

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_top_functions_reduces_collapsed_stacks(tmp_path):
    raw = tmp_path / "spy.txt"
    raw.write_text(
        "thread (1): MainThread;run (asyncio/base_events.py:1);infer (frontend/kserve.py:10) 30\n"
        "thread (1): MainThread;run (asyncio/base_events.py:1);parse (frontend/requests.py:5) 10\n"
        "thread (2): Thread-1;Thread.run (threading.py:982) 60\n"
        "thread (1): MainThread;run (asyncio/base_events.py:1);select (selectors.py:468) 500\n"
    )
    top = top_functions(raw, seconds=1.0, rate_hz=100)
    assert top["busy_samples"] == 100 and top["idle_samples"] == 500
    assert top["self_pct"]["Thread.run (threading.py)"] == 60.0
    assert top["self_pct"]["infer (frontend/kserve.py)"] == 30.0
    assert top["inclusive_pct"]["run (asyncio/base_events.py)"] == 40.0
    assert top["thread_cores"] == {"Thread-1": 0.6, "MainThread": 0.4}


def test_models_are_valid_and_the_resnet_is_another_file(tmp_path):
    models = {"r18_64": (resnet18_64(seed=1018), (3, 64, 64)), "tiny_cnn": (tiny_cnn(), (3, 32, 32))}
    assert model_bytes(models["r18_64"][0]) != model_bytes(resnet18_64())
    for name, (model, shape) in models.items():
        onnx.checker.check_model(model)
        session = ort.InferenceSession(model_bytes(model), providers=["CPUExecutionProvider"])
        x = np.zeros((2, *shape), np.float32)
        assert session.run(None, {"input": x})[0].shape[0] == 2


@pytest.mark.parametrize("argv, message", [
    (["--models", "nope"], "unknown model or server"),
    (["--servers", "tritonx"], "unknown model or server"),
    (["--triton-python", "/nonexistent/python"], "does not exist"),
])
def test_bad_arguments_are_refused(argv, message):
    run = subprocess.run([sys.executable, "-m", "benchmarks.vs_triton", *argv], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 2
    assert message in run.stderr
