"""Sessions that go live on a plan's routes before its make step has ended.

A plan's routing tables go to the frontends once every backend has answered its make table
(globalsched/actuators/handover.py). The slowest backend then holds back every session, also those
whose new backends were ready long before. After a kill of 10 of 100 devices at peak
(benchmarks/elastic.md) the replicas that replaced the lost ones were warm 0.75 s after the repair
plan, and the frontends kept overflowing the survivors for another second, until the last of 90
backends, loading five unrelated models, had answered.

So, while the make step runs, a session whose routes the plan changes *goes live* on them once every
backend those routes name has answered its make table: each has loaded and warmed the session (or
held it already). The frontends are then sent the routing table in force with the live sessions'
routes replaced; every other session keeps the routes in force, which name backends that still hold
it (a make table keeps what the plan moves away). The plan's own routing tables follow at the end of
the make step as before, and the release step after them.

A session whose routes the plan re-weights or re-batches goes live too: a surge's plan gives the
surging session more of a backend it had. In the simulator that was worth more than going live only
on new backends (benchmarks/elastic.md). Only a session the plan gives a route goes early: dropping
routes early serves nothing. The first plan (nothing in force) waits for its routing tables, as the
frontends' readiness does.

Pure bookkeeping: the distribution (globalsched/actuators/distribution.py) and the simulator
(nexus/simulate/control.py) both drive it, and decide when to send what it says.
"""

from __future__ import annotations

from typing import Iterable

from globalsched.planning.cluster_values import ClusterPlan

# Tables of live sessions go no more often than this while a make step runs: at 1,000 backends each
# is a routing table of every session, built on the scheduler's loop.
EARLY_ROUTES_INTERVAL_S = 0.25


class EarlyRoutes:
    def __init__(self, in_force: ClusterPlan | None, plan: ClusterPlan, making: Iterable[str]) -> None:
        """``making``: the backends sent a make table that have not answered it yet."""
        self.pending = pending = set(making)
        self.left: dict[str, int] = {}                  # session -> backends of its new routes still making
        self.waits_on: dict[str, list[str]] = {}        # backend -> sessions waiting on it
        self.ready: set[str] = set()                    # sessions whose new routes are all made
        self.live: set[str] = set()                     # ready sessions the frontends were sent
        if in_force is None:
            return
        before = in_force.routes()
        for session, routes in plan.routes().items():
            if session not in plan.sessions or not routes or sorted(routes) == sorted(before.get(session, ())):
                continue
            waiting = {node for node, _, _, _ in routes if node in pending}
            for node in waiting:
                self.waits_on.setdefault(node, []).append(session)
            self.left[session] = len(waiting)
            if not waiting:
                self.ready.add(session)

    def answered(self, node_id: str) -> None:
        """``node_id`` answered its make table (with or without a failure), or will not (it left)."""
        self.pending.discard(node_id)
        for session in self.waits_on.pop(node_id, ()):
            self.left[session] -= 1
            if self.left[session] == 0:
                self.ready.add(session)

    def due(self) -> frozenset[str]:
        """Sessions ready to go live that the frontends have not been sent yet; none once every backend
        answered, when the plan's routing tables are due."""
        return frozenset(self.ready - self.live) if self.pending else frozenset()

    def sent(self, sessions: Iterable[str]) -> None:
        """The frontends were sent ``sessions`` live."""
        self.live.update(sessions)
