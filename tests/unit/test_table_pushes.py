"""globalsched/actuators/distribution.py: a backend is sent a model table only when what it holds
differs: a plan that moves a few sessions of a large cluster pushes a few tables, while a failed
load, a re-registered node and a release step to come are always pushed again."""

from __future__ import annotations

import asyncio
import functools
from dataclasses import replace

import pytest

from common.pb import control
from globalsched.actuators.distribution import Distribution
from globalsched.state.catalog import Catalog
from globalsched.state.membership import Node
from tests.loop_turns import with_turns
from tests.unit.distribution_fakes import Backend, Events, Frontend, NoRates, node, plan


def test_only_the_tables_that_changed_are_sent_and_a_failure_is_sent_again():
    async def main():
        nodes, stubs = {}, {}
        for i in range(1, 5):
            nodes[f"be-{i}"], stubs[f"be-{i}"] = node(f"be-{i}")
        dist = Distribution(nodes, Events(), NoRates())
        first = plan({"be-1": (("a", 2),), "be-2": (("b", 4),), "be-3": (("c", 1),), "be-4": ()})
        await dist.apply(first, 1)
        assert [len(s.tables) for s in stubs.values()] == [1, 1, 1, 1]
        # the same tables again (an epoch that re-planned to what runs): nothing to send
        await dist.apply(plan({"be-1": (("a", 2),), "be-2": (("b", 4),), "be-3": (("c", 1),), "be-4": ()}), 2)
        assert [len(s.tables) for s in stubs.values()] == [1, 1, 1, 1]
        # c's batch changes on be-3, and be-4 is given d, which fails to load there
        stubs["be-4"].fail.add("d")
        await dist.apply(plan({"be-1": (("a", 2),), "be-2": (("b", 4),), "be-3": (("c", 2),), "be-4": (("d", 1),)}), 3)
        assert [len(s.tables) for s in stubs.values()] == [1, 1, 2, 2]
        assert stubs["be-3"].tables[-1].epoch == 3 and stubs["be-3"].tables[-1].sessions[0].batch == 2
        # the failed table is sent again with the next plan, even unchanged; the others are not
        stubs["be-4"].fail.clear()
        same = plan({"be-1": (("a", 2),), "be-2": (("b", 4),), "be-3": (("c", 2),), "be-4": (("d", 1),)})
        await dist.apply(same, 4)
        assert [len(s.tables) for s in stubs.values()] == [1, 1, 2, 3]
        await dist.apply(replace(same), 5)
        assert [len(s.tables) for s in stubs.values()] == [1, 1, 2, 3]
        # a node that registered again (a new process under the same id) holds nothing yet
        nodes["be-1"], stubs["be-1"] = node("be-1")
        await dist.apply(replace(same), 6)
        assert len(stubs["be-1"].tables) == 1 and stubs["be-1"].tables[0].epoch == 6
        # what a table says beyond its sessions counts too: a description that changed
        changed = replace(same, catalog=Catalog(descs={**same.catalog.descs,
                                                        "b": control.ModelDesc(name="b", sha256="cd" * 32)}))
        await dist.apply(changed, 7)
        assert len(stubs["be-2"].tables) == 2 and len(stubs["be-3"].tables) == 2

    asyncio.run(main())


def test_what_is_kept_of_a_backend_goes_when_it_leaves_and_it_is_sent_its_table_when_it_returns():
    async def main():
        nodes, stubs = {}, {}
        for i in (1, 2, 3):
            nodes[f"be-{i}"], stubs[f"be-{i}"] = node(f"be-{i}")
        dist = Distribution(nodes, Events(), NoRates())
        tables = {"be-1": (("a", 2),), "be-2": (("b", 2),), "be-3": (("c", 2),)}
        await dist.apply(plan(tables), 1)
        assert set(dist.held) == set(dist.pushing) == {"be-1", "be-2", "be-3"}
        # be-3 leaves (drained); the next plan forgets it
        returning = nodes.pop("be-3")
        await dist.apply(plan({"be-1": (("a", 2),), "be-2": (("b", 2), ("c", 2))}), 2)
        assert set(dist.held) == set(dist.pushing) == {"be-1", "be-2"}
        # the same node object comes back under its id: it is sent its table, not taken to hold it
        nodes["be-3"] = returning
        await dist.apply(plan(tables), 3)
        assert [t.epoch for t in stubs["be-3"].tables] == [1, 3]

    asyncio.run(main())


def test_a_backend_with_a_release_to_come_is_sent_its_table_so_the_release_cannot_undo_it():
    async def main():
        nodes, stubs = {}, {}
        for i in (1, 2):
            nodes[f"be-{i}"], stubs[f"be-{i}"] = node(f"be-{i}")
        dist = Distribution(nodes, Events(), NoRates())
        await dist.apply(plan({"be-1": (("a", 2),), "be-2": (("b", 2),)}), 1)
        # a moves to be-2: be-1 keeps it until the release step (after a's SLO, 0.1 s)
        await dist.apply(plan({"be-1": (("b", 2),), "be-2": (("a", 2),)}), 2)
        assert dist.releasing == {"be-1": 1, "be-2": 1}
        assert [e.model.name for e in stubs["be-1"].tables[-1].sessions] == ["b", "a"]    # a kept
        # a plan before the release puts a back on be-1 too: be-1's table says what it was sent, yet it
        # goes out, so that be-1 takes epoch 3 and ignores the release of epoch 2 that would drop a
        await dist.apply(plan({"be-1": (("b", 2), ("a", 2)), "be-2": (("a", 2),)}), 3)
        assert stubs["be-1"].tables[-1].epoch == 3
        assert [e.model.name for e in stubs["be-1"].tables[-1].sessions] == ["b", "a"]
        await asyncio.sleep(0.3)                # the releases run: later tables are always sent
        assert dist.releasing == {}
        before = [len(s.tables) for s in stubs.values()]
        await dist.apply(plan({"be-1": (("b", 2), ("a", 2)), "be-2": (("a", 2),)}), 4)
        assert [len(s.tables) for s in stubs.values()] == [n + 1 for n in before]
        await dist.apply(plan({"be-1": (("b", 2), ("a", 2)), "be-2": (("a", 2),)}), 5)
        assert [len(s.tables) for s in stubs.values()] == [n + 1 for n in before]

    asyncio.run(main())



def test_a_plan_pushed_before_a_release_keeps_what_the_release_was_to_drop_until_its_own():
    """A make table that dropped a kept session at once failed the requests queued on it, routed
    there before the frontends' tables changed (benchmarks/elastic.md)."""
    async def main():
        nodes, stubs = {}, {}
        for i in (1, 2, 3):
            nodes[f"be-{i}"], stubs[f"be-{i}"] = node(f"be-{i}")
        dist = Distribution(nodes, Events(), NoRates())
        await dist.apply(plan({"be-1": (("a", 2),), "be-2": (("b", 2),), "be-3": ()}), 1)
        await dist.apply(plan({"be-1": (), "be-2": (("b", 2), ("a", 2))}), 2)     # a moves: be-1 keeps it
        assert [e.model.name for e in stubs["be-1"].tables[-1].sessions] == ["a"]
        assert dist.unreleased["be-1"][0] == 2
        # before that release, a plan gives be-1 c and a a third backend: be-1 still keeps a
        await dist.apply(plan({"be-1": (("c", 1),), "be-2": (("b", 2), ("a", 2)), "be-3": (("a", 1),)}), 3)
        assert stubs["be-1"].tables[-1].epoch == 3
        assert [e.model.name for e in stubs["be-1"].tables[-1].sessions] == ["c", "a"]
        assert dist.unreleased["be-1"][0] == 3
        await asyncio.sleep(0.3)                # both releases run; epoch 3's drops a from be-1
        assert dist.unreleased == {} and dist.releasing == {}
        last = [t for t in stubs["be-1"].tables if t.epoch == 3][-1]
        assert [e.model.name for e in last.sessions] == ["c"]
        # a backend that registered again before the release holds nothing of what was kept there
        await dist.apply(plan({"be-1": (), "be-2": (("b", 2), ("a", 2), ("c", 1)), "be-3": (("a", 1),)}), 4)
        assert [e.model.name for e in stubs["be-1"].tables[-1].sessions] == ["c"]      # c kept
        nodes["be-1"], stubs["be-1"] = node("be-1")
        await dist.apply(plan({"be-1": (("d", 1),), "be-2": (("b", 2), ("a", 2), ("c", 1)), "be-3": (("a", 1),)}), 5)
        assert [e.model.name for e in stubs["be-1"].tables[-1].sessions] == ["d"]

    asyncio.run(main())


def test_building_a_plans_tables_hands_the_loop_back_and_sends_the_same(monkeypatch):
    """With every slice used up at once, the loop runs other work between two model tables and
    between two routes; what is sent is what one unbroken piece of work sends."""
    import common.loop_slices as loop_slices

    async def push(slice_s: float) -> tuple[list, list, int]:
        monkeypatch.setattr(loop_slices, "SLICE_S", slice_s)
        nodes, stubs = {}, {}
        for i in range(1, 5):
            nodes[f"be-{i}"], stubs[f"be-{i}"] = node(f"be-{i}")
        frontend = Frontend()
        nodes["fe-1"] = Node("fe-1", control.NODE_KIND_FRONTEND, "127.0.0.1:2", "", "", 0.0, stub=frontend)
        _, turns = await with_turns(Distribution(nodes, Events(), NoRates()).apply(
            plan({"be-1": (("a", 2),), "be-2": (("b", 4),), "be-3": (("c", 1),), "be-4": (("d", 1),)}), 1))
        return [[t.SerializeToString() for t in s.tables] for s in stubs.values()], \
            [t.SerializeToString() for t in frontend.tables], turns

    async def main():
        whole = await push(60.0)
        sliced = await push(0.0)
        assert sliced[:2] == whole[:2] and whole[1]
        assert sliced[2] >= whole[2] + 4 + 4          # once per model table and once per route, at least

    asyncio.run(main())


def test_a_push_cancelled_while_its_calls_start_leaves_no_call_behind():
    """Calls start a few per turn of the loop; the planner stopping in between cancels the started
    ones and starts no more."""
    from globalsched.actuators.distribution import CALLS_PER_TURN, _answers

    started, ended = [], []

    async def answer(i):
        started.append(i)
        try:
            await asyncio.sleep(10)
        finally:
            ended.append(i)
        return "reply"

    async def main():
        calls = [(None, functools.partial(answer, i)) for i in range(3 * CALLS_PER_TURN)]
        task = asyncio.create_task(_answers(calls))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert 0 < len(started) < 3 * CALLS_PER_TURN
    assert sorted(ended) == sorted(started)


def test_calls_start_a_few_per_turn_of_the_loop():
    """A call starts (serializes its request) in the loop's next turn: at most CALLS_PER_TURN start
    between two turns in which other work runs, and every call is answered in order."""
    from globalsched.actuators.distribution import CALLS_PER_TURN, _answers

    turns, started_by_turn = [0], []

    async def answer(i):
        started_by_turn.append(turns[0])
        return i

    async def ticker():
        while True:
            await asyncio.sleep(0)
            turns[0] += 1

    async def main():
        tick = asyncio.create_task(ticker())
        try:
            return await _answers([(f"node-{i}", functools.partial(answer, i)) for i in range(40)])
        finally:
            tick.cancel()

    out = asyncio.run(main())
    assert out == [(f"node-{i}", i, "") for i in range(40)]
    per_turn = [started_by_turn.count(t) for t in set(started_by_turn)]
    assert max(per_turn) <= CALLS_PER_TURN and len(per_turn) >= 40 // CALLS_PER_TURN


class GatedBackend(Backend):
    """A backend whose answer to a table of a gated epoch waits until the test opens the gate (its
    new sessions still warming up)."""

    def __init__(self) -> None:
        super().__init__()
        self.gates: dict[int, asyncio.Event] = {}

    async def UpdateModelTable(self, table, timeout=None):
        gate = self.gates.get(table.epoch)
        if gate is not None:
            await gate.wait()
        return await super().UpdateModelTable(table, timeout)


def test_a_superseded_make_step_sends_no_routing_table_and_the_next_plan_keeps_what_it_sent():
    """A newer plan cuts a make step short (globalsched/planning/control_loop.py, may_supersede): its
    routing tables never go; what its make tables gave the backends is kept by the next plan until
    that plan's own release, the routes it sent live stay live, and its late answers say nothing of
    what a backend holds once a newer table went to it."""
    from globalsched.actuators.distribution import Distribution

    async def main():
        nodes = {"be-1": node("be-1")[0]}
        slow = GatedBackend()
        nodes["be-2"] = Node("be-2", control.NODE_KIND_BACKEND, "127.0.0.1:1", "emulated:t4", "t4", 16000.0, stub=slow)
        frontend = Frontend()
        nodes["fe-1"] = Node("fe-1", control.NODE_KIND_FRONTEND, "127.0.0.1:2", "", "", 0.0, stub=frontend)
        dist = Distribution(nodes, Events(), NoRates())
        first = plan({"be-1": (("a", 2),), "be-2": (("b", 2),)})
        await dist.apply(first, 1)
        assert dist.making_for_s() is None and [t.epoch for t in frontend.tables] == [1]

        slow.gates[2] = asyncio.Event()
        applying = asyncio.create_task(dist.apply(plan({"be-1": (("a", 2), ("c", 1)),
                                                         "be-2": (("b", 2), ("d", 1))}), 2))
        while not frontend.tables[-1].epoch == 2:       # c goes live on be-1, which answered
            await asyncio.sleep(0.01)
        live = {r.model.name: [b.node_id for b in r.backends] for r in frontend.tables[-1].routes}
        assert live["c"] == ["be-1"] and "d" not in live
        assert dist.making_for_s() is not None and not applying.done()
        dist.supersede()
        await asyncio.wait_for(applying, 1.0)            # without be-2's answer
        assert dist.making_for_s() is None and dist.in_force is first
        assert len(frontend.tables) == 2                # no routing table of epoch 2 went
        assert {n: e for n, (e, _, _) in dist.unreleased.items()} == {"be-1": 2, "be-2": 2}

        # the next plan moves c to be-2 and d's batch: be-1 keeps c until its release
        await dist.apply(plan({"be-1": (("a", 2),), "be-2": (("b", 4), ("d", 1), ("c", 1))}), 3)
        assert [e.model.name for e in nodes["be-1"].stub.tables[-1].sessions] == ["a", "c"]
        assert frontend.tables[-1].epoch == 3 and dist.in_force.sessions.keys() == {"a", "b", "c", "d"}
        slow.gates[2].set()                              # epoch 2's answer comes last
        await asyncio.sleep(0.05)
        assert [said[1].batch for said in dist.held["be-2"][1][1]] == [4, 1, 1]     # epoch 3's, not 2's
        before = len(slow.tables)
        # be-2 holds epoch 3's table (b at 4): a plan that says what epoch 2 said is sent to it
        await dist.apply(plan({"be-1": (("a", 2),), "be-2": (("b", 2), ("d", 1))}), 4)
        assert [t.epoch for t in slow.tables[before:]] == [4]

    asyncio.run(main())


class BrokenLateBackend(GatedBackend):
    """A gated backend whose stub raises an unexpected error once its gate opens (not a gRPC error:
    nothing waits for a superseded make step's answers to raise it to)."""

    async def UpdateModelTable(self, table, timeout=None):
        gate = self.gates.get(table.epoch)
        if gate is not None:
            await gate.wait()
            raise ValueError("a broken stub")
        return await Backend.UpdateModelTable(self, table, timeout)


def test_an_unexpected_error_in_a_superseded_make_steps_late_answer_is_logged_and_nothing_else_stops(caplog):
    from globalsched.actuators.distribution import Distribution

    async def main():
        broken = BrokenLateBackend()
        nodes = {"be-1": node("be-1")[0],
                 "be-2": Node("be-2", control.NODE_KIND_BACKEND, "127.0.0.1:1", "emulated:t4", "t4", 16000.0,
                              stub=broken)}
        dist = Distribution(nodes, Events(), NoRates())
        await dist.apply(plan({"be-1": (("a", 2),), "be-2": (("b", 2),)}), 1)
        broken.gates[2] = asyncio.Event()
        applying = asyncio.create_task(dist.apply(plan({"be-1": (("a", 2),), "be-2": (("b", 2), ("c", 1))}), 2))
        while dist.making_for_s() is None:
            await asyncio.sleep(0.01)
        dist.supersede()
        await asyncio.wait_for(applying, 1.0)
        await dist.apply(plan({"be-1": (("a", 2), ("c", 1)), "be-2": (("b", 2),)}), 3)
        broken.gates[2].set()                            # the late answer raises
        while dist.late:
            await asyncio.sleep(0.01)
        assert "model table push to be-2 of a superseded plan" in caplog.text and "a broken stub" in caplog.text
        # the distribution goes on: the next plan is applied in full
        last = plan({"be-1": (("a", 2),), "be-2": (("b", 2), ("c", 1))})
        await asyncio.wait_for(dist.apply(last, 4), 5.0)
        assert dist.in_force is last and broken.tables[-1].epoch == 4

    asyncio.run(main())
