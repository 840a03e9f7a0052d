"""The profiler's building blocks and ``profile_model`` on the sample models (in-process, CPU)."""

from __future__ import annotations

import json
import subprocess
import sys

import onnx
import pytest
from onnx import TensorProto, helper

from common.profile import Profile, conservative_latency_ms
from common.sample_models import SAMPLE_MODELS, build_sample_model, model_bytes, mlp_small
from profiler.auto_batch import BatchPlan, probe_grid, trim_to_best_throughput
from profiler.cost import compare_point, cost_per_million
from profiler.errors import ProfilerError
from profiler.fill import fill_rows
from profiler.measure import BatchMeasurement
from profiler.model_file import model_sha256, read_model_file
from profiler.profiling import profile_model
from profiler.slowdown import apply_colocation_slowdown, measured_slowdown, slowdowns_from_report
from tests.e2e.profile_checks import assert_means_nondecreasing_within_noise, assert_valid_profile, fails_above_4

# Fast settings: few timed runs, small time budget, one pinned thread (the test machine is shared).
FAST = dict(warmup=1, iters=8, min_iters=3, time_budget_s=0.15, threads=1)


def fails_at_1() -> bytes:
    """An ONNX model whose Reshape to [3, -1] fails unless 4 * batch is a multiple of 3."""
    x = helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", "d"])
    shape = helper.make_tensor("shape", TensorProto.INT64, [2], [3, -1])
    model = helper.make_model(helper.make_graph([helper.make_node("Reshape", ["input", "shape"], ["output"])],
                                                "fails_at_1", [x], [y], [shape]),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


def measurement(batch: int, mean: float, spread: float = 0.0, mem: float = 10.0) -> BatchMeasurement:
    samples = tuple(mean + spread * d for d in (-1.0, 0.0, 1.0))
    return BatchMeasurement(batch, samples, mem)


# ---- batch sizes and the automatic rule ------------------------------------------------------------

def test_probe_grid_is_powers_of_two_and_midpoints():
    assert probe_grid(64) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    assert probe_grid(1) == [1]
    assert probe_grid(10) == [1, 2, 3, 4, 6, 8, 10]
    with pytest.raises(ProfilerError):
        probe_grid(0)


@pytest.mark.parametrize("bad", [[0, 2], [-1], [], [1.5], [True]])
def test_batch_plan_rejects_non_positive_sizes(bad):
    with pytest.raises(ProfilerError, match="batch sizes"):
        BatchPlan.make(bad)


def test_batch_plan_always_measures_batch_1_and_sorts():
    assert BatchPlan.make([8, 4, 4]).sizes == (1, 4, 8)
    assert BatchPlan.make("auto", limit=8).auto
    with pytest.raises(ProfilerError):
        BatchPlan.make("sometimes")


def test_auto_rule_stops_on_throughput_plateau_and_trims_to_best():
    plan = BatchPlan.make("auto", limit=64)
    done = [measurement(1, 1.0), measurement(2, 1.5), measurement(3, 2.0)]
    assert plan.stop_reason(done) is None  # 1000 -> 1333 -> 1500 items/s
    done.append(measurement(4, 2.8))  # 1428 items/s: worse, but one point is not a plateau
    assert plan.stop_reason(done) is None
    done.append(measurement(6, 4.0))  # 1500 items/s: no better than batch 3 either
    kind, reason = plan.stop_reason(done)
    assert kind == "throughput" and reason == ("throughput at batch 4, 6 gains at most +0.0% over batch 3, "
                                               "under 1%")
    assert [m.batch for m in trim_to_best_throughput(done)] == [1, 2, 3]


def test_auto_rule_rides_over_one_noisy_point():
    """A slow measurement at one batch (contention) must not end the search while the next point
    still beats every smaller batch: the rule compares with the best so far, not the previous point."""
    plan = BatchPlan.make("auto", limit=64)
    done = [measurement(1, 4.0), measurement(2, 6.6), measurement(4, 10.3), measurement(6, 14.6),
            measurement(8, 21.0),    # noisy: 381 items/s against 411 at batch 6
            measurement(12, 25.4)]   # 472 items/s: the search goes on
    assert plan.stop_reason(done[:5]) is None
    assert plan.stop_reason(done) is None
    assert BatchPlan.make("auto", limit=64, patience=1).stop_reason(done[:5])[0] == "throughput"


def test_latency_cap_and_memory_limit():
    plan = BatchPlan.make([1, 2, 4], max_latency_ms=5.0, memory_limit_mb=100.0)
    assert plan.stop_reason([measurement(1, 1.0), measurement(2, 6.0)])[0] == "latency_cap"
    assert plan.stop_reason([measurement(1, 1.0), measurement(2, 1.0)]) is None  # no gain rule on a list
    assert plan.over_memory(measurement(4, 1.0, mem=150.0))


def test_fill_interpolates_unmeasured_sizes_with_the_one_latency_rule():
    rows = fill_rows([measurement(1, 1.0, 0.1), measurement(4, 4.0, 0.1, mem=40.0)])
    assert [r.batch for r in rows] == [1, 2, 3, 4]
    assert rows[1].mean_ms == pytest.approx(2.0) and rows[2].memory_mb == pytest.approx(30.0)
    assert [r.median_ms for r in rows] == pytest.approx([1.0, 2.0, 3.0, 4.0])      # measured, and between
    for r in rows:
        assert r.latency_ms == pytest.approx(conservative_latency_ms(r.mean_ms, r.std_ms, r.p99_ms))
    step = fill_rows([measurement(1, 1.0), measurement(4, 4.0)], "step")
    assert step[1].mean_ms == pytest.approx(4.0)
    with pytest.raises(ProfilerError):
        fill_rows([measurement(2, 1.0)])


# ---- profiling real models on CPU ------------------------------------------------------------------

@pytest.mark.parametrize("name", list(SAMPLE_MODELS))
def test_sample_model_profiles_on_cpu(name):
    data = model_bytes(build_sample_model(name))
    sizes = [1, 2] if name == "resnet18_64" else [1, 2, 4]
    profile = profile_model(data, "cpu", "onnxruntime", sizes, **FAST)
    assert_valid_profile(profile, max_batch=sizes[-1])
    assert profile.device_type == "cpu"
    assert profile.meta["measured_batches"] == sizes
    assert_means_nondecreasing_within_noise(profile)
    meta = profile.meta
    for key in ("runtime", "runtime_version", "device", "threads", "seed", "model_sha256", "created", "cpus"):
        assert key in meta, key
    assert meta["runtime"] == "onnxruntime" and meta["threads"] == 1 and meta["device"] == "cpu"
    assert meta["model_sha256"] == model_sha256(data)
    import onnxruntime

    assert meta["runtime_version"] == onnxruntime.__version__
    assert all(r.memory_mb > 0 for r in profile.rows)


def test_auto_profile_finds_a_largest_batch_and_says_why():
    profile = profile_model(model_bytes(mlp_small()), "cpu", "onnxruntime", "auto", limit=32, **FAST)
    assert_valid_profile(profile)
    stop = profile.meta["stop"]
    assert stop["kind"] in ("throughput", "limit")
    assert profile.max_batch <= 32
    assert profile.meta["batch_mode"] == "auto"


def test_a_model_failing_at_some_batch_size_stops_the_profile_there():
    profile = profile_model(fails_above_4(), "cpu", "onnxruntime", [1, 2, 4, 8, 16], **FAST)
    assert_valid_profile(profile, max_batch=4)
    stop = profile.meta["stop"]
    assert stop["batch"] == 8 and stop["kind"] == "failed"
    assert "batch 8" in stop["reason"] and "broadcast" in stop["reason"].lower()


def test_a_model_failing_at_batch_1_is_an_error():
    with pytest.raises(ProfilerError, match="fails at batch size 1"):
        profile_model(fails_at_1(), "cpu", "onnxruntime", [1, 2], **FAST)


def test_bad_model_bytes_and_options_are_profiler_errors(tmp_path):
    with pytest.raises(ProfilerError, match="cannot load"):
        profile_model(b"not a model", "cpu", "onnxruntime", [1], **FAST)
    with pytest.raises(ProfilerError, match="device"):
        profile_model(model_bytes(mlp_small()), "tpu:0", "onnxruntime", [1], **FAST)
    with pytest.raises(ProfilerError, match="batch sizes must be positive"):
        profile_model(model_bytes(mlp_small()), "cpu", "onnxruntime", [0, 1], **FAST)
    missing = tmp_path / "nope.onnx"
    with pytest.raises(ProfilerError, match="not found"):
        read_model_file(str(missing))
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x00\x01garbage")
    with pytest.raises(ProfilerError, match="ONNX"):
        read_model_file(str(garbage))


def test_memory_limit_below_batch_1_is_an_error():
    with pytest.raises(ProfilerError, match="over the"):
        profile_model(model_bytes(mlp_small()), "cpu", "onnxruntime", [1, 2], memory_limit_mb=1e-6, **FAST)


def test_profiles_are_accepted_by_the_model_database_and_the_planner(tmp_path):
    data = model_bytes(mlp_small())
    profile = profile_model(data, "cpu", "onnxruntime", [1, 2, 4, 8], **FAST)
    from globalsched.state.modeldb import ModelDatabase

    db = ModelDatabase(tmp_path / "db")
    try:
        db.add_model("mlp_small", [data], profile_json=profile.to_json())
        stored = db.profiles("mlp_small")
        assert set(stored) == {"cpu"} and stored["cpu"].max_batch == profile.max_batch
    finally:
        db.close()

    slo = max(20.0, 4 * profile.latency_ms(1))
    workload = {"gpu": {"name": "cpu", "memory_mb": 4096},
                "sessions": [{"name": "mlp", "model": "mlp_small", "slo_ms": slo, "rate": 100.0,
                              "profile": profile.to_json_obj()["profile"]}]}
    from nexus.plan_files import parse_workload
    from globalsched.planning.algorithms.solve import solve

    w = parse_workload(json.loads(json.dumps(workload)))
    plan = solve(w.sessions, w.gpu)
    assert len(plan.gpus) >= 1
    path = tmp_path / "workload.json"
    path.write_text(json.dumps(workload))
    out = subprocess.run([sys.executable, "-m", "nexus", "plan", str(path), "--json"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["num_gpus"] >= 1


# ---- slowdown, cost, ramp, load --------------------------------------------------------------------

def test_apply_colocation_slowdown_scales_every_latency():
    p = Profile.linear(1.0, 2.0, 4, device_type="gtx")
    q = apply_colocation_slowdown(p, 1.25)
    assert [r.latency_ms for r in q.rows] == pytest.approx([1.25 * r.latency_ms for r in p.rows])
    assert q.meta["colocation_slowdown"] == 1.25 and q.device_type == "gtx"
    assert apply_colocation_slowdown(q, 2.0).meta["colocation_slowdown"] == 2.5
    for bad in (0.9, float("nan"), -1, "2"):
        with pytest.raises(ValueError):
            apply_colocation_slowdown(p, bad)


def test_measured_slowdown_compares_same_batch_sizes():
    alone = {1: (10, 10.0), 4: (10, 30.0)}  # 1 ms and 3 ms per batch
    shared = {1: (5, 6.0), 4: (5, 18.0)}  # 1.2 ms and 3.6 ms
    assert measured_slowdown(alone, shared) == pytest.approx(1.2)
    p = Profile.from_rows([measurement(b, float(b)).to_row() for b in (1, 2)])
    assert measured_slowdown({}, {2: (2, 5.0)}, p) == pytest.approx(1.25)  # profile mean as reference
    assert measured_slowdown({}, {}) is None
    report = {"models": [{"name": "a", "model_sha256": "f" * 64, "slowdown": 1.1}]}
    assert slowdowns_from_report(report) == {"a": 1.1, "f" * 64: 1.1}


def test_cost_figures_are_consistent():
    assert cost_per_million(3.6, 1000.0) == pytest.approx(1.0)
    assert cost_per_million(1.0, 0.0) is None
    point = compare_point(2.0, {"a": 50.0, "b": 100.0}, {"a": 100.0, "b": 400.0})
    assert point["efficiency"] == pytest.approx(0.75)
    assert point["cost_per_million_shared"] == pytest.approx(2.0 / (3600 * 150) * 1e6)
    assert point["cost_per_million_dedicated"] == pytest.approx(point["cost_per_million_shared"] * 0.75)
    assert point["cost_change_vs_dedicated"] == pytest.approx(1 / 0.75 - 1)
    assert point["dedicated_devices_whole"] == 2
    assert point["cost_change_vs_dedicated_whole"] == pytest.approx(-0.5)
