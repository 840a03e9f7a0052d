"""Spare replicas on real processes: a backend the plan leaves idle holds a replica of the busiest
session, so a kill -9 of the session's other backend under load costs only what was in flight there
(globalsched/planning/replicas.py, add_spares). The planner's side is tests/unit/test_plan_device_type.py's."""

from __future__ import annotations

import pytest

from tests.components import start_cluster
from tests.e2e.load_under_faults import DEVICE, FAST, FAST_SLO_MS, kill_one_of_two_replicas_under_load, upload

pytestmark = pytest.mark.slow


def test_an_idle_backend_holds_a_spare_that_takes_over_a_killed_backends_load(tmp_path):
    cluster = start_cluster(tmp_path / "cluster", 2, DEVICE, scheduler={"node_timeout_s": 3600, "spare_replicas": True})
    try:
        upload(cluster, tmp_path, "spared", FAST, FAST_SLO_MS)        # one replica asked for
        kill_one_of_two_replicas_under_load(cluster, "spared")          # the idle backend holds a spare
    finally:
        cluster.stop()
