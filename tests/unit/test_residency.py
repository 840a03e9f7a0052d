"""Which sessions the devices' memory holds (globalsched/planning/residency.py): the most requested first, then
the planned rate, then those resident before; a session larger than any device is not cold but
cannot be served on the type."""

from __future__ import annotations

from common.profile import Profile
from globalsched.planning.cluster_values import SessionInput
from globalsched.planning.placement import BackendSlot
from globalsched.planning.residency import COLD_PREFIX, choose_resident


def _session(name: str, memory_mb: float, rate_rps: float = 1.0) -> SessionInput:
    return SessionInput(name, 100.0, rate_rps, {"t4": Profile.linear(1.0, 0.5, 8, memory_base_mb=memory_mb,
                                                                     device_type="t4")})


SLOTS = [BackendSlot("a", "t4", 1000.0), BackendSlot("b", "t4", 1000.0)]


def test_the_most_requested_sessions_are_resident_and_the_rest_cold():
    sessions = [_session(f"m{i}", 299.0, rate_rps=1.0) for i in range(8)]
    resident, cold, too_large = choose_resident(sessions, SLOTS, "t4", demand={"m7": 2.0, "m6": 0.5},
                                                resident_before={"m0", "m1", "m2", "m3"})
    names = [s.model for s in resident]
    assert len(names) == 6 and {"m7", "m6"} <= set(names)       # requested now: resident first
    assert {"m0", "m1", "m2", "m3"} <= set(names)                 # then those resident before
    assert sorted(cold) == ["m4", "m5"] and not too_large
    assert cold["m4"].startswith(COLD_PREFIX) and "holds 6 of 8 sessions" in cold["m4"]
    assert names == [s.model for s in sessions if s.model in names]      # in their given order


def test_the_planned_rate_ranks_before_residence_and_unknown_memory_holds_everything():
    sessions = [_session("busy", 600.0, rate_rps=50.0), _session("idle", 600.0, rate_rps=0.001),
                _session("mid", 600.0, rate_rps=5.0)]
    resident, cold, _ = choose_resident(sessions, SLOTS, "t4", demand={}, resident_before={"idle"})
    assert [s.model for s in resident] == ["busy", "mid"] and list(cold) == ["idle"]
    unknown = [BackendSlot("a", "t4", 0.0)]
    resident, cold, _ = choose_resident(sessions, unknown, "t4", demand={})
    assert len(resident) == 3 and not cold


def test_a_session_larger_than_every_device_is_not_cold_but_says_it_cannot_fit():
    resident, cold, too_large = choose_resident([_session("huge", 4000.0), _session("small", 10.0)], SLOTS, "t4",
                                                demand={"huge": 9.0})
    assert [s.model for s in resident] == ["small"] and not cold
    assert too_large == {"huge": "needs 4,000 MB on t4, and its largest device holds 1,000 MB"}


def test_the_least_recently_used_goes_cold_and_a_report_stamps_what_it_counted():
    from common.pb import control
    from globalsched.planning.residency import requested_while_cold
    from globalsched.state.rate_reports import Workload

    sessions = [_session(f"m{i}", 450.0, rate_rps=1.0) for i in range(5)]
    # m4 was just requested (cold): it evicts m0, used longest ago, not the busier m1..m3
    last = {"m0": 10.0, "m1": 50.0, "m2": 50.0, "m3": 50.0, "m4": 50.0}
    demand = {"m1": 10.0, "m2": 10.0, "m3": 10.0, "m4": 2.0}
    resident, cold, _ = choose_resident(sessions, SLOTS, "t4", demand, resident_before={"m0", "m1", "m2", "m3"},
                                        last_requested_s=last)
    assert [s.model for s in resident] == ["m1", "m2", "m3", "m4"] and list(cold) == ["m0"]
    # requested in the same report as four busier ones, it is the one that waits
    resident, cold, _ = choose_resident(sessions, SLOTS, "t4", {**demand, "m0": 10.0},
                                        last_requested_s={**last, "m0": 50.0})
    assert list(cold) == ["m4"]
    report = control.WorkloadReport(node_id="fe")
    report.rates.add(model="m4", requests=1, rate_rps=2.0)
    report.rates.add(model="m3", requests=0, rate_rps=0.0)
    report.rates.add(model="m0", requests=5, rate_rps=10.0)
    assert requested_while_cold(frozenset({"m4", "m3"}), report) == ["m4"]
    workload = Workload()
    workload.report(report, now=100.0)
    assert workload.last_requested_s() == {"m4": 100.0, "m0": 100.0}
