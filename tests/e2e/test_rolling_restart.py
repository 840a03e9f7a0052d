"""Restarts under steady load lose no request: a rolling restart of every backend (SIGTERM: it
leaves the plan and drains) and of every frontend (it stops taking calls and finishes those in
flight), and a backend SIGKILLed under `nexus serve`, which restarts it.
Outcomes are counted by status; no wall-clock assertion."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from harness.background_load import BackgroundLoad
from harness.rolling_restart import CLIENT_TIMEOUT_S, DEVICE_TYPE, MODEL, SLO_MS, model_upload, rolling_restart
from nexus.scheduler_client import upload_model
from nexus.serve_cmd import wait_models_ready
from tests.conftest import start_serve

pytestmark = pytest.mark.slow

CLEAR = {"UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"}


def test_rolling_restart_of_every_backend_and_frontend_answers_every_request(tmp_path):
    result = rolling_restart(tmp_path, rate_rps=30, backends=2, frontends=2, rounds=1, settle_s=1.0,
                             log=lambda line: None)
    assert result["sent"] > 0
    assert result["no_response"] == 0, result
    assert result["answered"] + result["failed_total"] == result["sent"], result
    assert set(result["failed"]) <= CLEAR, result
    # With a second backend to take over, a backend that leaves first costs no request: a request
    # turned away (UNAVAILABLE, RESOURCE_EXHAUSTED) is what a lossy restart produces. A busy CI
    # machine may still make a few requests late, which says nothing about the restart: on CI's two
    # cores, beside the other test worker, 17 of 435 were (3.9%, 2026-12-07), and the restarted
    # processes' own start-up shares those cores. A collapse is still far beyond 5%.
    turned_away = sum(n for status, n in result["failed"].items() if status != "DEADLINE_EXCEEDED")
    assert turned_away <= 0.01 * result["sent"], result
    assert result["failed_total"] <= 0.05 * result["sent"], result
    assert result["backend_exit_statuses"] == [0, 0]      # each drained and exited cleanly
    assert result["frontend_exit_statuses"] == [0, 0]


def _wait_line(path, pattern: str, timeout_s: float = 120) -> re.Match:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        match = re.search(pattern, path.read_text())
        if match:
            return match
        time.sleep(0.2)
    raise AssertionError(f"no {pattern!r} in:\n{path.read_text()[-3000:]}")


def _wait_answered(load: BackgroundLoad, answered: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while load.counts()["answered"] < answered:
        assert time.monotonic() < deadline, f"fewer than {answered} requests answered in {timeout_s} s: {load.counts()}"
        time.sleep(0.1)


def test_nexus_serve_restarts_a_killed_backend_and_keeps_serving(tmp_path):
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        cluster = start_serve(tmp_path / "data", "--backends", "2", "--no-samples", "--device",
                                f"emulated:{DEVICE_TYPE}", stderr=log)
    try:
        model = model_upload(tmp_path)
        cluster.upload(model)
        pid = int(_wait_line(log_path, r"backend-0 started \(pid (\d+)\)").group(1))
        load = BackgroundLoad(cluster.frontend, MODEL, 30, slo_ms=SLO_MS, timeout_s=CLIENT_TIMEOUT_S).start()
        _wait_answered(load, 10)
        os.kill(pid, signal.SIGKILL)
        _wait_line(log_path, rf"backend-0 \(pid {pid}\) exited with status -9; restarting in")
        back = _wait_line(log_path, r"backend-0 is back \(pid (\d+)\)")
        assert int(back.group(1)) != pid
        _wait_answered(load, load.counts()["answered"] + 30)      # the load goes on being answered after the restart
        load.stop()
        counts = load.counts()
        assert cluster.proc.poll() is None                      # nexus serve itself kept running
        assert counts["sent"] > 0 and counts["no_response"] == 0, counts
        assert counts["answered"] + counts["failed_total"] == counts["sent"], counts
        assert set(counts["failed"]) <= CLEAR, counts
        assert not wait_models_ready(cluster.frontend, [MODEL], 60)
        # The scheduler too comes back, at the address its nodes know, and they register again.
        scheduler_pid = int(_wait_line(log_path, r"scheduler started \(pid (\d+)\)").group(1))
        os.kill(scheduler_pid, signal.SIGKILL)
        back = _wait_line(log_path, rf"scheduler is back \(pid \d+\) at {re.escape(cluster.scheduler)}")
        upload_model(cluster.scheduler, model.path, "mlp2", profile_path=model.profile_path, slo_ms=SLO_MS,
                     creds=cluster.creds)
        assert not wait_models_ready(cluster.frontend, [MODEL, "mlp2"], 120)
        assert back and cluster.proc.poll() is None
    finally:
        assert cluster.stop() == 0
