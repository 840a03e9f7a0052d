"""The scheduler's planning task (globalsched/planning/control_loop.py) in process: one plan per burst of
triggers, new plans only go to the actuators, a Leave waits for the plan without its node, and a
failed plan reaches the waiter without ending the task."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from common.profile import Profile
from globalsched.planning.cluster_values import ClusterView, ModelView
from globalsched.planning.control_loop import ControlLoop
from globalsched.planning.placement import BackendSlot
from globalsched.planning.planner import PlannerSettings
from globalsched.planning.replan_trigger import ReplanTrigger

PROFILE = Profile.linear(2.0, 10.0, 32, device_type="gpu")


class World:
    """What read_view sees, changed by the test; and a record of what the actuators were given."""

    def __init__(self) -> None:
        self.backends = [BackendSlot("a", "gpu", 16000.0), BackendSlot("b", "gpu", 16000.0)]
        self.models = [ModelView("m", 100.0, {"gpu": PROFILE})]
        self.reads = 0
        self.applied: list[tuple[int, frozenset[str]]] = []
        self.fail = False
        self.apply_fails = 0                 # the next applies that raise

    def read_view(self, now, force, why):
        self.reads += 1
        if self.fail:
            raise RuntimeError("the database is gone")
        return ClusterView(now, tuple(self.backends), tuple(self.models), rates_rps={"m": 50.0}, force=force, why=why)

    async def apply(self, plan, epoch):
        await asyncio.sleep(0.01)            # a push takes time; a Leave must wait for it
        if self.apply_fails:
            self.apply_fails -= 1
            raise RuntimeError("the actuator broke")
        nodes = frozenset(b.node_id for p in plan.placements.values() for b in p.backends if b.sessions)
        self.applied.append((epoch, nodes))


async def _started(world: World):
    trigger = ReplanTrigger()
    loop = ControlLoop(PlannerSettings(), trigger, world.read_view, [world])
    task = asyncio.create_task(loop.run())
    while not world.applied:
        await asyncio.sleep(0.01)
    return trigger, loop, task


def test_a_burst_of_triggers_is_one_plan_and_an_unchanged_plan_is_not_applied_again(caplog):
    caplog.set_level(logging.INFO, logger="nexus.scheduler")

    async def main():
        world = World()
        trigger, loop, task = await _started(world)
        reads, applied = world.reads, len(world.applied)
        for i in range(5):
            trigger.request(f"change {i}")
        await asyncio.sleep(0.3)
        assert world.reads == reads + 1 and len(world.applied) == applied + 1
        assert world.applied[-1][0] == loop.epoch == trigger.epoch
        assert f"epoch {loop.epoch}: re-planned: gpu sessions-changed (change 0; change 1" in caplog.text  # and why
        assert f"epoch {loop.epoch}: applied in " in caplog.text
        trigger.evaluate()                                 # nothing changed: planned, not applied
        await asyncio.sleep(0.3)
        assert world.reads == reads + 2 and len(world.applied) == applied + 1
        # every plan applied, and none that was not, in the apply-time histogram
        count = loop.apply_seconds.collect()[0]
        observed = {s.name: s.value for s in count.samples}
        assert observed["nexus_scheduler_plan_apply_seconds_count"] == len(world.applied)
        assert observed["nexus_scheduler_plan_apply_seconds_sum"] > 0
        task.cancel()

    asyncio.run(main())


def test_those_told_ahead_get_each_new_plan_before_any_actuator_applies_it():
    """The device scaler starts a step's devices while the plan's tables go out."""
    async def main():
        world = World()
        told: list[tuple[int, int]] = []         # (plans applied when told, the plan's epoch-to-be)
        trigger = ReplanTrigger()
        loop = ControlLoop(PlannerSettings(), trigger, world.read_view, [world],
                           ahead=[lambda plan: told.append((len(world.applied), loop.epoch))])
        task = asyncio.create_task(loop.run())
        while not world.applied:
            await asyncio.sleep(0.01)
        assert told == [(0, world.applied[0][0])]
        world.backends.append(BackendSlot("c", "gpu", 16000.0))
        trigger.request("c registered")
        while len(world.applied) < 2:
            await asyncio.sleep(0.01)
        assert told[1] == (1, world.applied[1][0])
        trigger.evaluate()                       # nothing changed: no new plan, nobody told
        await asyncio.sleep(0.3)
        assert len(told) == 2
        task.cancel()

    asyncio.run(main())


def test_a_leave_returns_once_the_plan_without_the_node_is_applied():
    async def main():
        world = World()
        trigger, loop, task = await _started(world)
        [(_, nodes)] = world.applied
        assert nodes == {"a", "b"}                   # m and its spare replica
        node = "a"
        world.backends = [b for b in world.backends if b.node_id != node]
        await trigger.replan_now(f"{node} leaves")
        assert node not in world.applied[-1][1] and world.applied[-1][1]
        assert loop.plan.sessions_on(node) == 0
        task.cancel()

    asyncio.run(main())


def test_a_failed_apply_reaches_the_waiter_and_the_plan_is_applied_at_the_next_trigger():
    async def main():
        world = World()
        trigger, loop, task = await _started(world)
        applied = len(world.applied)
        world.backends = [b for b in world.backends if b.node_id != "b"]
        world.apply_fails = 1
        with pytest.raises(RuntimeError, match="the actuator broke"):
            await asyncio.wait_for(trigger.replan_now("b leaves"), 10)
        assert len(world.applied) == applied and loop.plan.sessions_on("b") > 0     # still the old plan
        # nothing changed since: the next trigger plans the same placement, and it is applied this time
        await asyncio.wait_for(trigger.replan_now("b leaves, asked again"), 10)
        assert len(world.applied) == applied + 1 and world.applied[-1][1] == {"a"}
        assert loop.plan.sessions_on("b") == 0
        assert not task.done()
        task.cancel()

    asyncio.run(main())


def test_a_failed_plan_reaches_the_waiter_and_the_task_goes_on():
    async def main():
        world = World()
        trigger, loop, task = await _started(world)
        world.fail = True
        with pytest.raises(RuntimeError, match="the database is gone"):
            await trigger.replan_now("be-x leaves")
        world.fail = False
        await trigger.replan_now("be-y leaves")
        assert not task.done()
        task.cancel()

    asyncio.run(main())


def test_a_warning_that_still_holds_is_not_repeated_with_every_plan(caplog):
    """A best-effort session (its SLO below 2*l(1)) is warned about once, not on every re-plan."""
    import logging

    async def main():
        world = World()
        world.models.append(ModelView("tight", 3.0, {"gpu": PROFILE}))       # 2*l(1) = 24 ms > 3 ms
        trigger, loop, task = await _started(world)
        for i in range(3):
            await trigger.replan_now(f"change {i}")
        task.cancel()
        return loop.plan

    with caplog.at_level(logging.WARNING, logger="nexus.scheduler"):
        plan = asyncio.run(main())
    assert "tight" in plan.best_effort
    warned = [r for r in caplog.records if r.getMessage().startswith("tight: SLO 3 ms")]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]


def test_the_event_loop_runs_on_while_a_plan_is_made(monkeypatch):
    """Planning runs in a worker thread: a slow plan leaves the loop answering (heartbeats, reports)."""
    import time

    import globalsched.planning.planner_host as planner_host

    real = planner_host.plan_cluster

    def slow(*args, **kwargs):
        time.sleep(1.0)             # a plan of a thousand devices, without holding the GIL
        return real(*args, **kwargs)

    monkeypatch.setattr(planner_host, "plan_cluster", slow)

    async def main():
        world = World()
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        beat = asyncio.create_task(ticker())
        trigger, loop, task = await _started(world)      # the first plan took a second
        assert ticks >= 20, ticks                         # in line, the loop would have ticked once
        beat.cancel()
        task.cancel()

    asyncio.run(main())


def test_the_loop_lag_monitor_sees_a_blocked_loop():
    from common.loop_lag import LoopLagMonitor

    async def main():
        monitor = LoopLagMonitor("lag_test_seconds", interval_s=0.05)
        task = asyncio.create_task(monitor.run())
        await asyncio.sleep(0.2)
        import time
        time.sleep(1.0)                                   # the loop is blocked for a second
        await asyncio.sleep(0.2)
        task.cancel()
        return monitor

    monitor = asyncio.run(main())
    assert monitor.worst_s >= 0.9                        # the timer due within it ran that late
    buckets = {s.labels["le"]: s.value for s in monitor.histogram.collect()[0].samples if s.name.endswith("_bucket")}
    assert buckets["0.5"] < buckets["+Inf"]              # one observation beyond half a second


def test_a_plan_made_while_models_are_profiled_warns_of_nothing_until_profiling_ends(caplog):
    # A first start plans each model as its profile arrives: a plan that needs more devices than there
    # are is then provisional (information), and a warning once no model is being profiled, once.
    from globalsched.state.catalog import Catalog

    caplog.set_level(logging.INFO, logger="nexus.scheduler")
    profiling = {"m2"}

    class Busy(World):
        def read_view(self, now, force, why):
            self.reads += 1
            return ClusterView(now, tuple(self.backends), tuple(self.models), rates_rps={"m": 2000.0},
                               force=force, why=why)

    async def main():
        world = Busy()
        world.backends = world.backends[:1]
        trigger = ReplanTrigger()
        def catalog(plan):             # in steps, as the model administration reads it
            yield
            return Catalog(profiling=frozenset(profiling))

        loop = ControlLoop(PlannerSettings(), trigger, world.read_view, [world], catalog=catalog)
        task = asyncio.create_task(loop.run())
        while not world.applied:
            await asyncio.sleep(0.01)
        folded = [r for r in caplog.records if "folded onto busy backends" in r.getMessage()]
        assert folded and all(r.levelno == logging.INFO and "provisional: m2 still being profiled" in r.getMessage()
                              for r in folded), [r.getMessage() for r in folded]
        profiling.clear()
        for _ in range(2):                   # the note holds on: warned once
            applied = len(world.applied)
            trigger.request("profile of m2 done")
            while len(world.applied) == applied:
                await asyncio.sleep(0.01)
        warned = [r for r in caplog.records if "folded onto busy backends" in r.getMessage()
                  and r.levelno == logging.WARNING]
        assert len(warned) == 1, [r.getMessage() for r in warned]
        task.cancel()

    asyncio.run(main())


def test_a_page_in_is_planned_without_delay_and_each_reason_is_given_once():
    async def main():
        trigger = ReplanTrigger()
        trigger.request("demand changed")
        assert not trigger.urgent                   # coalesced for COALESCE_S
        trigger.request("m7 requested while cold", requests_wait=True)
        trigger.request("m7 requested while cold", requests_wait=True)     # every report until paged in
        assert trigger.urgent                       # requests are held for it: REPAIR_COALESCE_S
        taken = trigger.take()
        assert taken.why == ("demand changed", "m7 requested while cold") and not trigger.urgent

    asyncio.run(main())


def test_a_plan_logs_the_backends_whose_assignment_changed_and_counts_the_others(caplog):
    caplog.set_level(logging.INFO, logger="nexus.scheduler")

    async def main():
        world = World()
        trigger, loop, task = await _started(world)
        first = loop.plan
        assert f"epoch {loop.epoch}: a duty cycle" in caplog.text and f"epoch {loop.epoch}: b duty cycle" in caplog.text
        assert "as before" not in caplog.text
        caplog.clear()
        world.backends = [*world.backends, BackendSlot("c", "gpu", 16000.0)]
        await trigger.replan_now("c joins")
        assert loop.plan is not first
        before = {b.node_id: b for p in first.placements.values() for b in p.backends}
        now = [b for p in loop.plan.placements.values() for b in p.backends]
        changed = sorted(b.node_id for b in now if before.get(b.node_id) != b)
        logged = sorted(n for n in "abc" if f"epoch {loop.epoch}: {n} duty cycle" in caplog.text)
        assert "c" in changed and logged == changed
        kept = len(now) - len(changed)
        assert (f"epoch {loop.epoch}: {kept} backend(s) as before" in caplog.text) == (kept > 0)
        task.cancel()

    asyncio.run(main())


class Making(World):
    """An actuator with a make step (as the distribution's): it waits until ``release`` is set, and a
    newer plan may cut it short (control_loop.Supersedable)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()
        self.release.set()
        self.cut = asyncio.Event()
        self.started: float | None = None
        self.superseded: list[int] = []

    def making_for_s(self):
        return None if self.started is None or self.cut.is_set() else time.monotonic() - self.started

    def supersede(self):
        self.cut.set()

    async def apply(self, plan, epoch):
        self.cut, self.started = asyncio.Event(), time.monotonic()
        released, cut = asyncio.ensure_future(self.release.wait()), asyncio.ensure_future(self.cut.wait())
        try:
            await asyncio.wait([released, cut], return_when=asyncio.FIRST_COMPLETED)
        finally:
            released.cancel()
            cut.cancel()
            self.started = None
        if self.cut.is_set():
            self.superseded.append(epoch)
            return
        await super().apply(plan, epoch)


class After:
    """An actuator after the make step's (the device scaler): the plans it was given."""

    def __init__(self) -> None:
        self.epochs: list[int] = []

    async def apply(self, plan, epoch):
        self.epochs.append(epoch)


async def _until(condition, timeout_s: float = 5.0) -> None:
    async def wait():
        while not condition():
            await asyncio.sleep(0.01)
    await asyncio.wait_for(wait(), timeout_s)


async def _making_loop(world: Making, after: After):
    trigger = ReplanTrigger()
    loop = ControlLoop(PlannerSettings(), trigger, world.read_view, [world, after])
    task = asyncio.create_task(loop.run())
    while not world.applied:
        await asyncio.sleep(0.01)
    return trigger, loop, task


def test_a_node_that_joins_during_a_make_step_is_planned_for_at_once_and_the_older_plan_never_applies():
    """A plan waits no longer for a make step to end (globalsched/planning/control_loop.py,
    may_supersede): the step's devices registered while a make step waited, and no plan used them."""
    async def main():
        world, after = Making(), After()
        trigger, loop, task = await _making_loop(world, after)
        first = world.applied[0][0]
        world.release.clear()                           # the next make step waits for a slow backend
        world.backends.append(BackendSlot("c", "gpu", 16000.0))
        joined = asyncio.ensure_future(trigger.replan_now("c registered"))
        await _until(lambda: world.started is not None)
        second = loop.epoch
        world.backends.append(BackendSlot("d", "gpu", 16000.0))
        again = asyncio.ensure_future(trigger.replan_now("d registered"))
        await _until(lambda: world.superseded == [second])
        assert loop.epoch == second + 1 and loop.latest.placements["gpu"].backends[-1].node_id == "d"
        assert not joined.done() and not again.done()   # settled once a plan with c is in force
        world.release.set()
        await asyncio.wait_for(asyncio.gather(joined, again), 2.0)
        assert [e for e, _ in world.applied] == [first, second + 1] and after.epochs == [first, second + 1]
        assert loop.plan is loop.latest
        task.cancel()
        loop.close()

    asyncio.run(main())


def test_a_make_step_is_superseded_only_once_it_has_run_long_enough(monkeypatch):
    import globalsched.planning.control_loop as control_loop

    monkeypatch.setattr(control_loop, "SUPERSEDE_NODES_AFTER_S", 60.0)

    async def main():
        world, after = Making(), After()
        trigger, loop, task = await _making_loop(world, after)
        world.release.clear()
        world.backends.append(BackendSlot("c", "gpu", 16000.0))
        trigger.request("c registered", joined=True)
        await _until(lambda: world.started is not None)
        world.backends.append(BackendSlot("d", "gpu", 16000.0))
        trigger.request("d registered", joined=True)
        await asyncio.sleep(0.3)
        assert loop.latest.placements["gpu"].backends[-1].node_id == "c"     # d waits for c's plan
        world.release.set()
        await _until(lambda: len(world.applied) == 3)
        assert world.superseded == [] and after.epochs == [e for e, _ in world.applied]
        task.cancel()
        loop.close()

    asyncio.run(main())
