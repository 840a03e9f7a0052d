"""The sums of a frontend's sibling workers' request counts (frontend/worker_statistics.py) only grow."""

from frontend.worker_statistics import SiblingCounts


def _counts(rows: int, fail: int = 0) -> dict:
    return {("m", "1"): {"rows": rows, "success": rows, "success_ns": rows * 1000, "fail": fail}}


def test_sums_over_siblings_and_keeps_a_restarted_siblings_counts():
    s = SiblingCounts([], creds=None)
    s.record("a", _counts(10))
    s.record("b", _counts(5, fail=1))
    assert s.totals()[("m", "1")] == {"rows": 15, "success": 15, "success_ns": 15000, "fail": 1}
    s.record("a", _counts(12))
    assert s.totals()[("m", "1")]["rows"] == 17
    s.record("a", _counts(3))           # a restarted: its 12 are retired, its new 3 counted
    assert s.totals()[("m", "1")]["rows"] == 20
    s.record("b", {})                    # b no longer serves the model: what it counted stays
    assert s.totals()[("m", "1")] == {"rows": 20, "success": 20, "success_ns": 20000, "fail": 1}
