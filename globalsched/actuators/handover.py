"""Make before break: how a plan's model tables replace those in force without a moment in which a
moved session has no backend that serves it.

Frontends route by the routing table they hold. A session is routed to a new backend only once
that backend has answered its model table (globalsched/actuators/early_routes.py), and the plan's
whole routing table goes once every backend has (globalsched/actuators/distribution.py). A backend
that dropped a session as soon as its new table arrived would leave the frontends' routes to it
pointing at nothing until the routing table came, and that waits for the slowest backend's loads and
warm-ups: every request of the session in between would wait for the new table, then fail
(benchmarks/sim_fidelity.md measured every real UNAVAILABLE of a 5x step in those windows). So a
plan is pushed in two steps:

1. **make**: every backend of the plan gets the plan's sessions *and keeps* those the plan moves
   away from it, at the batch they had, while a session it keeps is still in the plan;
2. the routing tables go to the frontends;
3. **release**, :attr:`Handover.release_after_s` after the routing tables went out: the backends that
   kept sessions get the plan's own table, and drop them. No request is routed to a kept session
   once the frontends hold the new routing table, and every one routed there before has met its
   deadline by then (the longest SLO of the kept sessions), so the release fails nothing; what a
   backend might still hold is answered NOT_FOUND, which the frontend retries on its new routes.
   A plan pushed before an earlier plan's release keeps what that release was to drop, and its own
   release drops it.

A session the plan places on no backend is dropped at once: it has nowhere to go, and one that went
cold (globalsched/planning/residency.py) frees its memory for the session paged in in its place, which a
device whose memory the plan fills could not load beside it. A backend the plan does not name (it
left) is not pushed: it keeps serving what it holds until it exits.

Pure: the distribution (globalsched/actuators/distribution.py) and the simulator (nexus/simulate/control.py)
both execute what :func:`handover` returns. Keeping a session holds its memory for the move's
duration: on a device whose plan already fills its memory, the move briefly holds both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from globalsched.planning.cluster_values import ClusterPlan
from globalsched.planning.placement import PlacedSession


@dataclass(frozen=True)
class Handover:
    """The model tables of a plan's two steps, by backend. ``make`` names every backend of the plan;
    ``release`` only those whose ``make`` table kept sessions the plan moved away, and ``kept``
    which sessions those are."""

    make: Mapping[str, tuple[PlacedSession, ...]]
    release: Mapping[str, tuple[PlacedSession, ...]]
    kept: Mapping[str, tuple[str, ...]]
    release_after_s: float = 0.0      # after the routing tables: the longest SLO of a kept session


def backend_tables(plan: ClusterPlan | None) -> dict[str, tuple[PlacedSession, ...]]:
    """Each backend's model table in ``plan`` (none: no plan yet)."""
    if plan is None:
        return {}
    return {b.node_id: b.sessions for placement in plan.placements.values() for b in placement.backends}


def handover(in_force: ClusterPlan | None, plan: ClusterPlan,
             unreleased: Mapping[str, tuple[PlacedSession, ...]] = {}) -> Handover:
    """How to push ``plan`` over ``in_force`` (the plan the backends and frontends hold; None at the
    first plan, or after a restart: then nothing is kept, as nothing is known to be held).
    ``unreleased``: the backends whose release step has not come yet, with the make table they hold
    (the plan in force's sessions and those it kept). Those kept sessions are kept again, and the new
    release drops them, when its own wait is over: a plan made before the release dropped them at
    once, with the requests routed there before the frontends' tables changed (17 of one session at a
    simulated 5x step, benchmarks/elastic.md)."""
    before, after = {**backend_tables(in_force), **unreleased}, backend_tables(plan)
    placed = {s.model for sessions in after.values() for s in sessions}
    make: dict[str, tuple[PlacedSession, ...]] = {}
    release: dict[str, tuple[PlacedSession, ...]] = {}
    kept: dict[str, tuple[str, ...]] = {}
    for node_id, sessions in after.items():
        names = {s.model for s in sessions}
        keep = tuple(s for s in before.get(node_id, ()) if s.model not in names and s.model in placed)
        make[node_id] = sessions + keep
        if keep:
            release[node_id] = sessions
            kept[node_id] = tuple(s.model for s in keep)
    slos = [plan.sessions[name].slo_ms for names in kept.values() for name in names]
    return Handover(make, release, kept, max(slos, default=0.0) / 1000.0)


# The backends with a release step to come: node id -> (the release's epoch, the node that holds it,
# the make table it holds until then). What the distribution and the simulator keep between pushes,
# by the functions below, and pass to :func:`handover` as ``unreleased``.
Unreleased = dict[str, tuple[int, object, tuple[PlacedSession, ...]]]


def unreleased_tables(unreleased: Unreleased, holder: Callable[[str], object] = lambda node_id: None
                      ) -> dict[str, tuple[PlacedSession, ...]]:
    """The make tables still held, of the backends whose node is still the one that took them
    (``holder(node_id)``: a node that registered again, a new process under the same id, holds none)."""
    return {node_id: table for node_id, (_, node, table) in unreleased.items() if holder(node_id) is node}


def pushed(unreleased: Unreleased, steps: Handover, epoch: int,
           holder: Callable[[str], object] = lambda node_id: None) -> None:
    """``steps`` of the plan numbered ``epoch`` went out: a backend whose make table kept nothing holds
    the plan's; one that kept sessions holds its make table until this release."""
    for node_id in steps.make:
        if node_id not in steps.release:
            unreleased.pop(node_id, None)
    for node_id in steps.release:
        unreleased[node_id] = (epoch, holder(node_id), steps.make[node_id])


def released(unreleased: Unreleased, node_ids: Iterable[str], epoch: int) -> None:
    """The release of ``epoch`` went to ``node_ids``; a backend a later plan kept sessions on waits
    for that plan's release."""
    for node_id in node_ids:
        if unreleased.get(node_id, (None,))[0] == epoch:
            del unreleased[node_id]


def superseded(unreleased: Unreleased, steps: Handover, epoch: int,
               holder: Callable[[str], object] = lambda node_id: None) -> None:
    """The make step of the plan numbered ``epoch`` was cut short by a newer plan (its routing tables
    never go): every backend sent its make table holds it, or will once it has loaded it, and the
    frontends may route there (its early routes). The newer plan keeps what those tables hold as it
    keeps an unreleased table's sessions, and its own release drops them."""
    for node_id, table in steps.make.items():
        unreleased[node_id] = (epoch, holder(node_id), table)
