"""The direct-ORT baseline of the benchmark library (harness/ort_direct.py), on the sample MLP."""

from __future__ import annotations

import numpy as np
import pytest

from common.sample_models import mlp_small, model_bytes, sample_input
from harness.ort_direct import ort_limit, ort_session, paced_latencies, time_batch


@pytest.fixture(scope="module")
def model():
    return mlp_small()


def test_sessions_from_bytes_and_from_a_path_answer_alike(model, tmp_path):
    path = tmp_path / "mlp.onnx"
    path.write_bytes(model_bytes(model))
    x = sample_input(model, 3)
    a = ort_session(model_bytes(model), 1).run(None, {"input": x})[0]
    b = ort_session(path, 1, spin=True, config={"session.force_spinning_stop": "1"}).run(None, {"input": x})[0]
    assert a.shape[0] == 3 and np.array_equal(a, b)
    with pytest.raises(Exception):
        ort_session(b"not an onnx model")


def test_time_batch_times_each_repeat(model):
    times = time_batch(ort_session(model_bytes(model), 1), sample_input(model, 2), 5, warmup=1, idle_s=0.001)
    assert len(times) == 5 and all(t > 0 for t in times)


def test_the_limit_is_the_largest_batch_whose_double_latency_fits_the_slo(model):
    session = ort_session(model_bytes(model), 1)
    tried = []

    def inputs(b: int) -> np.ndarray:
        tried.append(b)
        return sample_input(model, b)

    lim = ort_limit(session, 1e6, inputs, 3, next_batch=lambda b: 2 * b, max_batch=8)
    assert tried == [1, 2, 4, 8] and lim["batch"] == 8
    assert lim["throughput_rps"] == pytest.approx(8 * 1000 / lim["l_ms"]) and lim["l_ms"] == lim["latency_ms"][8]
    # No batch fits: two sizes over the SLO in a row end the scan, and b* is 1.
    none = ort_limit(session, 1e-9, lambda b: sample_input(model, b), 2)
    assert sorted(none["latency_ms"]) == [1, 2] and none["batch"] == 1


def test_paced_runs_idle_between_calls(model):
    lat = paced_latencies(ort_session(model_bytes(model), 1), sample_input(model, 1), 200.0, 0.2,
                          np.random.default_rng(0))
    assert 0 < len(lat) < 200 and all(t > 0 for t in lat)
