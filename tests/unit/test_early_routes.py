"""globalsched/actuators/early_routes.py: a session goes live on each backend the plan gives it as
soon as that backend has answered its make table, beside the routes in force; and the distribution
sends the frontends those routes while a slow backend still loads, before the plan's own routing
table."""

from __future__ import annotations

import asyncio

from common.pb import control
from globalsched.actuators.distribution import Distribution
from globalsched.actuators.early_routes import EARLY_ROUTES_INTERVAL_S, EarlyRoutes
from globalsched.state.membership import Node
from tests.unit.distribution_fakes import Backend, Events, Frontend, NoRates, node, plan


def nodes(routes) -> list[str]:
    return sorted(node for node, _, _, _ in routes)


def test_a_session_goes_live_on_each_new_backend_as_it_answers_beside_its_routes_in_force():
    old = plan({"be-1": (("a", 2), ("b", 2)), "be-2": (("a", 2),), "be-3": (("c", 1),)})
    # be-1 died: a gains be-4 and be-5, b moves to be-6; c stays as it was
    new = plan({"be-2": (("a", 2),), "be-3": (("c", 1),), "be-4": (("a", 2),), "be-5": (("a", 2),),
                "be-6": (("b", 2),)})
    early = EarlyRoutes(old, new, ["be-2", "be-3", "be-4", "be-5", "be-6"])
    assert early.due() == frozenset() and early.live() == {}
    early.answered("be-2")
    assert early.due() == frozenset()             # be-2 brings a no new backend
    early.answered("be-4")
    assert early.due() == {"a"}
    # the plan's route on be-4; those in force on be-1 (dead: the actuator drops it) and be-2
    assert {s: nodes(r) for s, r in early.live().items()} == {"a": ["be-1", "be-2", "be-4"]}
    early.sent({"a"})
    assert early.due() == frozenset()
    early.answered("be-5")
    assert early.due() == {"a"} and nodes(early.routes("a")) == ["be-1", "be-2", "be-4", "be-5"]
    early.sent({"a"})
    early.answered("be-6")
    assert early.due() == {"b"} and nodes(early.live()["b"]) == ["be-1", "be-6"]
    assert set(early.live()) == {"a", "b"}        # a stays live in every later table
    early.answered("be-3")                        # c's routes did not change: it never goes early
    assert early.due() == frozenset()             # and once every backend answered, nothing goes early


def test_a_rebatched_or_unplaced_session_waits_and_a_backend_still_making_keeps_its_route_in_force():
    old = plan({"be-1": (("a", 2), ("b", 2), ("c", 2)), "be-2": (), "be-3": (("d", 1),)})
    # a: re-batched where it was; b: unplaced; c: moves from be-1 to be-2 and gains be-3; d: as it was
    new = plan({"be-1": (("a", 4),), "be-2": (("c", 2),), "be-3": (("c", 4), ("d", 1))},
               served=("a", "b", "c", "d"))
    early = EarlyRoutes(old, new, ["be-1", "be-2", "be-3"])
    assert set(early.new) == {"c"}
    early.answered("be-3")
    assert early.due() == {"c"}
    routes = {node: batch for node, _, batch, _ in early.routes("c")}
    assert routes == {"be-3": 4, "be-1": 2}      # be-2 still loading; be-1 keeps c until release
    early.answered("be-2")
    assert {node: batch for node, _, batch, _ in early.routes("c")} == {"be-2": 2, "be-3": 4, "be-1": 2}


def test_the_first_plan_waits_for_its_routing_tables():
    new = plan({"be-1": (("a", 2),), "be-2": (("a", 2),)})
    early = EarlyRoutes(None, new, ["be-1", "be-2"])
    early.answered("be-1")
    assert early.due() == frozenset() and early.live() == {}


class SlowBackend(Backend):
    """Answers a table only once ``go`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.go = asyncio.Event()

    async def UpdateModelTable(self, table, timeout=None):
        await self.go.wait()
        return await super().UpdateModelTable(table, timeout)


def _routes(table: control.RoutingTable) -> dict[str, list[str]]:
    return {r.session or r.model.name: sorted(b.node_id for b in r.backends) for r in table.routes}


class Cluster:
    """be-1 to be-3 answer at once, be-4 (``slow``) when told; one frontend; the first plan applied:
    a on be-1, b on be-2."""

    async def start(self) -> "Cluster":
        self.nodes, self.stubs = {}, {}
        for i in range(1, 4):
            self.nodes[f"be-{i}"], self.stubs[f"be-{i}"] = node(f"be-{i}")
        self.slow = SlowBackend()
        self.nodes["be-4"] = Node("be-4", control.NODE_KIND_BACKEND, "127.0.0.1:1", "emulated:t4", "t4", 16000.0,
                                  stub=self.slow)
        self.frontend = Frontend()
        self.nodes["fe-1"] = Node("fe-1", control.NODE_KIND_FRONTEND, "127.0.0.1:2", "", "", 0.0,
                                  stub=self.frontend)
        self.dist = Distribution(self.nodes, Events(), NoRates())
        self.slow.go.set()
        await self.dist.apply(plan({"be-1": (("a", 2),), "be-2": (("b", 2),), "be-3": (), "be-4": ()}), 1)
        assert len(self.frontend.tables) == 1     # a make step that ends at once sends no early table
        self.slow.go.clear()
        return self

    async def apply_slowly(self, tables: dict) -> None:
        """Apply epoch 2; be-4 answers once an early table had its time to go out."""
        apply = asyncio.create_task(self.dist.apply(plan(tables), 2))
        await asyncio.sleep(EARLY_ROUTES_INTERVAL_S + 0.2)
        self.early = self.frontend.tables[1:]
        assert not apply.done()
        self.slow.go.set()
        await apply


def test_the_distribution_routes_a_ready_session_while_a_slow_backend_still_loads():
    async def main():
        c = await Cluster().start()
        # a gains be-3 (quick); b moves to be-4, which takes its time
        await c.apply_slowly({"be-1": (("a", 2),), "be-2": (), "be-3": (("a", 2),), "be-4": (("b", 2),)})
        [early] = c.early
        assert early.epoch == 2
        assert _routes(early) == {"a": ["be-1", "be-3"], "b": ["be-2"]}     # b keeps its route in force
        assert len(c.frontend.tables) == 3
        assert _routes(c.frontend.tables[2]) == {"a": ["be-1", "be-3"], "b": ["be-4"]}

    asyncio.run(main())


def test_a_load_that_failed_is_not_routed_early():
    async def main():
        c = await Cluster().start()
        c.stubs["be-3"].fail.add("a")
        await c.apply_slowly({"be-1": (), "be-2": (("b", 2),), "be-3": (("a", 2),), "be-4": (("b", 2),)})
        # a's only new backend failed to load it: its early route has none, with the reason
        [early] = c.early
        route = next(r for r in early.routes if r.model.name == "a")
        assert not route.backends and "failed to load on be-3" in route.reason

    asyncio.run(main())


def test_early_routes_that_fail_are_logged_and_the_plans_routing_table_still_goes(caplog):
    async def main():
        c = await Cluster().start()
        routes = c.dist._routes

        def broken(plan, failed, only=None, placed=None):
            if only is not None:
                raise RuntimeError("broken early table")
            return routes(plan, failed, only, placed)

        c.dist._routes = broken
        await c.apply_slowly({"be-1": (("a", 2),), "be-2": (), "be-3": (("a", 2),), "be-4": (("b", 2),)})
        assert c.early == [] and len(c.frontend.tables) == 2 and c.frontend.tables[-1].epoch == 2
        assert _routes(c.frontend.tables[-1]) == {"a": ["be-1", "be-3"], "b": ["be-4"]}

    asyncio.run(main())
    assert "early routes failed: broken early table" in caplog.text


def test_a_later_early_table_keeps_the_sessions_an_earlier_one_sent_live():
    async def main():
        c = await Cluster().start()
        later = SlowBackend()
        c.nodes["be-5"] = Node("be-5", control.NODE_KIND_BACKEND, "127.0.0.1:1", "emulated:t4", "t4", 16000.0,
                               stub=later)
        # a gains be-3 (at once), b moves to be-4 (when told), c is new on be-5 (later still)
        apply = asyncio.create_task(c.dist.apply(plan(
            {"be-1": (("a", 2),), "be-2": (), "be-3": (("a", 2),), "be-4": (("b", 2),), "be-5": (("c", 1),)}), 2))
        await asyncio.sleep(0.1)
        c.slow.go.set()
        await asyncio.sleep(EARLY_ROUTES_INTERVAL_S + 0.2)
        assert not apply.done()
        later.go.set()
        await apply
        first, second, final = c.frontend.tables[1:]
        assert _routes(first) == {"a": ["be-1", "be-3"], "b": ["be-2"]}
        assert _routes(second) == {"a": ["be-1", "be-3"], "b": ["be-2", "be-4"]}    # be-2 keeps b until release
        assert _routes(final) == {"a": ["be-1", "be-3"], "b": ["be-4"], "c": ["be-5"]}

    asyncio.run(main())
