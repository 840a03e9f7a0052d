"""A stalled scheduler on real processes (issue 24): SIGSTOP it for 10 s under load, then SIGCONT.
The data path serves on its last tables meanwhile; when the scheduler resumes, the heartbeats it
missed were its own pause, not the nodes' silence (globalsched/state/failure_detector.py), so it evicts
nobody, and every request is answered OK. The node timeout is the default 5 s: the stall is twice it."""

from __future__ import annotations

import time

import pytest

from tests.components import start_cluster, wait_for
from tests.e2e.load_under_faults import DEVICE, FAST, FAST_SLO_MS, ok_in_a_row_since, steady_load, upload

pytestmark = pytest.mark.slow


def test_a_scheduler_stopped_for_10_s_under_load_evicts_nobody_and_fails_nothing(tmp_path):
    cluster = start_cluster(tmp_path / "cluster", 2, DEVICE)
    try:
        upload(cluster, tmp_path, "steady", FAST, FAST_SLO_MS)
        serving = {b.name for b in cluster.serving("steady")}
        load = steady_load(cluster, "steady", 50)
        wait_for(lambda: ok_in_a_row_since(load, 0.0), what="the load answered")
        cluster.scheduler.pause()
        time.sleep(10.0)
        cluster.scheduler.resume()
        resumed_at = time.monotonic()
        time.sleep(6.0)                            # past a node timeout after the resume
        wait_for(lambda: ok_in_a_row_since(load, resumed_at), what="25 requests after the resume answered OK")
        codes = load.stop().samples.status_counts()
        print("stall:", codes)
        assert set(codes) == {"OK"}, codes
        log = cluster.scheduler.logs()
        assert "missed heartbeats" not in log and " removed: " not in log, log[-3000:]
        assert serving <= {b.name for b in cluster.serving("steady")}     # still served where it was
    finally:
        cluster.stop()
