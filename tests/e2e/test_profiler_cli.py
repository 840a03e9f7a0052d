"""``nexus profile MODEL``: end to end as a subprocess, and its errors."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest

from common.profile import Profile
from common.sample_models import write_sample_models
from nexus.cli import main
from tests.e2e.profile_checks import assert_means_nondecreasing_within_noise, assert_valid_profile, fails_above_4

FAST_FLAGS = ["--threads", "1", "--iters", "10", "--min-iters", "3", "--warmup", "1", "--time-budget-s", "0.15", "-q"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    paths = {name: str(p) for name, p in write_sample_models(d, ["mlp_small", "vehicle_cls"]).items()}
    bad = d / "fails_above_4.onnx"
    bad.write_bytes(fails_above_4())
    paths["fails_above_4"] = str(bad)
    garbage = d / "garbage.onnx"
    garbage.write_bytes(b"this is not a protobuf")
    paths["garbage"] = str(garbage)
    return paths


def nexus(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nexus", *args], capture_output=True, text=True, timeout=timeout_s)


def test_profile_end_to_end_subprocess(models, tmp_path):
    out = tmp_path / "mlp.json"
    r = nexus("profile", models["mlp_small"], "--device", "cpu", "--max-batch", "auto", "--batch-limit", "64",
              *FAST_FLAGS, "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert "l(b) ms" in r.stdout and f"wrote {out}" in r.stdout
    profile = Profile.from_json(out.read_text())
    assert_valid_profile(profile)
    assert_means_nondecreasing_within_noise(profile)
    assert profile.device_type == "cpu"
    meta = profile.meta
    assert meta["model"] == "mlp_small.onnx" and meta["threads"] == 1 and meta["seed"] == 0
    with open(models["mlp_small"], "rb") as f:
        assert meta["model_sha256"] == hashlib.sha256(f.read()).hexdigest()
    assert meta["stop"]["kind"] in ("throughput", "limit")
    png = tmp_path / "mlp.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_profile_to_stdout_with_a_batch_list(models, capsys):
    rc = main(["profile", models["vehicle_cls"], "--batch-sizes", "1,2,4", *FAST_FLAGS])
    out = capsys.readouterr().out
    assert rc == 0
    profile = Profile.from_json(out)
    assert_valid_profile(profile, max_batch=4)
    assert profile.meta["measured_batches"] == [1, 2, 4]


def test_failing_batch_size_keeps_the_profile_and_warns(models, tmp_path):
    out = tmp_path / "bad.json"
    r = nexus("profile", models["fails_above_4"], "--batch-sizes", "1,2,4,8", *FAST_FLAGS, "-o", str(out),
              "--no-plot", "--strict")
    assert r.returncode == 1, r.stderr
    assert "nexus profile: warning: the profile stops at batch 4: batch 8 failed" in r.stderr
    profile = Profile.from_json(out.read_text())
    assert profile.max_batch == 4 and profile.meta["stop"]["batch"] == 8
    assert not (tmp_path / "bad.png").exists()


def test_missing_model_file_is_a_one_line_error():
    r = nexus("profile", "/nonexistent/model.onnx", "--device", "cpu", "-o", "/tmp/never.json")
    assert r.returncode == 2
    assert r.stderr.strip() == "nexus profile: error: /nonexistent/model.onnx: model file not found"


@pytest.mark.parametrize("argv, message", [
    (["{garbage}"], "not an ONNX model"),
    (["{mlp}", "--batch-sizes", "0,2"], "--batch-sizes: batch sizes must be positive, got 0"),
    (["{mlp}", "--batch-sizes=-4"], "batch sizes must be positive, got -4"),
    (["{mlp}", "--batch-sizes", "1,x"], "--batch-sizes: expected comma-separated integers"),
    (["{mlp}", "--max-batch", "0"], "--max-batch: batch sizes must be positive"),
    (["{mlp}", "--max-batch", "lots"], "--max-batch: expected 'auto' or a positive integer"),
    (["{mlp}", "--batch-sizes", "1,2", "--max-batch", "4"], "either --batch-sizes or --max-batch"),
    (["{mlp}", "--device", "tpu"], "invalid device 'tpu'"),
    (["{mlp}", "--threads", "0"], "--threads: must be >= 1"),
    (["{mlp}", "--cpus", "0,x"], "--cpus: expected comma-separated integers"),
    (["{mlp}", "--cpus", ","], "--cpus: empty list"),
    (["{mlp}", "--cpus=-1"], "--cpus: CPU ids must be >= 0, got [-1]"),
    (["{mlp}", "--slo-ms", "10"], "--slo-ms: not an option of 'nexus profile MODEL'"),
    (["{mlp}", "{mlp}"], "expected one MODEL, got 2"),
    (["{mlp}", "-o", "/nonexistent-dir/x.json"], "directory /nonexistent-dir does not exist"),
    (["multitenant", "{mlp}"], "at least two MODEL files"),
    (["multitenant", "{mlp}", "{mlp}"], "multitenant needs --slo-ms"),
    (["multitenant", "{mlp}", "{mlp}", "--slo-ms", "-1"], "--slo-ms: must be positive"),
    (["multitenant", "{mlp}", "{mlp}", "--slo-ms", "5", "--fractions", "0.5,1"], "--fractions"),
    (["multitenant", "{mlp}", "{mlp}", "--slo-ms", "5", "--strict"], "--strict: not an option"),
])
def test_usage_errors(models, capsys, argv, message):
    argv = [a.replace("{garbage}", models["garbage"]).replace("{mlp}", models["mlp_small"]) for a in argv]
    rc = main(["profile", *argv, "-q"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("nexus profile: error: ") and err.count("\n") == 1, err
    assert message in err


def test_help_shows_both_forms():
    r = nexus("profile", "--help")
    assert r.returncode == 0
    assert "nexus profile MODEL" in r.stdout and "nexus profile multitenant MODEL MODEL..." in r.stdout
    assert "multitenant options" in r.stdout
