"""Spare replicas on real processes: a backend the plan leaves idle holds a replica of the busiest
session, so a kill -9 of the session's other backend under load costs only what was in flight there
(globalsched/planning/replicas.py, add_spares). The planner's side is tests/unit/test_plan_device_type.py's."""

from __future__ import annotations

import time

import pytest

from tests.components import start_cluster, wait_for
from tests.e2e.test_failover import DEVICE, FAST, FAST_SLO_MS, _ok_in_a_row_since, _upload, steady_load

pytestmark = pytest.mark.slow


def test_an_idle_backend_holds_a_spare_that_takes_over_a_killed_backends_load(tmp_path):
    cluster = start_cluster(tmp_path / "cluster", 2, DEVICE, scheduler={"node_timeout_s": 3600, "spare_replicas": True})
    try:
        _upload(cluster, tmp_path, "spared", FAST, FAST_SLO_MS)        # one replica asked for
        deadline = time.monotonic() + 30
        while len(cluster.serving("spared")) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        serving = cluster.serving("spared")
        assert len(serving) == 2                                      # the idle backend holds a spare
        load = steady_load(cluster, "spared", 100)
        wait_for(lambda: _ok_in_a_row_since(load, 0.0), what="the load answered")
        in_flight = load.in_flight()
        killed_at = time.monotonic()
        serving[0].kill()
        wait_for(lambda: _ok_in_a_row_since(load, killed_at), what="25 requests sent after the kill answered OK in a row")
        codes = load.stop().samples.status_counts()
        print("spared:", codes, "in flight at the kill:", in_flight)
        assert "NO_RESPONSE" not in codes
        assert sum(codes.values()) - codes.get("OK", 0) <= in_flight, codes
    finally:
        cluster.stop()
