"""The scheduler service's own logic, in process: co-location slowdown, rate smoothing, bad config."""

from __future__ import annotations

import json
import subprocess
import sys

from common.config import SchedulerConfig
from common.profile import Profile
from common.sample_models import mlp_small, model_bytes
from globalsched.modeldb import ModelDatabase
from globalsched.service import RATE_SMOOTHING, SchedulerService


def _service(tmp_path, **config) -> SchedulerService:
    db = ModelDatabase(tmp_path / "db")
    profile = Profile.linear(1.0, 4.0, 8, device_type="cpu")
    db.add_model("m", [model_bytes(mlp_small())], profile_json=profile.to_json(), slo_ms=50)
    return SchedulerService(SchedulerConfig(data_dir=tmp_path / "db", **config), db)


def test_colocation_report_inflates_planning_latency(tmp_path):
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"models": [{"name": "m", "slowdown": 1.5}]}))
    plain = _service(tmp_path / "a")._profiles("m")["cpu"]
    inflated = _service(tmp_path / "b", colocation_report=str(report))._profiles("m")["cpu"]
    for b in range(1, plain.max_batch + 1):
        assert abs(inflated.latency_ms(b) - 1.5 * plain.latency_ms(b)) < 1e-9
    assert inflated.meta["colocation_slowdown"] == 1.5


def test_unreadable_colocation_report_stops_the_scheduler_with_a_message(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    done = subprocess.run([sys.executable, "-m", "nexus", "scheduler", "--listen", "127.0.0.1:0", "--data-dir",
                           str(tmp_path / "db"), "--colocation-report", str(bad)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "--colocation-report" in done.stderr


def test_bad_scheduler_flags_are_refused(tmp_path):
    for flags, message in ((["--listen", "nowhere"], "--listen: expected HOST:PORT"),
                           (["--epoch-s", "0"], "--epoch-s: must be positive"),
                           (["--latency-split", "random"], "--latency-split")):
        done = subprocess.run([sys.executable, "-m", "nexus", "scheduler", "--data-dir", str(tmp_path), *flags],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and message in done.stderr, (flags, done.stderr)


def test_reported_rates_are_smoothed(tmp_path):
    service = _service(tmp_path)
    service.rates["fe"] = {}

    class Report:
        def __init__(self, rate):
            self.node_id = "fe"
            self.rates = [type("R", (), {"model": "m", "rate_rps": rate})()]
            self.edges = []

    import asyncio

    service.nodes["fe"] = object()
    asyncio.run(service.ReportWorkload(Report(100.0), None))
    asyncio.run(service.ReportWorkload(Report(200.0), None))
    expected = RATE_SMOOTHING * 200.0 + (1 - RATE_SMOOTHING) * 100.0
    assert abs(service.rates["fe"]["m"][0] - expected) < 1e-9
