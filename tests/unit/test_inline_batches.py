"""Inline batches (backend/engine.py): on an idle CPU device, a batch its profile expects to take at
most ``inline_max_ms`` runs on the event loop's thread, and a loop turn's requests still batch
together; a longer batch, an unprofiled session, a busy executor or waiting warm-up leave the work to
the executor thread; every request gets its outcome either way. A real ONNX model runs every batch."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from backend.engine import Engine, WarmupBatch
from backend.sessions import Session
from backend.work import Work
from common.batch_decision import SlidingWindowEarlyDrop
from common.config import BackendConfig, ConfigError
from common.exec_status import ExecStatus
from common.profile import Profile

TINY = Profile.linear(0.01, 0.05, 64, device_type="cpu")     # l(b) = 0.01b + 0.05 ms
LONG = Profile.linear(2.0, 10.0, 4, device_type="cpu")       # l(1) = 12 ms


class ThreadRecordingRuntime:
    """A real ONNX runtime that notes the thread and rows of every run; ``hold_s`` makes runs take
    that much longer (a busy device)."""

    def __init__(self, inner, hold_s: float = 0.0) -> None:
        self.inner, self.hold_s = inner, hold_s
        self.inputs, self.outputs = inner.inputs, inner.outputs
        self.runs: list[tuple[int, int]] = []       # (thread ident, rows)

    def run(self, feeds):
        self.runs.append((threading.get_ident(), next(iter(feeds.values())).shape[0]))
        if self.hold_s:
            time.sleep(self.hold_s)
        return self.inner.run(feeds)

    def memory_mb(self) -> float:
        return 0.0


async def _serve(engine: Engine, models: list[str], max_ms: float = 1.0) -> list:
    """Submit one request per entry of ``models`` in one loop turn; their outcomes and the thread
    each ``done`` ran on, once all are answered."""
    loop = asyncio.get_running_loop()
    engine.run_inline_on(loop, max_ms)
    futures = []
    for name in models:
        future = loop.create_future()

        def done(outcome, future=future):
            future.set_result((outcome, threading.get_ident()))

        now = engine.clock()
        engine.submit(Work(name, [np.ones((1, 64), np.float32)], 1, now + 1.0, now, done, loop.call_soon_threadsafe))
        futures.append(future)
    return await asyncio.wait_for(asyncio.gather(*futures), 10)


def _engine(sessions: dict[str, Session]) -> Engine:
    engine = Engine(SlidingWindowEarlyDrop())
    engine.set_sessions(sessions)
    # set_sessions wakes the executor thread for a turn; an inline turn that met it there would leave
    # its batch to the executor (a CI run on a loaded machine did): wait until it has taken the
    # wake-up and its turn is over, so that nothing but the test wakes it again.
    deadline = time.monotonic() + 10
    while engine._wake.is_set() and time.monotonic() < deadline:
        time.sleep(0.001)
    with engine._device:
        pass
    return engine


def test_a_tiny_batch_runs_on_the_loop_thread_and_a_turn_batches_together(mlp_small_runtime):
    runtime = ThreadRecordingRuntime(mlp_small_runtime)
    engine = _engine({"m": Session("m", runtime, 100.0, 1, TINY, model="m")})
    try:
        results = asyncio.run(_run_on_loop(engine, ["m"] * 3))
    finally:
        engine.stop()
    loop_thread, answers = results
    assert [o.status for o, _ in answers] == [ExecStatus.OK] * 3
    assert all(o.outputs[0].shape == (1, 10) for o, _ in answers)
    assert runtime.runs == [(loop_thread, 3)]       # one batch of the turn's three, on the loop's thread
    assert {t for _, t in answers} == {loop_thread}


async def _run_on_loop(engine: Engine, models: list[str], max_ms: float = 1.0):
    return threading.get_ident(), await _serve(engine, models, max_ms)


@pytest.mark.parametrize("profile, max_ms", [
    (LONG, 1.0),        # expected to take 12 ms: over the limit
    (None, 1.0),        # no profile says how long it takes
    (TINY, 0.0),        # inline batches off
])
def test_other_batches_run_on_the_executor_and_are_answered_on_the_loop(mlp_small_runtime, profile, max_ms):
    runtime = ThreadRecordingRuntime(mlp_small_runtime)
    engine = _engine({"m": Session("m", runtime, 100.0, 1, profile, model="m")})
    try:
        loop_thread, answers = asyncio.run(_run_on_loop(engine, ["m"] * 2, max_ms))
    finally:
        engine.stop()
    assert [o.status for o, _ in answers] == [ExecStatus.OK] * 2
    assert runtime.runs and all(t == engine._thread.ident for t, _ in runtime.runs)
    assert sum(rows for _, rows in runtime.runs) == 2
    assert {t for _, t in answers} == {loop_thread}


def test_a_busy_device_leaves_the_tiny_batch_to_the_executor(mlp_small_runtime):
    slow = ThreadRecordingRuntime(mlp_small_runtime, hold_s=0.3)
    tiny = ThreadRecordingRuntime(mlp_small_runtime)
    engine = _engine({"slow": Session("slow", slow, 1000.0, 1, LONG, model="slow"),
                      "tiny": Session("tiny", tiny, 1000.0, 1, TINY, model="tiny")})

    async def scenario():
        first = asyncio.ensure_future(_serve(engine, ["slow"]))
        deadline = time.monotonic() + 5
        while not slow.runs and time.monotonic() < deadline:    # the executor runs the slow batch now
            await asyncio.sleep(0.005)
        second = await _serve(engine, ["tiny"])
        return await first, second

    try:
        first, second = asyncio.run(scenario())
    finally:
        engine.stop()
    assert first[0][0].status is ExecStatus.OK and second[0][0].status is ExecStatus.OK
    assert tiny.runs == [(engine._thread.ident, 1)]


def test_waiting_warm_up_leaves_serving_to_the_executor(mlp_small_runtime):
    runtime = ThreadRecordingRuntime(mlp_small_runtime)
    engine = _engine({"m": Session("m", runtime, 1000.0, 1, TINY, model="m")})
    gate = threading.Event()

    async def scenario():
        warm = engine.warm_up([WarmupBatch("held", gate.wait)], budget_s=10)
        await asyncio.sleep(0.05)         # the executor is in the warm-up batch, waiting on the gate
        serving = asyncio.ensure_future(_serve(engine, ["m"]))
        await asyncio.sleep(0.05)
        gate.set()
        return await serving, await asyncio.wrap_future(warm)

    try:
        answers, warmed = asyncio.run(scenario())
    finally:
        gate.set()
        engine.stop()
    assert answers[0][0].status is ExecStatus.OK
    assert warmed.batches == 1
    assert runtime.runs == [(engine._thread.ident, 1)]


def test_a_negative_limit_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"--inline-max-ms: must be >= 0, got -1"):
        BackendConfig(inline_max_ms=-1.0).validate()
    BackendConfig(inline_max_ms=0.0).validate()


def test_a_batch_handed_over_is_run_before_the_next_inline_turn_decides(mlp_small_runtime):
    """Two long batches handed over in two loop turns before the executor thread takes the first: the
    second turn must leave the first's hand-over alone (both are answered, in order)."""
    runtime = ThreadRecordingRuntime(mlp_small_runtime)
    engine = Engine(SlidingWindowEarlyDrop(), start=False)     # the executor thread starts later
    engine.set_sessions({"m": Session("m", runtime, 1000.0, 1, LONG, model="m")})

    async def scenario():
        first = asyncio.ensure_future(_serve(engine, ["m"]))
        await asyncio.sleep(0.02)           # its inline turn handed its batch over: nobody runs it yet
        second = asyncio.ensure_future(_serve(engine, ["m"]))
        await asyncio.sleep(0.02)
        engine._thread = threading.Thread(target=engine._loop, daemon=True)
        engine._thread.start()
        return await first, await second

    try:
        first, second = asyncio.run(scenario())
    finally:
        engine.stop()
    assert first[0][0].status is ExecStatus.OK and second[0][0].status is ExecStatus.OK
    assert [rows for _, rows in runtime.runs] == [1, 1]
    assert {t for t, _ in runtime.runs} == {engine._thread.ident}
