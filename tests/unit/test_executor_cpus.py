"""``nexus backend --executor-cpus``: the executor thread, where the runtime runs batches, is pinned to
the CPUs named, and the rest of the process keeps its own; a wrong value is refused by name."""

from __future__ import annotations

import os
import time

import pytest

from backend.engine import Engine
from common.batch_decision import SlidingWindowEarlyDrop
from common.config import BackendConfig, ConfigError


def test_the_executor_thread_alone_is_pinned():
    usable = sorted(os.sched_getaffinity(0))
    cpu = usable[-1]
    engine = Engine(SlidingWindowEarlyDrop(), executor_cpus=frozenset({cpu}))
    try:
        deadline = time.monotonic() + 5
        while engine._thread.native_id is None and time.monotonic() < deadline:
            time.sleep(0.01)
        pinned = set()
        while pinned != {cpu} and time.monotonic() < deadline:     # the thread pins itself when it starts
            pinned = os.sched_getaffinity(engine._thread.native_id)
            time.sleep(0.01)
        assert pinned == {cpu}
        assert sorted(os.sched_getaffinity(0)) == usable             # this (the loop's) thread is not
    finally:
        engine.stop()


def test_no_pinning_by_default():
    assert BackendConfig().executor_cpu_set() == frozenset()
    assert Engine(SlidingWindowEarlyDrop(), start=False).executor_cpus == frozenset()


@pytest.mark.parametrize("value, message", [
    ("one", "expected CPU numbers separated by commas, got 'one'"),
    ("0,,1", "expected CPU numbers separated by commas"),
    ("100000", "CPU 100000 is not one of this machine's"),
])
def test_a_wrong_value_is_refused_by_name(value, message):
    with pytest.raises(ConfigError, match="--executor-cpus: " + message):
        BackendConfig(executor_cpus=value).validate()


def test_a_usable_cpu_list_passes():
    cpus = sorted(os.sched_getaffinity(0))
    config = BackendConfig(executor_cpus=",".join(map(str, cpus)))
    config.validate()
    assert config.executor_cpu_set() == frozenset(cpus)


def test_the_executor_may_take_a_cpu_the_process_is_kept_off():
    """``taskset -c 0 nexus backend --executor-cpus 1``: the process's other threads on CPU 0, the
    runtime alone on CPU 1 (benchmarks/serving.py --pin)."""
    last = (os.cpu_count() or 1) - 1
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {0})
    try:
        config = BackendConfig(executor_cpus=str(last))
        config.validate()
        assert config.executor_cpu_set() == frozenset({last})
    finally:
        os.sched_setaffinity(0, saved)


def test_a_pin_the_system_refuses_is_logged_and_the_executor_runs_unpinned(caplog):
    """A cpuset that excludes the CPUs named (here: one that does not exist, past the config's check)."""
    engine = Engine(SlidingWindowEarlyDrop(), executor_cpus=frozenset({100000}))
    try:
        deadline = time.monotonic() + 5
        while "cannot pin the executor thread" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "cannot pin the executor thread to CPUs 100000" in caplog.text
        assert engine._thread.is_alive()
        assert os.sched_getaffinity(engine._thread.native_id) == os.sched_getaffinity(0)
    finally:
        engine.stop()
