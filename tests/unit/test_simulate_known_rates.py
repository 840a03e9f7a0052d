"""``nexus simulate`` given the true rates (nexus/simulate/known_rates.py): the planner's view reads
them instead of the measured ones, and the same planner then plans for them."""

from __future__ import annotations

import math

import pytest

from common.config import SchedulerConfig
from globalsched.state.rate_reports import PLAN_RATE_WINDOW_S
from nexus.simulate.config import SimConfig
from nexus.simulate.known_rates import KnownRates
from nexus.simulate.models import linear_models, shares
from nexus.simulate.run import Simulation
from nexus.simulate.workload import parse_schedule, scheduled_arrivals

MODELS = linear_models(4, 200.0, 8.0, 20.0, 32, memory_mb=500)
STEP = parse_schedule("0:60,20:300,40:60")


def test_the_view_reads_each_models_share_of_the_rate_known_ahead_with_no_surge_drop_or_lag():
    known = KnownRates(STEP.rate_at, {"a": 0.75, "b": 0.25}, ahead_s=2.0, dispersions={"a": 9.0})
    before = known.view_fields(17.0)                  # the step at 20 s is not 2 s ahead yet
    assert before["rates_rps"] == {"a": 45.0, "b": 15.0}
    ahead = known.view_fields(18.5)                   # it is now: planned for before it comes
    assert ahead["rates_rps"] == {"a": 225.0, "b": 75.0}
    assert known.view_fields(41.0)["rates_rps"] == {"a": 45.0, "b": 15.0}      # and down once it is gone
    assert ahead["surges_rps"] == {} and ahead["surge_windows_s"] == {}
    assert ahead["rate_windows_s"] == {"a": PLAN_RATE_WINDOW_S, "b": PLAN_RATE_WINDOW_S}
    assert ahead["latest_reports"] == {"a": (225.0, PLAN_RATE_WINDOW_S), "b": (75.0, PLAN_RATE_WINDOW_S)}
    assert ahead["rate_dispersions"] == {"a": 9.0}
    now_only = KnownRates(STEP.rate_at, {"a": 1.0})
    assert now_only.view_fields(19.9)["rates_rps"] == {"a": 60.0}
    assert now_only.view_fields(19.9)["rate_dispersions"] == {}


def test_the_known_view_has_every_field_of_the_measured_one_and_reads_no_reported_rate():
    """The simulated scheduler with known rates takes the fan-outs and last requests from the reports,
    and every other field from the known rates: together, the fields a measured view has."""
    from globalsched.state.read_view import measured, measured_apart_from_rates
    from globalsched.state.rate_reports import Workload

    known = KnownRates(STEP.rate_at, {"a": 1.0}).view_fields(0.0)
    apart = measured_apart_from_rates(Workload(), 0.0)
    assert not set(known) & set(apart)
    assert set(known) | set(apart) == set(measured(Workload(), 0.0))


@pytest.mark.parametrize("kwargs, message", [
    ({"ahead_s": -1.0}, "ahead_s must be a number of seconds >= 0, not -1.0"),
    ({"ahead_s": math.nan}, "ahead_s must be a number of seconds >= 0, not nan"),
    ({"shares": {"a": 1.0, "b": -0.5}}, "shares must be >= 0: b"),
])
def test_known_rates_that_mean_nothing_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KnownRates(STEP.rate_at, **{"shares": {"a": 1.0}, **kwargs})


def _plans(known: KnownRates | None) -> list[tuple[float, int]]:
    arrivals = scheduled_arrivals(STEP, shares(MODELS), 45.0, seed=3)
    config = SimConfig(seed=3, max_backends=8, scheduler=SchedulerConfig(min_devices="t4=1", max_devices="t4=8"))
    sim = Simulation(MODELS, arrivals, config, known)
    sim.run()
    return [(e["time_s"], e["devices"]) for e in sim.events if e["kind"] == "plan" and "devices" in e]


def test_a_planner_told_the_rates_ahead_plans_the_step_before_it_comes_and_one_that_measures_after():
    measured = _plans(None)
    known = _plans(KnownRates(STEP.rate_at, shares(MODELS), ahead_s=5.0))
    base = max(devices for t, devices in measured if t < 15.0)
    assert max(devices for t, devices in measured if t < 20.0) == base          # measured: nothing before it
    assert any(devices > base for t, devices in measured if 20.0 <= t < 25.0)    # then it grows
    assert any(devices > base for t, devices in known if 15.0 <= t < 20.0)       # known 5 s ahead: before it
