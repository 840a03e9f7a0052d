"""What a standby scheduler answers before and after it has read the lease's holder
(globalsched/leadership/leader.py, ``Leadership.refusal``)."""

from __future__ import annotations

from globalsched.leadership.leader import Leadership, Role


def test_a_standby_names_the_leader_once_it_has_read_the_lease_and_says_so_before():
    standby = Leadership(None, shared=True)
    assert standby.role is Role.STANDBY and not standby.may_act()
    assert standby.refusal() == "this scheduler is a standby; the leader is not known yet"
    standby.leader_address = "10.0.0.7:8100"
    assert standby.refusal() == "this scheduler is a standby; the leader is 10.0.0.7:8100"
