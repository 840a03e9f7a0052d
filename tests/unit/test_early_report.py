"""Cold start (issue 17 item 5): a frontend reports a sharp rise of a session's demand at once, by the
scheduler's own surge rule (common/surge.py), at most once per session per EARLY_REPORT_GAP_S; the
pure rule here, the whole path on real processes in tests/e2e/test_elastic.py."""

from __future__ import annotations

import pytest

from common.surge import is_surge
from frontend.early_report import EARLY_REPORT_GAP_S, MIN_WINDOW_S, ReportClock


def test_a_surge_is_beyond_poisson_noise_and_well_above_what_was_expected():
    assert not is_surge(74, 60)              # within 4 sigma (+3) of 60
    assert is_surge(300, 60)
    assert not is_surge(3, 0) and is_surge(4, 0)    # a handful where nothing was expected is noise
    assert not is_surge(10_400, 10_000)       # far beyond the noise of a large rate, but no surge
    assert is_surge(15_500, 10_000)


def test_the_report_goes_at_the_period_or_at_once_when_a_session_surges():
    clock = ReportClock(interval_s=2.0, now=0.0)
    planned = {"m": 10.0, "quiet": 10.0}
    assert clock.due({"m": 3, "quiet": 1}, planned, 0.5) is None         # 5 expected by now: noise
    assert clock.due({"m": 3}, planned, 2.0) == []                       # the period is over: report
    clock.reported(2.0, [])
    assert clock.due({"m": 40, "quiet": 2}, planned, 2.0 + MIN_WINDOW_S / 2) is None   # too short a window
    assert clock.due({"m": 40, "quiet": 2}, planned, 2.5) == ["m"]       # 5 expected, 40 came: at once
    clock.reported(2.5, ["m"])
    # m may not trigger again within the gap; the period still ends on time
    assert clock.due({"m": 60}, planned, 2.5 + EARLY_REPORT_GAP_S / 2) is None
    assert clock.due({"m": 60}, planned, 2.5 + EARLY_REPORT_GAP_S) == ["m"]
    assert clock.due({"m": 0}, planned, 4.5) == []


@pytest.mark.parametrize("planned_rps", [0.0, 1.0])
def test_a_session_planned_for_little_or_nothing_surges_with_a_handful_of_requests(planned_rps):
    """A model just uploaded is planned for the default 1 rps (or nothing, before its first plan)."""
    clock = ReportClock(interval_s=2.0, now=0.0)
    assert clock.due({"new": 3}, {"new": planned_rps}, 0.3) is None
    assert clock.due({"new": 12}, {"new": planned_rps}, 0.3) == ["new"]


def test_names_the_frontend_does_not_plan_for_never_trigger():
    clock = ReportClock(interval_s=2.0, now=0.0)
    assert clock.due({"traffic": 500}, {}, 1.0) is None                  # a query: its stages are sessions


def test_a_surging_sessions_window_is_split_where_the_surge_began():
    """1 s at the planned 10 rps, then 60 rps: the report gives the new rate, not the window's blend."""
    clock = ReportClock(interval_s=5.0, now=0.0)
    planned = {"m": 10.0, "other": 5.0}
    counts: dict[str, int] = {}
    t, due = 0.0, None
    while due is None:
        t = round(t + 0.1, 1)
        rate = 10 if t <= 1.0 else 60
        counts["m"] = counts.get("m", 0) + int(rate * 0.1)
        counts["other"] = counts.get("other", 0) + (1 if int(t * 10) % 2 else 0)
        due = clock.due(counts, planned, t)
    assert due == ["m"] and t < 2.0
    (n_old, w_old), (n_new, w_new) = clock.parts("m", counts["m"], planned["m"], t)
    assert n_old + n_new == counts["m"] and w_old + w_new == pytest.approx(t)
    assert w_old == pytest.approx(1.0, abs=0.15) and n_new / w_new == pytest.approx(60, rel=0.15)
    assert clock.parts("other", counts["other"], planned["other"], t) == [(counts["other"], t)]
    clock.reported(t, due)
    assert clock.marks == [(t, {})] and clock.window_start == t


def test_a_page_in_report_carries_only_the_cold_sessions_and_each_starts_its_own_window():
    clock = ReportClock(interval_s=2.0, now=0.0)
    window = {"cold": 1, "busy": 30}
    assert clock.page_in_counts(window, ["cold"], 1.5) == [("cold", 1, 1.5)]
    assert window == {"busy": 30}                                       # the rest of the window goes on
    # a request just after its own report does not read as a burst: the window is at least MIN_WINDOW_S
    window["cold"] = 1
    assert clock.page_in_counts(window, ["cold"], 1.51) == [("cold", 1, MIN_WINDOW_S)]
    window["cold"] = 2
    counts = dict((n, (r, round(w, 6))) for n, r, w in clock.report_counts(window, ["cold", "busy"],
                                                                         {"cold": 0.0, "busy": 15.0}, [], 2.0))
    assert counts == {"cold": (2, 0.49), "busy": (30, 2.0)}             # the full report: each over its own window
    clock.reported(2.0, [])
    assert clock.start("cold") == clock.start("busy") == 2.0
    # a surge is judged over the session's own window: 15 requests in its 0.5 s where 2 rps is planned
    # (over the whole 5.5 s window, 11 would be expected: no surge)
    clock2 = ReportClock(interval_s=10.0, now=0.0)
    clock2.page_in_counts({"m": 1}, ["m"], 5.0)
    assert clock2.surging({"m": 2}, {"m": 2.0}, 5.5) == []
    assert clock2.surging({"m": 15}, {"m": 2.0}, 5.5) == ["m"]
