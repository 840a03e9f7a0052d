"""What a backend reports for the scheduler's measured profiles (backend/latency_samples.py): every
serving batch's rows and time, contended when the device was behind or its host busy; never a
warm-up batch nor a failed one; bounded between reports. The engine runs in virtual time (a fake
clock that the runtime advances by l(b)), as in tests/unit/test_engine_clock.py."""

from __future__ import annotations

import numpy as np
import pytest

from backend.engine import Engine, WarmupBatch

from backend.sessions import Session

from backend.work import Work
from backend.latency_samples import SampleRecorder
from backend.server import BackendService
from common.batch_decision import SlidingWindowEarlyDrop
from common.config import BackendConfig
from common.measured_profile import LatencySample
from common.pb import control
from common.profile import Profile

PROFILE = Profile.linear(2.0, 10.0, 4, device_type="cpu")      # l(b) = 2b + 10 ms, at most 4 rows


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class TimedRuntime:
    """A real ONNX runtime whose runs take l(b) of virtual time; ``fail`` makes the next run raise."""

    def __init__(self, inner, clock: Clock) -> None:
        self.inner, self.clock = inner, clock
        self.inputs, self.outputs = inner.inputs, inner.outputs
        self.fail = False

    def run(self, feeds):
        rows = next(iter(feeds.values())).shape[0]
        self.clock.t += PROFILE.latency_ms(min(rows, 4)) / 1000
        if self.fail:
            raise RuntimeError("device lost")
        return self.inner.run(feeds)

    def memory_mb(self) -> float:
        return 0.0


@pytest.fixture
def engine(mlp_small_runtime):
    clock = Clock()
    engine = Engine(SlidingWindowEarlyDrop(), clock, wall_clock=lambda: 0.0, start=False)
    runtime = TimedRuntime(mlp_small_runtime, clock)
    engine.set_sessions({"stage": Session("stage", runtime, 100.0, 1, PROFILE, model="m")})
    engine.samples = SampleRecorder()
    return engine, clock, runtime


def submit(engine, clock, n: int, slo_s: float = 0.1) -> None:
    for _ in range(n):
        x = np.ones((1, 64), np.float32)
        engine.submit(Work("stage", [x], 1, clock() + slo_s, clock(), lambda outcome: None))


def test_a_batch_is_recorded_under_its_model_with_its_time(engine):
    engine, clock, _ = engine
    submit(engine, clock, 3)
    engine.step()
    [taken] = engine.samples.take()
    assert taken.model == "m" and taken.lost == 0       # the session "stage" runs model "m"
    [s] = taken.samples
    assert s.batch == 3 and s.latency_ms == pytest.approx(16.0) and not s.contended
    assert engine.samples.take() == []                  # taken: the next report starts afresh


def test_a_batch_capped_with_rows_left_queued_is_contended(engine):
    engine, clock, _ = engine
    submit(engine, clock, 6)                 # the largest batch is 4: two rows wait behind it
    engine.step()
    engine.step()
    [taken] = engine.samples.take()
    assert [(s.batch, s.contended) for s in taken.samples] == [(4, True), (2, False)]


def test_a_batch_run_beside_deadline_drops_is_contended(engine):
    engine, clock, _ = engine
    submit(engine, clock, 1, slo_s=0.005)    # cannot meet its deadline: dropped
    submit(engine, clock, 2)
    engine.step()
    [taken] = engine.samples.take()
    assert [(s.batch, s.contended) for s in taken.samples] == [(2, True)]


def test_a_busy_host_makes_every_batch_contended(engine):
    engine, clock, _ = engine
    engine.host_contended = lambda: True
    submit(engine, clock, 1)
    engine.step()
    assert [s.contended for t in engine.samples.take() for s in t.samples] == [True]


def test_failed_and_warm_up_batches_are_not_samples(engine):
    engine, clock, runtime = engine
    runtime.fail = True
    submit(engine, clock, 2)
    engine.step()
    runtime.fail = False
    job = engine.warm_up([WarmupBatch("warm-up", lambda: runtime.run({"input": np.ones((2, 64), np.float32)}))], 60)
    engine.turn()
    assert job.result().batches == 1
    assert engine.samples.take() == []


def test_the_recorder_is_bounded_and_counts_what_it_lost():
    rec = SampleRecorder(max_per_model=3)
    for b in range(1, 6):
        rec.record("m", b, float(b), False)
    [taken] = rec.take()
    assert [s.batch for s in taken.samples] == [3, 4, 5] and taken.lost == 2
    assert rec.take() == []
    with pytest.raises(ValueError, match="at least 1"):
        SampleRecorder(max_per_model=0)


def test_the_heartbeat_carries_the_samples(engine):
    engine, clock, _ = engine
    service = BackendService(BackendConfig(), engine)
    submit(engine, clock, 1)
    engine.step()
    request = control.HeartbeatRequest(node_id="be-1")
    service.fill_heartbeat(request)
    [entry] = request.batch_samples
    assert entry.model == "m" and len(entry.samples) == 1
    s = entry.samples[0]
    assert (s.batch, s.contended) == (1, False) and s.latency_ms == pytest.approx(12.0)
    request = control.HeartbeatRequest(node_id="be-1")
    service.fill_heartbeat(request)
    assert not request.batch_samples                    # nothing served since


def test_samples_are_the_estimator_s_type():
    rec = SampleRecorder()
    rec.record("m", 2, 5.0, True)
    assert rec.take()[0].samples == (LatencySample(2, 5.0, True),)
