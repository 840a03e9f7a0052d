"""The scheduler's planner process on real processes (globalsched/planning/planner_host.py): killed with
SIGKILL, it is started again from the last plan's state, the next change is planned, and what was
placed stays where it was; the scheduler's exit takes it along."""

from __future__ import annotations

import os
import signal

import pytest

from harness.cluster import cmdline
from harness.meters import descendants
from tests.components import alive, start_cluster, wait_for
from tests.e2e.load_under_faults import DEVICE, FAST, FAST_SLO_MS, upload

pytestmark = pytest.mark.slow


def _planners(scheduler_pid: int) -> list[int]:
    return [pid for pid in descendants(scheduler_pid) if "planner_worker" in cmdline(pid)]


def test_a_killed_planner_process_is_replaced_and_the_next_change_is_planned(tmp_path):
    cluster = start_cluster(tmp_path / "cluster", 2, DEVICE)
    try:
        upload(cluster, tmp_path, "first", FAST, FAST_SLO_MS)
        serving = {b.name for b in cluster.serving("first")}
        [planner] = _planners(cluster.scheduler.pid)
        os.kill(planner, signal.SIGKILL)
        upload(cluster, tmp_path, "second", FAST, FAST_SLO_MS)      # a change the planner must plan
        assert cluster.serving("second")
        [again] = _planners(cluster.scheduler.pid)
        assert again != planner
        assert {b.name for b in cluster.serving("first")} == serving       # planned on, not afresh
        assert "the planner process ended" in cluster.scheduler.logs()
        scheduler = cluster.scheduler.pid
        cluster.scheduler.stop()
        wait_for(lambda: not alive(again), what="the planner process gone with the scheduler")
        assert not alive(scheduler)
    finally:
        cluster.stop()

