"""Stand-ins for the nodes a plan's distribution talks to, and small plans, shared by the tests of
globalsched/actuators/ (handover, table pushes, early routes)."""

from __future__ import annotations

from common.pb import control
from globalsched.planning.cluster_values import ClusterPlan, PlannedSession
from globalsched.planning.placement import BackendAssignment, PlacedSession, Placement
from globalsched.state.catalog import Catalog
from globalsched.state.membership import Node


class Backend:
    """A backend's stub: answers every table, failing the loads it is told to fail."""

    def __init__(self) -> None:
        self.tables: list[control.ModelTable] = []
        self.fail: set[str] = set()

    async def UpdateModelTable(self, table, timeout=None):
        self.tables.append(table)
        names = [e.session or e.model.name for e in table.sessions]
        return control.ModelTableReply(loaded=[n for n in names if n not in self.fail],
                                       failed=[f"{n}: broken" for n in names if n in self.fail])


class Events:
    def loaded(self, models):
        pass

    def load_failed(self, *args):
        pass

    def routed(self, keys):
        pass


class NoRates:
    def current_rates(self, now):
        return {}


def node(node_id: str) -> tuple[Node, Backend]:
    """A backend node on an emulated T4 and its stub."""
    stub = Backend()
    return Node(node_id, control.NODE_KIND_BACKEND, "127.0.0.1:1", "emulated:t4", "t4", 16000.0, stub=stub), stub


def plan(tables: dict[str, tuple[tuple[str, int], ...]], served: tuple[str, ...] | None = None) -> ClusterPlan:
    """A plan on T4s with ``tables`` (backend -> (session, batch)...), each session its own model in the
    catalog; every session named is served unless ``served`` says which are."""
    backends = tuple(BackendAssignment(backend, 50.0, tuple(PlacedSession(s, b, 20.0 * b) for s, b in sessions))
                     for backend, sessions in tables.items())
    names = served if served is not None else {s for sessions in tables.values() for s, _ in sessions}
    return ClusterPlan({"t4": Placement(backends, 0, 0)}, {}, {},
                       sessions={s: PlannedSession(s, s, 100.0, 10.0) for s in names},
                       catalog=Catalog(descs={s: control.ModelDesc(name=s, sha256="ab" * 32) for s in names}))


class Frontend:
    def __init__(self) -> None:
        self.tables: list[control.RoutingTable] = []

    async def UpdateRoutingTable(self, table, timeout=None):
        self.tables.append(table)
        return control.RoutingTableReply()
