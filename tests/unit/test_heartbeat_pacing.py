"""The heartbeat period grows with the cluster so that the scheduler answers a bounded number of
heartbeats a second; the removal timeout stretches alike (globalsched/state/heartbeat_pacing.py)."""

from __future__ import annotations

import pytest

from common.config import ConfigError, SchedulerConfig
from globalsched.state.heartbeat_pacing import Pacing, pacing


def test_a_small_cluster_keeps_the_configured_period_and_timeout():
    assert pacing(10, 1.0, 5.0, 200.0) == Pacing(1.0, 5.0)
    assert pacing(200, 1.0, 5.0, 200.0) == Pacing(1.0, 5.0)


def test_a_fleet_is_asked_for_fewer_heartbeats_and_waited_for_as_many_periods():
    paced = pacing(1010, 1.0, 5.0, 200.0)
    assert paced.period_s == pytest.approx(5.05)
    assert paced.timeout_s == pytest.approx(25.25)
    assert 1010 / paced.period_s == pytest.approx(200.0)          # the scheduler's heartbeats per second


def test_no_limit_keeps_the_configured_pacing_at_any_size():
    assert pacing(100_000, 0.5, 3.0, 0.0) == Pacing(0.5, 3.0)


def test_a_negative_limit_is_refused():
    with pytest.raises(ConfigError, match="max-heartbeats-per-s"):
        SchedulerConfig(max_heartbeats_per_s=-1.0).validate()
