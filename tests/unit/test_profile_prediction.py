"""Predicted profiles across device types (issue 18, item 2): ratios of models measured on both."""

from __future__ import annotations

import pytest

from common.profile import BatchLatency, Profile
from common.profile_prediction import is_predicted, predict_profile, prediction_error


def lin(alpha: float, beta: float, n: int, device: str, mem: float = 100.0) -> Profile:
    return Profile.linear(alpha, beta, n, mem, 10.0, device)


def test_prediction_follows_the_median_ratio_of_models_measured_on_both() -> None:
    # The target device is twice as fast for two models and 4x for an outlier: the median is 2.
    measured = {
        ("a", "t4"): lin(2.0, 10.0, 16, "t4"), ("a", "a100"): lin(1.0, 5.0, 16, "a100", 50.0),
        ("b", "t4"): lin(4.0, 6.0, 8, "t4"), ("b", "a100"): lin(2.0, 3.0, 8, "a100", 50.0),
        ("c", "t4"): lin(1.0, 8.0, 32, "t4"), ("c", "a100"): lin(0.25, 2.0, 32, "a100", 50.0),
        ("new", "t4"): lin(3.0, 9.0, 32, "t4", 400.0),
    }
    pred = predict_profile("new", "a100", measured)
    assert pred is not None and pred.source_device_type == "t4" and pred.basis == ("a", "b", "c")
    assert pred.profile.max_batch == 32 and pred.profile.device_type == "a100"
    for b in (1, 5, 8):
        assert pred.profile.latency_ms(b) == pytest.approx((3.0 * b + 9.0) / 2)
    # beyond b's profile (8) its ratio stays at its batch 8; a and c still say 2 and 4: median 2 or more
    assert pred.profile.latency_ms(32) >= (3.0 * 32 + 9.0) / 2 - 1e-9
    assert pred.memory_ratio == pytest.approx(60 / 110) and pred.profile.memory_mb(1) == pytest.approx(410 * 60 / 110)
    assert is_predicted(pred.profile) and not is_predicted(measured[("a", "t4")])
    back = Profile.from_json(pred.profile.to_json())  # the mark survives the database
    assert is_predicted(back) and back.meta["predicted_from"] == "t4"


def test_the_source_with_most_common_models_wins_and_predictions_are_not_sources() -> None:
    measured = {
        ("x", "cpu"): lin(5.0, 5.0, 4, "cpu"), ("x", "t4"): lin(1.0, 1.0, 4, "t4"),
        ("y", "cpu"): lin(5.0, 5.0, 4, "cpu"),
        ("z", "v100"): lin(1.0, 1.0, 4, "v100"), ("z", "t4"): lin(1.0, 1.0, 4, "t4"),
        ("w", "v100"): lin(1.0, 1.0, 4, "v100"), ("w", "t4"): lin(1.0, 1.0, 4, "t4"),
        ("m", "cpu"): lin(10.0, 10.0, 4, "cpu"), ("m", "v100"): lin(2.0, 2.0, 4, "v100"),
    }
    pred = predict_profile("m", "t4", measured)
    assert pred is not None and pred.source_device_type == "v100" and pred.basis == ("w", "z")
    guess = predict_profile("y", "t4", measured)
    assert guess is not None and guess.basis == ("x",)
    measured[("y", "t4")] = guess.profile  # a prediction is never a basis for another
    assert predict_profile("q", "t4", {**measured, ("q", "cpu"): lin(1.0, 1.0, 4, "cpu")}).basis == ("x",)


def test_no_prediction_without_a_bridge_and_none_over_a_measurement() -> None:
    measured = {("a", "cpu"): lin(1.0, 1.0, 4, "cpu"), ("b", "t4"): lin(1.0, 1.0, 4, "t4")}
    assert predict_profile("a", "t4", measured) is None     # nothing measured on both
    assert predict_profile("zz", "t4", measured) is None    # measured nowhere
    with pytest.raises(ValueError, match="already measured"):
        predict_profile("b", "t4", measured)


def test_prediction_error_when_a_measurement_arrives() -> None:
    predicted = Profile(tuple(BatchLatency(b, 10.0 * b) for b in range(1, 5)))
    measured = Profile(tuple(BatchLatency(b, v) for b, v in enumerate([8.0, 20.0, 30.0, 50.0, 60.0], start=1)))
    err = prediction_error(predicted, measured)
    assert err.batches == 4 and err.worst_batch == 1
    assert err.max_rel == pytest.approx(0.25)
    assert err.mean_rel == pytest.approx((0.25 + 0 + 0 + 0.2) / 4)
    assert err.bias == pytest.approx((0.25 - 0.2) / 4)
