"""The engine's batching decisions in virtual time (issue 12): a fake clock is injected, no executor
thread runs and the test drives :meth:`Engine.step` itself, so nothing sleeps and no assertion
depends on how fast the machine is. The model is a real (tiny) ONNX model."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from backend.engine import Engine

from backend.sessions import Session, SharedPrefix

from backend.work import ExecError, Work
from common.batch_decision import EarliestFirst, SlidingWindowEarlyDrop
from common.profile import Profile
from common.exec_status import ExecStatus

PROFILE = Profile.linear(2.0, 10.0, 16, device_type="cpu")      # l(b) = 2b + 10 ms; 2*l(b) <= 100: b <= 20 -> 16


class FakeClock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def runtime(mlp_small_runtime):
    return mlp_small_runtime


def _engine(runtime, policy=None, *, planned: int = 1, max_queue: int = 4096, names=("m",), deliver=None):
    clock = FakeClock()
    engine = Engine(policy or SlidingWindowEarlyDrop(), clock, wall_clock=lambda: 1_700_000_000.5,
                    deliver=deliver, start=False)
    engine.set_sessions({n: Session(n, runtime, 100.0, planned, PROFILE, max_queue=max_queue) for n in names})
    return engine, clock


def _submit(engine, clock, outcomes, *, model="m", rows=1, slo_s=0.1, key=None):
    x = np.ones((rows, 64), np.float32)
    key = len(outcomes) if key is None else key
    outcomes[key] = None

    def done(outcome):
        outcomes[key] = outcome
    return engine.submit(Work(model, [x], rows, clock() + slo_s, clock(), done))


def test_nothing_queued_nothing_to_wake_for(runtime):
    engine, _ = _engine(runtime)
    decision = engine.step()
    assert decision.queue is None and decision.wake_s is None


def test_eager_start_runs_what_is_queued_at_once(runtime):
    engine, clock = _engine(runtime, planned=8)
    outcomes = {}
    for _ in range(3):
        _submit(engine, clock, outcomes)
    decision = engine.step()
    assert decision.rows == 3 and len(decision.batch) == 3
    assert [o.status for o in outcomes.values()] == [ExecStatus.OK] * 3
    assert all(o.batch_size == 3 for o in outcomes.values())
    st = engine.sessions["m"].stats
    assert st.batch_histogram == {3: 1} and st.last_inference_ms == 1_700_000_000_500


def test_duty_cycle_waits_for_the_planned_batch_or_one_cycle(runtime):
    engine, clock = _engine(runtime, planned=4)
    engine.duty_cycle_s = 0.03
    outcomes = {}
    _submit(engine, clock, outcomes)
    clock.t += 0.01
    _submit(engine, clock, outcomes)
    decision = engine.step()
    assert decision.queue is None
    assert decision.wake_s == pytest.approx(100.03)      # the oldest request has waited one duty cycle
    assert all(o is None for o in outcomes.values())
    clock.t = 100.03
    decision = engine.step()
    assert decision.rows == 2 and [o.status for o in outcomes.values()] == [ExecStatus.OK] * 2


def test_duty_cycle_starts_at_once_when_the_planned_batch_is_there(runtime):
    engine, clock = _engine(runtime, planned=2)
    engine.duty_cycle_s = 1.0
    outcomes = {}
    _submit(engine, clock, outcomes, rows=2)               # rows count towards the planned batch
    assert engine.step().rows == 2


def test_early_drop_answers_what_cannot_make_it_and_runs_the_rest(runtime):
    engine, clock = _engine(runtime)
    outcomes = {}
    _submit(engine, clock, outcomes, slo_s=0.005)          # l(1) = 12 ms > 5 ms left
    for _ in range(3):
        _submit(engine, clock, outcomes)
    decision = engine.step()
    assert [p.request_id for p in decision.dropped] == [1] and decision.rows == 3
    assert outcomes[0].status == ExecStatus.DEADLINE
    assert [outcomes[i].status for i in (1, 2, 3)] == [ExecStatus.OK] * 3
    assert engine.sessions["m"].stats.dropped == 1


def test_a_session_that_serves_late_requests_runs_them_however_late(runtime):
    """common/late_requests.py: the same queue as above, but the model serves its late requests; and
    a request whose deadline has already passed runs too, earliest deadline first."""
    engine, clock = _engine(runtime, names=("late", "drops"))
    engine.sessions["late"].serve_late = True
    outcomes = {}
    _submit(engine, clock, outcomes, model="late", slo_s=0.005, key="tight")     # l(1) = 12 ms > 5 ms left
    _submit(engine, clock, outcomes, model="late", slo_s=-0.010, key="passed")   # 10 ms past its deadline
    _submit(engine, clock, outcomes, model="late", key="ok")
    decision = engine.step()
    assert decision.dropped == () and decision.rows == 3
    assert [p.payload.arrival_s for p in decision.batch] == [clock()] * 3
    assert {k: o.status for k, o in outcomes.items()} == {k: ExecStatus.OK for k in ("tight", "passed", "ok")}
    assert engine.sessions["late"].stats.dropped == 0
    _submit(engine, clock, outcomes, model="drops", slo_s=0.005, key="dropped")  # the other session still drops
    engine.step()
    assert outcomes["dropped"].status == ExecStatus.DEADLINE


@pytest.mark.parametrize("late_members, dropped", [((True, True), 0), ((True, False), 0), ((False, False), 1)])
def test_a_prefix_group_serves_late_when_any_member_does(runtime, late_members, dropped):
    """A group's merged queue has one policy: late requests are served when any member serves late (a
    user's setting is never lost to a prefix it shares with another model)."""
    clock = FakeClock()
    engine = Engine(SlidingWindowEarlyDrop(), clock, start=False)
    members = [Session(n, runtime, 100.0, 1, PROFILE, serve_late=late) for n, late in zip(("a", "b"), late_members)]
    engine.set_sessions({m.name: m for m in members}, [SharedPrefix("g", runtime, "output", members)])
    outcomes = {}
    _submit(engine, clock, outcomes, model="a", slo_s=0.005)      # l(1) = 12 ms > 5 ms left
    _submit(engine, clock, outcomes, model="b")
    with engine._lock:
        decision = engine._decide()[0]
    assert decision.queue is not None and len(decision.dropped) == dropped
    assert len(decision.batch) == 2 - dropped


class _TimedRuntime:
    """The real runtime, with every run taking ``ms`` on the fake clock (as a device faster or slower
    than its profile)."""

    def __init__(self, runtime, clock: FakeClock, ms: float) -> None:
        self.runtime, self.clock, self.ms = runtime, clock, ms
        self.inputs, self.outputs = runtime.inputs, runtime.outputs

    def run(self, feeds):
        self.clock.t += self.ms / 1000
        return self.runtime.run(feeds)


def test_early_drop_predicts_from_what_batches_took_not_the_profiles_margin(runtime):
    # The profile says l(1) = 12 ms (the planning figure); the device runs a batch in 4 ms. A request
    # with 8 ms left is dropped on the profile alone, and served once batches showed what they take.
    engine, clock = _engine(runtime)
    session = engine.sessions["m"]
    session.runtime = _TimedRuntime(runtime, clock, 4.0)
    outcomes = {}
    _submit(engine, clock, outcomes, slo_s=0.008)
    engine.step()
    assert outcomes[0].status == ExecStatus.DEADLINE           # no batch ran yet: l(1) it is
    for _ in range(5):
        _submit(engine, clock, outcomes)
        engine.step()
    assert session.calibration.factor == pytest.approx(4 / 12)
    _submit(engine, clock, outcomes, key="tight", slo_s=0.008)
    engine.step()
    assert outcomes["tight"].status == ExecStatus.OK


def test_the_batch_cap_follows_what_batches_take(runtime):
    # l(b) = 5b + 10 ms by the profile: 2*l(b) <= 100 up to b = 8. Batches that take half that allow 18;
    # twice that, 3, but never fewer than the plan's batch.
    engine, clock = _engine(runtime, planned=4)
    session = Session("m", runtime, 100.0, 4, Profile.linear(5.0, 10.0, 32, device_type="cpu"))
    engine.set_sessions({"m": session})
    assert session.max_batch == 8
    session.runtime = _TimedRuntime(runtime, clock, 7.5)      # l(1) = 15 ms by the profile
    outcomes = {}
    for _ in range(5):
        _submit(engine, clock, outcomes)
        engine.step()
    assert session.calibration.factor == pytest.approx(0.5) and session.max_batch == 18
    session.runtime.ms = 60.0
    for _ in range(12):
        _submit(engine, clock, outcomes)
        engine.step()
    assert session.calibration.factor == pytest.approx(4.0) and session.max_batch == 4


def test_a_slower_device_than_its_profile_drops_earlier(runtime):
    engine, clock = _engine(runtime)
    session = engine.sessions["m"]
    session.runtime = _TimedRuntime(runtime, clock, 36.0)   # 3x the profile's l(1)
    outcomes = {}
    for _ in range(5):
        _submit(engine, clock, outcomes)
        engine.step()
    assert session.calibration.factor == pytest.approx(3.0)
    _submit(engine, clock, outcomes, key="doomed", slo_s=0.020)   # 12 ms by the profile, 36 ms here
    engine.step()
    assert outcomes["doomed"].status == ExecStatus.DEADLINE


def test_the_calibration_survives_a_replan_of_the_same_profile_only(runtime):
    engine, clock = _engine(runtime)
    engine.sessions["m"].runtime = _TimedRuntime(runtime, clock, 6.0)
    outcomes = {}
    for _ in range(3):
        _submit(engine, clock, outcomes)
        engine.step()
    calibration = engine.sessions["m"].calibration
    engine.set_sessions({"m": Session("m", runtime, 100.0, 2, PROFILE)})          # a new plan, same profile
    assert engine.sessions["m"].calibration is calibration
    other = Profile.linear(3.0, 10.0, 16, device_type="cpu")
    engine.set_sessions({"m": Session("m", runtime, 100.0, 2, other)})
    assert engine.sessions["m"].calibration.samples == 0


def test_a_request_expires_while_it_waits_in_virtual_time(runtime):
    engine, clock = _engine(runtime, EarliestFirst())
    outcomes = {}
    _submit(engine, clock, outcomes, slo_s=0.05)
    clock.t += 0.06
    decision = engine.step()
    assert len(decision.dropped) == 1 and not decision.batch
    assert outcomes[0].status == ExecStatus.DEADLINE


def test_earliest_deadline_first_across_sessions(runtime):
    engine, clock = _engine(runtime, names=("a", "b"))
    outcomes = {}
    _submit(engine, clock, outcomes, model="a", slo_s=0.09, key="a")
    _submit(engine, clock, outcomes, model="b", slo_s=0.05, key="b")
    engine.step()
    assert outcomes["b"].status == ExecStatus.OK and outcomes["a"] is None
    engine.step()
    assert outcomes["a"].status == ExecStatus.OK


def test_batches_are_sized_in_rows(runtime):
    engine, clock = _engine(runtime, EarliestFirst())
    session = engine.sessions["m"]
    assert session.max_batch == 16                          # 2 * (2*16 + 10) = 84 <= 100
    outcomes = {}
    for _ in range(3):
        _submit(engine, clock, outcomes, rows=6)
    decision = engine.step()
    assert decision.rows == 12 and len(decision.batch) == 2     # a third request would make 18 rows
    assert all(outcomes[i].batch_size == 12 for i in (0, 1)) and outcomes[2] is None
    assert engine.step().rows == 6
    assert session.stats.inference_count == 18 and session.stats.batch_histogram == {12: 1, 6: 1}


def test_a_request_larger_than_the_max_batch_still_runs_alone(runtime):
    engine, clock = _engine(runtime, EarliestFirst())
    outcomes = {}
    _submit(engine, clock, outcomes, rows=20, slo_s=10.0)
    assert engine.step().rows == 20 and outcomes[0].status == ExecStatus.OK


def test_one_hand_over_per_batch(runtime):
    calls = []
    engine, clock = _engine(runtime, deliver=lambda fn, arg: calls.append((fn, arg)))
    outcomes = {}
    _submit(engine, clock, outcomes, slo_s=0.001)          # dropped in the same turn
    for _ in range(5):
        _submit(engine, clock, outcomes)
    engine.step()
    assert len(calls) == 1 and len(calls[0][1]) == 6
    assert all(o is None for o in outcomes.values())        # nothing ran on the executor's side
    fn, arg = calls[0]
    fn(arg)                                                 # the loop's side
    assert sorted(o.status for o in outcomes.values()) == [ExecStatus.OK] * 5 + [ExecStatus.DEADLINE]


def test_cancel_takes_a_queued_request_off_and_only_once(runtime):
    engine, clock = _engine(runtime)
    outcomes = {}
    first = _submit(engine, clock, outcomes)
    _submit(engine, clock, outcomes)
    assert engine.cancel(first) is True
    assert engine.cancel(first) is False
    assert engine.step().rows == 1
    assert outcomes[0] is None and outcomes[1].status == ExecStatus.OK
    assert engine.sessions["m"].stats.cancelled == 1
    ran = _submit(engine, clock, outcomes)
    engine.step()
    assert engine.cancel(ran) is False                      # it already ran


def test_full_queue_is_refused_and_counts_queued_requests_only(runtime):
    engine, clock = _engine(runtime, max_queue=2)
    outcomes = {}
    first = _submit(engine, clock, outcomes)
    _submit(engine, clock, outcomes)
    with pytest.raises(ExecError) as err:
        _submit(engine, clock, outcomes)
    assert err.value.status == ExecStatus.OVERLOADED
    engine.cancel(first)
    _submit(engine, clock, outcomes)                        # room again
    assert engine.step().rows == 2
    assert engine.sessions["m"].depth.queued == 0


def test_submit_does_not_wait_for_the_executor(runtime):
    engine, clock = _engine(runtime)
    outcomes = {}
    submitted = threading.Event()
    with engine.paused():                                   # the executor's lock is held
        t = threading.Thread(target=lambda: (_submit(engine, clock, outcomes), submitted.set()))
        t.start()
        assert submitted.wait(30)
    t.join()
    assert engine.step().rows == 1


def test_unknown_model_and_a_model_unloaded_before_its_turn(runtime):
    engine, clock = _engine(runtime)
    outcomes = {}
    with pytest.raises(ExecError) as err:
        _submit(engine, clock, outcomes, model="nope")
    assert err.value.status == ExecStatus.NOT_FOUND
    outcomes.clear()
    _submit(engine, clock, outcomes)
    engine.set_sessions({})                                 # unloaded while still in the inbox
    assert engine.step().queue is None
    assert outcomes[0].status == ExecStatus.NOT_FOUND


def test_fail_queued_answers_a_removed_sessions_queue(runtime):
    engine, clock = _engine(runtime)
    engine.duty_cycle_s = 1.0
    engine.sessions["m"].planned_batch = 4
    outcomes = {}
    item = _submit(engine, clock, outcomes)
    assert engine.step().queue is None                      # admitted, waiting for its duty cycle
    from backend.work import Outcome

    (removed,) = engine.set_sessions({})
    assert engine.fail_queued(removed, Outcome(ExecStatus.NOT_FOUND, "gone")) == 1
    assert outcomes[0].status == ExecStatus.NOT_FOUND and engine.cancel(item) is False


def test_each_consumer_gets_one_hand_over_and_a_closed_one_disturbs_nothing(runtime):
    engine, clock = _engine(runtime)
    handed: list = []
    x = np.ones((1, 64), np.float32)
    outcomes = {}

    def closed(fn, arg):
        raise RuntimeError("Event loop is closed")

    def keep(fn, arg):
        handed.append(len(arg))
        fn(arg)

    for i, deliver in enumerate([closed, keep, keep, closed]):
        engine.submit(Work("m", [x], 1, clock() + 1.0, clock(), lambda o, i=i: outcomes.__setitem__(i, o), deliver))
    assert engine.step().rows == 4                          # the closed consumer did not stop the executor
    assert handed == [2] and sorted(outcomes) == [1, 2]
    assert engine.step().queue is None
