"""nexus/simulate/fidelity.py, with which benchmarks/sim_fidelity.py compares a simulation and a real
run: decisions read from both sides' logs, their pairing in time, and the series the comparison is
made of. No processes, no wall clock."""

from __future__ import annotations

import datetime

import numpy as np
import pytest

from nexus.simulate.fidelity import (Decision, intervals_overlap_s, line_time, match_decisions, per_second,
                                     real_decisions, sim_decisions, within_window)


def D(t, kind="add", value=0):
    return Decision(t, kind, value)


def test_match_pairs_in_order_and_reports_the_time_difference():
    real = [D(10.0), D(20.0), D(50.0)]
    sim = [D(10.5), D(21.9), D(49.0)]
    m = match_decisions(real, sim)
    assert [(p.real.time_s, p.sim.time_s) for p in m] == [(10.0, 10.5), (20.0, 21.9), (50.0, 49.0)]
    assert [round(p.dt_s, 3) for p in m] == [0.5, 1.9, -1.0]
    assert all(p.within(2.0) for p in m)


def test_an_extra_decision_on_one_side_stays_unmatched_and_does_not_shift_later_pairs():
    real = [D(10.0), D(30.0), D(60.0)]
    sim = [D(10.2), D(18.0), D(30.4), D(60.1)]        # the simulator added one more backend at 18 s
    m = match_decisions(real, sim, unmatched_cost_s=6.0)
    pairs = [(p.real and p.real.time_s, p.sim and p.sim.time_s) for p in m]
    assert pairs == [(10.0, 10.2), (None, 18.0), (30.0, 30.4), (60.0, 60.1)]
    assert not m[1].within(2.0) and m[1].dt_s is None


def test_decisions_far_apart_are_not_paired():
    m = match_decisions([D(10.0)], [D(40.0)], unmatched_cost_s=6.0)
    assert [(p.real is None, p.sim is None) for p in m] == [(False, True), (True, False)]
    # ...but within twice the unmatched cost they are, however late
    m = match_decisions([D(10.0)], [D(21.0)], unmatched_cost_s=6.0)
    assert len(m) == 1 and m[0].dt_s == pytest.approx(11.0) and not m[0].within(2.0)


def test_kinds_pair_only_with_their_own_kind_and_desired_only_with_the_same_count():
    real = [D(5.0, "plan"), D(6.0, "desired", 3), D(9.0, "desired", 4)]
    sim = [D(5.5, "add"), D(6.1, "desired", 4), D(5.2, "plan")]
    m = match_decisions(real, sim)
    got = {(p.kind, p.real and p.real.time_s, p.sim and p.sim.time_s) for p in m}
    assert got == {("plan", 5.0, 5.2), ("add", None, 5.5), ("desired", 6.0, None), ("desired", 9.0, 6.1)}
    first = [min(d.time_s for d in (p.real, p.sim) if d) for p in m]
    assert first == sorted(first)


def test_real_log_lines_become_decisions_in_trace_seconds():
    offset = 1000.0        # wall clock minus monotonic
    t0 = 500.0
    wall = datetime.datetime(2024, 5, 1, 12, 0, 0, 250000).timestamp()
    stamp = "2024-05-01 12:00:00,250"
    lines = [
        (510.0, "nexus serve: adding backend-3 (pid 12): the plan uses 4"),
        (511.0, f"{stamp} globalsched.planning.control_loop INFO epoch 17: re-planned: t4 surge"),
        (512.0, f"{stamp} globalsched.actuators.device_scaler INFO devices t4: 4 desired, 3 registered: x"),
        (512.5, f"{stamp} globalsched.actuators.device_scaler INFO devices t4: 4 desired, 4 registered: x"),   # same count
        (513.0, "nexus serve: removing backend-1 (abc at 127.0.0.1:5): surplus; draining it (SIGTERM)"),
        (514.0, "nexus serve: t4: 4 devices desired (was 3), 3 registered: x"),      # serve's echo: not counted
        (515.0, "nexus serve: backend-1 (pid 9) stopped, exit status 0"),
    ]
    ds = real_decisions(lines, t0, offset)
    assert [(d.kind, d.value) for d in ds] == [("add", 0), ("plan", 0), ("desired", 4), ("remove", 0), ("exit", 0)]
    assert ds[0].time_s == pytest.approx(10.0)                     # seen time: serve's lines have no stamp
    assert ds[1].time_s == pytest.approx(wall - offset - t0)        # the line's own stamp
    assert line_time(7.0, "no stamp", offset) == 7.0 and line_time(7.0, f"{stamp} x", None) == 7.0


def test_sim_events_become_decisions_relative_to_the_lead():
    events = [{"time_s": 21.0, "kind": "actuator", "text": "adding be-2: x"},
              {"time_s": 22.0, "kind": "plan", "text": "epoch 3: t4 surge"},
              {"time_s": 23.0, "kind": "scaling", "text": "t4: 3 desired", "desired": 3, "registered": 2},
              {"time_s": 24.0, "kind": "scaling", "text": "t4: 3 desired", "desired": 3, "registered": 3},
              {"time_s": 25.0, "kind": "actuator", "text": "removing be-0: x; draining it"},
              {"time_s": 26.0, "kind": "membership", "text": "be-0 drained and exited"}]
    ds = sim_decisions(events, lead_s=20.0)
    assert [(d.time_s, d.kind, d.value) for d in ds] == [(1.0, "add", 0), (2.0, "plan", 0), (3.0, "desired", 3),
                                                         (5.0, "remove", 0), (6.0, "exit", 0)]
    assert [d.time_s for d in within_window(ds, 2.0, 5.0)] == [2.0, 3.0]


def test_per_second_attainment_and_interval_overlaps():
    times = np.array([0.1, 0.5, 1.2, 3.9, -0.01, 9.0])
    good = np.array([1, 0, 1, 1, 1, 0], bool)
    assert per_second(times, good, 4) == [2 / 3, 1.0, None, 0.5]
    assert intervals_overlap_s([(-5.0, 2.0), (1.0, None), (8.0, 9.0)], 0.0, 4.0) == pytest.approx(2.0 + 3.0)


def test_distribution_delays_and_the_fit_of_their_two_parts():
    from nexus.simulate.fidelity import distribution_delays, fit_distribution, new_sessions_per_plan

    planned = [(10.0, 7), (12.0, 8), (15.0, 9)]
    routed = [(10.4, 7), (10.5, 7), (13.1, 8)]            # epoch 9 never reached a frontend
    assert [round(d, 3) for d in distribution_delays(planned, routed)] == [0.4, 1.1]
    # delay = 0.3 + 0.15 * n exactly: the fit returns (intercept, slope)
    intercept, slope = fit_distribution([(0, 0.3), (1, 0.45), (4, 0.9), (2, 0.6)])
    assert intercept == pytest.approx(0.3) and slope == pytest.approx(0.15)
    assert fit_distribution([(1, 0.4), (1, 0.5)]) is None
    lines = [(1.0, "x epoch 7: re-planned: t4 surge"),
             (1.0, "x epoch 7: be-a duty cycle 50.0 ms: m01 b=2 10.0 rps, m02 b=1 5.0 rps"),
             (1.0, "x epoch 7: be-b duty cycle 50.0 ms: idle"),
             (1.3, "x routing epoch 7: m01->1"),
             (2.0, "x epoch 8: re-planned: t4 surge"),
             (2.0, "x epoch 8: be-a duty cycle 50.0 ms: m01 b=2 10.0 rps"),
             (2.0, "x epoch 8: be-b duty cycle 50.0 ms: m02 b=1 5.0 rps, m03 b=1 2.0 rps"),
             (2.9, "x routing epoch 8: m01->1")]
    got = new_sessions_per_plan(lines, None)
    assert [(n, round(d, 3)) for n, d in got] == [(2, 0.9)]     # be-b gained m02 and m03
    # a plan names only the backends that changed: the others hold what they held
    changed_only = [(t, line) for t, line in lines if line != "x epoch 8: be-a duty cycle 50.0 ms: m01 b=2 10.0 rps"]
    changed_only += [(3.0, "x epoch 9: re-planned: t4 surge"), (3.0, "x epoch 9: be-b duty cycle 50.0 ms: m02 b=1 5.0 rps"),
                     (3.5, "x routing epoch 9: m01->1")]
    got = new_sessions_per_plan(changed_only, None)
    assert [(n, round(d, 3)) for n, d in got] == [(2, 0.9), (0, 0.5)]   # be-b lost m03: nothing new
