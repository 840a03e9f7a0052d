"""globalsched/actuators/handover.py: make before break, as a pure function of the plan in force and the next."""

from __future__ import annotations

from globalsched.actuators.handover import handover
from tests.unit.distribution_fakes import plan


def names(sessions) -> list[tuple[str, int]]:
    return sorted((s.model, s.batch) for s in sessions)


def test_the_first_plan_is_pushed_as_it_is():
    new = plan({"be-1": (("a", 2),), "be-2": (("b", 4),)})
    steps = handover(None, new)
    assert {n: names(t) for n, t in steps.make.items()} == {"be-1": [("a", 2)], "be-2": [("b", 4)]}
    assert steps.release == {} and steps.kept == {} and steps.release_after_s == 0.0


def test_a_moved_session_stays_where_it_was_until_the_routing_tables_moved():
    old = plan({"be-1": (("a", 2), ("b", 4)), "be-2": ()})
    new = plan({"be-1": (("b", 8),), "be-2": (("a", 3),)})
    steps = handover(old, new)
    # be-1 loads nothing new, keeps a at its old batch, and takes b's new batch
    assert names(steps.make["be-1"]) == [("a", 2), ("b", 8)]
    assert names(steps.make["be-2"]) == [("a", 3)]
    assert steps.kept == {"be-1": ("a",)}
    assert {n: names(t) for n, t in steps.release.items()} == {"be-1": [("b", 8)]}
    assert steps.release_after_s == 0.1          # a's SLO: what was routed to it has met its deadline by then


def test_a_backend_the_plan_leaves_idle_keeps_its_sessions_until_release():
    old = plan({"be-1": (("a", 2),), "be-2": (("a", 2),)})
    new = plan({"be-1": (("a", 4),), "be-2": ()})
    steps = handover(old, new)
    assert names(steps.make["be-2"]) == [("a", 2)] and steps.release == {"be-2": ()}


def test_a_session_no_longer_served_is_dropped_at_once_and_a_backend_not_in_the_plan_is_not_pushed():
    old = plan({"be-1": (("a", 2), ("gone", 2)), "be-9": (("a", 1),)})
    new = plan({"be-1": (("a", 2),)}, served=("a",))
    steps = handover(old, new)
    assert names(steps.make["be-1"]) == [("a", 2)] and steps.release == {}
    assert "be-9" not in steps.make         # it left the plan: it keeps what it holds until it exits


def test_an_unchanged_plan_keeps_nothing():
    tables = {"be-1": (("a", 2),), "be-2": (("b", 4),)}
    steps = handover(plan(tables), plan(tables))
    assert steps.release == {} and {n: names(t) for n, t in steps.make.items()} == {"be-1": [("a", 2)],
                                                                                     "be-2": [("b", 4)]}


def test_a_plan_pushed_before_the_last_release_keeps_what_that_release_was_to_drop():
    """Plan 2 moved a from be-1 to be-2; be-1 keeps it until plan 2's release. Plan 3 comes first
    and also leaves be-1 without a: its make table must not drop a at once, with the requests routed
    there before the frontends' tables changed; its own release drops it, after its own wait."""
    one = plan({"be-1": (("a", 2), ("b", 4)), "be-2": ()})
    two = plan({"be-1": (("b", 4),), "be-2": (("a", 3),)})
    second = handover(one, two)
    assert names(second.make["be-1"]) == [("a", 2), ("b", 4)]
    three = plan({"be-1": (("b", 6),), "be-2": (("a", 3),), "be-3": (("a", 2),)})
    without = handover(two, three)
    assert names(without.make["be-1"]) == [("b", 6)]                    # what plan 3 alone would send
    third = handover(two, three, {"be-1": second.make["be-1"]})
    assert names(third.make["be-1"]) == [("a", 2), ("b", 6)] and third.kept == {"be-1": ("a",)}
    assert {n: names(t) for n, t in third.release.items()} == {"be-1": [("b", 6)]}
    assert third.release_after_s == 0.1
    # A session no longer served is dropped at once, held for a release or not.
    four = plan({"be-1": (("b", 6),), "be-2": ()}, served=("b",))
    assert names(handover(three, four, {"be-1": third.make["be-1"]}).make["be-1"]) == [("b", 6)]
