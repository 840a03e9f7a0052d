"""Make before break: how a plan's model tables replace those in force without a moment in which a
moved session has no backend that serves it.

Frontends route by the routing table they hold; it changes only after every backend answered its
model table (globalsched/distribution.py). A backend that dropped a session as soon as its new table
arrived would leave the frontends' routes to it pointing at nothing until the routing table came,
and that waits for the slowest backend's loads and warm-ups: every request of the session in between
would wait for the new table, then fail (benchmarks/sim_fidelity.md measured every real UNAVAILABLE
of a 5x step in those windows). So a plan is pushed in two steps:

1. **make**: every backend of the plan gets the plan's sessions *and keeps* those the plan moves
   away from it, at the batch they had, while a session it keeps is still in the plan;
2. the routing tables go to the frontends;
3. **release**: the backends that kept sessions get the plan's own table, and drop them. What they
   still hold of a dropped session is answered NOT_FOUND, which the frontend retries on the routes
   it now has.

A session the plan no longer serves at all is dropped at once (it has nowhere to go). A backend the
plan does not name (it left) is not pushed: it keeps serving what it holds until it exits.

Pure: the distribution (globalsched/distribution.py) and the simulator (nexus/simulate/control.py)
both execute what :func:`handover` returns. Keeping a session holds its memory for the move's
duration: on a device whose plan already fills its memory, the move briefly holds both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from globalsched.cluster import ClusterPlan
from globalsched.placement import PlacedSession


@dataclass(frozen=True)
class Handover:
    """The model tables of a plan's two steps, by backend. ``make`` names every backend of the plan;
    ``release`` only those whose ``make`` table kept sessions the plan moved away, and ``kept``
    which sessions those are."""

    make: Mapping[str, tuple[PlacedSession, ...]]
    release: Mapping[str, tuple[PlacedSession, ...]]
    kept: Mapping[str, tuple[str, ...]]


def backend_tables(plan: ClusterPlan | None) -> dict[str, tuple[PlacedSession, ...]]:
    """Each backend's model table in ``plan`` (none: no plan yet)."""
    if plan is None:
        return {}
    return {b.node_id: b.sessions for placement in plan.placements.values() for b in placement.backends}


def handover(in_force: ClusterPlan | None, plan: ClusterPlan) -> Handover:
    """How to push ``plan`` over ``in_force`` (the plan the backends and frontends hold; None at the
    first plan, or after a restart: then nothing is kept, as nothing is known to be held)."""
    before = backend_tables(in_force)
    make: dict[str, tuple[PlacedSession, ...]] = {}
    release: dict[str, tuple[PlacedSession, ...]] = {}
    kept: dict[str, tuple[str, ...]] = {}
    for node_id, sessions in backend_tables(plan).items():
        names = {s.model for s in sessions}
        keep = tuple(s for s in before.get(node_id, ()) if s.model not in names and s.model in plan.sessions)
        make[node_id] = sessions + keep
        if keep:
            release[node_id] = sessions
            kept[node_id] = tuple(s.model for s in keep)
    return Handover(make, release, kept)
