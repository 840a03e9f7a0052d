"""A load step onto a cluster with idle devices registered, on real processes (issue 24): the plan
keeps spare replicas on the backends it leaves idle, and the frontend sends a burst to the replicas
with room at once, so an 11.5x step is served from its first second, before the re-plan it sets off.
The test asserts the spares and that no request of the step is turned away or lost; the share within
the SLO depends on the machine's load and is printed, and measured in benchmarks/elastic.md. The
simulator measures the same case at 100 and 1,000 devices ("the step, every device registered")."""

from __future__ import annotations

import numpy as np
import pytest

from common.profile import Profile
from harness.background_load import BackgroundLoad
from nexus.bench.report import OK
from tests.components import start_cluster, wait_for
from tests.e2e.load_under_faults import DEVICE, upload

pytestmark = pytest.mark.slow

# l(b) = 20 + 8b ms at a 200 ms SLO: a device serves about 100 requests/s (batch 10 in 100 ms), so
# 20 requests/s is planned on one device of four and 250 need every one.
PROFILE = Profile.linear(8.0, 20.0, 32, device_type="gtx1080ti")
SLO_MS = 200.0
BASE_RPS, STEP_RPS = 20.0, 230.0
FIRST_S = 3.0                     # the step's first seconds: what the spares alone must absorb


def test_idle_devices_hold_spares_that_serve_a_step_with_no_request_turned_away(tmp_path):
    cluster = start_cluster(tmp_path / "cluster", 4, DEVICE, scheduler={"node_timeout_s": 3600,
                                                                         "spare_replicas": True})
    try:
        upload(cluster, tmp_path, "stepped", PROFILE, SLO_MS)
        wait_for(lambda: len(cluster.serving("stepped")) == 4, 60, what="spares on the three idle backends")
        base = BackgroundLoad(cluster.frontend.address, "stepped", BASE_RPS, slo_ms=SLO_MS, timeout_s=10.0).start()
        wait_for(lambda: base.counts()["answered"] >= 5 * BASE_RPS, 60, what="five seconds of the base load")
        assert len(cluster.serving("stepped")) == 4            # the base load's plan kept the spares
        step = BackgroundLoad(cluster.frontend.address, "stepped", STEP_RPS, slo_ms=SLO_MS, timeout_s=10.0).start()
        wait_for(lambda: step.counts()["answered"] >= 2 * FIRST_S * STEP_RPS, 120, what="the step's load answered")
        samples = step.stop().samples
        counts = step.counts()
        base.stop()
        first = samples.sched_s < FIRST_S
        ok = (samples.outcome == OK) & (samples.latency_ms <= SLO_MS)
        print(f"the step's first {FIRST_S:g} s: {int(first.sum())} requests, {float(np.mean(ok[first])):.2%} "
              f"within SLO; the whole step: {counts}")
        # Every request of the step is answered, or answered late (DEADLINE_EXCEEDED): none is turned
        # away or lost. How many are within the SLO depends on the machine's load, so it is measured,
        # not asserted here (benchmarks/elastic.md, "2026-12-07, 04:55-05:20 UTC": 100% on a quiet
        # machine against 95.5-95.8% with the spares off; 65% in one CI run beside the other worker).
        assert counts["no_response"] == 0, counts
        assert set(counts["failed"]) <= {"DEADLINE_EXCEEDED"}, counts
        assert first.sum() >= FIRST_S * STEP_RPS * 0.8, int(first.sum())
        assert len(cluster.serving("stepped")) == 4
    finally:
        cluster.stop()
