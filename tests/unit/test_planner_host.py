"""The planner's own process (globalsched/planning/planner_host.py, planner_worker.py), driven as the
planning task drives it: its plans are the thread's plans, an unchanged plan comes back as the same
object, the slow fields of the view travel once, and a process that dies or a planner that raises
costs one call at most."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import io
import logging
import os
import pickle
import signal
import subprocess
import sys
from dataclasses import replace

import pytest

from common.profile import Profile
from globalsched.planning import planner_host
from globalsched.planning.cluster_values import ClusterView, ModelView
from globalsched.planning.algorithms.replan import ReplanReason
from globalsched.planning.placement import BackendSlot
from globalsched.planning.planner import PlannerSettings, adopted_state
from globalsched.planning.planner_host import InThreadPlanner, PlannerFailed, PlannerProcess
from globalsched.planning.planner_worker import PLAN, frame, read_frame

PROFILE = Profile.linear(2.0, 10.0, 32, device_type="gpu")
BACKENDS = tuple(BackendSlot(f"be-{i}", "gpu", 16000.0) for i in range(4))
MODELS = tuple(ModelView(f"m{i}", 100.0, {"gpu": PROFILE}) for i in range(3))

# A worker whose planner raises when the view's ``why`` says "boom" (and plans otherwise).
RAISING_WORKER = (sys.executable, "-c", """
import globalsched.planning.planner_worker as w
real = w.plan_cluster
def plan_cluster(view, state, settings):
    if "boom" in view.why:
        raise ValueError("no plan today")
    return real(view, state, settings)
w.plan_cluster = plan_cluster
raise SystemExit(w.main())
""")


def view(now: float, backends=BACKENDS, rate: float = 40.0, force=None, why=()) -> ClusterView:
    return ClusterView(now, backends, MODELS, rates_rps={m.name: rate for m in MODELS}, force=force, why=why)


async def _both(views):
    """The plans of the process and of the thread for the same calls."""
    process, thread = PlannerProcess(PlannerSettings()), InThreadPlanner(PlannerSettings())
    try:
        got = [(await process.plan(v), await thread.plan(v)) for v in views]
    finally:
        await process.close()
    return got


def test_the_process_plans_as_the_thread_does_and_gives_back_an_unchanged_plan_itself():
    views = [view(0.0, force=ReplanReason.MEMBERSHIP), view(1.0), view(2.0, backends=BACKENDS[:3],
                                                                           force=ReplanReason.MEMBERSHIP)]
    got = asyncio.run(_both(views))
    assert gc.isenabled()                       # paused while a plan is read, on again after
    for by_process, by_thread in got:
        assert by_process == by_thread
    (first, _), (second, _), (third, _) = got
    assert second is first                      # nothing changed: the same object, as the loop compares
    assert third is not first and {b.node_id for p in third.placements.values() for b in p.backends} <= \
        {b.node_id for b in BACKENDS[:3]}


def test_the_slow_fields_travel_only_when_they_change(monkeypatch):
    """Backends when they change; models one by one, when their profile objects or their data change."""
    sent: list[dict] = []
    real = planner_host.frame

    def spy(message):
        if message[0] == PLAN:
            sent.append(message[1])
        return real(message)

    monkeypatch.setattr(planner_host, "frame", spy)
    slower = Profile.linear(4.0, 20.0, 32, device_type="gpu")
    models = (MODELS[0], ModelView("m1", 100.0, {"gpu": slower}), MODELS[2])

    async def main():
        host, thread = PlannerProcess(PlannerSettings()), InThreadPlanner(PlannerSettings())
        calls = [view(0.0, force=ReplanReason.MEMBERSHIP), view(1.0, rate=45.0),
                 view(2.0, backends=BACKENDS[:3], force=ReplanReason.MEMBERSHIP),
                 replace(view(3.0, backends=BACKENDS[:3], force=ReplanReason.MEMBERSHIP), models=models),
                 replace(view(4.0, backends=BACKENDS[:3], force=ReplanReason.MEMBERSHIP), models=models[1:])]
        try:
            return [(await host.plan(v), await thread.plan(v)) for v in calls]
        finally:
            await host.close()

    plans = asyncio.run(main())
    assert {"backends", "models", "rates_rps"} <= set(sent[0]) and set(sent[0]["models"].changed) == {"m0", "m1", "m2"}
    assert "backends" not in sent[1] and not sent[1]["models"].changed and sent[1]["rates_rps"]["m0"] == 45.0
    assert "backends" in sent[2] and not sent[2]["models"].changed
    assert set(sent[3]["models"].changed) == {"m1"}                # its profile changed
    assert sent[4]["models"].names == ("m1", "m2") and not sent[4]["models"].changed
    for by_process, by_thread in plans:
        assert by_process == by_thread
    assert "m0" not in {s.model for p in plans[-1][0].placements.values() for b in p.backends for s in b.sessions}


def test_a_killed_process_is_started_again_from_the_last_plan(caplog):
    async def main():
        host = PlannerProcess(PlannerSettings())
        try:
            first = await host.plan(view(0.0, force=ReplanReason.MEMBERSHIP))
            os.kill(host.pid, signal.SIGKILL)
            await asyncio.sleep(0.2)
            again = await host.plan(view(1.0))
            return first, again, host.starts
        finally:
            await host.close()

    with caplog.at_level(logging.WARNING, logger="nexus.scheduler"):
        first, again, starts = asyncio.run(main())
    assert starts == 2
    assert again.placements == first.placements  # the new process repaired the last plan: nothing moved
    assert any("the planner process ended" in r.getMessage() for r in caplog.records)


def test_the_state_is_pickled_only_when_asked_and_a_restart_starts_from_it(monkeypatch):
    """A plan comes back without its state (13 MB, 240 ms at 1,000 devices); the plan store asks for
    it; a process killed after that starts from it, so an unchanged view still gives the same plan."""
    sent: list[str] = []
    real = planner_host.frame

    def spy(message):
        sent.append(message[0])
        return real(message)

    monkeypatch.setattr(planner_host, "frame", spy)

    async def main():
        host = PlannerProcess(PlannerSettings())
        try:
            first = await host.plan(view(0.0, force=ReplanReason.MEMBERSHIP))
            asked_before = sent.count("give state")
            state = pickle.loads(await host.pickled_state())
            os.kill(host.pid, signal.SIGKILL)
            await asyncio.sleep(0.2)
            again = await host.plan(view(1.0))
            return first, state, asked_before, again
        finally:
            await host.close()

    first, state, asked_before, again = asyncio.run(main())
    assert asked_before == 0
    assert state.plan == first and state.types       # the whole state, device types included
    assert again is first                             # from that state: nothing to re-plan


def test_a_planner_that_raises_fails_its_call_and_the_next_plans():
    async def main():
        host = PlannerProcess(PlannerSettings(), command=RAISING_WORKER)
        try:
            first = await host.plan(view(0.0, force=ReplanReason.MEMBERSHIP))
            with pytest.raises(PlannerFailed, match="ValueError: no plan today"):
                await host.plan(view(1.0, force=ReplanReason.MEMBERSHIP, why=("boom",)))
            later = await host.plan(view(2.0, backends=BACKENDS[:2], force=ReplanReason.MEMBERSHIP))
            return first, later, host.starts
        finally:
            await host.close()

    first, later, starts = asyncio.run(main())
    assert starts == 1                          # the process lived on
    assert later is not first and len({b.node_id for p in later.placements.values() for b in p.backends}) <= 2


def test_an_adopted_plan_holds_in_the_process():
    """A standby's adopted state goes to the process: with nothing changed, the plan stays that object."""
    async def main():
        made = InThreadPlanner(PlannerSettings())
        plan = await made.plan(view(0.0, force=ReplanReason.MEMBERSHIP))
        host = PlannerProcess(PlannerSettings())
        try:
            host.adopt(adopted_state(made.state, 100.0))
            held = await host.plan(view(100.5))
            state = await host.pickled_state()
            return plan, held, state
        finally:
            await host.close()

    plan, held, state = asyncio.run(main())
    assert held is plan
    assert isinstance(state, bytes) and state


def test_closing_ends_the_process_and_a_later_plan_starts_one():
    async def main():
        host = PlannerProcess(PlannerSettings())
        await host.start()
        pid = host.pid
        await host.close()
        gone = host.pid is None
        try:
            await host.plan(view(0.0, force=ReplanReason.MEMBERSHIP))
            return pid, gone, host.starts
        finally:
            await host.close()

    pid, gone, starts = asyncio.run(main())
    assert pid and gone and starts == 2
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_the_worker_ends_when_its_input_ends():
    """The scheduler gone (even by SIGKILL), its pipe closes: the worker exits, nothing left running."""
    proc = subprocess.Popen([sys.executable, "-m", "globalsched.planning.planner_worker"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)
    proc.stdin.write(frame(("settings", PlannerSettings()))[:5])      # and a frame cut short
    proc.stdin.close()
    assert proc.wait(timeout=30) == 0


def test_a_frame_cut_short_reads_as_the_end():
    whole = frame((PLAN, {"now_s": 1.0}))
    assert read_frame(io.BytesIO(whole)) == (PLAN, {"now_s": 1.0})
    assert read_frame(io.BytesIO(whole[:-1])) is None
    assert read_frame(io.BytesIO(whole[:3])) is None


def test_a_models_delta_keeps_the_receivers_models_in_step():
    from common.loop_slices import drain
    from globalsched.planning.planner_host import _models_delta_steps

    def _models_delta(value, held):
        return drain(_models_delta_steps(value, held))

    held_here: dict = {}
    held_there: dict = {}
    stage = {m.name: m for m in MODELS}
    delta, held_here = _models_delta(stage, held_here)
    assert delta.apply(held_there) == stage and set(delta.changed) == set(stage)
    fewer = {"m2": MODELS[2], "m0": MODELS[0]}
    delta, held_here = _models_delta(fewer, held_here)
    assert not delta.changed and delta.apply(held_there) == fewer and set(held_there) == {"m0", "m2"}
    twice = (MODELS[0], MODELS[0])          # a name twice: sent whole, the next call sends every model
    whole, held_here = _models_delta(twice, held_here)
    assert whole is twice and held_here == {}
    delta, held_here = _models_delta(MODELS, held_here)
    assert set(delta.changed) == {"m0", "m1", "m2"} and delta.apply(held_there) == MODELS


def test_the_slow_fields_and_the_models_are_compared_in_steps():
    """The loop gets a turn every SAME_PER_STEP items compared; the answers are those of ``==``."""
    from common.loop_slices import drain
    from globalsched.planning.planner_host import SAME_PER_STEP, _models_delta_steps, _same_steps

    def steps_of(gen):
        n = 0
        while True:
            try:
                next(gen)
                n += 1
            except StopIteration as done:
                return n, done.value

    items = tuple(range(3 * SAME_PER_STEP))
    assert steps_of(_same_steps(items, tuple(list(items)))) == (3, True)
    assert steps_of(_same_steps(items, items[:-1] + (-1,)))[1] is False
    assert steps_of(_same_steps(items, items[:-1])) == (0, False)
    assert drain(_same_steps({"q": 1}, {"q": 1})) is True and drain(_same_steps({"q": 1}, {"q": 2})) is False
    assert drain(_same_steps(items, list(items))) is False

    many = tuple(dataclasses.replace(MODELS[0], name=f"m{i}") for i in range(2 * SAME_PER_STEP))
    steps, (delta, held) = steps_of(_models_delta_steps(many, {}))
    assert steps == 2 and set(delta.changed) == set(held) == {m.name for m in many}
    steps, (delta, _) = steps_of(_models_delta_steps(many, held))
    assert steps == 2 and not delta.changed


def test_many_changed_models_go_ahead_of_the_plan_a_part_at_a_time(monkeypatch):
    """More changed models than a frame holds go in MODELS frames before the plan, which then names
    them only; the process plans as the thread does, and a changed model later goes in the plan."""
    from globalsched.planning.planner_worker import MODELS as MODELS_KIND

    sent: list[tuple] = []
    real = planner_host.frame

    def spy(message):
        sent.append(message)
        return real(message)

    monkeypatch.setattr(planner_host, "frame", spy)
    monkeypatch.setattr(planner_host, "MODELS_PER_FRAME", 2)
    many = tuple(ModelView(f"m{i}", 100.0, {"gpu": PROFILE}) for i in range(5))
    slower = Profile.linear(4.0, 20.0, 32, device_type="gpu")
    changed = (many[0], ModelView("m1", 100.0, {"gpu": slower}), *many[2:])

    def of(now, models, force=None):
        return ClusterView(now, BACKENDS, models, rates_rps={m.name: 10.0 for m in models}, force=force)

    async def main():
        host, thread = PlannerProcess(PlannerSettings()), InThreadPlanner(PlannerSettings())
        try:
            return [(await host.plan(v), await thread.plan(v))
                    for v in (of(0.0, many, ReplanReason.MEMBERSHIP), of(1.0, changed, ReplanReason.MEMBERSHIP))]
        finally:
            await host.close()

    plans = asyncio.run(main())
    kinds = [m[0] for m in sent]
    first_plan = kinds.index(PLAN)
    parts = [m for m in sent[:first_plan] if m[0] == MODELS_KIND]
    assert [sorted(m[2]) for m in parts] == [["m0", "m1"], ["m2", "m3"], ["m4"]] and {m[1] for m in parts} == {"models"}
    assert not sent[first_plan][1]["models"].changed and len(sent[first_plan][1]["models"].names) == 5
    assert MODELS_KIND not in kinds[first_plan:]                       # one model changed: in the plan
    assert set(sent[-1][1]["models"].changed) == {"m1"}
    for by_process, by_thread in plans:
        assert by_process == by_thread


def test_the_worker_refuses_a_message_it_does_not_know_and_keeps_models_sent_ahead():
    """A message of no known kind (a scheduler of another release) is refused by name; MODELS frames
    are held for the PLAN that names them."""
    from globalsched.planning.planner_worker import MODELS as MODELS_KIND
    from globalsched.planning.planner_worker import NEW, ModelsDelta, Worker

    worker = Worker()
    with pytest.raises(ValueError, match="unknown message 'nonsense'"):
        worker.handle(("nonsense",))
    assert worker.handle((MODELS_KIND, "models", {m.name: m for m in MODELS})) is None
    answer = worker.handle((PLAN, {"now_s": 0.0, "backends": BACKENDS, "force": ReplanReason.MEMBERSHIP,
                                   "models": ModelsDelta(tuple(m.name for m in MODELS), {}),
                                   "rates_rps": {m.name: 40.0 for m in MODELS}}))
    assert answer[0] == NEW
    assert {s for s in answer[1].sessions} == {m.name for m in MODELS}
