"""The parts of benchmarks/vs_triton.py that run without servers: the py-spy reduction
(harness/pyspy.py), its models, Triton's tuning grid and when a level passes
(harness/triton_compare.py), and the driver's argument refusals (run as a command, as a user
would). The benchmark itself (servers under load) is
run by hand; see benchmarks/vs_triton.md."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from common.sample_models import model_bytes, resnet18_64
from harness.pyspy import top_functions

ROOT = pathlib.Path(__file__).resolve().parents[2]


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
    from harness.triton_compare import MODELS, build_models

    paths = build_models(tmp_path, list(MODELS))
    assert paths["r18_64"].read_bytes() != model_bytes(resnet18_64())
    for name, path in paths.items():
        onnx.checker.check_model(onnx.load(path))
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        x = np.zeros((2, *MODELS[name].input_shape), np.float32)
        assert session.run(None, {"input": x})[0].shape[0] == 2


def test_tritons_grid_is_what_its_users_would_tune():
    from harness.triton_compare import delay_candidates, triton_candidates

    limits = {"r18_64": {"batch": 4}, "small_cnn": {"batch": 12}, "tiny16": {"batch": 300}, "mlp": {"batch": 90}}
    single = triton_candidates("single", limits)
    assert {(m["max_batch"], m["instances"], m["threads"], m["queue_delay_us"]) for c in single for m in c["models"]} \
        == {(b, i, t, 5000) for b in (8, 16, 32) for i, t in ((1, 2), (2, 1))}
    assert all(m["preferred_batch_sizes"] == [m["max_batch"] // 2, m["max_batch"]] for c in single for m in c["models"])
    mix = triton_candidates("mix", limits)
    assert [c["name"] for c in mix] == ["1 thread per model, delay 0.5 ms", "1 thread per model, delay SLO/10",
                                        "ORT default threads, delay 0.5 ms"]
    slo_tenth = {m["name"]: m["queue_delay_us"] for m in mix[1]["models"]}
    assert slo_tenth == {"r18_64": 10000, "small_cnn": 5000, "tiny16": 3000, "mlp": 2000}
    assert {m["name"]: m["max_batch"] for m in mix[0]["models"]} == {"r18_64": 8, "small_cnn": 12, "tiny16": 64,
                                                                     "mlp": 64}
    shorter, longer = delay_candidates(mix[1])
    assert [m["queue_delay_us"] for m in shorter["models"]] == [2500, 1250, 750, 500]
    assert [m["queue_delay_us"] for m in longer["models"]] == [40000, 20000, 12000, 8000]
    assert all(a["max_batch"] == b["max_batch"] for a, b in zip(longer["models"], mix[1]["models"]))


def test_a_mix_level_passes_only_when_every_model_does():
    from harness.triton_compare import level_passes
    from harness.perf_analyzer import Level

    good = [Level("a", 50, throughput_rps=50, p99_us=40_000), Level("b", 50, throughput_rps=49, p99_us=15_000)]
    assert level_passes(good, {"a": 50, "b": 20}, window_s=3)
    assert not level_passes(good, {"a": 50, "b": 10}, window_s=3)                     # b's p99 past its SLO
    assert not level_passes([*good, Level("c", 50, error="dropped")], {"a": 50, "b": 20, "c": 99}, window_s=3)
    assert not level_passes([], {}, window_s=3)


def test_nexus_configurations_by_name_or_flags():
    from harness.triton_compare import parse_nexus_configs

    assert parse_nexus_configs(["default", "mine=--backends 3 --threads 1"]) == {
        "default": (), "mine": ("--backends", "3", "--threads", "1")}
    with pytest.raises(ValueError, match="unknown --nexus-config 'nope'"):
        parse_nexus_configs(["nope"])


def test_late_requests_of_nexus_by_name():
    from common.late_requests import LateRequests
    from harness.triton_compare import parse_late_requests

    assert parse_late_requests("drop,serve") == [LateRequests.DROP, LateRequests.SERVE]
    for bad in ("maybe", "", ","):
        with pytest.raises(ValueError, match="--late-requests: expected drop and/or serve"):
            parse_late_requests(bad)


@pytest.mark.parametrize("argv, message", [
    (["--scenarios", "nope"], "unknown scenario or server"),
    (["--servers", "tritonx"], "unknown scenario or server"),
    (["--nexus-config", "nope"], "unknown --nexus-config"),
    (["--triton-python", "/nonexistent/python"], "does not exist"),
    (["--servers", "nexus", "--perf-analyzer", "/nonexistent/perf_analyzer"], "is not an executable"),
    (["--late-requests", "maybe"], "--late-requests: expected drop and/or serve"),
])
def test_bad_arguments_are_refused(argv, message):
    run = subprocess.run([sys.executable, "-m", "benchmarks.vs_triton", *argv], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 2
    assert message in run.stderr


@pytest.mark.parametrize("argv, message", [
    (["--servers", "tritonx"], "--servers: expected triton and/or nexus"),
    (["--concurrency", "4,0"], "--concurrency: expected positive integers"),
    (["--nexus-config", "nope"], "unknown --nexus-config"),
    (["--triton-python", "/nonexistent/python"], "does not exist"),
    (["--servers", "nexus", "--perf-analyzer", "/nonexistent/perf_analyzer"], "is not an executable"),
    (["--late-requests", "maybe"], "--late-requests: expected drop and/or serve"),
])
def test_bad_arguments_to_the_tiny_sweep_are_refused(argv, message):
    run = subprocess.run([sys.executable, "-m", "benchmarks.tiny_sweep", *argv], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 2
    assert message in run.stderr


def test_a_paired_ladder_measures_every_server_at_each_rate_until_it_fails_twice():
    from harness.ladder import ladder_rates, paired_ladder

    capacity = {"a": 130, "b": 300}
    flaky = {("b", 160.0)}                        # one failed level (the machine's): b stays in the race
    calls = []

    def level(server, rate):
        calls.append((server, rate))
        return {"pass": rate <= capacity[server] and (server, rate) not in flaky}

    assert ladder_rates(100, 1.25, 300) == [100, 125, 156.25, 195.3125, 244.140625]
    out = paired_ladder(["a", "b"], level, 100, 1.6, 1000)
    assert out["a"]["goodput_rps"] == 100.0 and out["a"]["dropped_at"] == 256.0
    assert out["b"]["goodput_rps"] == 256.0 and out["b"]["dropped_at"] == 655.4
    assert [s["rate"] for s in out["a"]["steps"]] == [100, 160, 256]
    assert [s["pass"] for s in out["b"]["steps"]] == [True, False, True, False, False]
    assert calls[:4] == [("a", 100), ("b", 100), ("b", 160), ("a", 160)]      # the order rotates by rate
    with pytest.raises(ValueError):
        paired_ladder(["a"], level, 100, 1.0, 200)
