"""Capacity a plan adds, routed to while its make step still runs.

A plan's routing tables go to the frontends once every backend has answered its make table
(globalsched/actuators/handover.py). The slowest backend then holds back every session, also those
whose new backends were ready long before. After a kill of 10 of 100 devices at peak
(benchmarks/elastic.md) the replicas that replaced the lost ones were warm 0.75 s after the repair
plan, and the frontends kept overflowing the survivors for another second, until the last of 90
backends, loading five unrelated models, had answered.

So, while the make step runs, a session the plan gives backends it did not have *goes live* on each
of them as soon as that backend has answered its make table (it has loaded and warmed the session).
A live session's routes are:
- the plan's routes on the backends that have answered (or were sent nothing);
- the routes in force on the backends still taking their table;
- the routes in force that the plan drops: a make table keeps what the plan moves away, so those
  backends hold the session until the release step.

The capacity the plan adds thus comes before the capacity it takes away, and a session that lost
every backend is served by the first replica that is ready. The frontends are sent the routing table
in force with the live sessions' routes replaced; every other session keeps the routes in force. The
plan's own routing tables follow at the end of the make step as before, and the release step after
them, once what was routed to the dropped routes has met its deadline.

Measured in the simulator (benchmarks/elastic.md): going live on the plan's routes alone took the
spares that the plan moved to a surging session away from the other sessions a make step early; and
waiting for every new backend of a session left a session whose every backend was killed without
a route until its slowest replica was warm. A session the plan only re-weights or re-batches waits
for the routing tables, as does the first plan (nothing in force), as the frontends' readiness does.

Pure bookkeeping: the distribution (globalsched/actuators/distribution.py) and the simulator
(nexus/simulate/control.py) both drive it, and decide when to send what it says.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

from globalsched.planning.cluster_values import ClusterPlan

# Tables of live sessions go no more often than this while a make step runs: at 1,000 backends each
# is a routing table of every session, built on the scheduler's loop.
EARLY_ROUTES_INTERVAL_S = 0.25

Route = tuple[str, float, int, float]      # (node id, share in requests/s, batch, duty cycle ms): ClusterPlan.routes


class EarlyRoutes:
    def __init__(self, in_force: ClusterPlan | None, plan: ClusterPlan, making: Iterable[str],
                 live: Mapping[str, Sequence[Route]] = {}) -> None:
        """``making``: the backends sent a make table that have not answered it yet. ``live``: the
        routes the frontends hold in place of ``in_force``'s, of the sessions that a make step this plan
        superseded sent live (globalsched/planning/control_loop.py, "A plan that supersedes")."""
        self.pending = set(making)
        self.new: dict[str, list[Route]] = {}           # a session that gains backends: its routes in the plan
        self.held: dict[str, list[Route]] = {}          # ... and in force
        self.waits_on: dict[str, list[str]] = {}        # backend -> sessions it brings a new route to
        self.changed: set[str] = set()                  # sessions with a new backend ready, not yet sent
        if in_force is None:
            return
        before = {**in_force.routes(), **live}
        for session, routes in plan.routes().items():
            held = before.get(session, [])
            gained = {node for node, _, _, _ in routes} - {node for node, _, _, _ in held}
            if session not in plan.sessions or not gained:
                continue
            self.new[session], self.held[session] = routes, held
            for node in gained:
                if node in self.pending:
                    self.waits_on.setdefault(node, []).append(session)
                else:
                    self.changed.add(session)

    def answered(self, node_id: str) -> None:
        """``node_id`` answered its make table (with or without a failure), or will not (it left)."""
        self.pending.discard(node_id)
        self.changed.update(self.waits_on.pop(node_id, ()))

    def due(self) -> frozenset[str]:
        """Sessions whose live routes grew since the frontends were last sent them; none once every
        backend answered, when the plan's routing tables are due."""
        return frozenset(self.changed) if self.pending else frozenset()

    def sent(self, sessions: Iterable[str]) -> None:
        """The frontends were sent ``sessions``' live routes."""
        self.changed.difference_update(sessions)

    def routes(self, session: str) -> tuple[Route, ...]:
        """``session``'s routes while live (see the module's docstring)."""
        new = {r[0]: r for r in self.new[session]}
        held = {r[0]: r for r in self.held[session]}
        out = [r for node, r in new.items() if node not in self.pending]
        out += [r for node, r in held.items() if node not in new or node in self.pending]
        return tuple(out)

    def live(self) -> dict[str, tuple[Route, ...]]:
        """The routes of every session that went live so far, or is due to (its new backends may have
        answered since it was sent)."""
        return {s: self.routes(s) for s in self.new if self._any_ready(s)}

    def _any_ready(self, session: str) -> bool:
        held = {r[0] for r in self.held[session]}
        return any(node not in held and node not in self.pending for node, _, _, _ in self.new[session])
