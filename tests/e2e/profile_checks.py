"""What the profiler's tests check of a profile, and a model that fails above batch 4, shared by the
library's tests (test_profiler.py) and the command's (test_profiler_cli.py)."""

from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto, helper

from common.profile import Profile, conservative_latency_ms


def fails_above_4() -> bytes:
    """An ONNX model that runs for batch sizes 1..4 and fails from 5 on (broadcast error in Add)."""
    x = helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 4])
    inits = [helper.make_tensor(n, TensorProto.INT64, [1], [v]) for n, v in (("s", 0), ("e", 4), ("a", 0))]
    nodes = [helper.make_node("Slice", ["input", "s", "e", "a"], ["head"]),
             helper.make_node("Add", ["input", "head"], ["output"])]
    model = helper.make_model(helper.make_graph(nodes, "fails_above_4", [x], [y], inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


def assert_valid_profile(profile: Profile, max_batch: int | None = None) -> None:
    assert [r.batch for r in profile.rows] == list(range(1, profile.max_batch + 1))
    if max_batch is not None:
        assert profile.max_batch == max_batch
    lats = [r.latency_ms for r in profile.rows]
    assert all(b >= a for a, b in zip(lats, lats[1:]))
    if not profile.meta.get("contended_batches"):     # else some sizes plan at the median-based figure
        for r in profile.rows:
            assert r.latency_ms >= conservative_latency_ms(r.mean_ms, r.std_ms, r.p99_ms) - 1e-5  # JSON rounds
    again = Profile.from_json(profile.to_json())
    assert again.device_type == profile.device_type and again.max_batch == profile.max_batch
    for a, b in zip(again.rows, profile.rows):
        assert a.latency_ms == pytest.approx(b.latency_ms, abs=1e-6) and a.mean_ms == pytest.approx(b.mean_ms, abs=1e-6)
        assert a.median_ms == pytest.approx(b.median_ms, abs=1e-6) and a.median_ms is not None


def assert_means_nondecreasing_within_noise(profile: Profile) -> None:
    measured = [profile.rows[b - 1] for b in profile.meta["measured_batches"]]
    for a, b in zip(measured, measured[1:]):
        noise = 2.0 * (a.std_ms + b.std_ms) + 0.05 * a.mean_ms + 0.02
        assert b.mean_ms >= a.mean_ms - noise, (a, b)
